"""Drive real oMLX (``omlx`` from flyto-mlx or fusion-mlx) with the plug-in installed, and write
what its scheduler received as JSON; run with the oMLX venv's python (tests/engine/test_omlx.py).

    python -m engine_adapter.testing.omlx_check OUT.json --models DIR [--template FILE]

One BatchedEngine (a tiny random-weights qwen3 target, a smaller draft for SpecPrefill, the
real Qwen3 tokenizer, the Qwen3.5 template or the given one), ``install(engine, boundary)``
and nothing else; each case goes through ``engine.stream_chat`` as oMLX's server calls it. The
truth is computed here, apart from the plug-in: the two-probe boundary over oMLX's own render
(its ``_apply_chat_template`` before install) in its own ids (``tokenizer.encode``), never
past the first non-static message's text. Per case: the truth, the boundary and prompt the
scheduler got, whether the prompt came as ids equal to oMLX's own encode, the cache outcome,
probe renders, and what SpecPrefill kept dense.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from .tiny_model import tiny_model_folder
from .two_probe import exact

TOOL_COUNTS = (0, 1, 4, 16, 64)
SYSTEM = "You are a careful coding agent. Answer briefly and cite files you read."
LONG_SYSTEM = " ".join(f"Rule {i}: keep every edit minimal and explain it in one line."
                       for i in range(120))


def make_tools(n: int) -> list[dict[str, Any]]:
    """n distinct OpenAI function tools of realistic size (as tests/support/tools.py)."""
    return [{"type": "function", "function": {
        "name": f"tool_{i}",
        "description": f"Tool number {i}: reads, edits or searches files in the workspace.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "Path relative to the root."},
            "limit": {"type": "integer", "description": "Maximum results.", "default": 20},
            "recursive": {"type": "boolean"}}, "required": ["path"]}}} for i in range(n)]


def truth(render: Any, encode: Any, messages: list[dict[str, Any]], tools: Any,
          ct: dict[str, Any] | None) -> int:
    """The contract over oMLX's own render and ids: the two-probe boundary, capped at the
    first non-static message's text."""
    def ids(msgs: list[dict[str, Any]]) -> list[int]:
        return list(encode(render([dict(m) for m in msgs], tools, chat_template_kwargs=ct)))
    return exact(ids, messages)


def cases() -> list[dict[str, Any]]:
    """name, messages, tools, chat_template_kwargs for each case (SpecPrefill on)."""
    out = []
    for n in TOOL_COUNTS:
        out.append({"name": f"tools_{n}", "tools": make_tools(n) or None, "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "List the files under src/ and summarize the largest."}]})
    out.append({"name": "multi_turn", "tools": make_tools(4), "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Open README.md."},
        {"role": "assistant", "content": "It describes the project's install steps."},
        {"role": "user", "content": "Now summarize the test folder in two lines."}]})
    out.append({"name": "no_thinking", "tools": make_tools(4),
                "chat_template_kwargs": {"enable_thinking": False}, "messages": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": "Which file defines the CLI?"}]})
    out.append({"name": "long_system", "tools": None, "messages": [
        {"role": "system", "content": LONG_SYSTEM},
        {"role": "user", "content": "Rename the helper in utils.py and say why."}]})
    # A long conversation after 16 tools: SpecPrefill keeps a tenth of it, never the static part.
    out.append({"name": "sparse", "tools": make_tools(16), "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": " ".join(f"Line {i} of the log says the build step {i} "
                                             "passed." for i in range(150))}]})
    return out


async def tenants(engine: Any, cache: Any, case: dict[str, Any], send: Any
                  ) -> list[dict[str, Any]]:
    """The same request from API keys A, A, B and A again (as x-api-key), through an HTTP app
    behind ``TenantFromKey`` that calls ``engine.stream_chat`` as oMLX's server does."""
    import httpx
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    from engine_adapter.omlx_tenant import TenantFromKey

    app = FastAPI()
    rows: list[dict[str, Any]] = []

    @app.post("/chat")
    async def chat() -> StreamingResponse:
        async def body() -> Any:
            rows.append(await send(case))  # stream_chat, inside this request's context
            yield "ok"
        return StreamingResponse(body())

    transport = httpx.ASGITransport(app=TenantFromKey(app))
    sent = [("A", {"authorization": "Bearer key-a"}), ("A", {"authorization": "Bearer key-a"}),
            ("B", {"authorization": "Bearer key-b"}), ("A", {"x-api-key": "key-a"})]
    async with httpx.AsyncClient(transport=transport, base_url="http://omlx") as client:
        for who, headers in sent:
            answer = await client.post("/chat", json={}, headers=headers)
            assert answer.status_code == 200, answer.text
            rows[-1]["who"] = who
    return rows


def omlx_api() -> tuple[Any, Any, Any]:
    """BatchedEngine, convert_tools_for_template and ModelSettings of the oMLX installed here:
    ``omlx`` (flyto-mlx) or its fork ``fusion_mlx``."""
    try:
        from omlx.api.tool_calling import convert_tools_for_template
        from omlx.engine.batched import BatchedEngine
        from omlx.model_settings import ModelSettings
    except ImportError:
        from fusion_mlx.api.tool_calling import convert_tools_for_template
        from fusion_mlx.engines.batched import BatchedEngine
        from fusion_mlx.model_settings import ModelSettings
    return BatchedEngine, convert_tools_for_template, ModelSettings


