"""`prefix-cache boundary`: flags, one JSON line per request in order, errors, exit codes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from prefix_cache import cli
from prefix_cache.testing.offline_tokenizers import make_model_dir

from tests.support import reference
from tests.support.templates import BEHAVIOURS
from tests.support.tools import make_tools

TEMPLATE = BEHAVIOURS["default_system"]
SYSTEM = {"role": "system", "content": "You are the CLI agent."}


def body(user: str, tools: int = 3, system: dict[str, Any] = SYSTEM, **extra: Any) -> dict[str, Any]:
    return {"model": "x", "messages": [system, {"role": "user", "content": user}],
            "tools": make_tools(tools), **extra}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("models") / "demo-qwen3", "qwen3", TEMPLATE)


def run_cli(args: list[str], capsysbinary) -> tuple[int, list[dict[str, Any]], str]:
    code = cli.main(args)
    out, err = capsysbinary.readouterr()
    return code, [json.loads(line) for line in out.decode().splitlines()], err.decode()


def test_single_request(model_dir, tmp_path, capsysbinary, qwen3) -> None:
    req = tmp_path / "req.json"
    req.write_text(json.dumps(body("Deploy the service.")))
    code, lines, _ = run_cli(["boundary", "--model", str(model_dir), "--request", str(req)], capsysbinary)
    b = body("Deploy the service.")
    assert code == 0 and len(lines) == 1
    line = lines[0]
    assert set(line) == {"specprefill_system_end", "prompt_tokens", "cache", "key"}
    assert line["specprefill_system_end"] == reference.two_probe(qwen3, b["messages"], b["tools"], template=TEMPLATE)
    assert line["prompt_tokens"] == len(reference.render(qwen3, b["messages"], b["tools"], None, TEMPLATE))
    assert line["cache"] == "miss" and line["key"].startswith("spc:default:demo-qwen3:")


def test_requests_jsonl_in_order_with_errors(model_dir, tmp_path, capsysbinary) -> None:
    rows = [
        json.dumps(body("one")),
        "{not json",
        json.dumps(body("two")),
        json.dumps({"messages": [{"role": "robot", "content": "x"}]}),
        "",
        json.dumps([1, 2]),
        json.dumps({"messages": [{"role": "user", "content": "no system"}]}),
        json.dumps(body("three", tools=1)),
    ]
    path = tmp_path / "reqs.jsonl"
    path.write_text("\n".join(rows) + "\n")
    code, lines, err = run_cli(
        ["boundary", "--model", str(model_dir), "--requests", str(path), "--namespace", "tenant-1"],
        capsysbinary)
    assert code == 2
    assert [line.get("cache", "error") for line in lines] == [
        "miss", "error", "hit", "error", "error", "none", "miss"]
    assert "invalid JSON" in lines[1]["error"] and "robot" in lines[3]["error"]
    assert lines[0]["specprefill_system_end"] == lines[2]["specprefill_system_end"] > 0
    assert lines[0]["key"] == lines[2]["key"] and lines[0]["key"].split(":")[1] == "tenant-1"
    assert lines[5] == {"specprefill_system_end": 0, "prompt_tokens": lines[5]["prompt_tokens"],
                        "cache": "none", "key": ""}
    assert "hits=1" in err  # logs go to stderr, never stdout


def test_no_chat_template_exits_2(tmp_path, capsysbinary) -> None:
    bare = make_model_dir(tmp_path / "bare", "qwen3", None)
    req = tmp_path / "req.json"
    req.write_text(json.dumps(body("x")))
    code, lines, err = run_cli(["boundary", "--model", str(bare), "--request", str(req)], capsysbinary)
    assert code == 2 and lines == [] and "no chat template" in err


def test_chat_template_flag_overrides_folder(model_dir, tmp_path, capsysbinary, qwen3) -> None:
    other = tmp_path / "other.jinja"
    other.write_text(BEHAVIOURS["tools_first"])
    req = tmp_path / "req.json"
    b = body("hello")
    req.write_text(json.dumps(b))
    code, lines, _ = run_cli(["boundary", "--model", str(model_dir), "--chat-template", str(other),
                              "--request", str(req)], capsysbinary)
    assert code == 0
    assert lines[0]["specprefill_system_end"] == reference.two_probe(
        qwen3, b["messages"], b["tools"], template=BEHAVIOURS["tools_first"])


def test_template_error_is_a_line_not_a_crash(model_dir, tmp_path, capsysbinary) -> None:
    bad = tmp_path / "bad.jinja"
    bad.write_text(BEHAVIOURS["default_system"].replace("{%- endif %}", "", 1))  # syntax error
    path = tmp_path / "reqs.jsonl"
    path.write_text(json.dumps(body("a")) + "\n" + json.dumps(body("b")) + "\n")
    code, lines, _ = run_cli(["boundary", "--model", str(model_dir), "--chat-template", str(bad),
                              "--requests", str(path)], capsysbinary)
    assert code == 2 and len(lines) == 2 and all("chat template error" in line["error"] for line in lines)


def test_missing_model_folder(tmp_path, capsysbinary) -> None:
    req = tmp_path / "req.json"
    req.write_text("{}")
    code, lines, err = run_cli(["boundary", "--model", str(tmp_path / "nope"), "--request", str(req)],
                               capsysbinary)
    assert code == 2 and lines == [] and "does not exist" in err


def test_console_script_end_to_end(model_dir, tmp_path) -> None:
    """The installed entry point, as a user runs it: stdin in, JSON lines out, logs on stderr."""
    exe = shutil.which("prefix-cache")
    cmd = [exe] if exe else [sys.executable, "-m", "prefix_cache.cli"]
    data = "\n".join(json.dumps(body(u)) for u in ("a", "b", "c")) + "\n"
    proc = subprocess.run([*cmd, "boundary", "--model", str(model_dir), "--requests", "-"],
                          input=data, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [line["cache"] for line in lines] == ["miss", "hit", "hit"]
    assert len({line["specprefill_system_end"] for line in lines}) == 1


def test_version_prints_the_installed_version() -> None:
    from importlib import metadata

    proc = subprocess.run([sys.executable, "-m", "prefix_cache.cli", "--version"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"prefix-cache {metadata.version('prefix-cache')}"


def test_help_is_plain_text_naming_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    """The top-level --help: no reStructuredText markup, every command named in its description
    as in its list; every option of every command has help text."""
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = capsys.readouterr().out
    assert "``" not in text
    parser = cli.build_parser()
    (commands,) = [a for a in parser._actions if a.dest == "command"]
    description = " ".join(parser.description.split())
    for name in commands.choices:
        assert name in description, name
        for action in commands.choices[name]._actions:
            assert action.help, f"prefix-cache {name} {action.option_strings}: no help text"
