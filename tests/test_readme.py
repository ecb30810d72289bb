"""The README, read as a newcomer follows it: its first two commands (install and serve, then the
tests, the one `.ci/run` runs), the tour's order, files, links and flags, and the answer it shows."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from prefix_cache import cli
from tests.support.paths import REPO

README = REPO / "README.md"
SERVE_COMMAND = "pip install -e . -c constraints.txt && prefix-cache serve"
TEST_COMMAND = "pip install -e '.[test,mlx]' -c constraints.txt && python -m pytest -q"
# The pages the README's text moved to: their links are checked as the README's are.
MOVED_TO = ("usage.md", "contract.md", "layout.md", "dependencies.md")


def blocks(path: Path = README) -> list[tuple[str, str]]:
    """The page as (kind, text) in order: "code" for each indented command (continuation lines
    joined, comment lines left out), "comment" for a code comment, "text" for a prose line."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("    ") or not line.strip():
            pending = ""
            if line.strip():
                out.append(("text", line))
            continue
        code = line.strip()
        if code.startswith("#"):
            out.append(("comment", code[1:].strip()))
            continue
        if code.endswith("\\"):
            pending += code[:-1].rstrip() + " "
            continue
        out.append(("code", pending + code))
        pending = ""
    return out


def commands() -> list[str]:
    return [text for kind, text in blocks() if kind == "code"]


def test_the_first_two_commands_install_and_serve_then_run_the_tests() -> None:
    assert commands()[:2] == [SERVE_COMMAND, TEST_COMMAND]


def test_ci_runs_the_readme_test_command() -> None:
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    runs = [line.replace("pip install -q ", "pip install ", 1) for line in ci
            if "python -m pytest" in line and not line.startswith("#")]
    assert runs == [TEST_COMMAND]      # the same command, pip only quieter


def test_each_from_another_shell_step_follows_a_serve_command() -> None:
    last_command, steps = "", 0
    for kind, text in blocks():
        if kind == "code":
            last_command = text
        elif kind == "text" and "from another shell" in text:
            steps += 1
            assert "prefix-cache serve" in last_command, (text, last_command)
    assert steps >= 2       # the boundary call and the engine's chat


def _paths_named(text: str) -> set[str]:
    """Repository files a command or its prose names: curl's @FILE and examples/ ... paths."""
    return (set(re.findall(r"@([\w./-]+)", text))
            | set(re.findall(r"(?<![\w/])((?:examples|docs|deploy|bench)/[\w./-]*\w)", text)))


def test_the_tour_names_files_that_exist() -> None:
    named = set().union(*(_paths_named(text) for _, text in blocks()))
    assert {"examples/request.json", "examples/agent_turns.jsonl"} <= named
    assert sorted(p for p in named if not (REPO / p).exists()) == []


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in path.read_text(encoding="utf-8").splitlines()
            if line.startswith("#")}


@pytest.mark.parametrize("page", [README, *(REPO / "docs" / name for name in MOVED_TO)],
                         ids=lambda p: p.name)
def test_every_relative_link_reaches_a_file_and_heading(page: Path) -> None:
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        where = (page.parent / file).resolve() if file else page
        if not where.exists() or (anchor and anchor not in _anchors(where)):
            broken.append(target)
    assert broken == []


def test_every_prefix_cache_command_parses_with_the_cli() -> None:
    parser = cli.build_parser()
    shown = [part.strip() for line in commands() for part in line.split("&&")
             if part.strip().startswith("prefix-cache ")]
    assert len(shown) >= 5
    for line in shown:
        argv = shlex.split(line)[1:]
        try:
            parser.parse_args(argv)
        except SystemExit as exc:     # argparse's way to refuse
            pytest.fail(f"{line!r} does not parse: exit {exc.code}")


def test_every_chat_call_in_the_tour_asks_for_temperature_zero() -> None:
    chats = [c for c in commands() if "/v1/chat/completions" in c or "completions.create(" in c]
    assert len(chats) >= 3          # behind an upstream, on the engine, and the OpenAI SDK's
    for line in chats:
        if line.startswith("curl"):
            words = shlex.split(line)
            assert json.loads(words[words.index("-d") + 1])["temperature"] == 0, line
        else:
            assert "temperature=0" in line, line


