"""Every default of the MLX engine in one place, the knobs an operator cannot set included.

Imports nothing: ``options.py`` (what an operator may set) and the engine's modules both read
these, so neither imports the other.
"""

from __future__ import annotations

GIB = 1 << 30

DEFAULT_KV_BYTES = GIB              # each of the two KV stores (static prefixes, conversations)
DEFAULT_KV_DISK_BYTES = 16 * GIB    # the disk tier under both stores (per model)
DEFAULT_KV_DISK_QUEUE = 16          # snapshots waiting for the disk writer; more are dropped
DEFAULT_MAX_BATCH_SIZE = 16         # sequences decoded together
DEFAULT_PREFILL_BATCH_SIZE = 8      # prompts BatchGenerator prefills together
DEFAULT_PREFILL_STEP = 2048         # tokens per model call of a prefill chunk
DEFAULT_STEP_TOKENS = 1024          # an engine step's token budget: decode, then prefill chunks
# (1024, not 512: the flood's prefill rate 0.80-1.75x first come first served, median 1.04x,
# against 512's median 0.62x; the quiet tenant's TTFT alike; docs/reliability.md)
DEFAULT_MIN_CHUNK = 32              # the smallest prefill chunk the budget gives a namespace
DEFAULT_MAX_TOKENS = 512            # a chat request that names no max_tokens (cut to the context)
# SpecPrefill (arXiv 2502.02789)
DEFAULT_KEEP_PCT = 0.2              # share of the scored chunks kept
DEFAULT_SPECPREFILL_THRESHOLD = 8192  # engages above this many tokens left to compute
DEFAULT_CHUNK_SIZE = 32             # tokens kept or dropped together
DEFAULT_TAIL_TOKENS = 512           # always kept at the end of the prompt (template structure)
DEFAULT_LOOKAHEAD = 8               # draft decode steps whose attention scores the prompt
DEFAULT_POOL_KERNEL = 13            # smoothing window of the scores
# A GenerationRequest made directly (benchmarks, tests) decodes greedily; the API layers fill
# the temperature in from the request (OpenAI's default, 1.0, in ``SamplingParams``).
GREEDY = 0.0
# Speculative decoding by prompt lookup (``mlx_engine/speculative.py``)
DEFAULT_SPECULATIVE = True          # on: drafts from the sequence's own tokens, with back-off
DEFAULT_SPEC_NGRAM = 3              # the longest n-gram looked up (then shorter ones)
DEFAULT_SPEC_MIN_NGRAM = 2          # the shortest
DEFAULT_SPEC_MAX_DRAFT = 8          # tokens a draft may have (it grows while drafts are taken)
DEFAULT_SPEC_BACKOFF_MAX = 64       # steps without drafting after drafts were rejected in a row
