"""Test and benchmark tooling: offline tokenizers of many model families
(``offline_tokenizers.py``) and the boundary benchmark behind ``prefix-cache bench``
(``benchmark.py``); nothing the sidecar or the library imports at run time.
"""
