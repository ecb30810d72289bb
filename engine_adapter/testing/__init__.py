"""Test and benchmark tooling of the engine: tiny random-weights model folders (``tiny_model.py``;
``python -m engine_adapter.testing.tiny_model DEST``) uncached reference computations
(``reference.py``), and real oMLX with the plug-in, driven in oMLX's own venv (``omlx_check.py``).
"""
