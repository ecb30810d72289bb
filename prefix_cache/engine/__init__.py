"""The engine seam: what an API layer and an engine say to each other, and engines by name.

``protocol.py`` (``BackendRequest`` in, ``BackendOutput`` out, ``ChatBackend``, ``EngineStats``,
the wire field names; imports nothing of the project), ``lookup.py`` (in-process engines by
name: the one place ``prefix_cache`` reaches ``engine_adapter``, lazily).
"""
