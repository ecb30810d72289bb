"""Small utilities the core, the servers and the engine share, each knowing no other part.

``json_io.py`` (JSON bodies with exact integers, nesting bounded), ``token_ids.py`` (the one
token-id check and the uint32 packing), ``lru.py`` (the one byte-bounded LRU), ``prefix_len.py`` (the one common-prefix length), ``hints.py`` (the fast path's seam: the two
protocols the core asks the accelerators through).
"""
