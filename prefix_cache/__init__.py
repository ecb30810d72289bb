"""Static-prefix cache: ``specprefill_system_end`` for SpecPrefill engines, computed once per
static system/tool prefix instead of with two extra chat-template renders on every request.

The core: ``cache/`` (``StaticPrefixCache``, keys, entries, the boundary), ``render/`` (the
caller's tokenizer and template), ``fastpath/`` (the hit path's accelerators behind one seam, and
the switch that turns them off), ``util/``, ``model_folders/``, ``engine/`` (the engine protocol),
``errors.py``. Above it: ``store/`` < ``http/`` < ``chat/`` <
``api/`` < ``service/`` (the sidecar), with ``metrics/``; ``cli.py`` (the ``prefix-cache``
command); ``testing/`` (test and benchmark tooling).
"""

from .cache.boundary import PROBE_A, PROBE_B, common_prefix_len
from .cache.cache import PrefixResult, StaticPrefixCache
from .errors import (
    EntryError,
    InvalidRequestError,
    NoChatTemplateError,
    PrefixCacheError,
    StoreUnavailableError,
    TemplateRenderError,
)
from .fastpath import FrozenTools
from .store import MemoryStore, Store

__all__ = [
    "PROBE_A",
    "PROBE_B",
    "EntryError",
    "FrozenTools",
    "InvalidRequestError",
    "MemoryStore",
    "NoChatTemplateError",
    "PrefixCacheError",
    "PrefixResult",
    "StaticPrefixCache",
    "Store",
    "StoreUnavailableError",
    "TemplateRenderError",
    "common_prefix_len",
]
