"""The cache: a request's key, its stored entry, and the one decision sequence that answers it.

``cache.py`` (``StaticPrefixCache``: lookup, render, single-flight compute, cut, driven by
``resolve`` / ``aresolve``), ``keys.py`` (key material, the xxh3-128 key, the check value, the
key parser; pure), ``entry.py`` (the binary stored value, verified on read), ``boundary.py`` (the
two-probe computation and the prefix cuts; pure), ``messages.py`` (request validation, the static
run of messages), ``prompt_text.py`` (``PromptText``: the plain renderer of a plan's texts),
``prompt_tokens.py`` (``PromptTokenizer``: the plain prompt tokenizer; the rule of the
accelerated one, which tokenizes from the entry's split), ``observer.py`` (cache events, the one source of every counter). Its own parts, used by
``cache.py`` alone: ``_plan.py`` (a request's plan before any render), ``_probes.py`` (the miss's
probe renders), ``_request.py`` (one request as one value, the I/O steps), ``_result.py``
(``PrefixResult``), ``_singleflight.py`` (one computation per key), ``_stats.py``
(``CacheStats``).
"""
