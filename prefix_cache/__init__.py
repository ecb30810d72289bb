"""Static-prefix cache: ``specprefill_system_end`` for SpecPrefill engines, computed once per
static system/tool prefix instead of with two extra chat-template renders on every request."""

from .boundary import PROBE_A, PROBE_B, common_prefix_len
from .cache import PrefixResult, StaticPrefixCache
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
