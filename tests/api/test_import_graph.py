"""No import cycle anywhere in gpucoll/, counting every import a module makes.

The graph is read from the source with ``ast``, not from a running interpreter: every
``import`` and ``from ... import`` of a gpucoll module counts, at module level, inside
functions and methods, and under ``if TYPE_CHECKING:`` (a cycle that only the type
checker follows is still two modules that each need the other). Relative imports are
resolved against the importing module's package, and ``from pkg import name`` counts as
importing the submodule ``pkg.name`` where one exists (else the package itself).

A cycle is reported as each strongly connected component of that graph, with one
concrete loop through it, so a failure names the modules and the imports to break.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import gpucoll

PKG = pathlib.Path(gpucoll.__file__).resolve().parent




def module_name(path: pathlib.Path, root: pathlib.Path = PKG) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules(root: pathlib.Path = PKG) -> dict[str, pathlib.Path]:
    """Every module under ``root`` by dotted name (packages by their own name)."""
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def imports_of(path: pathlib.Path, module: str, known: set[str]) -> set[str]:
    """The gpucoll modules ``module`` (at ``path``) imports, anywhere in its source."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                if node.level > 1:
                    base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in known else target)  # a name defined in the package: its __init__
    return {m for m in found if m in known and m != module}


def import_graph(root: pathlib.Path = PKG) -> dict[str, set[str]]:
    modules = all_modules(root)
    known = set(modules)
    return {name: imports_of(path, name, known) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[tuple[frozenset[str], list[str]]]:
    """Each strongly connected component with more than one module (or a module that
    imports itself), with one loop through it: ``[a, b, ..., a]``. Tarjan's algorithm,
    iterative (no recursion limit to meet on a deep package)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[tuple[frozenset[str], list[str]]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, list[str]]] = [(start, sorted(graph[start]))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, todo = work[-1]
            if todo:
                dep = todo.pop(0)
                if dep not in index:
                    index[dep] = low[dep] = counter
                    counter += 1
                    stack.append(dep)
                    on_stack.add(dep)
                    work.append((dep, sorted(graph.get(dep, ()))))
                elif dep in on_stack:
                    low[node] = min(low[node], index[dep])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    members.append(m)
                    if m == node:
                        break
                if len(members) > 1 or node in graph.get(node, ()):
                    comp = frozenset(members)
                    found.append((comp, _loop(graph, comp)))
    return found


def _loop(graph: dict[str, set[str]], comp: frozenset[str]) -> list[str]:
    """A shortest loop through the component's first module (breadth-first, inside it)."""
    first = min(comp)
    prev: dict[str, str] = {}
    frontier = [first]
    while frontier:
        nxt = []
        for node in frontier:
            for dep in sorted(graph[node] & comp):
                if dep == first:
                    path = [node]
                    while path[-1] != first:
                        path.append(prev[path[-1]])
                    return [first] + path[::-1][1:] + [first] if len(path) > 1 else [first, first]
                if dep not in prev:
                    prev[dep] = node
                    nxt.append(dep)
        frontier = nxt
    return [first]


def describe(found: list[tuple[frozenset[str], list[str]]]) -> str:
    return "\n".join(f"- {len(comp)} modules ({', '.join(sorted(comp))}); one loop: {' -> '.join(loop)}"
                     for comp, loop in found)


def test_no_import_cycle_in_gpucoll_outside_the_allowed_nccl_ones() -> None:
    found = cycles(import_graph())
    assert not found, f"import cycles in gpucoll/ (TYPE_CHECKING imports included):\n{describe(found)}"


def _write(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for rel, text in files.items():
        path = root / "gpucoll" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "gpucoll"


@pytest.mark.parametrize("files, want", [
    # under TYPE_CHECKING
    ({"__init__.py": "", "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n",
      "b.py": "from .a import A\n"}, {"gpucoll.a", "gpucoll.b"}),
    # inside a function, and ``from pkg import submodule``
    ({"__init__.py": "", "p/__init__.py": "", "p/x.py": "def f():\n    from gpucoll.p import y\n",
      "p/y.py": "import gpucoll.p.x\n"}, {"gpucoll.p.x", "gpucoll.p.y"}),
    # relative imports two levels up, through a package's __init__
    ({"__init__.py": "", "q/__init__.py": "from .r import z\n", "q/r/__init__.py": "",
      "q/r/z.py": "from .. import Thing\n"}, {"gpucoll.q", "gpucoll.q.r.z"}),
])
def test_the_graph_finds_each_kind_of_import(tmp_path: pathlib.Path, files: dict[str, str], want: set[str]) -> None:
    found = cycles(import_graph(_write(tmp_path, files)))
    assert [comp for comp, _ in found] == [frozenset(want)], describe(found)
    loop = found[0][1]
    assert loop[0] == loop[-1] and set(loop) == want


def test_an_acyclic_package_has_no_cycle(tmp_path: pathlib.Path) -> None:
    root = _write(tmp_path, {"__init__.py": "from . import a\n", "a.py": "from .b import f\n",
                             "b.py": "import os\n"})
    assert cycles(import_graph(root)) == []
