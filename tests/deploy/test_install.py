"""The install is pinned: the README's test command is the one ``.ci/run`` runs, both install with
``-c constraints.txt``, and constraints.txt pins everything the runtime, ``mlx`` and ``test``
extras pull in (transitively, as installed here) at a version inside every range stated for it."""

from __future__ import annotations

import re
import shlex
import tomllib
from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import NormalizedName, canonicalize_name
from packaging.version import Version

from tests.support.paths import REPO as ROOT

EXTRAS = ("mlx", "test")
TEST_COMMAND = re.compile(r"pip install .*\[[^\]]*\btest\b[^\]]*\].*&&.*pytest.*")
QUIET = {"-q", "--quiet"}


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def pins() -> dict[NormalizedName, Version]:
    """constraints.txt as name -> pinned version; anything but ``name==version`` fails."""
    found: dict[NormalizedName, Version] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        requirement = Requirement(line)
        (spec,) = requirement.specifier
        assert spec.operator == "==", f"constraints.txt: {line!r} is not a pin"
        name = canonicalize_name(requirement.name)
        assert name not in found, f"constraints.txt pins {name} twice"
        found[name] = Version(spec.version)
    return found


def declared() -> list[Requirement]:
    """The runtime dependencies and those of the extras the README's test command installs."""
    project = pyproject()["project"]
    lines = list(project["dependencies"])
    for extra in EXTRAS:
        lines += project["optional-dependencies"][extra]
    return [Requirement(line) for line in lines]


def command_lines(text: str) -> list[tuple[tuple[str, ...], ...]]:
    """Each test command as its steps' words; pip's ``-q`` (log verbosity only) left out."""
    return [tuple(tuple(w for w in shlex.split(step) if not (w in QUIET and "pip" in step))
                  for step in m.group(0).split("&&"))
            for m in TEST_COMMAND.finditer(text)]


def test_the_readme_and_ci_run_the_same_pinned_test_command() -> None:
    readme = command_lines((ROOT / "README.md").read_text())
    ci = command_lines((ROOT / ".ci" / "run").read_text())
    assert len(ci) == 1, f".ci/run should run one test command, found {ci}"
    assert readme, "the README shows no test command (pip install '.[test...]' && pytest)"
    assert set(readme) == set(ci), f"README {readme} != .ci/run {ci}"
    ((install, *_),) = ci
    assert install[:2] == ("pip", "install") or install[:4] == ("python", "-m", "pip", "install")
    assert "-c" in install and install[install.index("-c") + 1] == "constraints.txt", install
    extras = re.search(r"\[([^\]]*)\]", " ".join(install))
    assert extras and set(EXTRAS) <= {e.strip() for e in extras.group(1).split(",")}, install


def test_constraints_pin_every_declared_dependency_inside_its_range() -> None:
    pinned = pins()
    for requirement in declared():
        name = canonicalize_name(requirement.name)
        assert name in pinned, f"{requirement} is not pinned in constraints.txt"
        assert requirement.specifier.contains(pinned[name], prereleases=True), (
            f"constraints.txt pins {name}=={pinned[name]} outside pyproject's {requirement}")


def test_constraints_pin_what_the_dependencies_pull_in() -> None:
    """Walks the installed metadata from the declared requirements: each one reached is pinned
    inside every range that asks for it (an unpinned one would float on a fresh machine)."""
    pinned = pins()
    seen: set[tuple[NormalizedName, str]] = set()
    todo = [(r, "") for r in declared()]
    while todo:
        requirement, extra = todo.pop()
        if requirement.marker and not requirement.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(requirement.name)
        assert name in pinned, f"{name} (wanted as {requirement}) is not pinned in constraints.txt"
        assert requirement.specifier.contains(pinned[name], prereleases=True), (
            f"constraints.txt pins {name}=={pinned[name]}, but something asks for {requirement}")
        for wanted in {""} | set(requirement.extras):
            if (name, wanted) in seen:
                continue
            seen.add((name, wanted))
            todo += [(Requirement(r), wanted) for r in metadata.requires(name) or []]
    assert len({name for name, _ in seen}) > len(declared()) / 2   # the walk went somewhere


def test_the_pins_match_what_this_environment_runs() -> None:
    """The tests ran against the pinned versions, or they prove nothing about them."""
    pinned = pins()
    for requirement in declared():
        if requirement.marker and not requirement.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(requirement.name)
        installed = Version(metadata.version(name))
        assert installed == pinned[name], f"{name} {installed} installed, {pinned[name]} pinned"


def test_the_license_is_an_spdx_expression_with_its_files() -> None:
    """PEP 639: ``license`` a SPDX string, not the TOML table setuptools stops building on
    2027-02-18; the files it names ship; and the build backend is one that reads both."""
    from packaging.licenses import canonicalize_license_expression

    project, build = pyproject()["project"], pyproject()["build-system"]
    assert isinstance(project["license"], str)
    assert canonicalize_license_expression(project["license"]) == project["license"]
    assert project["license-files"] and all((ROOT / f).is_file() for f in project["license-files"])
    (setuptools,) = [Requirement(r) for r in build["requires"] if r.startswith("setuptools")]
    assert not setuptools.specifier.contains("76.9"), "license-files needs setuptools >= 77"
