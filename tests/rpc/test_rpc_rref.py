"""The RRef protocol in one world of four workers: owners, forks between users, confirmations,
deletions and the debug counters, checked with the assertions of torch's own RRef tests
(rpc_test.py: test_rref_context_debug_info, test_owner_equality, test_rref_forward_chain,
test_remote_same_worker, test_rref_proxy_*, test_rref_timeout ...).
"""

from __future__ import annotations

import gc
import operator
import os
import time
from typing import Any, Callable

import numpy as np
import pytest

import gpucoll.rpc as rpc
from gpucoll.testing import run_spmd

_held: list[Any] = []


class Counter:
    def __init__(self, start: int) -> None:
        self.n = start

    def add(self, k: int) -> int:
        self.n += k
        return self.n

    @rpc.functions.async_execution
    def add_later(self, k: int) -> Any:
        from gpucoll.futures import Future

        f: Future[int] = Future()
        f.set_result(self.n + k)
        return f


def hold(rref: Any) -> bool:
    _held.append(rref)
    return rref.confirmed_by_owner() or True


def drop() -> None:
    _held.clear()
    gc.collect()


def fetch(rref: Any) -> Any:
    return rref.to_here()


def forward(rref: Any, to: str) -> Any:
    """Pass ``rref`` on to another worker (a user forking to a user)."""
    return rpc.rpc_sync(to, fetch, args=(rref,))


def own_rref(value: Any) -> Any:
    return rpc.RRef(value)


def is_owner_here(rref: Any) -> bool:
    return bool(rref.is_owner())


def nap(seconds: float) -> int:
    time.sleep(seconds)
    return 1


def raise_key(k: str) -> None:
    raise KeyError(k)


def counters() -> dict[str, int]:
    return {k: int(v) for k, v in rpc._rref_context_get_debug_info().items()}


def wait_for(pred: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}: {counters()}")
        time.sleep(0.01)


def owner_has(*rref_ids: Any) -> list[bool]:
    """On the owner: whether it still holds each RRef (a fork of it is alive)."""
    ctx = rpc._get_current_rpc_agent().rrefs
    with ctx.lock:
        return [rid in ctx.owners for rid in rref_ids]


def flushed() -> None:
    wait_for(lambda: counters()["num_pending_users"] == 0 and counters()["num_pending_futures"] == 0, "flush")


