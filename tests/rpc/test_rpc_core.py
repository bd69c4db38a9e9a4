"""gpucoll.rpc's calls in one world of three workers: identity, sync/async calls, arrays,
remote exceptions, timeouts, nested and async_execution calls, futures, shutdown.

Expectations are torch.distributed.rpc's documented behaviour (names, message shapes
such as "On WorkerInfo(id=1, name=worker1):" and "RPC ran for more than set timeout").
"""

from __future__ import annotations

import operator
import os
import pickle
import threading
import time
from typing import Any

import numpy as np
import pytest

import gpucoll.rpc as rpc
from gpucoll.rpc.functions import async_execution
from gpucoll.testing import run_spmd


class Boom(ValueError):
    """A user exception type: it must come back as itself."""


def raise_boom(x: int) -> None:
    raise Boom(f"boom {x}")


def nap(seconds: float) -> str:
    time.sleep(seconds)
    return "rested"


def echo(x: Any) -> Any:
    return x


def info_of_callee() -> tuple[str, int]:
    me = rpc.get_worker_info()
    return me.name, me.id


def nested_sum(via: str, x: int) -> int:
    return int(rpc.rpc_sync(via, operator.add, args=(x, 10))) + 1


def array_facts(a: np.ndarray) -> tuple[bool, int, float]:
    a += 1  # arrives writable
    return bool(a.flags.writeable), int(a.size), float(a.sum())


@async_execution
def async_double(to: str, x: int) -> Any:
    return rpc.rpc_async(to, operator.add, args=(x, 1)).then(lambda f: f.value() * 2)


@async_execution
def not_a_future() -> int:
    return 1


def make_future() -> Any:
    from gpucoll.futures import Future

    return Future()


def raise_lines() -> None:
    raise ValueError("\nfirst line\nsecond line")


