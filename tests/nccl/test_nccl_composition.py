"""The NCCL backend is a composition of parts that own their state: no module of
gpucoll/_backends/nccl/ reads or writes another object's private (underscore) fields.

Checked on the source with ``ast``: every attribute access ``X._name`` whose ``X`` is
not ``self`` or ``cls`` is a failure, except dunder names and the few accesses
:data:`ALLOWED` lists, each with why it must stay. An object's own private fields
are reached through ``self`` (its methods) only; what other objects need is a public
attribute, property or method.
"""

from __future__ import annotations

import ast
from pathlib import Path

import gpucoll._backends.nccl as nccl_pkg

PACKAGE = Path(nccl_pkg.__file__).parent

# (module, the access as ast.unparse writes it): why it is not ours to change.
ALLOWED: dict[tuple[str, str], str] = {
    ("backend.py", "op._name_"): "enum.Enum's member name (sunder API of the standard library)",
    ("config.py", "NcclConfigStruct._fields_"): "ctypes.Structure's field list (ctypes' API)",
}


def private_accesses(source: str) -> list[tuple[int, str]]:
    """(line, access) for every ``X._name`` in ``source`` with ``X`` not self/cls."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        name = node.attr
        if not name.startswith("_") or (name.startswith("__") and name.endswith("__")):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def test_the_checker_sees_what_it_must() -> None:
    # Independent of the package: the rule itself, on known snippets.
    src = ("def f(b, w):\n"
           "    b._rt.x = w._end\n"
           "    self._ok = cls._ok2 = b.__dict__\n"
           "    return self._owner._failure()\n")
    assert [a for _, a in private_accesses(src)] == ["b._rt", "w._end", "self._owner._failure"]


def test_no_module_touches_another_objects_private_fields() -> None:
    modules = sorted(PACKAGE.glob("*.py"))
    assert {p.name for p in modules} >= {"backend.py", "hot.py", "lifecycle.py", "work.py", "bootstrap.py"}
    bad = []
    used = set()
    for path in modules:
        for line, access in private_accesses(path.read_text()):
            if (path.name, access) in ALLOWED:
                used.add((path.name, access))
                continue
            bad.append(f"{path.name}:{line}: {access}")
    assert not bad, f"{len(bad)} accesses to another object's private fields:\n" + "\n".join(bad)
    assert used == set(ALLOWED), f"allow-list entries no longer needed: {set(ALLOWED) - used}"


def test_the_state_the_function_modules_read_is_plain_attributes() -> None:
    # hot.py reads these per op: a property would cost a call each time.
    from gpucoll._backends.nccl.backend import NCCLBackend
    from gpucoll._backends.nccl.state import BackendState

    fields = [n for n in BackendState.__annotations__]
    assert {"runtime", "device_index", "issue_lock", "ending", "timeout"} <= set(fields)
    assert not [n for n in fields if n.startswith("_")]
    assert not [n for n in fields if isinstance(getattr(NCCLBackend, n, None), property)]


def test_ending_sets_the_abort_reason_with_the_queue_taken_once() -> None:
    from gpucoll._backends.nccl.ending import Ending
    from gpucoll._backends.nccl.outstanding import Outstanding

    queue = Outstanding()
    ops = [object(), object()]
    queue.add(ops[0])
    queue.add(ops[1])
    end = Ending(queue)
    assert (end.aborted, end.closed, end.over) == (None, None, None)
    assert end.abort("first") == ops and not queue  # the reason and the queue, together
    queue.add(object())
    assert end.abort("second") is None and len(queue) == 1  # once: the first reason stays
    end.add_reason("ncclCommAbort failed")
    assert end.aborted == end.over == "first (and ncclCommAbort failed)"
    assert end.close("shut down") and not end.close("again")
    assert end.closed == "shut down" and end.over == "first (and ncclCommAbort failed)"  # the abort names it


def test_ending_close_alone_ends_the_issue_path() -> None:
    from gpucoll._backends.nccl.ending import Ending
    from gpucoll._backends.nccl.outstanding import Outstanding

    end = Ending(Outstanding())
    assert end.close("shut down") and end.over == "shut down" and end.aborted is None
    assert end.abort("later") == [] and end.over == "later"  # an abort after shutdown is named first
