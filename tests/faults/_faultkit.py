"""Fault cases run many to a world: each case is a fresh job formed by forked children.

Starting a rank costs about half a second; a case costs a fork. Every harness rank
(``gpucoll.testing.run_spmd`` with ``init=False``) forks one child per case; the
children form a new default group on their own prefix of the harness's store, warm
it up with one all_reduce, then the case's victim dies (SIGKILL) or stalls (SIGSTOP)
while the survivors are blocked in the case's op with it. Each survivor reports what
its op did (the error's type and message, and how long it took) through a pipe; its
parent waits with a hard deadline and SIGKILLs whatever is left. A stalled victim is
SIGKILLed by its parent once every survivor of the case has reported.
"""

from __future__ import annotations

import json
import os
import select
import signal
import time
from typing import Any, Callable

import numpy as np

PG_TIMEOUT = 3.0          # the cases' group timeout
DIE_AFTER = 0.3           # seconds the victim waits before dying: the survivors are blocked by then
BIG = 8 << 20             # bytes of the "big" payloads
STREAM = 128 << 20        # bytes of the point-to-point stream that is arriving when its sender dies


def _ones(n: int = 1024) -> np.ndarray:
    return np.ones(n, dtype=np.float64)


# -- what a survivor does in each case (rank, world size, victim) -----------------------------
# Returns whether the result it got is right (None: the op gives this rank no result).

def _all_reduce(r: int, n: int, v: int) -> None:
    import gpucoll
    gpucoll.all_reduce(_ones())


