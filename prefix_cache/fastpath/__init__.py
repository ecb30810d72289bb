"""The accelerators of the hit path, behind one seam, and the one switch that turns them all off.

Every accelerator must give exactly what the plain computation gives:
``PREFIX_CACHE_FAST_PATH=off`` (or ``StaticPrefixCache(fast_path=False)``) runs the plain
computation alone, and tests run the same suites both ways. A cache picks its collaborators
once, when it is made: the plain ones of the core (``keys.KeyPacker``, ``PromptText``,
``PromptTokenizer``) or these, each wrapping the plain one and owning its self-check and its
turning-off (``FastKeyPacker``, ``FastPromptText``, ``FastPromptTokenizer``). A request's
``Hints`` (``prefix_cache.util.hints``; ``KnownParts`` here: what its body's parse or a
``FrozenTools`` packed) reach only the accelerated key packer. The rest of the package imports
this package only, from at most three modules (``tests/test_architecture.py``).

Its modules: ``switch.py`` (the switch) and ``typed_keys.py`` (memo keys that carry types), and
private ones: ``_body_parts.py`` (a body parsed part by part, large parts' exact bytes
remembered per tenant), ``_known_parts.py`` (the hints those parts give), ``_frozen_tools.py``
(a tool list packed once), ``_key_packer.py`` (the key's field bytes packed in C, each new
packing walked once the plain way), ``_direct_render.py`` (transformers' render without its
copies, its ``tojson`` memo), ``_fast_text.py`` (the accelerated renderer: direct renders,
checked once per renderer), ``_tail_pieces.py`` (a hit's tail tokenized piece by piece, pieces
remembered per tenant), ``_fast_tokenize.py`` (the accelerated prompt tokenizer: from the
entry's split, sampled checks).
"""

from ._body_parts import REMEMBERED_BYTES, PartMemo, parse_body
from ._fast_text import FastPromptText
from ._fast_tokenize import FastPromptTokenizer
from ._frozen_tools import FrozenTools
from ._key_packer import FastKeyPacker
from ._known_parts import KnownParts
from ._tail_pieces import PieceMemo, piece_cuts, pieces
from .switch import FAST_PATH_ENV, fast_path_setting
from .typed_keys import Unkeyable, typed_key

__all__ = ["FAST_PATH_ENV", "REMEMBERED_BYTES", "FastKeyPacker", "FastPromptText",
           "FastPromptTokenizer", "FrozenTools", "KnownParts", "PartMemo", "PieceMemo",
           "Unkeyable", "fast_path_setting", "parse_body", "piece_cuts", "pieces", "typed_key"]
