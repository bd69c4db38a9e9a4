"""Groups and options, two worlds of three: a dynamic group (world_size=None) that workers
join and leave, duplicate names refused (file:// rendezvous); the faulty backend (torch's
FAULTY_TENSORPIPE: failed control messages are retried, delayed calls time out), the
thread-pool option, and device arrays refused without a device map."""

from __future__ import annotations

import gc
import operator
import os
import time
from typing import Any

import numpy as np
import pytest

import gpucoll.rpc as rpc
from gpucoll.testing import run_spmd


def names_known() -> list[str]:
    return sorted(w.name for w in rpc._get_current_rpc_agent().get_worker_infos())


def wait_names(want: list[str], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while names_known() != want:
        if time.monotonic() > deadline:
            raise AssertionError(f"members {names_known()}, expected {want}")
        time.sleep(0.02)


def dynamic_checks(tmp: str) -> dict[str, Any]:
    import gpucoll

    rank = int(os.environ["RANK"])
    gpucoll.init_process_group("cpu")
    time.sleep(0.1 * rank)  # joins in a mixed order are fine too; this one is rank order
    rpc.init_rpc(f"dyn{rank}", rank=rank)  # world_size=None: a dynamic group
    agent = rpc._get_current_rpc_agent()
    assert agent.is_static_group is False
    wait_names(["dyn0", "dyn1", "dyn2"])
    assert rpc.rpc_sync(f"dyn{(rank + 1) % 3}", operator.add, args=(rank, 100)) == rank + 100
    gpucoll.barrier()
    if rank == 2:
        rpc.shutdown()
    else:
        wait_names(["dyn0", "dyn1"])
        with pytest.raises(ValueError, match="Unknown destination worker"):
            rpc.rpc_sync("dyn2", operator.add, args=(1, 1))
        assert rpc.rpc_sync(f"dyn{1 - rank}", operator.mul, args=(3, 3)) == 9
    gpucoll.barrier()
    if rank != 2:
        rpc.shutdown()
    gpucoll.barrier()

    # duplicate names are refused on every worker, naming the name (file:// rendezvous)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{tmp}/store")
    with pytest.raises(ValueError, match="'dup' is not unique"):
        rpc.init_rpc("x" if rank == 2 else "dup", rank=rank, world_size=3, rpc_backend_options=opts)
    gpucoll.barrier()

    # a rank that ran a group of its own (world_size=1, another store) joins the next group of
    # all ranks: each init's keys are counted per rank in the store, not per process
    if rank == 0:
        rpc.init_rpc("solo", rank=0, world_size=1,
                     rpc_backend_options=rpc.TensorPipeRpcBackendOptions(init_method=f"file://{tmp}/solo"))
        assert rpc.rpc_sync("solo", operator.add, args=(2, 3)) == 5
        rpc.shutdown()
    gpucoll.barrier()
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{tmp}/after", rpc_timeout=20)
    t0 = time.monotonic()
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=3, rpc_backend_options=opts)
    assert time.monotonic() - t0 < 15
    assert rpc.rpc_sync(f"w{(rank + 1) % 3}", echo, args=(rpc.get_worker_info(),)) == rpc.get_worker_info()
    rpc.shutdown()
    gpucoll.barrier()
    for bad in ("has space", "a" * 128):
        with pytest.raises(ValueError):
            rpc.init_rpc(bad, rank=rank, world_size=3)
    gpucoll.destroy_process_group()
    return {"ok": True}


def echo(x: Any) -> Any:
    return x


def nap(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def fetch(rref: Any) -> Any:
    return rref.to_here()


def faulty_checks() -> dict[str, Any]:
    import gpucoll
    import gpucoll.rpc._testing as rpc_testing
    from _fake_arrays import FakeCudaArray

    rank = int(os.environ["RANK"])
    gpucoll.init_process_group("cpu")
    nxt, third = f"worker{(rank + 1) % 3}", f"worker{(rank + 2) % 3}"
    opts = rpc_testing.FaultyTensorPipeRpcBackendOptions(
        num_worker_threads=4, rpc_timeout=20,
        messages_to_fail=["RREF_FORK_REQUEST", "RREF_CHILD_ACCEPT", "RREF_USER_DELETE"],
        messages_to_delay={"SCRIPT_CALL": 1.0, "PYTHON_REMOTE_CALL": 0.6}, num_fail_sends=2)
    with pytest.raises(ValueError, match="unknown message types"):
        rpc_testing.FaultyTensorPipeRpcBackendOptions(messages_to_fail=["NOT_A_TYPE"])
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3, rpc_backend_options=opts)  # backend inferred
    assert rpc._get_debug_info()["agent.thread_pool_size"] == "4"
    assert rpc.backend_registry.backend_registered("FAULTY_TENSORPIPE")

    # control messages that fail twice are retried: the forks complete and are deleted
    r = rpc.remote(nxt, np.arange, args=(4,))
    assert np.array_equal(rpc.rpc_sync(third, fetch, args=(r,)), np.arange(4))
    del r
    gc.collect()
    deadline = time.monotonic() + 15
    while rpc._rref_context_get_debug_info()["num_forks"] != "0" or \
            rpc._rref_context_get_debug_info()["num_owner_rrefs"] != "0":
        assert time.monotonic() < deadline, rpc._rref_context_get_debug_info()
        time.sleep(0.02)
    gpucoll.barrier()
    # a delayed remote call times out at its timeout, not after the delay
    t0 = time.monotonic()
    slow = rpc.remote(nxt, operator.add, args=(1, 1), timeout=0.2)
    with pytest.raises(TimeoutError, match="RPC ran for more than set timeout"):
        slow._get_future().wait()
    assert time.monotonic() - t0 < 0.55
    assert rpc.remote(nxt, operator.add, args=(1, 1)).to_here() == 2  # ... and arrives with time
    # device arrays need a device map, and the error says how to add one
    with pytest.raises(ValueError, match="set_device_map"):
        rpc.rpc_sync(nxt, echo, args=(FakeCudaArray(np.ones(3)),))
    assert np.array_equal(rpc.rpc_sync(nxt, echo, args=(np.ones(3),)), np.ones(3))
    gpucoll.barrier()
    rpc.shutdown()
    gpucoll.destroy_process_group()
    return {"ok": True}


def test_dynamic_group_and_duplicate_names(tmp_path: Any) -> None:
    assert all(r["ok"] for r in run_spmd(dynamic_checks, 3, init=False, timeout=120, args=(str(tmp_path),)))


def test_faulty_backend_and_device_arrays() -> None:
    assert all(r["ok"] for r in run_spmd(faulty_checks, 3, init=False, timeout=120))


def test_joining_waits_name_the_missing_ranks(tmp_path: Any) -> None:
    from gpucoll.errors import DistStoreTimeoutError
    from gpucoll.rpc import _init
    from gpucoll.store import FileStore, PrefixStore

    files = FileStore(str(tmp_path / "store"), None, timeout=5)
    # each rank counts its own inits on a store: the n-th group of one rank is the n-th of all
    assert [_init._generation(files, 0), _init._generation(files, 0), _init._generation(files, 1)] == \
        ["rpc/1", "rpc/2", "rpc/1"]
    store = PrefixStore("rpc/1", files)
    store.set("worker/0", "{}")
    t0 = time.monotonic()
    with pytest.raises(DistStoreTimeoutError, match=r"waited 0.3 s for the workers of ranks \[1, 2\].*rpc/1/worker"):
        _init._published(store, "me", 0, 3, 0.3)
    assert time.monotonic() - t0 < 5
