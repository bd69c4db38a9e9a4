"""The world API: init methods, queries, groups and subgroups, teardown."""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

import numpy as np
import pytest

import gpucoll
from gpucoll.store import HashStore
from gpucoll.testing import run_spmd

from _fake_arrays import FakeCudaArray


@pytest.fixture
def world_of_one() -> Any:
    gpucoll.init_process_group("cpu", store=HashStore(), rank=0, world_size=1, timeout=20)
    try:
        yield gpucoll
    finally:
        if gpucoll.is_initialized():
            gpucoll.destroy_process_group()


# ----- single process -----

def test_world_of_one_with_a_store(world_of_one: Any) -> None:
    assert gpucoll.is_initialized() and gpucoll.is_available()
    assert (gpucoll.get_rank(), gpucoll.get_world_size(), gpucoll.get_backend()) == (0, 1, "cpu")
    assert gpucoll.get_process_group_ranks(None) == [0]
    assert gpucoll.GroupMember.WORLD is gpucoll._world.default_group()
    assert gpucoll.group.WORLD is gpucoll._world.default_group()  # torch's dist.group.WORLD
    x = np.arange(3.0)
    gpucoll.all_reduce(x, group=gpucoll.group.WORLD)
    assert x.tolist() == [0.0, 1.0, 2.0]
    gpucoll.all_reduce(x)
    assert x.tolist() == [0.0, 1.0, 2.0]
    with pytest.raises(RuntimeError, match="already initialized"):
        gpucoll.init_process_group("cpu", store=HashStore(), rank=0, world_size=1)


def test_calls_after_destroy_raise() -> None:
    gpucoll.init_process_group("cpu", store=HashStore(), rank=0, world_size=1, timeout=20)
    group = gpucoll._world.default_group()
    gpucoll.destroy_process_group()
    assert not gpucoll.is_initialized() and gpucoll.GroupMember.WORLD is None and gpucoll.group.WORLD is None
    with pytest.raises(RuntimeError, match="not initialized.*init_process_group"):
        gpucoll.all_reduce(np.zeros(1))
    with pytest.raises(RuntimeError, match="not initialized"):
        gpucoll.get_rank()
    with pytest.raises(RuntimeError, match="has been destroyed"):
        gpucoll.all_reduce(np.zeros(1), group=group)
    with pytest.raises(RuntimeError, match="not initialized"):
        gpucoll.destroy_process_group()


def test_tcp_init_method_port_zero_single_rank() -> None:
    gpucoll.init_process_group("cpu", init_method="tcp://127.0.0.1:0", rank=0, world_size=1, timeout=20)
    try:
        x = np.ones(2)
        gpucoll.all_reduce(x)
        assert x.tolist() == [1.0, 1.0]
    finally:
        gpucoll.destroy_process_group()


def test_file_init_method_single_rank(tmp_path: Any) -> None:
    gpucoll.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1, timeout=20)
    try:
        assert gpucoll.get_backend() == "gloo"  # the spelling asked for, as torch (the CPU backend runs)
        assert gpucoll.GroupMember.WORLD.backend_name == "cpu"  # type: ignore[union-attr]
    finally:
        gpucoll.destroy_process_group()


@pytest.mark.parametrize("kwargs, match", [
    ({"backend": "mpi"}, "backend must be one of"),
    ({"init_method": "udp://x:1", "rank": 0, "world_size": 1}, "init_method must start with"),
    ({"init_method": "tcp://127.0.0.1:0"}, "needs rank and world_size"),
    ({"init_method": "tcp://127.0.0.1", "rank": 0, "world_size": 1}, "tcp://host:port"),
    ({"store": HashStore(), "rank": 0}, "world_size and rank are required"),
    ({"store": HashStore(), "rank": 2, "world_size": 2}, r"rank must be in \[0, world_size=2\)"),
    ({"store": HashStore(), "rank": 0, "world_size": 1, "init_method": "env://"}, "not both"),
    ({"store": HashStore(), "rank": 0, "world_size": 1, "device_id": "gpu7"}, "device_id"),
    ({"store": HashStore(), "rank": 0, "world_size": 1, "timeout": -1}, "timeout must be a positive"),
])
def test_init_rejects_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    args = {"backend": "cpu", **kwargs}
    with pytest.raises(ValueError, match=match):
        gpucoll.init_process_group(**args)
    assert not gpucoll.is_initialized()


def test_env_init_names_missing_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "GPUCOLL_STORE_HOSTED",
                "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        gpucoll.init_process_group("cpu")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "0")
    with pytest.raises(ValueError, match="MASTER_PORT"):
        gpucoll.init_process_group("cpu", timeout=5)


def test_nccl_availability_follows_the_backend_probe() -> None:
    from gpucoll._backends.nccl.backend import nccl_unavailable_reason
    from gpucoll._group.registry import default_backend

    usable = nccl_unavailable_reason() is None
    assert gpucoll.is_nccl_available() is usable
    assert default_backend() == ("nccl" if usable else "cpu")


