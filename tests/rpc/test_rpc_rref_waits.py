"""RRef protocol messages that somebody waits for are written and read at once, not held
for the connection's next write (the lazy sweep, ``LAZY_WAKE``).

Every rank runs with ``LAZY_WAKE`` raised to 2 s, so that a held message costs 2-4 s: each
wait below must end well within 1 s. What is waited on: ``remote()``'s creation future
(its reply asked for with REPLY_NOW, before and after the callee has made it),
``confirmed_by_owner()`` polled, and a call to a third worker with an RRef argument (the
callee runs it once the owner has accepted its fork). The protocol's results are checked
too: the values, and the callee's fork confirmed when its function runs. Over the same-host
Unix transport and over TCP.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

import gpucoll.rpc as rpc
from gpucoll.testing import run_spmd
from _workers import init_worker

_HOLD = 2.0  # seconds: LAZY_WAKE in this test
_BOUND = 1.0  # seconds: a wait that a held message would make at least _HOLD long


def slow_add(x: Any, y: Any) -> Any:
    time.sleep(0.2)
    return np.add(x, y)


def confirmed_here(rref: Any) -> tuple[bool, Any]:
    """On the callee: whether its fork is confirmed when the call runs, and the value."""
    return rref.confirmed_by_owner(), rref.to_here()


def _timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _poll_confirmed(rref: Any) -> None:
    deadline = time.monotonic() + 10
    while not rref.confirmed_by_owner():
        if time.monotonic() > deadline:
            raise TimeoutError("confirmed_by_owner() stayed False for 10 s")
        time.sleep(0.0005)


def waits(unix: str) -> dict[str, Any]:
    import gpucoll.rpc._timer as timer_module

    timer_module.LAZY_WAKE = _HOLD  # (the timer's sweep) a held frame would now wait 2-4 s
    rank = init_worker()
    out: dict[str, Any] = {"times": {}}
    if rank == 1:
        times = out["times"]
        rpc.rpc_sync("worker0", np.add, args=(1, 1))  # connections up
        rpc.rpc_sync("worker2", np.add, args=(1, 1))
        for i in range(3):
            a = rpc.remote("worker0", np.add, args=(np.ones(2), i))
            times[f"creation wait {i}"] = _timed(a._get_future().wait)
            out[f"creation value {i}"] = a.to_here().tolist()
            b = rpc.remote("worker0", slow_add, args=(np.ones(2), i))  # asked before the reply exists
            times[f"slow creation wait {i}"] = _timed(b._get_future().wait) - 0.2
            c = rpc.remote("worker0", np.add, args=(np.ones(2), i))
            times[f"confirmed_by_owner {i}"] = _timed(lambda: _poll_confirmed(c))
            t = time.perf_counter()
            out[f"third worker {i}"] = rpc.rpc_sync("worker2", confirmed_here, args=(a,))
            times[f"third worker {i}"] = time.perf_counter() - t
            del a, b, c
        out["connections"] = rpc._get_debug_info()["agent.connections"]
    rpc.api._all_gather(None, timeout=30)
    rpc.shutdown()
    return out


def test_waited_on_rref_messages_are_not_held() -> None:
    for unix in ("1", "0"):
        outs = run_spmd(waits, 3, args=(unix,), init=False, timeout=120, env={"GPUCOLL_RPC_UNIX": unix})
        out = outs[1]
        for i in range(3):
            assert out[f"creation value {i}"] == [1.0 + i, 1.0 + i], out
            confirmed, value = out[f"third worker {i}"]
            assert confirmed is True, out  # the callee ran only once its fork was confirmed
            assert value.tolist() == [1.0 + i, 1.0 + i], out
        slow = {k: v for k, v in out["times"].items() if v >= _BOUND}
        assert not slow, (unix, slow, out["times"])  # a held message would take >= 2 s
        want = "unix" if unix == "1" else "tcp"
        assert all(c.endswith("=" + want) for c in out["connections"].split(",")), out
