"""A real engine upstream: ``mlx_lm.server`` serving the tiny random-weights model, reached
through the sidecar by the OpenAI SDK, streaming and not."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("openai", reason="the OpenAI SDK is the client under test")

from prefix_cache.model_folders.model_dir import load_tokenizer  # noqa: E402
from prefix_cache.service.upstream import Upstream  # noqa: E402

from tests.support.loopback import (  # noqa: E402
    local_client,
    openai_client,
    streamed_chat,
    streamed_text,
)
from tests.support.sidecar import served, sidecar_app, unique_system  # noqa: E402
from tests.support.tools import make_tools  # noqa: E402


# mlx_lm.server loads the model it was started with under this name; any other is a Hub id.
MLX_DEFAULT_MODEL = "default_model"


@pytest.fixture(scope="module")
def app(mlx_server: str, tiny_model_dir: Path) -> Any:
    return sidecar_app(served("tiny", load_tokenizer(tiny_model_dir),
                              Upstream(mlx_server, model=MLX_DEFAULT_MODEL)))


def test_tiny_model_loads_with_mlx_lm(tiny_model_dir: Path) -> None:
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(tiny_model_dir))[:2]
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["vocab_size"] == len(load_tokenizer(tiny_model_dir)) == 151669
    assert model.model.embed_tokens.weight.shape == (config["vocab_size"], config["hidden_size"])
    assert tokenizer.chat_template and "tools" in tokenizer.chat_template


def test_sdk_chat_completion_from_mlx_lm_server(base: str) -> None:
    sdk = openai_client(base)
    messages = [unique_system(), {"role": "user", "content": "Say something."}]
    tools = make_tools(2)
    with local_client(base_url=base) as http:
        boundary = http.post("/v1/prefix/boundary", json={"messages": messages,
                                                          "tools": tools}).json()
    raw = sdk.chat.completions.with_raw_response.create(
        model="tiny", messages=messages, tools=tools, max_tokens=4, temperature=0.0)
    completion = raw.parse()
    assert raw.headers["x-prefix-cache"] == "hit"  # the boundary call above stored it
    assert raw.headers["x-specprefill-system-end"] == str(boundary["specprefill_system_end"])
    assert completion.choices[0].finish_reason in ("length", "stop")
    assert isinstance(completion.choices[0].message.content, str)
    # mlx_lm.server rendered and tokenized the very prompt the sidecar cut the boundary in.
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == boundary["prompt_tokens"]


def test_sdk_streams_a_chat_completion_from_mlx_lm_server(base: str) -> None:
    sdk = openai_client(base)
    headers, chunks = streamed_chat(
        sdk, model="tiny", messages=[unique_system(), {"role": "user", "content": "Stream."}],
        max_tokens=6, temperature=0.0)
    assert headers["x-prefix-cache"] == "miss"
    assert int(headers["x-specprefill-system-end"]) > 0
    assert len(chunks) >= 2 and streamed_text(chunks)
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_readyz_probes_mlx_lm_server(base: str) -> None:
    with local_client(base_url=base) as http:
        report = http.get("/readyz").json()
    assert report["status"] == "ready" and report["upstreams"]["tiny"] == {"ok": True,
                                                                           "status": 200}