def _all_reduce_big(r: int, n: int, v: int) -> bool:
    import gpucoll
    x = _ones(BIG // 8)
    gpucoll.all_reduce(x)
    return bool((x == n).all())


def _broadcast(r: int, n: int, v: int) -> bool:
    import gpucoll
    src = 0 if v != 0 else n - 1
    x = _ones() * (r + 1)
    gpucoll.broadcast(x, src=src)
    return bool((x == src + 1).all())


def _broadcast_from_victim(r: int, n: int, v: int) -> None:
    import gpucoll
    gpucoll.broadcast(_ones(), src=v)


def _reduce(r: int, n: int, v: int) -> None:
    import gpucoll
    gpucoll.reduce(_ones(), dst=0 if v != 0 else n - 1)


def _all_gather(r: int, n: int, v: int) -> None:
    import gpucoll
    gpucoll.all_gather([_ones() for _ in range(n)], _ones())


def _reduce_scatter(r: int, n: int, v: int) -> None:
    import gpucoll
    gpucoll.reduce_scatter(_ones(), [_ones() for _ in range(n)])


def _all_to_all(r: int, n: int, v: int) -> None:
    import gpucoll
    gpucoll.all_to_all([_ones() for _ in range(n)], [_ones() for _ in range(n)])


def _gather(r: int, n: int, v: int) -> None:
    import gpucoll
    dst = 0 if v != 0 else n - 1
    gpucoll.gather(_ones(), [_ones() for _ in range(n)] if r == dst else None, dst=dst)


def _scatter(r: int, n: int, v: int) -> bool:
    import gpucoll
    src = 0 if v != 0 else n - 1
    out = _ones() * -1
    gpucoll.scatter(out, [_ones() * (i + 1) for i in range(n)] if r == src else None, src=src)
    return bool((out == r + 1).all())


def _barrier(r: int, n: int, v: int) -> None:
    import gpucoll
    gpucoll.barrier()


def _recv_from_victim(r: int, n: int, v: int) -> None:
    import gpucoll
    gpucoll.recv(_ones(), src=v)


def _recv_streaming(r: int, n: int, v: int) -> bool:
    import gpucoll
    x = np.zeros(STREAM // 8)
    gpucoll.recv(x, src=v)
    return bool((x == 1).all())


def _send_to_dead(r: int, n: int, v: int) -> None:
    import gpucoll
    time.sleep(DIE_AFTER + 0.3)  # the victim is dead (and its death seen) before the send starts
    gpucoll.send(_ones(BIG // 8), dst=v)


def _all_gather_object(r: int, n: int, v: int) -> None:
    import gpucoll
    out: list[Any] = [None] * n
    gpucoll.all_gather_object(out, {"rank": r})


def _broadcast_object_list(r: int, n: int, v: int) -> None:
    import gpucoll
    gpucoll.broadcast_object_list([r, "x"], src=0 if v != 0 else n - 1)


def _gather_object(r: int, n: int, v: int) -> None:
    import gpucoll
    dst = 0 if v != 0 else n - 1
    gpucoll.gather_object(r, [None] * n if r == dst else None, dst=dst)


def _scatter_object_list(r: int, n: int, v: int) -> None:
    import gpucoll
    src = 0 if v != 0 else n - 1
    out: list[Any] = [None]
    gpucoll.scatter_object_list(out, list(range(n)) if r == src else None, src=src)


def _monitored_barrier(r: int, n: int, v: int) -> None:
    import gpucoll
    gpucoll.monitored_barrier(timeout=PG_TIMEOUT)


_JIT: list[Any] = []  # the case's jitted step (made by _jit_warm_up)


def _jit_warm_up(r: int, n: int) -> None:
    """Every rank of a jit case, the victim too: compile the step and run it once, which
    sets up the group's jit channel (with every rank alive)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp

    import gpucoll.functional as F
    from gpucoll._jax import native

    _JIT.append(jax.jit(lambda v: F.all_reduce(v)))
    assert (np.asarray(_JIT[0](jnp.ones(8))) == n).all()
    # the compiled handler ran it, where it could be built (else the Python handler did)
    assert native.library() is None or native.native_ops() == 1, native.native_ops()


def _jit_all_reduce(r: int, n: int, v: int) -> None:
    import jax.numpy as jnp

    from gpucoll.errors import DistBackendError

    try:
        _JIT[0](jnp.ones(8)).block_until_ready()
    except Exception as exc:
        # an error inside jit reaches the caller as XLA's runtime error, carrying ours
        if type(exc).__name__ in ("JaxRuntimeError", "XlaRuntimeError") and "DistBackendError: " in str(exc):
            raise DistBackendError(str(exc)) from exc
        raise


def _jit_first_all_reduce(r: int, n: int, v: int) -> None:
    """The group's first collective inside jit, which sets its jit channel up (the
    victim never comes)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    import gpucoll.functional as F

    _JIT.append(jax.jit(lambda x: F.all_reduce(x)))
    _jit_all_reduce(r, n, v)


WARM_UP: dict[str, Callable[[int, int], None]] = {"jit_all_reduce": _jit_warm_up}
"""Cases whose every rank (the victim too) runs a warm-up of its own first."""

OPS: dict[str, tuple[str, Callable[[int, int, int], bool | None]]] = {
    # case op name -> (the op's name in messages, what survivors do)
    "all_reduce": ("all_reduce", _all_reduce),
    "all_reduce_big": ("all_reduce", _all_reduce_big),
    "broadcast": ("broadcast", _broadcast),
    "broadcast_from_victim": ("broadcast", _broadcast_from_victim),
    "reduce": ("reduce", _reduce),
    "all_gather": ("all_gather", _all_gather),
    "reduce_scatter": ("reduce_scatter", _reduce_scatter),
    "all_to_all": ("all_to_all", _all_to_all),
    "gather": ("gather", _gather),
    "scatter": ("scatter", _scatter),
    "barrier": ("barrier", _barrier),
    "recv": ("recv", _recv_from_victim),
    "recv_streaming": ("recv", _recv_streaming),
    "send_to_dead": ("send", _send_to_dead),
    "all_gather_object": ("all_gather", _all_gather_object),
    "broadcast_object_list": ("broadcast", _broadcast_object_list),
    "gather_object": ("gather", _gather_object),
    "scatter_object_list": ("scatter", _scatter_object_list),
    "monitored_barrier": ("monitored_barrier", _monitored_barrier),
    "jit_all_reduce": ("all_reduce", _jit_all_reduce),  # inside jax.jit: the compiled handler's channel
    "jit_first_all_reduce": ("all_reduce", _jit_first_all_reduce),  # ... while the channel is set up
}


def _victim(op: str, r: int, n: int, how: str) -> None:
    """The victim: dies (or stalls) while the others are blocked in ``op`` with it.

    For ``recv_streaming`` it first starts sending the receiver a big payload, so that
    the payload is arriving when it dies; for ``all_reduce_big`` it enters the op."""
    import gpucoll

    sig = signal.SIGKILL if how == "kill" else signal.SIGSTOP
    if op == "recv_streaming":
        import threading

        def stream() -> None:
            for dst in range(n):
                if dst != r:
                    gpucoll.send(_ones(STREAM // 8), dst=dst)

        threading.Thread(target=stream, daemon=True).start()
        time.sleep(0.005)  # a few MiB are on their way
    elif op == "all_reduce_big":
        time.sleep(DIE_AFTER)
        gpucoll.all_reduce(_ones(BIG // 8), async_op=True)
        time.sleep(0.002)
    else:
        time.sleep(DIE_AFTER)
    os.kill(os.getpid(), sig)
    time.sleep(60)  # a SIGSTOPped victim is killed by its parent


def _case_child(i: int, op: str, victim: int, how: str, write_fd: int) -> None:
    import gpucoll
    from gpucoll.store import PrefixStore, TCPStore

    r, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    report: dict[str, Any] = {"rank": r, "pid": os.getpid()}
    try:
        base = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout=PG_TIMEOUT + 10,
                        token=os.environ.get("GPUCOLL_STORE_TOKEN"))
        gpucoll.init_process_group("cpu", store=PrefixStore(f"fault-case-{i}", base), rank=r, world_size=n,
                                   timeout=PG_TIMEOUT)
        x = _ones(8)
        gpucoll.all_reduce(x)
        assert (x == n).all()
        if op in WARM_UP:
            WARM_UP[op](r, n)
        if r == victim:
            _victim(op, r, n, how)
        t0 = time.monotonic()
        try:
            correct = OPS[op][1](r, n, victim)
            report.update(raised=None, correct=correct, elapsed=time.monotonic() - t0)
        except Exception as exc:  # noqa: BLE001 - the type is what is checked
            report.update(raised=type(exc).__name__, dist=isinstance(exc, gpucoll.DistError), msg=str(exc),
                          elapsed=time.monotonic() - t0)
        try:
            gpucoll.destroy_process_group()
        except Exception:  # noqa: BLE001 - the group is broken on purpose
            pass
    except BaseException as exc:  # noqa: BLE001 - reported, not raised, from a forked child
        report.update(setup_error=f"{type(exc).__name__}: {exc}")
    os.write(write_fd, json.dumps(report).encode())


def run_cases(cases: list[tuple[str, int, str]]) -> list[dict[str, Any]]:
    """Harness body: run every ``(op, victim, how)`` case; return this rank's reports."""
    from gpucoll.store import TCPStore

    r, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout=60,
                     token=os.environ.get("GPUCOLL_STORE_TOKEN"))
    out: list[dict[str, Any]] = []
    for i, (op, victim, how) in enumerate(cases):
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(rfd)
            try:
                _case_child(i, op, victim, how, wfd)
            finally:
                os._exit(0)
        os.close(wfd)
        report = _collect(rfd, pid, PG_TIMEOUT + 20) if r != victim else {"rank": r, "pid": pid}
        os.close(rfd)
        store.set(f"case{i}/reported/{r}", "1")
        if r == victim:
            try:
                store.wait([f"case{i}/reported/{s}" for s in range(n) if s != victim], timeout=PG_TIMEOUT + 25)
            except Exception:  # noqa: BLE001 - a survivor that never reported shows in its own report
                pass
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _, status = os.waitpid(pid, 0)
        report["status"] = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        out.append(report)
    return out


def _collect(fd: int, pid: int, within: float) -> dict[str, Any]:
    data = b""
    deadline = time.monotonic() + within
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return {"pid": pid, "hung": True}
        if select.select([fd], [], [], left)[0]:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            data += chunk
    try:
        return dict(json.loads(data.decode()))
    except ValueError:
        return {"pid": pid, "no_report": data.decode(errors="replace")}
