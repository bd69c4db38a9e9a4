"""The store loop's compiled repeated ADD (gpucoll/store/_native.c): built on first use
where a C compiler and this interpreter's headers are, serving the repeated ADDs (the
answers themselves are checked in test_counter_hot_path.py, on both loops), and where it
cannot be built, the loop's Python serves and says why; GPUCOLL_STORE_NATIVE turns it off
or makes a failed build an error."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path
from typing import Any

import pytest

from gpucoll.store import TCPStore
from gpucoll.store import _native

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _can_build() -> bool:
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    return (cc is not None and sys.platform.startswith("linux")
            and os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))


@pytest.mark.skipif(not _can_build(), reason="no C compiler or no Python.h: the loop's Python serves")
def test_the_compiled_loop_is_built_and_serves_a_master_where_it_can_be() -> None:
    if os.environ.get("GPUCOLL_STORE_NATIVE", "").strip() == "0":
        pytest.skip("GPUCOLL_STORE_NATIVE=0 in this environment")
    assert _native.module() is not None, _native.why_not()
    assert _native.why_not() == ""
    m = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=10)
    try:
        assert m._server is not None and m._server.native is _native.module()
    finally:
        m.close()


@pytest.mark.parametrize("unix", [True, False])
def test_repeated_adds_are_served_by_the_compiled_loop(monkeypatch: pytest.MonkeyPatch, unix: bool) -> None:
    """Three clients each repeat their ADD 150 times, interleaved: every answer follows a
    reference counter, and the compiled loop handed the loop's Python only a handful of
    the 450 requests (each connection's first ADD, which sets the frame the compiled loop
    compares against, and its first repeat, read by the Python loop's own hot path)."""
    if _native.module() is None:
        pytest.skip(f"the store's compiled loop is not built here: {_native.why_not()}")
    handed = [0, 0]  # calls, events handed back to the loop's Python
    real = _native.wait

    def counting(*args: Any) -> list[tuple[int, int]]:
        events = real(*args)
        handed[0] += 1
        handed[1] += len(events)
        return events

    monkeypatch.setattr(_native, "wait", counting)
    m = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=10, use_unix_socket=unix)
    assert m._server is not None
    server = m._server
    reads = [0]
    on_input = server._on_input

    def counted(*args: Any) -> None:
        reads[0] += 1
        on_input(*args)

    server._on_input = counted  # type: ignore[method-assign]
    clients = [TCPStore("127.0.0.1", m.port, timeout=10, use_unix_socket=unix) for _ in range(3)]
    try:
        before = list(handed)
        ref = {"n0": 0, "n1": 0, "n2": 0}
        for i in range(150):
            for k, c in enumerate(clients):
                ref[f"n{k}"] += k + 1
                assert c.add(f"n{k}", k + 1) == ref[f"n{k}"], (i, k)
        assert handed[0] > before[0]  # the compiled loop waited
        assert handed[1] - before[1] <= 12, handed
        assert reads[0] <= 12, reads[0]
        for key, total in ref.items():
            assert m.get(key) == str(total).encode()
    finally:
        for c in clients:
            c.close()
        m.close()


def _child(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": _REPO, **env})


_USE = """
    from gpucoll.store import TCPStore, _native
    m = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=10)
    c = TCPStore("127.0.0.1", m.port, timeout=10)
    assert [c.add("k", 2) for _ in range(5)] == [2, 4, 6, 8, 10]
    print(m._server.native is None, _native.why_not())
"""


def test_without_a_compiler_or_turned_off_the_python_loop_serves(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    out = _child(_USE, {"CC": str(tmp_path / "no-such-cc"), "GPUCOLL_CACHE_DIR": str(cache)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("True ") and "no-such-cc" in out.stdout, out.stdout
    assert not [p for p in cache.iterdir() if p.suffix == ".so"]  # nothing half-built left
    out = _child(_USE, {"GPUCOLL_STORE_NATIVE": "0", "GPUCOLL_CACHE_DIR": str(cache)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True GPUCOLL_STORE_NATIVE=0", out.stdout


def test_a_required_loop_that_cannot_be_built_is_an_error_and_a_bad_setting_is_refused(tmp_path: Path) -> None:
    env = {"CC": str(tmp_path / "no-such-cc"), "GPUCOLL_CACHE_DIR": str(tmp_path / "cache"),
           "GPUCOLL_STORE_NATIVE": "1"}
    out = _child(_USE, env)
    assert out.returncode != 0
    assert "DistStoreError: GPUCOLL_STORE_NATIVE=1 but the store's compiled loop could not be built" in out.stderr
    out = _child(_USE, {**env, "GPUCOLL_STORE_NATIVE": "yes"})
    assert out.returncode != 0 and "GPUCOLL_STORE_NATIVE must be 0, 1 or unset; got 'yes'" in out.stderr
