"""The package's import graph has no circle, lazy (function-level) imports included.

Read from the source: every ``import`` and ``from ... import`` statement of every module of
``eqx_bsattn`` (the core in ``eqx_bsattn/``, the plug-ins in ``strategies/``, installed as
``eqx_bsattn.strategies``), wherever it stands (module level, inside functions, under ``if``),
is an edge to the module it names: ``from a.b import c`` goes to ``a.b.c`` where that is a
module, else to ``a.b``. Packages are not edges of their children: importing ``a.b.c`` runs
``a/__init__`` first, but a package importing its own modules and those importing a sibling
is how packages work; ``from a import name`` (a name defined in ``a/__init__``) is an edge to
``a``.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TREES = {"eqx_bsattn": ROOT / "eqx_bsattn", "eqx_bsattn.strategies": ROOT / "strategies"}


def _module_files() -> dict[str, pathlib.Path]:
    """``{module name: file}`` for every module of the package (packages by their name)."""
    files = {}
    for prefix, folder in TREES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join([prefix, *parts])] = path
    return files


MODULES = _module_files()


def _package_of(name: str) -> str:
    """The package that relative imports in module `name` start from."""
    return name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]


def imports_of(name: str, source: str | None = None) -> set[str]:
    """The package's modules that module `name` imports anywhere in its source (`source`, or
    the module's file)."""
    tree = ast.parse(MODULES[name].read_text() if source is None else source)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = _package_of(name).split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                       for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in MODULES and t != name)
    return found


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of `graph` as a path ``[a, b, ..., a]``, or ``None`` (depth-first search)."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                circle = visit(nxt)
                if circle:
                    return circle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            circle = visit(node)
            if circle:
                return circle
    return None


def test_the_walk_sees_the_package():
    graph = {name: imports_of(name) for name in MODULES}
    assert len(MODULES) > 40
    assert "eqx_bsattn._module" in graph["eqx_bsattn"]
    assert "eqx_bsattn.contract" in graph["eqx_bsattn.strategies.kernels.xla"]
    # Relative imports resolve from a package's __init__ and from a module alike.
    assert "eqx_bsattn.strategies.kernels.triton.kernel" in graph[
        "eqx_bsattn.strategies.kernels.triton"]


def test_lazy_imports_are_edges_and_circles_are_found():
    # An import inside a function (or a method, or under `if`) is an edge like any other.
    source = ("import jax\nclass C:\n    def f(self):\n        if True:\n"
              "            from ._module import BlockSparseAttention\n"
              "            from . import contract, _cache\n")
    assert imports_of("eqx_bsattn._cache", source) == {"eqx_bsattn._module",
                                                       "eqx_bsattn.contract"}
    assert imports_of("eqx_bsattn._cache", "from . import __version__\n") == {"eqx_bsattn"}
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"a"}}) == ["a", "a"]


def test_the_package_has_no_import_circle():
    graph = {name: imports_of(name) for name in MODULES}
    circle = find_circle(graph)
    assert circle is None, "import circle: " + " -> ".join(circle)


@pytest.mark.parametrize("name", ["eqx_bsattn._module", "eqx_bsattn._tiling"])
def test_the_plan_does_not_import_the_tuner(name):
    """The plan asks the tiling strategy; the tuner (`_autotune`) writes the cache. Nothing the
    plan imports, directly or not, imports the tuner."""
    graph = {n: imports_of(n) for n in MODULES}
    seen, todo = set(), [name]
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(graph[node])
    assert "eqx_bsattn._autotune" not in seen