async def run(models: Path, template: str | None, out: Path) -> None:
    BatchedEngine, convert_tools_for_template, ModelSettings = omlx_api()

    from engine_adapter.omlx_hooks import omlx_version
    from engine_adapter.omlx_tenant import tenant_namespace
    from engine_adapter.plugin import SpecPrefillBoundary, install
    from prefix_cache import StaticPrefixCache

    target = tiny_model_folder(models / "omlx-target", "qwen3", chat_template=template)
    draft = tiny_model_folder(models / "omlx-draft", "qwen3", chat_template=template,
                              hidden=32, layers=1)
    settings = ModelSettings(specprefill_enabled=True, specprefill_draft_model=str(draft),
                             specprefill_keep_pct=0.1)
    engine = BatchedEngine(str(target), model_settings=settings)
    await engine.start()
    stock_render = engine._apply_chat_template  # oMLX's own, for the truth
    cache = StaticPrefixCache()
    boundary = SpecPrefillBoundary(cache, namespace=tenant_namespace)
    report: dict[str, Any] = {"version": omlx_version(engine),
                              "shape": install(engine, boundary), "cases": {}}
    scheduler = engine._engine.engine.scheduler
    got: list[dict[str, Any]] = []
    add, score = scheduler.add_request, scheduler._try_specprefill_scoring

    def recorded_add(request: Any) -> Any:
        got.append({"system_end": request.specprefill_system_end,
                    "ids_given": not isinstance(request.prompt, str),
                    "prompt": list(request.prompt) if not isinstance(request.prompt, str)
                    else list(engine._tokenizer.encode(request.prompt))})
        return add(request)

    def recorded_score(request: Any) -> None:
        score(request)
        indices = getattr(request, "specprefill_indices", None)
        if indices is not None:  # what SpecPrefill prefilled: the system part, then kept
            offset = request.specprefill_position_offset
            got[-1]["dense"] = sorted({*range(offset), *(offset + int(i) for i in
                                                         indices.tolist())})

    scheduler.add_request = recorded_add
    scheduler._try_specprefill_scoring = recorded_score

    async def send(case: dict[str, Any], streamed: bool = True, **extra: Any
                   ) -> dict[str, Any]:
        before = (cache.stats.renders, cache.stats.hits, cache.stats.misses,
                  cache.render_thread_calls)
        ct = case.get("chat_template_kwargs")
        kwargs = {"chat_template_kwargs": dict(ct)} if ct else {}
        messages = [dict(m) for m in case["messages"]]
        if streamed:
            async for _ in engine.stream_chat(messages, max_tokens=1, tools=case["tools"],
                                              specprefill_threshold=1, **kwargs, **extra):
                pass
        else:  # the non-streaming API (oMLX 0.7.0's generate() forwards no SpecPrefill kwarg)
            await engine.chat(messages, max_tokens=1, tools=case["tools"],
                              specprefill_threshold=1, **kwargs, **extra)
        row = got[-1]
        tools = convert_tools_for_template(case["tools"]) if case["tools"] else None
        own = list(engine._tokenizer.encode(stock_render(
            [dict(m) for m in case["messages"]], tools, chat_template_kwargs=ct)))
        row.update(
            truth=truth(stock_render, engine._tokenizer.encode, case["messages"], tools, ct),
            ids_equal_own=row["prompt"] == own, prompt_tokens=len(own),
            probe_renders=cache.stats.renders - before[0],
            hit=cache.stats.hits - before[1], miss=cache.stats.misses - before[2],
            thread_calls=cache.render_thread_calls - before[3])
        del row["prompt"]
        return row

    for case in cases():
        report["cases"][case["name"]] = await send(case)
    again = dict(cases()[3])  # tools_16 again, another user text: a hit
    again["messages"] = [again["messages"][0], {"role": "user", "content": "And under tests/?"}]
    report["cases"]["hit"] = await send(again)
    report["cases"]["chat"] = await send(cases()[2], streamed=False)
    report["tenants"] = await tenants(engine, cache, cases()[2], send)
    report["cache_calls_on"] = cache.stats.hits + cache.stats.misses + cache.stats.none
    report["cases"]["off_request"] = await send(cases()[3], specprefill=False)
    settings.specprefill_enabled = False
    report["cases"]["off_model"] = await send(cases()[3])
    report["cache_calls"] = cache.stats.hits + cache.stats.misses + cache.stats.none
    await engine.stop()
    cache.close()
    out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="engine_adapter.testing.omlx_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, nargs="?", help="JSON file to write")
    parser.add_argument("--models", type=Path, help="folder for the tiny models")
    parser.add_argument("--template", type=Path, default=None, help="chat template file")
    parser.add_argument("--probe", action="store_true",
                        help="only check that oMLX imports here (exit 0), and print its version")
    args = parser.parse_args(argv)
    if args.probe:
        omlx_api()
        from engine_adapter.omlx_hooks import omlx_version
        print(omlx_version(omlx_api()[0]))
        return 0
    if args.out is None or args.models is None:
        parser.error("OUT and --models are required")
    template = args.template.read_text(encoding="utf-8") if args.template else None
    asyncio.run(run(args.models, template, args.out))
    # The report is written; oMLX's MLX threads can abort the interpreter's teardown
    # ("terminate called without an active exception"), so leave without one.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
