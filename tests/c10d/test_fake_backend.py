"""The fake backend, side by side with torch's FakeProcessGroup: one process plays one
rank of a 1,024-rank job; every op completes at once, arguments are checked, and data
changes exactly where torch's fake group changes it (all-gathers replicate the input)."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest

import gpucoll

N, RANK = 1024, 37


def script(dist: Any, arr: Callable[[Any], Any], to_list: Callable[[Any], list[Any]]) -> dict[str, Any]:
    """The same calls through torch.distributed (torch tensors) or gpucoll (NumPy arrays)."""
    out: dict[str, Any] = {}
    x = arr(np.arange(4.0))
    dist.all_reduce(x)
    out["all_reduce"] = to_list(x)
    work = dist.all_reduce(x, async_op=True)
    out["wait"] = work.wait()
    gl = [arr(np.full(2, 7.0)) for _ in range(N)]
    dist.all_gather(gl, arr(np.array([1.0, 2.0])))
    out["all_gather"] = [to_list(gl[0]), to_list(gl[N - 1])]
    big = arr(np.full(2 * N, 9.0))
    dist.all_gather_into_tensor(big, arr(np.array([3.0, 4.0])))
    out["all_gather_into_tensor"] = to_list(big)[:6]
    y = arr(np.array([5.0, 6.0]))
    dist.broadcast(y, src=0)
    dist.reduce(y, dst=1)
    out["broadcast_reduce"] = to_list(y)
    rs = arr(np.full(2, -1.0))
    dist.reduce_scatter_tensor(rs, arr(np.ones(2 * N)))
    out["reduce_scatter_tensor"] = to_list(rs)
    a2a = arr(np.full(N, -2.0))
    dist.all_to_all_single(a2a, arr(np.arange(float(N))))
    out["all_to_all_single"] = to_list(a2a)[:3]
    a2u = arr(np.full(N + 5, -3.0))  # uneven splits: 6 rows from rank 0, 1 from every other
    dist.all_to_all_single(a2u, arr(np.arange(float(N + 1))), output_split_sizes=[6] + [1] * (N - 1),
                           input_split_sizes=[2] + [1] * (N - 1))
    out["all_to_all_uneven"] = to_list(a2u)[:8]
    outs = [arr(np.full(1, -4.0)) for _ in range(N)]
    dist.all_to_all(outs, [arr(np.array([float(i)])) for i in range(N)])
    out["all_to_all"] = [to_list(outs[i]) for i in (0, 5, N - 1)]
    rsl = arr(np.full(1, -5.0))
    dist.reduce_scatter(rsl, [arr(np.array([float(i)])) for i in range(N)])
    out["reduce_scatter"] = to_list(rsl)
    gl2 = [arr(np.full(1, -6.0)) for _ in range(N)]
    dist.gather(arr(np.array([11.0])), gl2, dst=RANK)
    out["gather"] = [to_list(gl2[0]), to_list(gl2[N - 1])]
    sc = arr(np.full(1, -7.0))
    dist.scatter(sc, [arr(np.array([float(i)])) for i in range(N)], src=RANK)
    out["scatter"] = to_list(sc)
    sc2 = arr(np.full(1, -8.0))
    dist.scatter(sc2, None, src=0)
    out["scatter_elsewhere"] = to_list(sc2)
    dist.barrier()
    z = arr(np.array([8.0]))
    dist.send(z, dst=RANK + 1)
    dist.recv(z, src=RANK - 1)
    out["p2p"] = to_list(z)
    objs: list[Any] = [None] * N
    dist.all_gather_object(objs, {"rank": dist.get_rank()})
    out["all_gather_object"] = [objs[0], objs[N - 1]]
    out["rank_size"] = (dist.get_rank(), dist.get_world_size())
    sub = dist.new_group([0, RANK, 100])
    out["new_group"] = (dist.get_rank(sub), dist.get_world_size(sub))
    return out


def test_the_same_script_gives_what_torchs_fake_group_gives() -> None:
    torch = pytest.importorskip("torch", reason="torch's FakeProcessGroup is the reference")
    tdist = torch.distributed
    from torch.testing._internal.distributed.fake_pg import FakeStore

    tdist.init_process_group("fake", rank=RANK, world_size=N, store=FakeStore())
    try:
        want = script(tdist, lambda a: torch.from_numpy(np.array(a)), lambda t: t.tolist())
    finally:
        tdist.destroy_process_group()
    gpucoll.init_process_group("fake", rank=RANK, world_size=N)
    try:
        assert gpucoll.get_backend() == "fake"
        got = script(gpucoll, lambda a: np.array(a), lambda a: a.tolist())
    finally:
        gpucoll.destroy_process_group()
    assert got == want
    assert got["all_gather"] == [[1.0, 2.0], [1.0, 2.0]] and got["all_reduce"] == [0.0, 1.0, 2.0, 3.0]


def test_arguments_are_checked_as_a_real_group_checks_them() -> None:
    gpucoll.init_process_group("fake", rank=0, world_size=N, store=gpucoll.HashStore())
    try:
        with pytest.raises(ValueError, match="group size x input_tensor"):
            gpucoll.all_gather_into_tensor(np.zeros(3), np.zeros(2))
        with pytest.raises(ValueError, match=f"must have {N} arrays"):
            gpucoll.all_gather([np.zeros(2)] * 3, np.zeros(2))
        with pytest.raises(TypeError, match="op=BAND needs integer"):
            gpucoll.all_reduce(np.zeros(2), op=gpucoll.ReduceOp.BAND)
        with pytest.raises(ValueError, match="src=1024 is not a member"):
            gpucoll.broadcast(np.zeros(2), src=N)
        with pytest.raises(ValueError, match="not divisible by the group size"):
            gpucoll.all_to_all_single(np.zeros(N + 1), np.zeros(N + 1))
        # a large mesh on one process: the layout and groups torch's DeviceMesh gives
        mesh = gpucoll.init_device_mesh("cpu", (32, 32), mesh_dim_names=("dp", "tp"))
        assert mesh.get_coordinate() == (0, 0)
        assert gpucoll.get_process_group_ranks(mesh.get_group("dp")) == list(range(0, N, 32))
    finally:
        gpucoll.destroy_process_group()


def test_a_fake_group_takes_device_arrays_without_a_gpu() -> None:
    from _fake_arrays import FakeCudaArray

    gpucoll.init_process_group("fake", rank=2, world_size=8)
    try:
        x = FakeCudaArray(np.ones(4, np.float32))
        gpucoll.all_reduce(x)
        gpucoll.broadcast(x, src=5)
        # ops that fill outputs copy on the device (through CuPy): only those that do not, here
        work = gpucoll.reduce(x, dst=0, async_op=True)
        assert work.is_completed() and work.wait()
        assert gpucoll.get_world_size() == 8
    finally:
        gpucoll.destroy_process_group()


def test_fake_process_group_options_is_fake_options_and_makes_no_group() -> None:
    opts = gpucoll.FakeProcessGroup.Options()
    assert isinstance(opts, gpucoll.FakeOptions) and opts.error_on_collective is False
    with pytest.raises(TypeError, match=r"init_process_group\('fake'"):
        gpucoll.FakeProcessGroup(0, 2)


def test_premul_sum_is_callable_with_its_factor_and_no_other_op_is() -> None:
    op = gpucoll.ReduceOp.PREMUL_SUM(np.float64(0.5))
    assert isinstance(op, gpucoll.ReduceOp) and op.factor == 0.5 and op == gpucoll.make_premul_sum(0.5)
    gpucoll.init_process_group("fake", rank=0, world_size=4)
    try:
        x = np.ones(3, np.float32)
        gpucoll.all_reduce(x, op=gpucoll.ReduceOp.PREMUL_SUM(2.0))  # accepted as an op (the fake moves nothing)
    finally:
        gpucoll.destroy_process_group()
    with pytest.raises(TypeError, match=r"only ReduceOp.PREMUL_SUM takes a factor; ReduceOp.SUM is not callable"):
        gpucoll.ReduceOp.SUM(2.0)
    with pytest.raises(TypeError, match="factor must be a real number"):
        gpucoll.ReduceOp.PREMUL_SUM("2")