def test_device_arrays_on_a_cpu_group_are_refused(world_of_one: Any) -> None:
    with pytest.raises(TypeError, match="device array.*cpu backend.*nccl"):
        gpucoll.all_reduce(FakeCudaArray(np.zeros(2)))
    out = np.zeros(2)
    with pytest.raises(TypeError, match="cannot mix memory kinds"):
        gpucoll.all_gather_single(out, FakeCudaArray(np.zeros(2)))


# ----- several ranks -----

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_methods_body(method: str, shared: str) -> list[int]:
    """Rank 0 binds a port, publishes it through the harness's store, then everyone inits."""
    import gpucoll
    from gpucoll.store import TCPStore

    r, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    harness = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout=30)
    if method == "file":
        gpucoll.init_process_group("cpu", init_method=f"file://{shared}", rank=r, world_size=n, timeout=30)
    else:
        if r == 0:
            harness.set("port", str(_free_port()))
        port = int(harness.get("port"))
        if method == "tcp":
            gpucoll.init_process_group("cpu", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=n,
                                       timeout=30)
        else:  # env:// with rank 0 serving the store itself
            os.environ.update({"GPUCOLL_STORE_HOSTED": "0", "MASTER_PORT": str(port)})
            gpucoll.init_process_group("cpu", timeout=30)
    x = np.array([r + 1], np.int64)
    gpucoll.all_reduce(x)
    gpucoll.destroy_process_group()
    harness.close()
    return [int(x[0]), gpucoll.is_initialized()]


@pytest.mark.parametrize("method", ["tcp", "file", "env"])
def test_init_methods_three_ranks(method: str, tmp_path: Any) -> None:
    out = run_spmd(init_methods_body, 3, args=(method, str(tmp_path / "fs")), init=False, timeout=90)
    assert out == [[6, False]] * 3


