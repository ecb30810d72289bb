"""Test and benchmark tooling of the engine: tiny random-weights model folders (``tiny_model.py``;
``python -m engine_adapter.testing.tiny_model DEST``) and uncached reference computations
(``reference.py``).
"""
