"""An RRef passed to a call is deleted when the call ends, not when the garbage collector
runs: with send failures injected (the faulty agent fails the first sends of the RRef
control messages, which are retried) and with errors raised by the function itself.

What this guards against: an error kept in a future (a failed send, the function's own
error) held the frames it was raised through, and those frames held the call's arguments.
The error, its traceback and the future made a cycle only the cyclic GC frees, so the
callee's user RRef outlived its call, and its owner, waiting for its forks to go in
``_delete_all_user_and_unforked_owner_rrefs`` (torch's FaultyAgentRpcTest
``test_check_failed_messages`` calls it in the test body), waited for a deletion that came
only from the callee's own shutdown, which waited for the owner: a hang.

Every rank runs with the cyclic GC off, so that the check is deterministic: a deletion
that needs the GC never comes. Over the same-host Unix transport and over TCP.
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any

import numpy as np
import pytest

import gpucoll.rpc as rpc
from gpucoll.testing import run_spmd

_RETRYABLE = ["RREF_FORK_REQUEST", "RREF_CHILD_ACCEPT", "RREF_USER_DELETE"]


def add_rref_to_value(rref: Any, value: Any) -> Any:
    return rref.to_here() + value


def raise_with_rref(rref: Any) -> None:
    rref.to_here()
    raise KeyError("raised with an RRef argument")


def raise_key() -> None:
    raise KeyError("raised by the owner")


def fail_with_rrefs() -> None:
    """On the caller: an rpc_sync that raises with an RRef argument, and a failed to_here();
    both RRefs must go when this returns (the errors keep no cycle with their futures)."""
    owned = rpc.remote("worker1", np.add, args=(np.ones(2), 1))
    owned.to_here()
    try:
        rpc.rpc_sync("worker2", raise_with_rref, args=(owned,))
    except KeyError:
        pass
    bad = rpc.remote("worker1", raise_key)
    try:
        bad.to_here()
    except KeyError:
        pass


def counters() -> dict[str, int]:
    return {k: int(v) for k, v in rpc._rref_context_get_debug_info().items()}


def _gather() -> None:
    rpc.api._all_gather(None, timeout=30)


def release_checks(unix: str) -> dict[str, Any]:
    from gpucoll.rpc._testing import FaultyTensorPipeRpcBackendOptions

    gc.disable()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    opts = FaultyTensorPipeRpcBackendOptions(num_worker_threads=8, messages_to_fail=_RETRYABLE, num_fail_sends=3,
                                             rpc_timeout=30)
    rpc.init_rpc(f"worker{rank}", backend=rpc.backend_registry.BackendType.FAULTY_TENSORPIPE, rank=rank,
                 world_size=world, rpc_backend_options=opts)
    out: dict[str, Any] = {}
    # 1. torch's test_check_failed_messages, with its order forced: worker1 owns an RRef that
    # worker0 forks to worker2; worker2's fork (its confirmation retried after injected
    # failures) must go when worker2's function returns.
    if rank == 0:
        rref = rpc.remote("worker1", np.add, args=(np.ones(2), np.ones(2)))
        res = rpc.remote("worker2", add_rref_to_value, args=(rref, np.ones(2)))
        out["value"] = res.to_here().tolist()
        assert np.array_equal(rref.to_here(), [2.0, 2.0])
        del res
    _gather()
    # worker2 does not delete its users here: in the hang, its own call had returned before
    # the fork reached it, so only the fork's going with the call could end worker1's wait
    t0 = time.monotonic()
    if rank != 2:
        rpc.api._delete_all_user_and_unforked_owner_rrefs(timeout=8)
    out["delete_all_s"] = time.monotonic() - t0
    _gather()
    # worker2's own RRef (worker0's `res`) goes when worker0's deletion, retried after the
    # injected failures, reaches it; nobody waited for that above
    deadline = time.monotonic() + 8
    while any(counters()[k] for k in ("num_owner_rrefs", "num_forks")) and time.monotonic() < deadline:
        time.sleep(0.02)
    out["after_delete_all"] = counters()
    if rank == 0:
        del rref
    _gather()

    # 2. a function that raises, an RRef among its arguments: the callee's fork goes with
    # the call (the error's frames, which hold the arguments, are not kept).
    if rank == 0:
        owned = rpc.remote("worker1", np.add, args=(np.ones(2), 1))
        owned.to_here()
        with pytest.raises(KeyError, match="raised with an RRef argument"):
            rpc.rpc_sync("worker2", raise_with_rref, args=(owned,))
    _gather()
    if rank == 1:  # worker0's own fork is left; worker2's went with its call
        deadline = time.monotonic() + 8
        while counters()["num_forks"] != 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        out["forks_after_error"] = counters()["num_forks"]
    _gather()
    if rank == 0:
        del owned
    _gather()

    # 3. the caller's side: an rpc_sync that raises and a to_here() that raises keep neither
    # their arguments nor their RRef past the call
    if rank == 0:
        fail_with_rrefs()
    _gather()
    if rank == 1:
        deadline = time.monotonic() + 8
        while counters()["num_owner_rrefs"] and time.monotonic() < deadline:
            time.sleep(0.02)
        out["after_caller_errors"] = counters()
    _gather()
    out["connections"] = rpc._get_debug_info()["agent.connections"]
    rpc.shutdown()
    gc.enable()
    return out


@pytest.mark.parametrize("unix", ["1", "0"], ids=["unix", "tcp"])
def test_rrefs_passed_to_a_call_go_with_it(unix: str) -> None:
    outs = run_spmd(release_checks, 3, args=(unix,), init=False, timeout=120, env={"GPUCOLL_RPC_UNIX": unix})
    assert outs[0]["value"] == [3.0, 3.0]
    for r, out in enumerate(outs):
        # worker1 waited for worker2's fork: it ends once worker2's function has returned,
        # long before the timeout (8 s) after which the wait gives up
        assert out["delete_all_s"] < 5.0, (r, out)
        assert out["after_delete_all"]["num_owner_rrefs"] == 0, (r, out)
        assert out["after_delete_all"]["num_forks"] == 0, (r, out)
        assert out["after_delete_all"]["num_pending_users"] == 0, (r, out)
        want = "unix" if unix == "1" else "tcp"
        assert out["connections"] and all(c.endswith("=" + want) for c in out["connections"].split(",")), (r, out)
    assert outs[1]["forks_after_error"] == 1, outs[1]
    assert outs[1]["after_caller_errors"]["num_owner_rrefs"] == 0, outs[1]
    assert outs[1]["after_caller_errors"]["num_forks"] == 0, outs[1]