def groups_body() -> dict[str, Any]:
    import gpucoll

    r, n = gpucoll.get_rank(), gpucoll.get_world_size()  # n == 4
    out: dict[str, Any] = {}
    odd = gpucoll.new_group([3, 1])
    if r % 2:
        assert isinstance(odd, gpucoll.ProcessGroup)
        assert gpucoll.get_process_group_ranks(odd) == [1, 3]
        assert gpucoll.get_rank(odd) == r // 2 and gpucoll.get_world_size(odd) == 2
        assert gpucoll.get_group_rank(odd, 3) == 1 and gpucoll.get_global_rank(odd, 0) == 1
        with pytest.raises(ValueError, match="global_rank=0 is not a member"):
            gpucoll.get_group_rank(odd, 0)
        with pytest.raises(ValueError, match="group_rank=2 is out of range"):
            gpucoll.get_global_rank(odd, 2)
        x = np.array([r], np.int64)
        gpucoll.all_reduce(x, group=odd)
        out["odd_sum"] = int(x[0])
        y = np.array([r], np.int64)
        gpucoll.broadcast(y, src=3, group=odd)  # src is a global rank, as in torch
        out["bcast"] = int(y[0])
        z = np.array([r], np.int64)
        gpucoll.broadcast(z, group=odd, group_src=0)
        out["bcast_group_src"] = int(z[0])
        with pytest.raises(ValueError, match="src=0 is not a member"):
            gpucoll.broadcast(z, src=0, group=odd)
        with pytest.raises(ValueError, match="not both"):
            gpucoll.broadcast(z, src=1, group=odd, group_src=0)
        peer = np.empty(1, np.int64)
        if r == 1:
            gpucoll.send(np.array([11], np.int64), dst=3, group=odd)
        else:
            out["sender"] = gpucoll.recv(peer, group=odd)
    else:
        assert odd is gpucoll.GroupMember.NON_GROUP_MEMBER
        assert gpucoll.get_rank(odd) == -1 and gpucoll.get_world_size(odd) == -1
        # torch's answers on a non-member: the members of the last group that left it out
        assert gpucoll.get_process_group_ranks(odd) == [1, 3]
        assert gpucoll.get_group_rank(odd, 3) == 1 and gpucoll.get_global_rank(odd, 0) == 1
        with pytest.raises(ValueError, match="Global rank 0 is not part of group"):
            gpucoll.get_group_rank(odd, 0)
        with pytest.raises(ValueError, match="Group rank 2 is not part of group"):
            gpucoll.get_global_rank(odd, 2)
        # torch's default: a warning naming the op, and the call does nothing
        z = np.zeros(1)
        with pytest.warns(UserWarning, match=r"Running all_reduce on global rank \d which does not belong") as rec:
            assert gpucoll.all_reduce(z, group=odd) is None
        assert rec[0].filename == __file__  # points at the caller's line, as torch's
        assert z[0] == 0.0
        with pytest.warns(UserWarning, match="recv"):
            assert gpucoll.recv(z, src=1, group=odd) == -1
        objs: list[Any] = [None, None]
        with pytest.warns(UserWarning, match="Running all_gather_object on global rank") as rec:
            assert gpucoll.all_gather_object(objs, r, group=odd) is None
        assert rec[0].filename == __file__
        with pytest.warns(UserWarning, match="recv_object_list"):
            assert gpucoll.recv_object_list(objs, src=1, group=odd) == -1
        assert objs == [None, None]
        for name in ("barrier", "monitored_barrier"):
            with pytest.warns(UserWarning, match=f"Running {name} on"):
                assert getattr(gpucoll, name)(group=odd) is None
        # the error, where asked for
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("GPUCOLL_NON_MEMBER", "error")
            with pytest.raises(RuntimeError, match="all_reduce on global rank .* not a member"):
                gpucoll.all_reduce(z, group=odd)
            with pytest.raises(RuntimeError, match="barrier .* not a member"):
                gpucoll.barrier(group=odd)
            with pytest.raises(RuntimeError, match="broadcast_object_list .* not a member"):
                gpucoll.broadcast_object_list([None], group=odd)
            mp.setenv("GPUCOLL_NON_MEMBER", "loud")
            with pytest.raises(ValueError, match="GPUCOLL_NON_MEMBER must be 'warn' or 'error'; got 'loud'"):
                gpucoll.barrier(group=odd)
            mp.delenv("GPUCOLL_NON_MEMBER")
            mp.setenv("GPUCOLL_DEBUG", "DETAIL")
            with pytest.raises(RuntimeError, match="monitored_barrier .* not a member"):
                gpucoll.monitored_barrier(group=odd)
    # default group still works between the subgroup's ops
    w = np.ones(1)
    gpucoll.all_reduce(w)
    out["world"] = float(w[0])
    # split_group: group ranks of the parent
    mine = gpucoll.split_group(split_ranks=[[0, 2], [1]])
    if r == 3:
        assert mine is None
    else:
        assert mine is not None
        v = np.array([r], np.int64)
        gpucoll.all_reduce(v, group=mine)
        out["split"] = int(v[0])
        out["split_name"] = mine.group_name
    # new_subgroups: pairs
    cur, subs = gpucoll.new_subgroups(group_size=2)
    assert len(subs) == 2 and gpucoll.get_process_group_ranks(cur) == [r - r % 2, r - r % 2 + 1]
    v = np.array([r], np.int64)
    gpucoll.all_reduce(v, group=cur)
    out["pairs"] = int(v[0])
    cur2, subs2 = gpucoll.new_subgroups_by_enumeration([[0, 3], [2]])
    if r == 1:
        assert cur2 is None
    else:
        out["enum"] = gpucoll.get_process_group_ranks(cur2)
        gpucoll.barrier(group=cur2)
    with pytest.raises(ValueError, match="more than one subgroup"):
        gpucoll.new_subgroups_by_enumeration([[0, 1], [1, 2]])
    with pytest.raises(ValueError, match="must divide"):
        gpucoll.new_subgroups(group_size=3)
    with pytest.raises(ValueError, match="duplicate"):
        gpucoll.new_group([0, 0])
    with pytest.raises(ValueError, match="not a rank in"):
        gpucoll.new_group([0, 9])
    with pytest.raises(ValueError, match="overlap"):
        gpucoll.split_group(split_ranks=[[0, 1], [1]])
    # destroying one subgroup leaves the others usable
    gpucoll.destroy_process_group(cur)
    with pytest.raises(RuntimeError, match="destroyed"):
        gpucoll.all_reduce(np.zeros(1), group=cur)
    gpucoll.all_reduce(w)
    return out


def test_groups_and_subgroups_four_ranks() -> None:
    out = run_spmd(groups_body, 4, timeout=120)
    for r, o in enumerate(out):
        assert o["world"] == 4.0
        assert o["pairs"] == 2 * (r - r % 2) + 1
        if r % 2:
            assert (o["odd_sum"], o["bcast"], o["bcast_group_src"]) == (4, 3, 1)
        if r != 3:
            assert o["split"] == (2 if r in (0, 2) else 1)
        if r != 1:
            assert o["enum"] == ([0, 3] if r in (0, 3) else [2])
    assert out[3]["sender"] == 1
    assert out[0]["split_name"] == out[2]["split_name"] != out[1]["split_name"]


def test_harness_default_init_sizes_one_and_three() -> None:
    def_body = rank_and_size
    assert run_spmd(def_body, 1) == [(0, 1, "cpu")]
    assert run_spmd(def_body, 3) == [(r, 3, "cpu") for r in range(3)]


def rank_and_size() -> tuple[int, int, str]:
    import gpucoll

    return gpucoll.get_rank(), gpucoll.get_world_size(), gpucoll.get_backend()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__]))
