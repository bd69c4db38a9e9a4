"""The store loop's repeated ADD, compiled (``_native.c``): built on first use.

``_native.c`` is a CPython extension with one function, ``run``: it waits on the
server's epoll set and does what :meth:`StoreServer._run`'s Python loop does for a
connection whose read is its last ADD frame again (the hottest request: ranks counting
arrivals), without the interpreter's work per request or per wake-up: the same tests in
the same order, the same reply; it returns to the loop's Python at the first event that
is anything else, and when the loop's timeout passes (see the source's head). It is
built with the machine's C compiler against this interpreter's ``Python.h`` into
gpucoll's per-user cache (``gpucoll/_env/cbuild.py``), keyed by the source, the header
and the interpreter, on Linux only. ``GPUCOLL_STORE_NATIVE=0`` never builds or uses it; ``=1`` makes a failed
build an error; unset, a failed build (no compiler, no ``Python.h``) leaves the Python
loop serving every request, as without it, and :func:`why_not` says why.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import sysconfig
import threading
from typing import Any

from .._env import STORE_NATIVE_ENV, cbuild
from ..errors import DistStoreError

__all__ = ["module", "why_not", "wait", "NONE", "INPUT", "PARTIAL"]

NONE, INPUT, PARTIAL = range(3)
"""What ``run`` left half done (``_native.c``)."""

_NAME = "_gpucoll_store_native"
_lock = threading.Lock()
_module: Any = None
_tried = False
_why_not = ""


def _build() -> str:
    include = sysconfig.get_paths()["include"]
    header = os.path.join(include, "Python.h")
    if not os.path.exists(header):
        raise OSError(f"no {header} (this interpreter's C headers are not installed)")
    with open(header, "rb") as f:
        key = f.read() + sys.version.encode() + (sysconfig.get_config_var("EXT_SUFFIX") or "").encode()
    return cbuild.build("store", os.path.join(os.path.dirname(os.path.abspath(__file__)), "_native.c"),
                        [include], key)


def _load(path: str) -> Any:
    loader = importlib.machinery.ExtensionFileLoader(_NAME, path)
    spec = importlib.util.spec_from_file_location(_NAME, path, loader=loader)
    if spec is None:
        raise ImportError(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def module() -> Any:
    """The compiled module, or None (turned off, not Linux, or it could not be built).

    Raises:
        DistStoreError: ``GPUCOLL_STORE_NATIVE=1`` and it could not be built or loaded.
        ValueError: ``GPUCOLL_STORE_NATIVE`` is neither 0, 1 nor unset.
    """
    global _module, _tried, _why_not
    mode = cbuild.mode(STORE_NATIVE_ENV)
    with _lock:
        if not _tried:
            if mode == "0":
                _why_not = f"{STORE_NATIVE_ENV}=0"
            elif not sys.platform.startswith("linux"):
                _why_not = f"not on Linux ({sys.platform})"
            else:
                try:
                    _module = _load(_build())
                except Exception as exc:  # no compiler, no headers, a failed build: Python serves
                    _why_not = f"{type(exc).__name__}: {exc}"
            _tried = True
    if _module is None and mode == "1":
        raise DistStoreError(f"{STORE_NATIVE_ENV}=1 but the store's compiled loop could not be built: {_why_not}")
    return _module


def why_not() -> str:
    """Why :func:`module` returned None ("" if it did not, or was not called yet)."""
    return _why_not


def wait(server: Any, run: Any, epfd: int, timeout: float, conns: dict[int, Any], data: dict[bytes, bytes],
         rbuf: bytearray, heads: tuple[bytes, ...]) -> list[tuple[int, int]]:
    """The compiled ``run``: wait on ``server``'s epoll set and serve the repeated ADDs until
    an event needs the loop's Python (or ``timeout`` seconds pass, negative: none); do
    what ``run`` left half done, and return the poller's events still to serve."""
    events, kind, fd, x = run(epfd, timeout, conns, data, rbuf, heads)
    if kind != NONE:
        conn = conns.get(fd)
        if conn is not None:
            try:
                if kind == INPUT:  # x bytes read into rbuf, not a repeated ADD
                    server._on_input(conn, conn.sock, x)
                else:  # PARTIAL: x is the rest of the reply
                    conn.out.append(x)
                    server._send(conn)
            except Exception:  # a bug serving one client must not stop the server
                server._drop(conn)
    return events  # type: ignore[no-any-return]
