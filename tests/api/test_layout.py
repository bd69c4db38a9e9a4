"""The package's shape: public modules and their __all__, no import cycles, one home
for GPUCOLL_* names, module sizes; and the wheel ships every module and the kernels."""

from __future__ import annotations

import ast
import importlib
import pathlib
import re
import subprocess
import sys
import zipfile

import pytest

import gpucoll

PKG = pathlib.Path(gpucoll.__file__).resolve().parent
PUBLIC = {"gpucoll", "gpucoll.functional", "gpucoll.testing", "gpucoll.store", "gpucoll.clusters",
          "gpucoll.errors", "gpucoll.array", "gpucoll.run", "gpucoll.bench", "gpucoll.ddp_comm_hooks", "gpucoll.ray",
          "gpucoll.rpc", "gpucoll.futures"}
"""The public modules (docs/design.md, "Layout"); their non-underscore submodules
(``gpucoll.store.tcp``, ``gpucoll.clusters.slurm``, ``gpucoll.bench.cli``, ...) are
public too and policed the same way."""


def all_modules() -> list[str]:
    names = []
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names.append(".".join(parts))
    return names


def is_public(name: str) -> bool:
    return not any(part.startswith("_") for part in name.split("."))


def test_public_modules_are_exactly_the_documented_ones() -> None:
    public = {m for m in all_modules() if is_public(m)}
    stray = {m for m in public if m not in PUBLIC and not any(m.startswith(p + ".") for p in PUBLIC - {"gpucoll"})}
    assert not stray, f"public (non-underscore) modules not in the documented list: {sorted(stray)}"
    assert PUBLIC <= public


@pytest.mark.parametrize("name", sorted(m for m in all_modules() if is_public(m) and m != "gpucoll.bench.__main__"))
def test_every_public_module_has_a_resolvable_all_without_private_names(name: str) -> None:
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    assert isinstance(exported, list) and exported, f"{name} has no __all__"
    assert len(exported) == len(set(exported)), f"duplicates in {name}.__all__"
    for item in exported:
        assert not item.startswith("_"), f"{name}.__all__ exports the private name {item!r}"
        assert hasattr(module, item), f"{name}.__all__ names {item!r}, which does not resolve"


def test_reduce_op_is_torchs_legacy_spelling_not_a_module() -> None:
    assert gpucoll.reduce_op is gpucoll.ReduceOp
    assert gpucoll.reduce_op.SUM is gpucoll.ReduceOp.SUM


def imports_of(path: pathlib.Path, module: str) -> set[str]:
    """Every gpucoll module ``module`` imports, at any level (function bodies included;
    ``if TYPE_CHECKING:`` blocks excluded: they never run)."""
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    package = module if is_pkg else module.rpartition(".")[0]
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for b in node.body for n in ast.walk(b))
    found: set[str] = set()
    known = set(all_modules())
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("gpucoll"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("gpucoll"):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in known else target)
    return {m for m in found if m in known and m != module}


