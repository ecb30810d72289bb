"""Running the sidecar on uvicorn: ``prefix-cache serve``.

With one worker the app is built here and served in-process. With several, uvicorn starts
worker processes that each build their own app from the same flags (handed over in the
environment) and the same environment, so all of them serve the same configuration.
"""

from __future__ import annotations

import json
import logging
import logging.config
import os
import signal
import sys
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from ..errors import validation_problems
from ..http.listen import check_can_listen
from ..http.logs import uvicorn_log_config
from ..http.connections import GuardedH11Protocol, connection_options
from ..metrics.multiprocess import clear_multiprocess_dir
from ..store.factory import open_store
from .app import create_app, open_backing_store
from .keys_reload import note_early_sighup
from .served_models import ModelRegistry, load_model_specs
from .settings import ServiceSettings, check_renamed_env
from .tenants import KeyRing

log = logging.getLogger("prefix_cache.service")

EXIT_OK, EXIT_CONFIG = 0, 2
LOGGERS = ("prefix_cache", "engine_adapter")
FLAGS_ENV = "PREFIX_CACHE_SERVE_FLAGS"  # not a settings field: read by worker processes only


def make_settings(overrides: Mapping[str, Any]) -> ServiceSettings:
    """Settings from the flags and the environment; ValueError naming what is wrong."""
    check_renamed_env()
    try:
        return ServiceSettings(**overrides)
    except ValidationError as exc:
        problems = validation_problems(exc, "settings")
        raise ValueError(f"invalid settings: {problems}") from None


def startup_warnings(settings: ServiceSettings) -> list[str]:
    warnings = []
    if settings.workers > 1 and settings.uses_memory_store:
        warnings.append(
            f"--workers {settings.workers} with the in-process memory store: each worker has "
            "its own cache, so hits (and tenant quotas) are per worker; pass --redis URL to "
            "share entries across workers")
    return warnings


def note_store_at_start(settings: ServiceSettings) -> bool:
    """Ping the shared store once at start and log it if it does not answer (serving goes on:
    every lookup is then a miss until it is back), rather than at the first request; whether
    it answered."""
    store = open_store(settings.redis_url, tiered=False,
                       timeout_seconds=settings.redis_timeout_s,
                       connect_timeout_seconds=settings.redis_connect_timeout_s)
    try:
        answered = store.ping()
    finally:
        store.close()
    if not answered:
        log.warning("the shared store %s does not answer at start: requests are served without "
                    "the cache (each a miss) until it does; GET /readyz says not_ready meanwhile",
                    store.stats().remote.url)
    return answered


def serve(overrides: Mapping[str, Any]) -> int:
    """Run until stopped; the exit code (2: the configuration cannot be served)."""
    import uvicorn

    # Each request tokenizes one text: tokenizers' thread pool would only hand it to another
    # thread and wait (a wakeup, 0.1-0.5 ms on a busy machine, per hit). Workers inherit this.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    note_early_sighup()  # a SIGHUP while starting re-reads the keys once serving, not a death
    try:
        settings = make_settings(overrides)
        check_can_listen(settings.host, settings.port)  # before models load (or convert)
        # The servers' logging from the first line on (JSON lines with --log-format json),
        # before models load: a download or a conversion, and the engine, log as they go.
        log_config = uvicorn_log_config(settings.log_level, LOGGERS,
                                        log_format=settings.log_format)
        logging.config.dictConfig(log_config)
        # Before any metric exists: what an earlier run left would count as this one's.
        cleared = clear_multiprocess_dir()
        keyring = KeyRing.from_settings(settings)
        registry = ModelRegistry.from_specs(load_model_specs(settings))
        if settings.workers == 1:
            app = create_app(settings, models=registry)
        else:  # each worker builds its own; check here that the store opens, so errors exit 2
            app = None
            open_backing_store(settings, len(keyring.tenants)).close()
    except (ValueError, OSError) as exc:
        print(f"prefix-cache serve: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if cleared:
        log.info("removed %d metric files an earlier run left in the multiprocess folder", cleared)
    for warning in startup_warnings(settings):
        log.warning(warning)
    if not settings.uses_memory_store:
        note_store_at_start(settings)
    log.info("serving %s; %s; %s store", ", ".join(m.name for m in registry),
             "open, namespace 'default'" if keyring.is_open else f"tenants {keyring.tenants}",
             "memory" if settings.uses_memory_store else "redis")
    common: dict[str, Any] = {
        "host": settings.host, "port": settings.port, "log_level": settings.log_level,
        "log_config": log_config,
        "server_header": False,
        # A head deadline, an idle timeout and a connection cap: idle sockets lock no one out.
        **connection_options(settings.header_timeout_s, settings.keep_alive_timeout_s,
                             settings.max_connections),
        # SIGTERM drains first (prefix_cache.http.drain); this bounds SIGINT's shutdown.
        "timeout_graceful_shutdown": settings.shutdown_grace_s,
    }
    # uvicorn shuts down gracefully on Ctrl-C, then re-raises it: after a clean stop, exit 0.
    try:
        if app is not None:
            server = uvicorn.Server(uvicorn.Config(app, **common))
            server.run()
            return EXIT_OK if server.started else EXIT_CONFIG
        # Workers build their own app: hand them exactly the flags this process was given.
        os.environ[FLAGS_ENV] = json.dumps({k: _jsonable(v) for k, v in overrides.items()})
        # The protocol class goes to the workers by name; worker_app sets its deadline.
        common["http"] = GuardedH11Protocol
        run_workers(uvicorn.Config("prefix_cache.service.server:worker_app", factory=True,
                                   workers=settings.workers, **common))
    except KeyboardInterrupt:
        pass
    return EXIT_OK


def run_workers(config: Any) -> None:
    """uvicorn's multiprocess supervisor (as ``uvicorn.run`` with workers), except that a
    SIGHUP is passed on to each worker, which re-reads the keys file (``keys_reload.py``),
    instead of restarting every worker."""
    from uvicorn.supervisors import Multiprocess

    class KeysReloadingSupervisor(Multiprocess):
        def handle_hup(self) -> None:
            log.info("SIGHUP: the workers re-read the keys file")
            for process in self.processes:
                if process.pid is not None:
                    try:
                        os.kill(process.pid, signal.SIGHUP)
                    except ProcessLookupError:
                        pass  # gone: its replacement reads the file as it starts

    KeysReloadingSupervisor(config, sockets=[config.bind_socket()]).run()


def _jsonable(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    return value if isinstance(value, (int, float, bool)) or value is None else str(value)


def worker_app() -> Any:
    """The app of one worker process (uvicorn factory)."""
    note_early_sighup()
    settings = make_settings(json.loads(os.environ.get(FLAGS_ENV, "{}")))
    GuardedH11Protocol.header_timeout_s = settings.header_timeout_s  # this process's servers
    return create_app(settings)
