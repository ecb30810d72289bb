"""The HTTP layer both servers stand on (the sidecar in ``prefix_cache.service`` and the engine's
own server in ``engine_adapter.server``): errors as responses, body limits, relaying with
disconnects, auth headers, uvicorn logging. Neither server's modules are imported here.
"""
