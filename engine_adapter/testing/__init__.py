"""Test and benchmark tooling of the engine: tiny random-weights model folders (``tiny_model.py``;
``python -m engine_adapter.testing.tiny_model DEST``), uncached reference computations
(``reference.py``), the boundary's definition computed over any render (``two_probe.py``), and
real oMLX with the plug-in, driven in oMLX's own venv (``omlx_check.py``).
"""
