"""The accelerators of the hit path, and the one switch that turns them all off.

Every accelerator (the body parser's packed parts, frozen tools' packing, the direct render and
its tojson memo, the prompt split and tail pieces, the tokenizer watch, the decoded-entry memo,
the C pass over the key's plain data) must give exactly what the plain computation gives:
``PREFIX_CACHE_FAST_PATH=off`` (or ``StaticPrefixCache(fast_path=False)``) runs the plain
computation alone, and tests compare the two.

The rest of the package reaches it only through this module (``tests/test_architecture.py``):
``switch.py`` (the switch), ``typed_keys.py`` (memo keys that carry types).
"""

from .switch import FAST_PATH_ENV, fast_path_setting
from .typed_keys import Unkeyable, typed_key

__all__ = ["FAST_PATH_ENV", "Unkeyable", "fast_path_setting", "typed_key"]