def test_the_shown_boundary_is_what_the_cli_answers(
        demo_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shown = next(text for kind, text in blocks()
                 if kind == "comment" and text.startswith('{"specprefill_system_end"'))
    prefix, dots, _ = shown.partition('..."')
    assert dots
    expected = json.loads(prefix + '"}')
    request = (REPO / "examples" / "request.json").read_text(encoding="utf-8")
    requests = tmp_path / "twice.jsonl"
    requests.write_text(json.dumps(json.loads(request)) + "\n" + json.dumps(json.loads(request)) + "\n")
    assert cli.main(["boundary", "--model", str(demo_folder), "--requests", str(requests)]) == 0
    first, second = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert (first["cache"], second["cache"]) == ("miss", "hit")
    key = second.pop("key")
    assert key.startswith(expected.pop("key")) and key == first["key"]
    assert {k: second[k] for k in expected} == expected


# -- the tour, run ------------------------------------------------------------------------------

TOUR_TIMEOUT_S = 900.0   # each install or server start: a bound against hangs, not a timing
SERVERS = ("prefix-cache serve",)   # serve and serve-engine: they run until stopped


class Tour:
    """The tour's commands run in order, as a newcomer's shells would, in a fresh venv: each
    ``&&`` part in turn; a server in the background (the one before it on its port stopped, as
    the tour says to), ready once its ``/healthz`` answers. The README's ports 8000 and 8001 are
    replaced by free ones (a shared machine may hold them); nothing else is changed."""

    def __init__(self, venv: Path) -> None:
        import os

        from tests.support.loopback import free_port
        from tests.support.paths import blas_env

        self.ports = {"8000": str(free_port()), "8001": str(free_port())}
        self.env = {**os.environ, **blas_env(), "VIRTUAL_ENV": str(venv),
                    "PATH": f"{venv / 'bin'}:{os.environ['PATH']}",
                    "PIP_DISABLE_PIP_VERSION_CHECK": "1", "NO_PROXY": "*", "no_proxy": "*"}
        for name in ("PYTHONPATH", "PYTHONHOME"):   # only what the venv installed is found
            self.env.pop(name, None)
        self.servers: dict[str, tuple[str, Any]] = {}   # port -> (command, process)
        self.log = venv.parent / "tour.log"

    def port_of(self, command: str) -> str:
        words = shlex.split(command)
        return words[words.index("--port") + 1] if "--port" in words else self.ports["8000"]

    def localize(self, command: str) -> str:
        for written, free in self.ports.items():
            command = command.replace(f"localhost:{written}", f"localhost:{free}")
            command = command.replace(f"--port {written}", f"--port {free}")
        if command.startswith(SERVERS) and "--port" not in command:
            command += f" --port {self.ports['8000']}"
        return command

    def run(self, command: str) -> str:
        """One part of a tour line; its stdout (a server: its readiness)."""
        import subprocess

        command = self.localize(command)
        with self.log.open("a") as log:
            log.write(f"\n$ {command}\n")
        if command.startswith(SERVERS):
            return self.serve(command)
        done = subprocess.run(["bash", "-c", command], cwd=REPO, env=self.env, text=True,
                              capture_output=True, timeout=TOUR_TIMEOUT_S)
        with self.log.open("a") as log:
            log.write(done.stdout[-4000:] + done.stderr[-4000:])
        assert done.returncode == 0, f"{command!r} exited {done.returncode}: {done.stderr[-3000:]}"
        return done.stdout

    def serve(self, command: str) -> str:
        import subprocess
        import time

        import httpx

        port = self.port_of(command)
        if port in self.servers and self.servers[port][0] == command:
            return "ready"   # the tour names the running one again (step 1: the first command)
        self.stop(port)
        out = self.log.with_name(f"server-{port}-{len(self.servers)}.log")
        with out.open("w") as log:
            process = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=REPO,
                                       env=self.env, stdout=log, stderr=subprocess.STDOUT)
        self.servers[port] = (command, process)
        deadline = time.monotonic() + TOUR_TIMEOUT_S
        while time.monotonic() < deadline:
            assert process.poll() is None, f"{command!r} exited: {out.read_text()[-3000:]}"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200:
                    return "ready"
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"{command!r} never became ready: {out.read_text()[-3000:]}")

    def stop(self, port: str | None = None) -> None:
        import signal

        for held in [p for p in self.servers if port is None or p == port]:
            _, process = self.servers.pop(held)
            process.send_signal(signal.SIGINT)
            try:
                process.wait(60)
            except Exception:
                process.kill()
                process.wait(10)


def test_the_tour_runs_step_by_step_in_a_fresh_venv(tmp_path: Path) -> None:
    """Every command of the tour, in the order written, from the first one alone (not the test
    command: the tour does not run it), in a new venv: each step installs what it needs. Pip's
    cache and the converted demo models in the project's cache folder are reused. The answers
    are checked where the tour shows them: the boundary's miss then hit, the sidecar's headers
    in front of the engine, and the engine's answer (greedy: Paris)."""
    import subprocess
    import sys

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    tour = Tour(venv)
    answers: list[tuple[str, str]] = []
    try:
        twice = False   # "... and from a third, twice:" before a command shown once
        for kind, line in blocks():
            if kind == "text":
                twice = line.rstrip().endswith("twice:")
            if kind != "code" or line == TEST_COMMAND:
                continue
            for part in line.split("&&") * (2 if twice else 1):
                answers.append((part.strip(), tour.run(part.strip())))
    finally:
        tour.stop()
    boundary = [json.loads(out) for cmd, out in answers
                if cmd.startswith("curl") and "/v1/prefix/boundary" in cmd]
    assert [b["cache"] for b in boundary] == ["miss", "hit"]
    behind = [out.lower() for cmd, out in answers if cmd.startswith("curl -si")]
    assert len(behind) == 2 and "x-prefix-cache: miss" in behind[0]
    assert "x-prefix-cache: hit" in behind[1] and "x-specprefill-system-end:" in behind[1]
    engine = [out for cmd, out in answers
              if "/v1/chat/completions" in cmd and not cmd.startswith("curl -si")]
    sdk = [out for cmd, out in answers if "completions.create(" in cmd]
    assert engine and sdk and all("Paris" in out for out in engine + sdk), answers[-3:]
