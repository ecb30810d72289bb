"""The architecture's rules, read from the source: which package imports which (layers one way,
inside the core too; the accelerators behind one seam; private modules kept to their package; no
import cycle), each package's docstring against its modules, and the layout page's tables
(docs/layout.md: modules, tests) against the tree."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("prefix_cache", "engine_adapter")
# The accelerators' seam: the rest of the code imports the package, never its modules, and
# from at most this many modules.
FASTPATH = "prefix_cache.fastpath"
MAX_FASTPATH_IMPORTERS = 3
# The one place prefix_cache reaches engine_adapter: the engine lookup by name.
ENGINE_LOOKUP = "prefix_cache.engine.lookup"
# The module table and the tests table (moved out of the README, which is for a newcomer).
LAYOUT_PAGE = REPO / "docs" / "layout.md"


@dataclass(frozen=True)
class Import:
    module: str        # the importing module
    target: str        # the imported module, absolute
    top_level: bool    # at module load (not inside a function)
    type_only: bool = False  # under ``if TYPE_CHECKING:`` (never runs)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (REPO / package).rglob("*.py"))


def imports_of(path: Path) -> list[Import]:
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    in_function: set[int] = set()
    type_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            in_function.update(id(child) for child in ast.walk(node) if child is not node)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            type_only.update(id(child) for child in ast.walk(node) if child is not node)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # ``from pkg import mod`` imports pkg.mod when mod is a module
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found += [Import(name, t, id(node) not in in_function, id(node) in type_only)
                  for t in targets]
    return found


def _all_imports() -> list[Import]:
    return [i for path in modules() for i in imports_of(path)]


def _under(target: str, package: str) -> bool:
    return target == package or target.startswith(package + ".")


def test_engine_adapter_never_imports_the_sidecar() -> None:
    bad = {(i.module, i.target) for i in _all_imports()
           if _under(i.module, "engine_adapter") and _under(i.target, "prefix_cache.service")}
    assert bad == set()


def test_prefix_cache_reaches_engine_adapter_only_in_the_engine_lookup() -> None:
    reaching = [i for i in _all_imports()
                if _under(i.module, "prefix_cache") and _under(i.target, "engine_adapter")]
    assert {i.module for i in reaching} == {ENGINE_LOOKUP}
    assert not [i for i in reaching if i.top_level]  # imported when asked for, not at load


def test_prefix_cache_never_imports_mlx() -> None:
    bad = {(i.module, i.target) for i in _all_imports() if _under(i.module, "prefix_cache")
           and (_under(i.target, "mlx") or _under(i.target, "mlx_lm"))}
    assert bad == set()


def test_the_lower_layers_never_import_the_higher_ones() -> None:
    """core < store < http < chat < api < service: the HTTP plumbing below both servers, the
    APIs' bodies and answers above it, the routes both servers mount above those, the sidecar
    on top."""
    order = ["prefix_cache.store", "prefix_cache.http", "prefix_cache.chat", "prefix_cache.api",
             "prefix_cache.service"]
    below = {lower: tuple(order[i + 1:]) for i, lower in enumerate(order)}
    bad = {(i.module, i.target) for i in _all_imports() for lower, higher in below.items()
           if _under(i.module, lower) and any(_under(i.target, h) for h in higher)}
    assert bad == set()


# The engine server and its host mount the API layer; the engine itself knows only the
# engine protocol (prefix_cache.engine.protocol) and the core.
ENGINE_SERVER = ("engine_adapter.server", "engine_adapter.engine_host")
API_LAYERS = ("prefix_cache.api", "prefix_cache.chat", "prefix_cache.http",
              "prefix_cache.service")


def test_the_engine_imports_nothing_from_the_api_layers() -> None:
    bad = {(i.module, i.target) for i in _all_imports()
           if _under(i.module, "engine_adapter") and i.module not in ENGINE_SERVER
           and ".testing" not in i.module and any(_under(i.target, a) for a in API_LAYERS)}
    assert bad == set()


def test_the_import_graph_has_no_cycle() -> None:
    """Among the runtime modules, counting imports inside functions and those made only for
    type checking too (two modules that name each other are one concept, or need a protocol)."""
    known = {module_name(p) for p in modules()}
    graph: dict[str, set[str]] = {m: set() for m in known}
    for i in _all_imports():
        if i.target in known and i.target != i.module:
            graph[i.module].add(i.target)
    # ``from pkg import mod`` also names pkg; that edge is not an import of pkg's own code
    # when pkg is the importer's own package (its __init__ imports its modules).
    for module in known:
        graph[module] -= {p for p in graph[module] if module.startswith(p + ".")}
    assert _cycles(graph) == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_one_definition_per_route() -> None:
    """Both servers mount the same routers: an API route (method and path under /v1/) is
    declared once in the source. (Each server's own /health or /metrics says its own things.)"""
    declared: dict[tuple[str, str], list[str]] = {}
    pattern = re.compile(r"\.(get|post|delete|put|patch)\(\s*\"(/v1/[^\"]*)\"")
    for path in modules():
        for route in pattern.findall(path.read_text(encoding="utf-8")):
            declared.setdefault(route, []).append(module_name(path))
    assert {r: m for r, m in declared.items() if len(m) > 1} == {}
    assert ("post", "/v1/chat/completions") in declared and ("post", "/v1/messages") in declared


def test_runtime_modules_load_no_test_tooling() -> None:
    bad = {(i.module, i.target) for i in _all_imports()
           if i.top_level and ".testing" not in i.module
           and (_under(i.target, "prefix_cache.testing") or _under(i.target, "engine_adapter.testing"))}
    assert bad == set()


def test_the_fast_path_is_reached_only_through_its_seam() -> None:
    inside = {module_name(p) for p in modules()} - {FASTPATH}  # its modules (not its names)
    outside = [i for i in _all_imports()
               if _under(i.target, FASTPATH) and not _under(i.module, FASTPATH)]
    assert {(i.module, i.target) for i in outside if i.target in inside} == set()
    assert len({i.module for i in outside}) <= MAX_FASTPATH_IMPORTERS


# The accelerators (issue 37): they live in the fastpath package, none at the core's root.
ACCELERATORS = ("body_parts", "known_parts", "tail_pieces", "direct_render", "frozen_tools",
                "key_packer")


def test_no_accelerator_module_is_left_in_the_core() -> None:
    found = {module_name(p) for p in modules()}
    outside = [m for m in found if not _under(m, FASTPATH)
               and m.rpartition(".")[2].lstrip("_") in ACCELERATORS]
    assert outside == []
    inside = {m.rpartition(".")[2] for m in found if _under(m, FASTPATH)}
    assert {f"_{name}" for name in ACCELERATORS} <= inside  # private modules of the package


def test_the_fast_path_imports_nothing_above_the_core() -> None:
    """The accelerators sit under the cache: no layer above it (nor the engine) below them."""
    above = ("prefix_cache.store", *API_LAYERS, "prefix_cache.cache.cache", "engine_adapter")
    bad = {(i.module, i.target) for i in _all_imports()
           if _under(i.module, FASTPATH) and any(_under(i.target, a) for a in above)}
    assert bad == set()


def layout_rows() -> dict[str, str]:
    """The layout page's module table: first backticked path of each row -> the whole row."""
    text = LAYOUT_PAGE.read_text(encoding="utf-8")
    table = text.split("\n## Modules\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in table.splitlines():
        match = re.match(r"\| `([^`]+)` \|", line)
        if match:
            rows[match.group(1)] = line
    return rows


def test_the_layout_table_matches_the_tree() -> None:
    rows = layout_rows()
    assert [p for p in rows if not (REPO / p).exists()] == []
    missing = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            rel = path.relative_to(REPO)
            if path.name == "__init__.py" and rel.parent.as_posix() in PACKAGES:
                continue
            own = rel.as_posix()
            folder = rel.parent.as_posix() + "/"
            if own in rows:
                continue
            if folder in rows and (path.name == "__init__.py" or f"`{path.name}`" in rows[folder]):
                continue
            missing.append(own)
    assert missing == []


def _tests_table() -> dict[str, str]:
    """The layout page's tests table: first backticked path of each row -> the whole row."""
    text = LAYOUT_PAGE.read_text(encoding="utf-8")
    table = text.split("\n## Tests\n", 1)[1].split("\n## ", 1)[0]
    return {m.group(1): line for line in table.splitlines()
            if (m := re.match(r"\| `([^`]+)` \|", line))}


def test_the_tests_table_matches_the_tests_tree() -> None:
    rows = _tests_table()
    folders = sorted(f"{p.parent.relative_to(REPO).as_posix()}/"
                     for p in (REPO / "tests").glob("*/__init__.py"))
    assert sorted(rows) == folders
    support = rows["tests/support/"]
    assert [p.name for p in sorted((REPO / "tests" / "support").glob("*.py"))
            if p.name != "__init__.py" and f"`{p.name}`" not in support] == []


# The core's packages, lowest first: utilities, rendering, the cache. (The engine protocol and
# the model folders sit beside them; the engine protocol imports only the utilities: the
# packed token ids it carries.)
CORE_ORDER = ["prefix_cache.util", "prefix_cache.render", "prefix_cache.cache"]
CORE_PACKAGES = (*CORE_ORDER, "prefix_cache.engine", "prefix_cache.model_folders")
ENGINE_PROTOCOL = "prefix_cache.engine.protocol"


def test_the_core_packages_import_one_way() -> None:
    """util < render < cache; the engine protocol imports nothing of the project but util."""
    below = {lower: tuple(CORE_ORDER[i + 1:]) for i, lower in enumerate(CORE_ORDER)}
    bad = {(i.module, i.target) for i in _all_imports() for lower, higher in below.items()
           if _under(i.module, lower) and any(_under(i.target, h) for h in higher)}
    bad |= {(i.module, i.target) for i in _all_imports() if i.module == ENGINE_PROTOCOL
            and any(_under(i.target, p) for p in PACKAGES)
            and not _under(i.target, "prefix_cache.util")}
    assert bad == set()


def _private(module: str) -> bool:
    leaf = module.rpartition(".")[2]
    return leaf.startswith("_") and not leaf.startswith("__")


def test_private_modules_are_imported_only_inside_their_package() -> None:
    known = {module_name(p) for p in modules()}
    bad = {(i.module, i.target) for i in _all_imports() if i.target in known
           and _private(i.target) and not _under(i.module, i.target.rpartition(".")[0])}
    assert bad == set()


def test_a_core_module_with_one_importer_in_its_package_is_private() -> None:
    """In the core's packages, a module only one of its siblings imports is that module's part
    (a leading underscore), so a newcomer sees at a glance what a package offers."""
    known = {module_name(p) for p in modules()}
    importers: dict[str, set[str]] = {}
    for i in _all_imports():
        if i.target in known and i.target != i.module and not i.module.endswith(".__init__"):
            importers.setdefault(i.target, set()).add(i.module)
    bad = []
    for module in sorted(known):
        package = module.rpartition(".")[0]
        if package not in CORE_PACKAGES or _private(module):
            continue
        users = importers.get(module, set()) - {package}
        if len(users) == 1 and next(iter(users)).rpartition(".")[0] == package:
            bad.append(module)
    assert bad == []


_NAMED = re.compile(r"`+(\w+)(\.py|/)`+")


def package_folders() -> list[Path]:
    return sorted(p.parent for package in PACKAGES for p in (REPO / package).rglob("__init__.py"))


def test_each_package_docstring_names_its_modules() -> None:
    """Every package's docstring names each of its modules (``name.py``) and subpackages
    (``name/``), and names nothing that is not there."""
    wrong = {}
    for folder in package_folders():
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text("utf-8"))) or ""
        named = {m.group(1) + m.group(2) for m in _NAMED.finditer(doc)}
        there = {p.name for p in folder.glob("*.py") if p.name != "__init__.py"}
        there |= {p.parent.name + "/" for p in folder.glob("*/__init__.py")}
        if named != there:
            wrong[folder.relative_to(REPO).as_posix()] = {
                "not named": sorted(there - named), "not there": sorted(named - there)}
    assert wrong == {}
