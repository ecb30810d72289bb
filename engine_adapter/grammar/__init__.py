"""Constrained decoding: what a request's output must be, as an llguidance grammar
(``build.py``: ``output_grammar``), compiled once per namespace, grammar and tokenizer
(``compiled.py``: ``GrammarCache``); the engine's sampler masks each step's logits with it
(``mlx_engine.sampling.constrained``).
"""

from .build import Envelope, OutputGrammar, output_grammar
from .compiled import GrammarCache, GrammarRun

__all__ = ["Envelope", "GrammarCache", "GrammarRun", "OutputGrammar", "output_grammar"]