def rref_checks() -> dict[str, Any]:
    import gpucoll

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    gpucoll.init_process_group("cpu")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world)
    nxt, third = f"worker{(rank + 1) % world}", f"worker{(rank + 2) % world}"
    barrier = gpucoll.barrier

    # a local RRef is not in the context until it is shared (torch: test_rref_context_debug_info)
    local = rpc.RRef(np.full(3, rank))
    assert local.is_owner() and local.confirmed_by_owner() and local.owner() == rpc.get_worker_info()
    assert local.owner_name() == f"worker{rank}" and np.array_equal(local.to_here(), [rank] * 3)
    assert counters() == {"num_owner_rrefs": 0, "num_pending_futures": 0, "num_pending_users": 0, "num_forks": 0}
    barrier()
    # sharing it as an argument registers the owner and the fork
    assert rpc.rpc_sync(nxt, hold, args=(local,))
    flushed()
    barrier()
    c = counters()
    assert c["num_owner_rrefs"] == 1 and c["num_forks"] == 1 and c["num_pending_users"] == 0, c
    barrier()
    rpc.rpc_sync(nxt, drop)
    wait_for(lambda: counters()["num_owner_rrefs"] == 0 and counters()["num_forks"] == 0, "the fork's deletion")
    barrier()

    # rpc.remote: the owner holds two RRefs while the users hold them
    r2 = rpc.remote(nxt, np.add, args=(np.ones(2), 1))
    r3 = rpc.remote(nxt, np.add, args=(np.ones(2), 2))
    assert not r2.is_owner() and r2.owner_name() == nxt
    assert np.array_equal(r2.to_here(), [2, 2]) and np.array_equal(r3.to_here(timeout=5), [3, 3])
    flushed()
    assert r2.confirmed_by_owner() and r3.confirmed_by_owner()
    barrier()
    c = counters()
    assert c["num_owner_rrefs"] == 2 and c["num_forks"] == 2 and c["num_pending_users"] == 0, c
    barrier()
    with pytest.raises(RuntimeError, match=r"can.t call localValue\(\) on user .*Call it on owner"):
        r2.local_value()
    del r2, r3
    gc.collect()
    wait_for(lambda: counters()["num_owner_rrefs"] == 0 and counters()["num_forks"] == 0, "users' deletion")
    barrier()

    # a user passes its RRef on to a third worker (user -> user fork); both see the value
    r = rpc.remote(nxt, np.arange, args=(5,))
    assert np.array_equal(rpc.rpc_sync(third, fetch, args=(r,)), np.arange(5))
    assert np.array_equal(rpc.rpc_sync(third, forward, args=(r, nxt)), np.arange(5))  # and on to the owner
    assert rpc.rpc_sync(nxt, is_owner_here, args=(r,)) is True
    assert rpc.rpc_sync(third, is_owner_here, args=(r,)) is False
    flushed()
    barrier()
    del r
    gc.collect()
    wait_for(lambda: counters()["num_owner_rrefs"] == 0 and counters()["num_forks"] == 0, "forwarded forks' deletion")
    barrier()

    # an RRef made on the callee and returned: owned there, confirmed at once
    back = rpc.rpc_sync(nxt, own_rref, args=({"k": rank},))
    assert back.owner_name() == nxt and back.confirmed_by_owner() and back.to_here() == {"k": rank}
    # remote to oneself: an owner RRef; the context forgets it once the call is done
    mine = rpc.remote(rpc.get_worker_info(), operator.mul, args=(6, 7))
    assert mine.is_owner() and mine.to_here() == 42 and mine.local_value() == 42
    mine._get_future().wait()
    # proxies
    ctr = rpc.remote(nxt, Counter, args=(10,))
    assert ctr.rpc_sync().add(1) == 11
    assert ctr.rpc_async().add(2).wait() == 13
    assert ctr.remote().add(3).to_here() == 16
    assert ctr.rpc_sync().add_later(100) == 116
    assert ctr._get_type() is Counter and ctr._get_type(blocking=False).wait() is Counter
    for proxy in (ctr.rpc_sync(), ctr.rpc_async(), ctr.remote()):
        with pytest.raises(AttributeError, match="has no attribute 'non_exist'"):
            proxy.non_exist()
    # errors: the remote exception at to_here; a timed-out creation
    bad = rpc.remote(nxt, raise_key, args=("missing",))
    with pytest.raises(KeyError, match="missing"):
        bad.to_here()
    slow = rpc.remote(nxt, nap, args=(1.0,), timeout=0.2)
    with pytest.raises(TimeoutError):
        slow._get_future().wait()
    with pytest.raises(RuntimeError, match=r"RRef creation via rpc.remote\(\) timed out"):
        slow.to_here()
    with pytest.raises(RuntimeError, match="Can not pickle rref"):
        import pickle

        pickle.dumps(ctr)
    del back, mine, ctr, bad, slow, proxy
    gc.collect()
    time.sleep(1.0)  # the slow call completes on its owner
    barrier()
    wait_for(lambda: counters()["num_forks"] == 0 and counters()["num_owner_rrefs"] == 0, "everything deleted")
    barrier()

    # a user RRef's deletion reaches its owner with every pool thread of the caller busy;
    # deleted inside the library's own code (the GC runs finalizers anywhere: here, inside
    # the timer's lock on this very thread) it neither sends nor waits on that thread, and
    # reaches the owner too
    if rank == 0:
        import threading

        agent = rpc._get_current_rpc_agent()
        gate = threading.Event()
        try:
            for _ in range(agent.num_worker_threads):
                agent.submit(lambda: gate.wait(30))
            wait_for(lambda: agent.idle_threads == 0, "a busy pool")
            direct, deferred = rpc.remote(nxt, np.ones, args=(2,)), rpc.remote(nxt, np.ones, args=(3,))
            direct.to_here(), deferred.to_here()
            ids = direct._rref_id, deferred._rref_id
            assert rpc.rpc_sync(nxt, owner_has, args=ids) == [True, True]
            del direct
            gc.collect()
            wait_for(lambda: rpc.rpc_sync(nxt, owner_has, args=ids) == [False, True], "the direct delete", 5.0)
            agent.timer.lazy_armed = False  # (the finalizer arms the sweep itself: the case that needs the lock)
            with agent.timer.lock:  # as if the GC ran the finalizer inside the timer's code
                del deferred
                gc.collect()  # returns: nothing on this thread waits for the lock it holds
        finally:
            gate.set()
        wait_for(lambda: rpc.rpc_sync(nxt, owner_has, args=ids) == [False, False], "the deferred delete", 5.0)
    barrier()

    # a user's deletion goes with its next request to the owner, not as a message of its
    # own, and the owner has done it before that request runs; deletions no request takes
    # go on their own within milliseconds, in one message
    ctx = rpc._get_current_rpc_agent().rrefs
    alone: list[Any] = []
    send_alone = ctx.send_with_retries
    ctx.send_with_retries = lambda to, kind, obj: (alone.append((kind.name, obj)), send_alone(to, kind, obj))[1]
    try:
        for _ in range(20):
            r = rpc.remote(nxt, np.ones, args=(2,))
            r.to_here()
            rid = r._rref_id
            del r
            assert rpc.rpc_sync(nxt, owner_has, args=(rid,)) == [False]
        sent_alone = [obj for kind, obj in alone if kind == "RREF_USER_DELETE"]
        assert len(sent_alone) <= 10, sent_alone  # (one goes alone only if an iteration outlasts the flush)
        a, b = rpc.remote(nxt, np.ones, args=(2,)), rpc.remote(nxt, np.ones, args=(3,))
        a.to_here(), b.to_here()
        ids = a._rref_id, b._rref_id
        del a, b
        wait_for(lambda: set(ids) <= {rid for k, obj in alone if k == "RREF_USER_DELETE" for rid, _ in obj},
                 "the deletions sent on their own")
        assert rpc.rpc_sync(nxt, owner_has, args=ids) == [False, False]
    finally:
        del ctx.send_with_retries
    barrier()

    # shutdown deletes the user RRefs still held: the owners end with nothing
    keep = rpc.remote(nxt, np.ones, args=(2,))
    keep.to_here()
    flushed()
    barrier()
    out = {"before": counters()}
    barrier()
    rpc.shutdown()
    with pytest.raises(RuntimeError, match=r"Cannot call to_here\(\) on it after deletion"):
        keep.to_here()
    out["owned_after"] = len(keep._ctx.owners)
    out["forks_after"] = sum(len(s) for s in keep._ctx.forks.values())
    gpucoll.destroy_process_group()
    return out


def test_rref_protocol_in_a_world_of_four() -> None:
    for r, out in enumerate(run_spmd(rref_checks, 4, init=False, timeout=120)):
        assert out["before"]["num_owner_rrefs"] == 1 and out["before"]["num_forks"] == 1, (r, out)
        assert out["owned_after"] == 0 and out["forks_after"] == 0, (r, out)