def import_graph() -> dict[str, set[str]]:
    """Every module of the package (by dotted name) and the gpucoll modules it imports."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        name = ".".join(parts)
        graph[name] = imports_of(path, name)
    return graph


def test_no_import_cycles_in_the_package() -> None:
    # A package's __init__ runs before any of its modules; importing a submodule
    # imports its parents, so a module depends on each parent package too.
    graph = import_graph()
    # Parent packages re-export their children: edges parent -> child are expected,
    # so only child -> (parent's other children ...) cycles are real. Check cycles on
    # the module graph where importing "a.b" means importing "a.b" only.
    cycles = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


DESIGN = PKG.parent / "docs" / "design.md"
# Upward imports made inside a function, named in docs/design.md's layer paragraph.
LAZY_UPWARD = {("_debug", "store")}


def design_layers() -> tuple[list[list[str]], list[str]]:
    """docs/design.md's layer paragraph: the layers bottom up (top-level names under
    gpucoll/, "gpucoll" for the package itself) and the parts that stand beside them."""
    text = DESIGN.read_text()
    para = text[text.index("Layers, bottom up"):]
    para = para[para.index("):") + 2:para.index(".\n\n")]
    layered, beside = para.split("; beside them", 1)
    layered = re.sub(r"\([^()]*\)", "", layered)  # asides name modules of other layers
    layers = [re.findall(r"`([\w.]+)`", seg) for seg in layered.split("->")]
    return layers, re.findall(r"`(\w+)`", beside.split(" start jobs")[0])


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "gpucoll"


def _top_level_imports(path: pathlib.Path, module: str) -> set[str]:
    """The gpucoll modules ``module`` imports outside any function body."""
    tree = ast.parse(path.read_text())
    inner: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inner.update(id(n) for n in ast.walk(node) if n is not node)
    deps = imports_of(path, module)
    at_call = {d for d in deps if not any(
        isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in inner
        and _names_module(n, module, path, d) for n in ast.walk(tree))}
    return deps - at_call


def _names_module(node: ast.Import | ast.ImportFrom, module: str, path: pathlib.Path, dep: str) -> bool:
    if isinstance(node, ast.Import):
        return any(a.name == dep or dep.startswith(a.name + ".") or a.name.startswith(dep + ".") for a in node.names)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    base = package.split(".")
    target = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else [])) if node.level \
        else (node.module or "")
    return dep == target or any(dep == f"{target}.{a.name}" for a in node.names)


def test_imports_follow_the_layers_design_md_draws() -> None:
    """Every import of the package points to its own layer or one below, as the layer
    paragraph of docs/design.md draws them (read from the doc, so the two cannot drift);
    the parts beside the layers (launcher, testing, bench) are imported by none of them."""
    layers, beside = design_layers()
    rank = {name: i for i, layer in enumerate(layers) for name in layer}
    assert len(layers) >= 8 and {"store", "_backends", "_group", "gpucoll"} <= set(rank), layers
    parts = {_part(m) for m in all_modules()}
    assert parts - set(rank) - set(beside) == set(), \
        f"parts of the package that design.md's layer paragraph does not place: {parts - set(rank) - set(beside)}"
    wrong = []
    for path in sorted(PKG.rglob("*.py")):
        bits = list(path.relative_to(PKG.parent).with_suffix("").parts)
        if bits[-1] == "__init__":
            bits.pop()
        module = ".".join(bits)
        me = _part(module)
        if me in beside:
            continue
        top = _top_level_imports(path, module)
        for dep in imports_of(path, module):
            them = _part(dep)
            if them in beside:
                wrong.append(f"{module} -> {dep} (beside the layers)")
            elif rank[them] > rank[me] and not (dep not in top and (me, them) in LAZY_UPWARD):
                wrong.append(f"{module} ({me}) -> {dep} ({them})")
    assert not wrong, "imports against docs/design.md's layers: " + "; ".join(wrong)


def test_the_layer_check_reads_the_paragraph_and_catches_an_upward_import() -> None:
    """Not vacuous: the paragraph parses into the layers it draws, and an import from a
    low layer to a high one would be ranked as wrong."""
    layers, beside = design_layers()
    rank = {name: i for i, layer in enumerate(layers) for name in layer}
    assert rank["_env"] == 0 and rank["gpucoll"] == len(layers) - 1
    assert rank["store"] < rank["_backends"] < rank["_group"] < rank["_world"]
    assert "testing" in beside and "_launch" in beside
    assert rank[_part("gpucoll._group.core")] > rank[_part("gpucoll.store.tcp")]  # store -> _group: upward


def test_stores_backends_and_debug_tools_import_nothing_from_clusters() -> None:
    """The bottom layers name environment variables through gpucoll/_env, never through
    ``clusters`` (the part that reads a launcher's environment, a layer of its own);
    ``_env`` itself imports nothing else of gpucoll; the array layer imports nothing of
    the backends or the group (the backends import it: the arrows point down)."""
    bottom = ("gpucoll.store", "gpucoll._backends", "gpucoll._debug", "gpucoll._work", "gpucoll._buffer",
              "gpucoll._debug.flight_recorder", "gpucoll._timeouts", "gpucoll.errors", "gpucoll.array")
    wrong = []
    for name, deps in import_graph().items():
        if name.startswith(bottom):
            wrong += [f"{name} -> {d}" for d in deps if d == "gpucoll.clusters" or d.startswith("gpucoll.clusters.")]
        if name.startswith("gpucoll._env"):
            wrong += [f"{name} -> {d}" for d in deps if not d.startswith("gpucoll._env")]
        if name in ("gpucoll.array", "gpucoll._buffer"):  # below the backends, which use them
            wrong += [f"{name} -> {d}" for d in deps if d.startswith(("gpucoll._backends", "gpucoll._group"))]
    assert not wrong, "imports against the layers: " + "; ".join(wrong)


ENV_HOME = PKG / "_env" / "__init__.py"
ENV_NAME = re.compile(r"GPUCOLL_[A-Z0-9_]*[A-Z0-9]")


def test_every_gpucoll_variable_is_named_in_one_module() -> None:
    """The rule: a string that is exactly a ``GPUCOLL_*`` name (what ``os.environ`` is
    read or set with) appears only in gpucoll/_env/; everywhere else code
    uses its constants. Prose (docstrings, comments, messages) may mention the names,
    and every name it mentions must be one of them, so a renamed or mistyped variable
    cannot linger in a message or a docstring."""
    from gpucoll import _env as _envvars

    home = {v for k, v in vars(_envvars).items() if k.endswith("_ENV")}
    assert set(_envvars.NAMES) == home and len(_envvars.NAMES) == len(home)
    spelled, unknown = [], []
    for path in sorted(PKG.rglob("*.py")):
        rel = str(path.relative_to(PKG.parent))
        text = path.read_text()
        unknown += [f"{rel}: {m}" for m in ENV_NAME.findall(text) if m not in home]
        if path == ENV_HOME:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)):
                value = node.value.decode() if isinstance(node.value, bytes) else node.value
                if ENV_NAME.fullmatch(value.strip()):
                    spelled.append(f"{rel}:{node.lineno}: {value!r}")
    assert not spelled, "GPUCOLL_* names spelled outside gpucoll/_env/: " + "; ".join(spelled)
    assert not unknown, "GPUCOLL_* names mentioned but not defined in gpucoll/_env/: " + "; ".join(unknown)


def test_the_rule_catches_a_spelled_name(tmp_path: pathlib.Path) -> None:
    """The check above is not vacuous: a reader spelling the name is a Constant it finds."""
    tree = ast.parse('import os\nx = os.environ.get("GPUCOLL_DEBUG")\n"""Docs: GPUCOLL_DEBUG."""\n')
    found = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
             and ENV_NAME.fullmatch(n.value.strip())]
    assert found == ["GPUCOLL_DEBUG"]


def test_modules_are_small_and_the_root_is_short() -> None:
    big = {str(p.relative_to(PKG.parent)): n for p in PKG.rglob("*.py")
           if (n := len(p.read_text().splitlines())) > 600}
    assert not big, f"modules over 600 lines: {big}"
    root = sorted(p.name for p in PKG.glob("*.py"))
    assert len(root) <= 16, f"{len(root)} modules directly in gpucoll/: {root}"


@pytest.mark.slow
def test_the_wheel_ships_every_module_and_the_kernels(tmp_path: pathlib.Path) -> None:
    root = PKG.parent
    if not (root / "pyproject.toml").is_file():
        pytest.skip("gpucoll is not a source checkout here")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path), str(root)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = tmp_path.glob("gpucoll-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {str(p.relative_to(root)) for p in PKG.rglob("*.py")}
    expected |= {str(p.relative_to(root)) for p in PKG.rglob("*.cu")} | {"gpucoll/py.typed"}
    assert any(n.endswith(".cu") for n in expected)
    missing = expected - names
    assert not missing, f"the wheel lacks {sorted(missing)}"


def _borrowed_bases(module_name: str) -> list[str]:
    """Classes of ``module_name`` that inherit implementation from a class of another
    gpucoll module (Protocols and errors are fine: they give a type, not state or code)."""
    module = importlib.import_module(module_name)
    found = []
    for obj in vars(module).values():
        if not isinstance(obj, type) or obj.__module__ != module_name:
            continue
        for base in obj.__bases__:
            home = base.__module__
            if home == module_name or not home.startswith("gpucoll"):
                continue
            if getattr(base, "_is_protocol", False) or issubclass(base, BaseException):
                continue
            found.append(f"{module_name}.{obj.__name__}({home}.{base.__name__})")
    return found


# Bases a class of another module may build on: public base classes whose subclasses are
# the point (users write stores; device backends make their own Work, as torch's do; RPC
# backends, the faulty test agent among them, extend the RPC options, as torch's do; a Work's
# future is torch's Future with two getters more).
# Protocols, exceptions and classes from outside gpucoll (ctypes.Structure, str) pass anyway.
PUBLIC_BASES = {"gpucoll.store.base.Store", "gpucoll._work.Work", "gpucoll.rpc.options.RpcBackendOptions",
                "gpucoll.rpc.options.TensorPipeRpcBackendOptions", "gpucoll.futures.Future"}


def test_no_class_is_spread_over_another_modules_mixin() -> None:
    """One object's state in one place (docs/design.md): a ProcessGroup holds its issuer, a
    TCPStore its links, a store server its request handler, and the NCCL backend's split,
    shrink and lifecycle are functions over its state; no class of the package inherits
    implementation from a class of another module, the public bases above apart."""
    borrowed = [b for m in all_modules() for b in _borrowed_bases(m)
                if b[b.index("(") + 1:-1] not in PUBLIC_BASES]
    assert not borrowed, f"classes built on another module's mix-in: {borrowed}"
    from gpucoll._backends.nccl.backend import NCCLBackend
    from gpucoll._group.core import Issuer
    from gpucoll._group.group import ProcessGroup
    from gpucoll.store._server import StoreServer
    from gpucoll.store.tcp import TCPStore

    assert ProcessGroup.__bases__ == (object,) and NCCLBackend.__bases__ == (object,)
    assert StoreServer.__bases__ == (object,) and [b.__name__ for b in TCPStore.__bases__] == ["Store"]
    assert "_issue" not in vars(Issuer) and "issue" in vars(Issuer)


def test_the_composition_rule_catches_a_mixin(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above is not vacuous: a class over another gpucoll module's class is found."""
    pkg = tmp_path / "gpucoll_probe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mixed.py").write_text("from gpucoll._group.core import Issuer\n\n\nclass Mixed(Issuer):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _borrowed_bases("gpucoll_probe.mixed") == ["gpucoll_probe.mixed.Mixed(gpucoll._group.core.Issuer)"]
