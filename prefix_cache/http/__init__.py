"""The HTTP layer both servers stand on (the sidecar in ``prefix_cache.service`` and the engine's
own server in ``engine_adapter.server``). Neither server's modules are imported here.

``errors.py`` (every error -> a response, in its API's shape), ``body.py`` (JSON bodies: type,
size, nesting), ``relay.py`` (an upstream's answer relayed, disconnects), ``sse.py`` (server-sent
events out and in), ``auth.py`` (credentials from the headers), ``logs.py`` (uvicorn's logging with
the project's loggers), ``request_id.py``, ``drain.py`` (graceful shutdown: SIGTERM and SIGINT
drain), ``connections.py`` (idle and slow connections), ``listen.py`` (a port in use found before
a server loads anything), ``request_record.py`` (what a request cost, noted as it goes),
``usage_tap.py`` (usage, content times and the finish read from a relayed answer),
``upstream_client.py`` (the pooled client to upstreams, without the Nagle/delayed-ACK stall).
"""
