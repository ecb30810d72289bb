"""One model of a tokenizer, as the prompt's split (``split.py``) and the tail pieces
(``fastpath``) read it: whether its calls go straight to a tokenizers backend through
transformers' own encode, its added tokens with their flags, and what its pipeline does
locally. Read once per tokenizer state: the state its key read (fingerprint and
``split_special_tokens``), whatever the tokenizer's attributes say later: each renderer keeps
the model of its state (no memo here).

A tokenizers backend cuts its input at the added tokens matched on the raw text first; the
pieces between them are normalized and pre-tokenized one by one. Two questions follow, each
answered here once:

- ``pieces_alone``: is a piece's encoding the same wherever the piece stands? (The kinds of
  pre-tokenizers in ``PIECE_LOCAL_PRE_TOKENIZERS`` act on each piece alone; Metaspace's
  ``prepend_scheme: first`` sees the same either way when every piece but the first starts
  with an added token, which the cuts make so.)
- ``lines_off``: can a piece also be cut at a line start (no normalizer but a Unicode form,
  regex ``Split`` / ``ByteLevel`` / ``Digits`` pre-tokenizers without look-behind or anchors,
  a BPE model, no added token holding a line break)? Why not, or None.
"""

from __future__ import annotations

import json
import re
from typing import Any

# Pre-tokenizers that act on each piece alone, whatever came before it in the text.
PIECE_LOCAL_PRE_TOKENIZERS = frozenset((
    "Sequence", "Split", "ByteLevel", "Digits", "Punctuation", "Whitespace", "WhitespaceSplit",
    "BertPreTokenizer", "UnicodeScripts", "CharDelimiterSplit", "Metaspace"))
_LOCAL_NORMALIZERS = frozenset(("NFC", "NFD", "NFKC", "NFKD"))
# Regex features that make a pre-token depend on what came before it, or on where it stands.
_NON_LOCAL_REGEX = re.compile(r"\(\?<[=!]|\\[bBAzZG]|(?<![\\\[])\^|(?<!\\)\$")


class TokenizerModel:
    """One tokenizer in one state (see the module docstring)."""

    def __init__(self, tokenizer: Any, split_special_tokens: bool | None = None) -> None:
        self.tokenizer = tokenizer
        self.split_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False)
                                         if split_special_tokens is None
                                         else split_special_tokens)
        self.off = own_encode_off(tokenizer)
        # The tokenizers backend every call goes straight to (None: see ``off``).
        self.backend: Any = None if self.off else tokenizer._tokenizer
        self.added: tuple[Any, ...] = () if self.backend is None else tuple(
            self.backend.get_added_tokens_decoder().values())

    @property
    def raw_added(self) -> list[Any]:
        """The added tokens matched on the raw text, before normalizing (non-empty ones)."""
        return [t for t in self.added if not t.normalized and t.content]

    def pre_tokenizer(self) -> dict[str, Any] | None:
        """The backend's pre-tokenizer, as its JSON config (None: none)."""
        pre = self.backend.pre_tokenizer
        return None if pre is None else json.loads(pre.__getstate__())

    def pieces_alone(self) -> bool:
        """Whether a text's ids are its pieces' ids, each piece (cut before an added token
        matched on the raw text) encoded alone: special tokens are not split, no such token
        looks past its cut (``lstrip``, ``rstrip``, ``single_word``), and the pre-tokenizer
        acts on each piece alone."""
        if self.backend is None or self.split_special_tokens:
            return False
        raw = self.raw_added
        if not raw or any(t.lstrip or t.rstrip or t.single_word for t in raw):
            return False
        try:
            return piece_local(self.pre_tokenizer())
        except Exception:  # another tokenizers layout: encode whole
            return False

    def lines_off(self) -> str | None:
        """Why a piece may not be cut at a line start, or None (components read one by one:
        serializing the whole backend would copy its vocabulary)."""
        if self.off is not None:
            return self.off
        if any("\n" in t.content or "\r" in t.content for t in self.added):
            return "an added token holds a line break"
        normalizer = self.backend.normalizer
        return (normalizer_off(None if normalizer is None
                               else json.loads(normalizer.__getstate__()))
                or pre_tokenizer_off(self.pre_tokenizer())
                or (None if type(self.backend.model).__name__ == "BPE"
                    else "the model is not BPE"))


def piece_local(config: Any) -> bool:
    """Whether a pre-tokenizer config acts on each piece alone (None: there is none)."""
    if config is None:
        return True
    if not isinstance(config, dict) or config.get("type") not in PIECE_LOCAL_PRE_TOKENIZERS:
        return False
    return all(piece_local(p) for p in config.get("pretokenizers", ()))


def normalizer_off(node: Any) -> str | None:
    """Why a normalizer (its JSON config) acts across a line cut, or None."""
    if node is None:
        return None
    kind = node.get("type")
    if kind == "Sequence":
        return next(filter(None, map(normalizer_off, node.get("normalizers", []))), None)
    return None if kind in _LOCAL_NORMALIZERS else f"normalizer {kind} acts across a cut"


def pre_tokenizer_off(node: Any) -> str | None:
    """Why a pre-tokenizer (its JSON config) acts across a line cut, or None."""
    if node is None:
        return "no pre-tokenizer (one pre-token per piece)"
    kind = node.get("type")
    if kind == "Sequence":
        parts = node.get("pretokenizers", [])
        if not parts:
            return "no pre-tokenizer (one pre-token per piece)"
        return next(filter(None, map(pre_tokenizer_off, parts)), None)
    if kind == "ByteLevel":
        return "ByteLevel adds a prefix space" if node.get("add_prefix_space") else None
    if kind == "Digits":
        return None
    if kind == "Split":
        pattern = (node.get("pattern") or {}).get("Regex")
        if pattern is None or node.get("behavior") != "Isolated" or node.get("invert"):
            return "a Split pre-tokenizer other than an isolated regex"
        if _NON_LOCAL_REGEX.search(pattern):
            return "a pre-tokenizer regex with look-behind or anchors"
        return None
    return f"pre-tokenizer {kind} acts across a cut"


def own_encode_off(tokenizer: Any) -> str | None:
    """Why ``tokenizer``'s calls do not go straight to a tokenizers backend through
    transformers' own encode (a slow tokenizer, or a class or instance with its own
    ``__call__`` or ``_encode_plus``), or None. (``apply_chat_template`` tokenizes through
    ``__call__``; so do ``TemplateRenderer.tokenize`` and the split.)"""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # pragma: no cover - another transformers layout
        return "unknown transformers tokenizer layout"
    if not isinstance(tokenizer, TokenizersBackend) or \
            getattr(tokenizer, "_tokenizer", None) is None:
        return "slow tokenizer (no tokenizers backend)"
    kind = type(tokenizer)
    if (kind._encode_plus is not TokenizersBackend._encode_plus
            or kind.__call__ is not PreTrainedTokenizerBase.__call__
            or {"_encode_plus", "__call__"} & vars(tokenizer).keys()):
        return f"{kind.__name__} encodes its own way"
    return None
