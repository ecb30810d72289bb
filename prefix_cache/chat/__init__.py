"""Chat generation through an engine, below the HTTP servers that expose it.

``backend`` is the seam (a neutral request in, text deltas and tool calls out, typed engine
figures); ``engines`` finds an engine by name; ``openai_params`` and ``openai_encode`` are the
OpenAI chat-completions layer over any backend. The agent APIs (Anthropic Messages, OpenAI
Responses) convert their bodies to the chat-template ``conversation`` (``anthropic_params``,
``responses_params``) and format a turn's neutral ``events`` -- from an engine, or from an
upstream's chat completion (``openai_decode``) -- in their own shape (``anthropic_encode``,
``responses_encode``). Importing this package imports no engine.
"""
