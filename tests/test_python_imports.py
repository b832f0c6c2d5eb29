"""No import circles in the Python package: no module of python/tpuc imports one that imports it
back, directly or around a loop, counting function-local (lazy) imports too. A lazy import
hides a circle from Python, not from a reader: each module should be readable on top of the
ones it imports."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "python" / "tpuc"
NAME = "tpuc"
EXTENSIONS = ("_native",)  # built from python/src (Rust): imports nothing of the package


def _module_name(path: Path) -> str:
    return NAME if path.stem == "__init__" else f"{NAME}.{path.stem}"


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package's own modules that `path` imports, anywhere in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == NAME or alias.name.startswith(NAME + "."):
                    found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if (
                node.level == 0
                and node.module
                and (node.module == NAME or node.module.startswith(NAME + "."))
            ):
                base = node.module
            elif node.level == 1:  # python/tpuc has no subpackages: `.` is the package
                base = f"{NAME}.{node.module}" if node.module else NAME
            else:
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                # `from . import x`: the submodule x where there is one, else a name the
                # package's __init__ defines (which imports __init__).
                found.add(sub if sub in modules else base)
    return {m for m in found if m in modules}


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    paths = sorted(package.glob("*.py"))
    modules = {_module_name(p) for p in paths} | {f"{NAME}.{e}" for e in EXTENSIONS}
    graph = {_module_name(p): _imports(p, modules) for p in paths}
    for name, deps in graph.items():
        deps.discard(name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return [*path[path.index(d) :], d]
            if d not in state and (cycle := visit(d)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_cycle_finder_finds_a_loop():
    # The finder itself, on graphs with and without a circle (so a pass below means something).
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_graph_sees_lazy_and_relative_imports(tmp_path):
    (tmp_path / "__init__.py").write_text("VERSION = 1\n")
    (tmp_path / "a.py").write_text("def f():\n    from . import b\n")
    (tmp_path / "b.py").write_text("from .c import g\nimport tpuc.a\n")
    (tmp_path / "c.py").write_text("from . import VERSION\n")
    g = import_graph(tmp_path)
    assert g == {"tpuc": set(), "tpuc.a": {"tpuc.b"}, "tpuc.b": {"tpuc.c", "tpuc.a"}, "tpuc.c": {"tpuc"}}
    assert find_cycle(g) == ["tpuc.a", "tpuc.b", "tpuc.a"]


def test_no_import_cycles():
    graph = import_graph()
    assert "tpuc.backend" in graph and graph["tpuc.backend"], "the package was not found or not parsed"
    cycle = find_cycle(graph)
    assert cycle is None, "import circle in python/tpuc: " + " -> ".join(cycle)