def core_checks() -> dict[str, Any]:
    from gpucoll.futures import Future, collect_all, wait_all

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world)
    names = [f"worker{i}" for i in range(world)]
    nxt, prev = names[(rank + 1) % world], names[(rank - 1) % world]
    out: dict[str, Any] = {}

    # identity
    me = rpc.get_worker_info()
    assert (me.name, me.id) == (f"worker{rank}", rank)
    other = rpc.get_worker_info(nxt)
    assert other.id == (rank + 1) % world and other == rpc.get_worker_info(nxt)
    assert pickle.loads(pickle.dumps(other)) == other and hash(other) == hash(rpc.get_worker_info(nxt))
    assert repr(me) == f"WorkerInfo(id={rank}, name=worker{rank})"
    infos = rpc._get_current_rpc_agent().get_worker_infos()
    assert [w.name for w in infos] == names
    with pytest.raises(ValueError, match="Unknown destination worker"):
        rpc.get_worker_info("nobody")
    with pytest.raises(RuntimeError, match="already initialized"):
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world)

    # `to` as a name, an id or a WorkerInfo; a call to oneself
    for to in (nxt, (rank + 1) % world, other):
        assert rpc.rpc_sync(to, info_of_callee) == (nxt, (rank + 1) % world)
    assert rpc.rpc_sync(me, info_of_callee) == (me.name, rank)
    with pytest.raises(TypeError, match="function should be callable"):
        rpc.rpc_sync(nxt, 3)
    with pytest.raises(Exception):
        rpc.rpc_sync(nxt, echo, args=(lambda: 1,))  # unpicklable: raised at the call site

    # arrays: values equal, copies (not the caller's memory), writable on arrival
    a = np.arange(1000, dtype=np.float64).reshape(10, 100)
    back = rpc.rpc_sync(nxt, echo, args=(a,))
    assert isinstance(back, np.ndarray) and back.dtype == a.dtype and back.shape == a.shape
    assert np.array_equal(back, a) and not np.shares_memory(back, a)
    assert rpc.rpc_sync(nxt, array_facts, args=(a,)) == (True, 1000, float(a.sum() + 1000))
    assert np.array_equal(a, np.arange(1000).reshape(10, 100))  # the caller's array is untouched
    mixed = {"s": "x", "t": (1, 2.5, None), "arrays": [np.ones(3, np.int8), np.zeros((0, 2))], "b": b"\x00\x01"}
    got = rpc.rpc_sync(nxt, echo, kwargs={"x": mixed})
    assert got["s"] == "x" and got["t"] == (1, 2.5, None) and got["b"] == b"\x00\x01"
    assert got["arrays"][0].dtype == np.int8 and got["arrays"][1].shape == (0, 2)
    big = np.random.default_rng(rank).standard_normal(3 << 20 // 8)
    assert np.array_equal(rpc.rpc_sync(nxt, echo, args=(big,)), big)

    # remote exceptions: their own type, naming the worker, with the remote traceback
    with pytest.raises(Boom) as info:
        rpc.rpc_sync(nxt, raise_boom, args=(7,))
    text = str(info.value)
    assert text.startswith(f"On WorkerInfo(id={(rank + 1) % world}, name={nxt}):"), text
    assert "boom 7" in text and "Traceback" in text and "raise_boom" in text
    fut = rpc.rpc_async(nxt, raise_boom, args=(8,))
    with pytest.raises(Boom, match="boom 8"):
        fut.wait()
    assert fut.done()

    # torch's messages: a remote message's escapes undone, bad async results, unpicklable futures
    with pytest.raises(ValueError) as info:
        rpc.rpc_sync(nxt, raise_lines)
    assert "\nfirst line\nsecond line" in str(info.value)
    with pytest.raises(RuntimeError, match="Functions decorated with @rpc.async_function must return a "
                                           r"gpucoll\.futures\.Future object, but got <class 'int'>"):
        rpc.rpc_sync(nxt, not_a_future)
    with pytest.raises(RuntimeError, match=r"Can not pickle gpucoll\.futures\.Future"):
        rpc.rpc_sync(nxt, make_future)
    with pytest.raises(RuntimeError, match="could not find destination"):
        rpc.get_worker_info("WorkerUnknown")
    for bad, why in (("", "must be non-empty"), ("abc*", "must match"), ("a" * 200, "shorter than 128")):
        with pytest.raises(RuntimeError, match=why):
            rpc.WorkerInfo(bad, 0)

    # async calls, futures
    futs = [rpc.rpc_async(names[i % world], operator.mul, args=(i, 3)) for i in range(30)]
    assert wait_all(futs) == [i * 3 for i in range(30)]
    assert [f.value() for f in collect_all(futs).wait()] == [i * 3 for i in range(30)]
    chained = rpc.rpc_async(nxt, operator.add, args=(1, 2)).then(lambda f: f.value() * 10)
    assert chained.wait() == 30
    seen: list[Any] = []
    f = rpc.rpc_async(nxt, operator.add, args=(2, 2))
    f.add_done_callback(lambda x: seen.append(x.value()))
    f.wait()
    deadline = time.monotonic() + 5
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen == [4]
    assert isinstance(f, Future)

    # timeouts: -1 the default, 0 none, else seconds; the error says which call and how long
    assert rpc.get_rpc_timeout() == 60
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"RPC ran for more than set timeout \(300 ms\).*nap"):
        rpc.rpc_sync(nxt, nap, args=(1.5,), timeout=0.3)
    assert time.monotonic() - t0 < 1.3
    assert rpc.rpc_sync(nxt, nap, args=(0.2,), timeout=0) == "rested"
    rpc._set_rpc_timeout(0.25)
    assert rpc.get_rpc_timeout() == 0.25
    with pytest.raises(TimeoutError, match="RPC ran for more than"):
        rpc.rpc_async(nxt, nap, args=(1.0,)).wait()
    assert rpc.rpc_sync(nxt, nap, args=(0.5,), timeout=2) == "rested"  # an explicit timeout wins
    rpc._set_rpc_timeout(60)

    # nested calls, and async_execution chaining without holding a callee thread
    assert rpc.rpc_sync(nxt, nested_sum, args=(prev, 5)) == 16
    assert rpc.rpc_sync(nxt, async_double, args=(prev, 4)) == 10

    # a callback runs on the completing thread, not on the waiter's
    threads: list[str] = []
    g = rpc.rpc_async(nxt, nap, args=(0.2,))
    g.then(lambda _: threads.append(threading.current_thread().name)).wait()
    assert threads and threads[0] != threading.current_thread().name

    # torch's api helpers: _all_gather (leader = smallest name), _barrier, _wait_all
    assert rpc.api._all_gather(rank * 10) == {n: i * 10 for i, n in enumerate(names)}
    rpc.api._barrier(names)
    with rpc.api._wait_all():
        w = rpc.rpc_async(nxt, operator.add, args=(1, 1))
        assert rpc.api._thread_local_var.future_list == [w]
    assert w.done() and w.value() == 2 and not hasattr(rpc.api._thread_local_var, "future_list")
    with pytest.raises(Boom), rpc.api._wait_all():
        rpc.rpc_async(nxt, raise_boom, args=(1,))

    out["debug"] = rpc._get_debug_info()
    rpc.shutdown()
    with pytest.raises(RuntimeError, match="not been initialized"):
        rpc.rpc_sync(nxt, echo, args=(1,))
    return out


def test_core_in_a_world_of_three() -> None:
    for r, out in enumerate(run_spmd(core_checks, 3, init=False, timeout=120)):
        debug = out["debug"]
        assert {"num_owner_rrefs", "num_pending_futures", "num_pending_users", "num_forks",
                "agent.thread_pool_size"} <= set(debug), (r, debug)
        assert all(isinstance(v, str) for v in debug.values())
        assert debug["agent.thread_pool_size"] == "16"
