"""Chat generation through an engine, below the HTTP servers that expose it.

``backend`` is the seam (a neutral request in, text deltas out, typed engine figures);
``engines`` finds an engine by name; ``openai_params`` and ``openai_stream`` are the OpenAI
chat-completions layer over any backend. Importing this package imports no engine.
"""
