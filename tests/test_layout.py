"""The package layout docs/ARCHITECTURE.md draws, held by the source itself.

- Imports point one way. Within ``router/`` each sub-package sits on a layer and imports
  only from layers below it (``LAYERS``); ``indexer/`` imports nothing of the router, the
  connector, the benchmarks or the launcher; the connector imports nothing of the router.
- No module imports itself back through others (no cycle), counting the imports that run
  when a module loads: those under ``if TYPE_CHECKING`` and inside functions are left out,
  as Python leaves them out.
- Every module of ``router/`` and ``indexer/`` stays under ``MAX_LINES``, and ``router/``
  keeps at most ``MAX_TOP_LEVEL`` modules beside its sub-packages.

Read from the files with ``ast``: nothing is imported, so a broken module fails its own
tests, not this one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {
    "router": "kvroute.router",
    "indexer": "kvroute.indexer",
    "connector": "kvroute.connector",
}
MAX_LINES = 600
MAX_TOP_LEVEL = 12

# Bottom first. A module may import from its own group and from groups on lower layers.
LAYERS: list[set[str]] = [
    {"router", "router.common", "router.errors", "router.config_error"},
    {"router.cost_settings"},
    {"router.config"},
    {"router.specs"},
    {"indexer", "router.tokens", "router.fleet"},
    {"router.routing", "router.peers"},
    {"router.ops"},
    {"router.serving", "router.ray"},  # the front doors over routing: HTTP, Ray Serve
    {"router.epp"},
    {"router.service"},
    {"router.app"},
    {"router.cli"},
]
# The same, inside the indexer: the wire below the index, the index below its feeds.
INDEXER_LAYERS: list[set[str]] = [
    {"indexer", "indexer.tiers", "indexer.cpu_priority", "indexer.native_core"},
    {"indexer.wire", "indexer.keys"},
    {"indexer.index", "indexer.publisher"},
    {"indexer.snapshot"},
    {"indexer.subscriber"},
    {"indexer.stats"},
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([FOLDERS[parts[0]], *parts[1:]])


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")}


def _load_time_imports(tree: ast.Module) -> list[str]:
    """Every name a module's top level imports (``a.b`` and ``a.b.c`` for ``from a.b import
    c``), leaving out ``if TYPE_CHECKING:`` blocks and function bodies."""
    found: list[str] = []

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.append(node.module)
                found.extend(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                found.extend(alias.name for alias in node.names)
            elif isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)

    visit(tree.body)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        imported = _load_time_imports(ast.parse(path.read_text()))
        graph[name] = {m for m in imported if m in modules and m != name}
    return graph


def _group(module: str) -> str:
    """``kvroute.router.routing.policies.base`` -> ``router.routing``; the indexer is one."""
    parts = module.split(".")[1:]
    if parts[0] in ("indexer", "connector"):
        return parts[0]
    return ".".join(parts[:2])


def _layer(group: str, layers: list[set[str]] = LAYERS) -> int:
    for i, layer in enumerate(layers):
        if group in layer:
            return i
    raise AssertionError(f"{group} is on no layer of tests/test_layout.py: place it")


def test_router_imports_point_down_the_layers() -> None:
    wrong = []
    for module, deps in _graph().items():
        if not module.startswith("kvroute.router"):
            continue
        here = _layer(_group(module))
        for dep in deps:
            group = _group(dep)
            if group == _group(module) or group == "connector":
                continue
            if _layer(group) >= here:
                wrong.append(f"{module} -> {dep}")
    assert not wrong, "imports against the layers:\n" + "\n".join(sorted(wrong))


def test_indexer_imports_point_down_its_layers() -> None:
    wrong = []
    for module, deps in _graph().items():
        if not module.startswith("kvroute.indexer"):
            continue
        here = ".".join(module.split(".")[1:3])
        for dep in deps:
            there = ".".join(dep.split(".")[1:3])
            if there != here and _layer(there, INDEXER_LAYERS) >= _layer(here, INDEXER_LAYERS):
                wrong.append(f"{module} -> {dep}")
    assert not wrong, "imports against the layers:\n" + "\n".join(sorted(wrong))


def test_indexer_and_connector_stay_below_the_router() -> None:
    wrong = []
    for module, deps in _graph().items():
        for dep in deps:
            if module.startswith("kvroute.indexer") and not dep.startswith("kvroute.indexer"):
                wrong.append(f"{module} -> {dep}")
            if module.startswith("kvroute.connector") and dep.startswith("kvroute.router"):
                wrong.append(f"{module} -> {dep}")
    assert not wrong, "\n".join(sorted(wrong))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def walk(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append([*path[path.index(dep) :], dep])
            elif dep not in state:
                walk(dep, [*path, dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            walk(node, [node])
    return cycles


def test_no_import_cycle() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("folder", ["router", "indexer"])
def test_modules_stay_small(folder: str) -> None:
    sizes = {
        str(p.relative_to(ROOT)): len(p.read_text().splitlines())
        for p in (ROOT / folder).rglob("*.py")
    }
    assert sizes, f"no modules found under {folder}/"
    big = {path: n for path, n in sizes.items() if n > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines: {big}"


def test_router_top_level_stays_short() -> None:
    top = sorted(p.name for p in (ROOT / "router").glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, top
    packages = sorted(p.name for p in (ROOT / "router").iterdir() if (p / "__init__.py").exists())
    assert {"serving", "tokens", "routing", "fleet", "peers", "ops", "epp"} <= set(packages)


def test_the_checks_can_fail() -> None:
    """The graph walk sees what it must: a module-level import, and not a TYPE_CHECKING one
    nor a function-local one; a cycle is found."""
    tree = ast.parse(
        "import a\nfrom b.c import d\nif TYPE_CHECKING:\n    import e\n"
        "def f():\n    import g\ntry:\n    import h\nexcept ImportError:\n    import i\n"
    )
    assert _load_time_imports(tree) == ["a", "b.c", "b.c.d", "h", "i"]
    assert _group("kvroute.router.routing.policies.base") == "router.routing"
    assert _layer("router.common") < _layer("router.routing") < _layer("router.service")
    with pytest.raises(AssertionError):
        _layer("router.nowhere")
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
