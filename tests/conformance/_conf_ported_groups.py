"""torch's own group, mesh, fake-backend and object-collective tests, check for check.

Unlike the intent-level checks of _conf_checks_groups.py, each check here keeps every
assertion of the torch test it names: the exception type, the message pattern the
test matches (``torch_raises``: a regular expression, searched as unittest's
``assertRaisesRegex`` does), the defaults the test relies on and the names it calls.
Only what NumPy forces is adapted (tensors become arrays; ``torch.arange(n)`` meshes
become lists). The same body runs on torch 2.13 (gloo, torch's fake backend) and on
gpucoll through the adapter of _conf_core. Sources:

- test/distributed/test_fake_pg.py (TestFakePG)
- test/distributed/test_c10d_object_collectives.py (TestObjectCollectives)
- test/distributed/test_device_mesh.py (DeviceMeshTest*, InitDeviceMeshTest,
  TestDeviceMeshGetItem)
- test/distributed/test_c10d_common.py (group tests, sequence numbers), as
  test/distributed/test_c10d_gloo.py's CommTest runs them; and that file's
  ProcessGroupGlooTest.test_allreduce_coalesced_async
- torch/testing/_internal/distributed/distributed_test.py, gloo half
  (test_monitored_barrier_*, test_new_subgroups_*, complex ops, non-contiguous inputs)

A check whose torch test needs more ranks than the suite starts (8) runs the same
assertions on a mesh of 4; world sizes are 1 to 4 as everywhere in the suite.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from datetime import timedelta
from typing import Any, Callable, Iterator

import numpy as np

from _conf_core import Impl, eq, section

FAKE = "test/distributed/test_fake_pg.py::TestFakePG"
OBJ = "test/distributed/test_c10d_object_collectives.py::TestObjectCollectives"
MESH = "test/distributed/test_device_mesh.py"
COMMON = "test/distributed/test_c10d_common.py"
DT = "torch/testing/_internal/distributed/distributed_test.py::DistributedTest"
C10D = "torch/distributed/distributed_c10d.py"
DMESH = "torch/distributed/device_mesh.py"

warnings.filterwarnings("ignore")


def torch_raises(exc: type[BaseException] | tuple[type[BaseException], ...], regex: str,
                 fn: Callable[[], Any]) -> BaseException:
    """unittest's ``assertRaisesRegex``: ``fn`` raises ``exc`` (or a subclass) whose
    ``str()`` matches ``regex`` (``re.search``)."""
    try:
        fn()
    except exc as err:
        if not re.search(regex, str(err)):
            raise AssertionError(f"{type(err).__name__} message does not match {regex!r}: {err}") from err
        return err
    except Exception as err:
        raise AssertionError(f"expected {exc}, got {type(err).__name__}: {err}") from err
    raise AssertionError(f"expected {exc} matching {regex!r}; nothing was raised")


# ----------------------------------------------------------------------------- adapter helpers

def default_group(T: Impl) -> Any:
    if T.is_torch:
        return T.dist.distributed_c10d._get_default_group()
    return T.dist.GroupMember.WORLD


def fake_store(T: Impl) -> Any:
    if T.is_torch:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        return FakeStore()
    return T.dist.HashStore()


def fake_process_group(T: Impl) -> Any:
    """``FakeProcessGroup``: torch imports it from ``torch._C._distributed_c10d``."""
    if T.is_torch:
        from torch._C._distributed_c10d import FakeProcessGroup

        return FakeProcessGroup
    return T.dist.FakeProcessGroup


def mesh_api(T: Impl) -> tuple[Any, Any]:
    """(DeviceMesh, init_device_mesh)."""
    if T.is_torch:
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        return DeviceMesh, init_device_mesh
    return T.dist.DeviceMesh, T.dist.init_device_mesh


def ones(T: Impl, shape: Any, value: float = 1.0) -> Any:
    return T.full(shape, value)


def empty(T: Impl, shape: Any) -> Any:
    return T.zeros(shape)


def arange(T: Impl, n: int, shape: Any = None) -> Any:
    a = np.arange(n, dtype=np.float32)
    return T.arr(a.reshape(shape) if shape is not None else a)


@contextlib.contextmanager
def fake_world(T: Impl, rank: int, world_size: int = 2, store: bool = True, **kw: Any) -> Iterator[None]:
    """``init_process_group(backend="fake", ...)`` for one check; destroyed after it
    (TestFakePG.tearDown)."""
    if store:
        kw["store"] = fake_store(T)
    T.dist.init_process_group(backend="fake", rank=rank, world_size=world_size, **kw)
    try:
        yield
    finally:
        T.dist.destroy_process_group()


# ============================================================================= test_fake_pg.py
F = section("ported_fake", world_sizes=(1,), init=False, pg_timeout=10.0, timeout=120.0)


@F.check(f"{FAKE}::test_invalid_rank")
def check_fake_invalid_rank(T: Impl) -> None:
    torch_raises(RuntimeError, "Cannot init process group where rank .* >= world_size",
                 lambda: T.dist.init_process_group(backend="fake", rank=3, world_size=2))


@F.check(f"{FAKE}::test_all_reduce")
def check_fake_all_reduce(T: Impl) -> None:
    with fake_world(T, 1, store=False):
        output = ones(T, (3, 3), float(T.dist.get_rank()))
        T.dist.all_reduce(output)
        assert tuple(output.shape) == (3, 3)


@F.check(f"{FAKE}::test_allgather")
def check_fake_allgather(T: Impl) -> None:
    with fake_world(T, 1, store=False):
        inp = ones(T, (3, 3), float(T.dist.get_rank()))
        outs = [empty(T, (3, 3)) for _ in range(2)]
        T.dist.all_gather(outs, inp)
        for out in outs:
            assert tuple(out.shape) == (3, 3)


@F.check(f"{FAKE}::test_allgather_into_tensor_requires_grad (no autograd in NumPy: the shape check)")
def check_fake_allgather_into_tensor(T: Impl) -> None:
    with fake_world(T, 0, 4, store=False):
        ws = T.dist.get_world_size()
        out = empty(T, (4 * ws,))
        T.dist.all_gather_into_tensor(out, ones(T, (4,)))
        assert tuple(out.shape) == (4 * ws,)


@F.check(f"{FAKE}::test_reduce_scatter")
def check_fake_reduce_scatter(T: Impl) -> None:
    with fake_world(T, 1):
        inputs = [ones(T, (3, 3), r) for r in range(2)]
        out = empty(T, (3, 3))
        T.dist.reduce_scatter(out, inputs)
        assert tuple(out.shape) == (3, 3)


@F.check(f"{FAKE}::test_broadcast")
def check_fake_broadcast(T: Impl) -> None:
    with fake_world(T, 0, store=False):
        for src in (0, 1):
            out = ones(T, (3, 3))
            T.dist.broadcast(out, src=src)
            assert tuple(out.shape) == (3, 3)


@F.check(f"{FAKE}::test_scatter")
def check_fake_scatter(T: Impl) -> None:
    with fake_world(T, 0):
        out = ones(T, (3, 3))
        T.dist.scatter(out, [ones(T, (3, 3), r) for r in range(2)])  # src defaults to 0
        assert tuple(out.shape) == (3, 3)
        out = ones(T, (3, 3))
        T.dist.scatter(out, None, src=1)
        assert tuple(out.shape) == (3, 3)


@F.check(f"{FAKE}::test_alltoall")
def check_fake_alltoall(T: Impl) -> None:
    with fake_world(T, 0):
        outs = [ones(T, (3, 3)) for _ in range(2)]
        T.dist.all_to_all(outs, [ones(T, (3, 3)) for _ in range(2)])
        assert len(outs) == 2
        for out in outs:
            assert tuple(out.shape) == (3, 3)


@F.check(f"{FAKE}::test_alltoall_base")
def check_fake_alltoall_base(T: Impl) -> None:
    with fake_world(T, 0):
        out = ones(T, (4, 3))
        T.dist.all_to_all_single(out, ones(T, (4, 3)), [2, 2], [2, 2])
        assert tuple(out.shape) == (4, 3)


@F.check(f"{FAKE}::test_send / test_recv")
def check_fake_send_recv(T: Impl) -> None:
    with fake_world(T, 0):
        t = ones(T, (3, 3))
        T.dist.send(t, 1)
        assert tuple(t.shape) == (3, 3)
        out = ones(T, (3, 3))
        T.dist.recv(out, 1)
        assert tuple(out.shape) == (3, 3)


@F.check(f"{FAKE}::test_reduce_scatter_copy_semantics (rank 0, 1)")
def check_fake_reduce_scatter_copy_semantics(T: Impl) -> None:
    for rank in (0, 1):
        with fake_world(T, rank):
            inputs = [ones(T, (3, 3), r) for r in range(2)]
            out = empty(T, (3, 3))
            T.dist.reduce_scatter(out, inputs)
            eq(out, T.np(inputs[rank]), T, f"rank {rank}")


@F.check(f"{FAKE}::test_scatter_copy_semantics (rank 0, 1)")
def check_fake_scatter_copy_semantics(T: Impl) -> None:
    for rank in (0, 1):
        with fake_world(T, rank):
            if rank == 0:
                lst = [ones(T, (3, 3), r) for r in range(2)]
                out = empty(T, (3, 3))
                T.dist.scatter(out, lst)
                eq(out, T.np(lst[0]), T)
            else:
                out = ones(T, (3, 3), 5.0)
                T.dist.scatter(out, None, src=0)
                eq(out, np.full((3, 3), 5.0, np.float32), T)


@F.check(f"{FAKE}::test_reduce_scatter_tensor_copy_semantics / test_reduce_scatter_base_copy_semantics")
def check_fake_reduce_scatter_tensor_copy_semantics(T: Impl) -> None:
    for rank in (0, 1):
        with fake_world(T, rank):
            inp = arange(T, 8, (4, 2))
            out = empty(T, (2, 2))
            T.dist.reduce_scatter_tensor(out, inp)
            eq(out, np.arange(8, dtype=np.float32).reshape(4, 2)[2 * rank:2 * rank + 2], T)


@F.check(f"{FAKE}::test_allgather_copy_semantics / test_gather_copy_semantics")
def check_fake_allgather_gather_copy_semantics(T: Impl) -> None:
    for rank in (0, 1):
        with fake_world(T, rank):
            inp = ones(T, (3, 3), 42.0)
            outs = [empty(T, (3, 3)) for _ in range(2)]
            T.dist.all_gather(outs, inp)
            for out in outs:
                eq(out, T.np(inp), T)
            if rank == 0:
                lst = [empty(T, (3, 3)) for _ in range(2)]
                T.dist.gather(inp, lst)  # dst defaults to 0
                for out in lst:
                    eq(out, T.np(inp), T)
            else:
                T.dist.gather(inp, None, dst=0)


@F.check(f"{FAKE}::test_allgather_coalesced_copy_semantics")
def check_fake_allgather_coalesced_copy_semantics(T: Impl) -> None:
    for rank in (0, 1):
        with fake_world(T, rank):
            inputs = [ones(T, (3, 3), i) for i in range(3)]
            output_lists = [[empty(T, (3, 3)) for _ in inputs] for _ in range(2)]
            T.dist.all_gather_coalesced(output_lists, inputs)
            for output_list in output_lists:
                for i, out in enumerate(output_list):
                    eq(out, T.np(inputs[i]), T)


@F.check(f"{FAKE}::test_alltoall_copy_semantics / test_alltoall_base_copy_semantics")
def check_fake_alltoall_copy_semantics(T: Impl) -> None:
    for rank in (0, 1):
        with fake_world(T, rank):
            inputs = [ones(T, (3, 3), i) for i in range(2)]
            outs = [empty(T, (3, 3)) for _ in range(2)]
            T.dist.all_to_all(outs, inputs)
            for i in range(2):
                eq(outs[i], T.np(inputs[i]), T)
            inp = arange(T, 8, (4, 2))
            out = empty(T, (4, 2))
            T.dist.all_to_all_single(out, inp)
            eq(out, T.np(inp), T)


@F.check(f"{FAKE}::test_alltoall_base_split_sizes_repeat / _truncate")
def check_fake_alltoall_base_split_sizes(T: Impl) -> None:
    for rank in (0, 1):
        with fake_world(T, rank):
            out = empty(T, (8, 1))
            T.dist.all_to_all_single(out, arange(T, 4, (4, 1)), output_split_sizes=[2, 6],
                                     input_split_sizes=[1, 3])
            eq(out, np.array([[0.0], [1.0], [0.0], [1.0], [2.0], [3.0], [0.0], [1.0]], np.float32), T, "repeat")
            out = empty(T, (4, 1))
            T.dist.all_to_all_single(out, arange(T, 8, (8, 1)), output_split_sizes=[1, 3],
                                     input_split_sizes=[4, 4])
            eq(out, np.array([[0.0], [0.0], [1.0], [2.0]], np.float32), T, "truncate")


@F.check(f"{FAKE}::test_alltoall_base_split_size_validation")
def check_fake_alltoall_base_split_size_validation(T: Impl) -> None:
    with fake_world(T, 0):
        torch_raises(RuntimeError, "does not divide equally across group size",
                     lambda: T.dist.all_to_all_single(empty(T, (3, 2)), ones(T, (3, 2))))
        torch_raises(RuntimeError, "Number of tensor splits not equal to group size",
                     lambda: T.dist.all_to_all_single(empty(T, (4, 2)), ones(T, (4, 2)),
                                                      output_split_sizes=[4], input_split_sizes=[4]))
        torch_raises(RuntimeError, "Split sizes doesn't match total dim 0 size",
                     lambda: T.dist.all_to_all_single(empty(T, (4, 2)), ones(T, (4, 2)),
                                                      output_split_sizes=[1, 1], input_split_sizes=[2, 2]))


@F.check(f"{FAKE}::test_alltoall_base_empty_input_with_output")
def check_fake_alltoall_base_empty_input_with_output(T: Impl) -> None:
    with fake_world(T, 0):
        torch_raises(RuntimeError, "inputBuffer is empty",
                     lambda: T.dist.all_to_all_single(empty(T, (2, 1)), empty(T, (0, 1)),
                                                      output_split_sizes=[1, 1], input_split_sizes=[0, 0]))


@F.check(f"{FAKE}::test_alltoall_list_size_validation")
def check_fake_alltoall_list_size_validation(T: Impl) -> None:
    with fake_world(T, 0):
        torch_raises(RuntimeError, "does not match world size",
                     lambda: T.dist.all_to_all([empty(T, (3, 3))], [ones(T, (3, 3)), ones(T, (3, 3))]))


@F.check(f"{FAKE}::test_error_on_collective")
def check_fake_error_on_collective(T: Impl) -> None:
    with fake_world(T, 0):
        t = ones(T, (3, 3))
        T.dist.all_reduce(t)
        assert tuple(t.shape) == (3, 3)
    FakeProcessGroup = fake_process_group(T)  # noqa: N806  (torch's name)
    options = FakeProcessGroup.Options()
    options.error_on_collective = True
    with fake_world(T, 0, pg_options=options):
        t = ones(T, (3, 3))
        msg = "FakeProcessGroup collective operation error"
        torch_raises(RuntimeError, msg, lambda: T.dist.all_reduce(t))
        torch_raises(RuntimeError, msg, lambda: T.dist.all_gather([empty(T, (3, 3)) for _ in range(2)], t))
        torch_raises(RuntimeError, msg, lambda: T.dist.broadcast(t, src=0))
        torch_raises(RuntimeError, msg, lambda: T.dist.barrier())


@F.check(f"{FAKE}::test_reduce_scatter_wrong_input_list_size")
def check_fake_reduce_scatter_wrong_input_list_size(T: Impl) -> None:
    with fake_world(T, 1):
        torch_raises(RuntimeError, "invalid input tensor list size, must be world size",
                     lambda: T.dist.reduce_scatter(empty(T, (3, 3)), [ones(T, (3, 3))]))


@F.check(f"{FAKE}::test_scatter_wrong_input_list_size")
def check_fake_scatter_wrong_input_list_size(T: Impl) -> None:
    with fake_world(T, 0):
        torch_raises(RuntimeError, "Incorrect input list size",
                     lambda: T.dist.scatter(empty(T, (3, 3)), [ones(T, (3, 3))]))


@F.check(f"{FAKE}::test_reduce_scatter_base_wrong_input_size")
def check_fake_reduce_scatter_base_wrong_input_size(T: Impl) -> None:
    with fake_world(T, 0):
        torch_raises(RuntimeError, "input tensor must be the same size as output size times world size",
                     lambda: T.dist.reduce_scatter_tensor(empty(T, (3, 2)), ones(T, (3, 2))))


@F.check(f"{FAKE}::test_allgather_coalesced_wrong_inner_list_size")
def check_fake_allgather_coalesced_wrong_inner_list_size(T: Impl) -> None:
    with fake_world(T, 0):
        torch_raises(RuntimeError, "invalid output size",
                     lambda: T.dist.all_gather_coalesced([[empty(T, (3, 3))], []], [ones(T, (3, 3))]))


@F.check(f"{MESH}::DeviceMeshTest::test_fake_pg_device_mesh")
def check_fake_pg_device_mesh(T: Impl) -> None:
    DeviceMesh, _ = mesh_api(T)
    with fake_world(T, 0, 4):
        mesh = DeviceMesh("cpu", list(range(4)))
        local = empty(T, (2, 8))
        out = empty(T, (4 * 2, 8))
        T.dist.all_gather_into_tensor(out, local, group=mesh.get_group())
        assert tuple(out.shape) == (4 * 2, 8)


# ============================================================================= object collectives
O = section("ported_objects", world_sizes=(2, 3, 4), pg_timeout=15.0, timeout=120.0)


@O.check(f"{OBJ}::test_all_gather_object")
def check_obj_all_gather_object(T: Impl) -> None:
    output: list[Any] = [None] * T.dist.get_world_size()
    T.dist.all_gather_object(object_list=output, obj=T.rank)
    for i, v in enumerate(output):
        assert i == v, f"rank: {T.rank}"


@O.check(f"{OBJ}::test_gather_object (dst defaults to 0)")
def check_obj_gather_object(T: Impl) -> None:
    output = [None] * T.dist.get_world_size() if T.rank == 0 else None
    T.dist.gather_object(obj=T.rank, object_gather_list=output)
    if T.rank == 0:
        assert output == list(range(T.ws)), output


@O.check(f"{OBJ}::test_broadcast_object_list (src defaults to 0)")
def check_obj_broadcast_object_list(T: Impl) -> None:
    val = 99 if T.rank == 0 else None
    object_list = [val] * T.dist.get_world_size()
    T.dist.broadcast_object_list(object_list=object_list)
    assert object_list[0] == 99, object_list


@O.check(f"{OBJ}::test_scatter_object_list (src defaults to 0)")
def check_obj_scatter_object_list(T: Impl) -> None:
    input_list = list(range(T.dist.get_world_size())) if T.rank == 0 else None
    output_list: list[Any] = [None]
    T.dist.scatter_object_list(scatter_object_output_list=output_list, scatter_object_input_list=input_list)
    assert output_list[0] == T.rank, output_list


@O.check(f"{C10D}::scatter_object_list (an empty output list)")
def check_obj_scatter_object_list_empty_output(T: Impl) -> None:
    inp = list(range(T.ws)) if T.rank == 0 else None
    torch_raises(ValueError, "Expected argument scatter_object_output_list to be a list of size at least 1",
                 lambda: T.dist.scatter_object_list([], inp))


def _setup_sub_pg(T: Impl) -> tuple[int, list[int], Any]:
    if T.ws % 2:
        T.skip("the torch test pairs ranks (base_rank, base_rank + 1): an even world size")
    rank = T.dist.get_rank()
    base = rank - rank % 2
    ranks = [base, base + 1]
    return rank, ranks, T.dist.new_group(ranks, use_local_synchronization=True)


@O.check(f"{OBJ}::test_subpg_scatter_object")
def check_obj_subpg_scatter_object(T: Impl) -> None:
    rank, ranks, pg = _setup_sub_pg(T)
    out: list[Any] = [None]
    T.dist.scatter_object_list(out, ranks, src=ranks[0], group=pg)
    assert out[0] == rank, out


@O.check(f"{OBJ}::test_subpg_all_gather_object")
def check_obj_subpg_all_gather_object(T: Impl) -> None:
    rank, ranks, pg = _setup_sub_pg(T)
    out: list[Any] = [None] * len(ranks)
    T.dist.all_gather_object(out, rank, group=pg)
    assert out == ranks, out


@O.check(f"{OBJ}::test_subpg_gather_object")
def check_obj_subpg_gather_object(T: Impl) -> None:
    rank, ranks, pg = _setup_sub_pg(T)
    out = [None] * len(ranks) if rank == ranks[0] else None
    T.dist.gather_object(rank, out, dst=ranks[0], group=pg)
    if rank == ranks[0]:
        assert out == ranks, out


@O.check(f"{OBJ}::test_subpg_broadcast_object")
def check_obj_subpg_broadcast_object(T: Impl) -> None:
    rank, ranks, pg = _setup_sub_pg(T)
    out: list[Any] = [None]
    if rank == ranks[0]:
        out[0] = rank
    T.dist.broadcast_object_list(out, src=ranks[0], group=pg)
    assert out[0] == ranks[0], out


# ============================================================================= device mesh
M = section("ported_mesh", world_sizes=(4,), pg_timeout=20.0, timeout=150.0)


def _ranks(T: Impl, x: Any) -> list[Any]:
    return T.np(x).tolist() if T.is_torch else np.asarray(x).tolist()


@M.check(f"{MESH}::DeviceMeshTestGlooBackend::test_device_mesh_reuse_default_group")
def check_mesh_reuse_default_group(T: Impl) -> None:
    _, init_device_mesh = mesh_api(T)
    mesh = init_device_mesh("cpu", (T.ws,))
    assert mesh.get_group() == default_group(T)


@M.check(f"{MESH}::DeviceMeshTest::test_get_group_and_get_all_groups")
def check_mesh_get_group_and_get_all_groups(T: Impl) -> None:
    _, init_device_mesh = mesh_api(T)
    mesh_2d = init_device_mesh("cpu", (2, T.ws // 2), mesh_dim_names=("dp", "tp"))
    tp_mesh, dp_mesh = mesh_2d["tp"], mesh_2d["dp"]
    assert mesh_2d.get_group(0) == mesh_2d.get_group("dp")
    assert mesh_2d.get_group(1) == mesh_2d.get_group("tp")
    assert mesh_2d.get_group("dp") == dp_mesh.get_group()
    assert mesh_2d.get_group("tp") == tp_mesh.get_group()
    groups = mesh_2d.get_all_groups()
    assert len(groups) == 2
    assert tp_mesh.get_group() in groups
    assert dp_mesh.get_group() in groups


@M.check(f"{MESH}::DeviceMeshTest::test_get_local_rank_raises_exception")
def check_mesh_get_local_rank_raises_exception(T: Impl) -> None:
    _, init_device_mesh = mesh_api(T)
    mesh_2d = init_device_mesh("cpu", (2, T.ws // 2), mesh_dim_names=("dp", "tp"))
    torch_raises(RuntimeError, "Optional kwarg `mesh_dim` needs to be specified when device_mesh.ndim > 1.",
                 lambda: mesh_2d.get_local_rank())


@M.check(f"{MESH}::DeviceMeshTest::test_get_local_rank")
def check_mesh_get_local_rank(T: Impl) -> None:
    _, init_device_mesh = mesh_api(T)
    mesh_2d = init_device_mesh("cpu", (2, T.ws // 2), mesh_dim_names=("dp", "tp"))
    assert mesh_2d.get_local_rank("dp") == mesh_2d.get_local_rank(0)
    assert mesh_2d.get_local_rank("tp") == mesh_2d.get_local_rank(1)
    assert mesh_2d["dp"].get_local_rank() == mesh_2d.get_local_rank("dp")
    assert mesh_2d["tp"].get_local_rank() == mesh_2d.get_local_rank("tp")


@M.check(f"{MESH}::DeviceMeshTest::test_device_mesh_2d")
def check_mesh_device_mesh_2d(T: Impl) -> None:
    DeviceMesh, _ = mesh_api(T)
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]])
    expected = [[[0, 2], [1, 3]], [[0, 1], [2, 3]]]
    pg_class = T.dist.ProcessGroup
    for dim, g in enumerate(mesh.get_all_groups()):
        assert dim < 2
        size = T.dist.get_world_size(g)
        assert isinstance(g, pg_class)
        assert size == 2
        got = [T.dist.get_global_rank(g, i) for i in range(size)]
        want = expected[dim][0] if T.rank in expected[dim][0] else expected[dim][1]
        assert got == want, (dim, got, want)


@M.check(f"{MESH}::DeviceMeshTestNDim::test_device_mesh_hash (on 4 ranks)")
def check_mesh_device_mesh_hash(T: Impl) -> None:
    DeviceMesh, _ = mesh_api(T)
    m1 = DeviceMesh("cpu", [[0, 1], [2, 3]])
    m2 = DeviceMesh("cpu", [[0, 1], [2, 3]])
    assert hash(m1) == hash(m2)
    m3 = DeviceMesh("cpu", [[[0, 1]], [[2, 3]]])
    assert hash(m1) != hash(m3)
    assert hash(m2) != hash(m3)


@M.check(f"{DMESH}::DeviceMesh.mesh (dtype torch.int and values)")
def check_mesh_dtype(T: Impl) -> None:
    # torch keeps the rank layout as an int32 ("torch.int") tensor
    DeviceMesh, _ = mesh_api(T)
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]])
    if T.is_torch:
        assert mesh.mesh.dtype == T.torch.int, mesh.mesh.dtype
    else:
        assert mesh.mesh.dtype == np.int32, mesh.mesh.dtype
    assert _ranks(T, mesh.mesh) == [[0, 1], [2, 3]]


@M.check(f"{MESH}::DeviceMeshTest::test_from_group_with_invalid_mesh")
def check_mesh_from_group_with_invalid_mesh(T: Impl) -> None:
    DeviceMesh, init_device_mesh = mesh_api(T)
    pg = default_group(T)
    assert pg.size() == 4
    torch_raises(ValueError, r"Invalid mesh \[\[0, 1\], \[2, 3\]\] for ProcessGroup with ranks \[0, 1, 2, 3\]",
                 lambda: DeviceMesh.from_group(pg, "cuda", [[0, 1], [2, 3]]))
    groups = init_device_mesh("cpu", (2, 2)).get_all_groups()
    torch_raises(ValueError, r"Expects mesh with ndim equal to number of ProcessGroups but got mesh "
                             r"\[0, 1, 2, 3\] and 2 ProcessGroups",
                 lambda: DeviceMesh.from_group(groups, "cpu", (0, 1, 2, 3), mesh_dim_names=("dp", "tp")))


@M.check(f"{MESH}::DeviceMeshTest::test_raises_invalid_device_type ('cpu:0': a device type with an index)")
def check_mesh_raises_invalid_device_type(T: Impl) -> None:
    _, init_device_mesh = mesh_api(T)
    for dt in ("cpu:0", "cuda:0"):
        torch_raises(RuntimeError, "Device type with index is not supported",
                     lambda: init_device_mesh(dt, (2, T.ws // 2), mesh_dim_names=("dp", "tp")))


@M.check(f"{MESH}::InitDeviceMeshTest::test_init_device_mesh (on 4 ranks)")
def check_mesh_init_device_mesh(T: Impl) -> None:
    DeviceMesh, init_device_mesh = mesh_api(T)
    names = ("DP", "TP")
    ref = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=names)
    mesh_2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    assert mesh_2d == ref
    assert mesh_2d.mesh_dim_names == names
    assert _ranks(T, mesh_2d.mesh) == [[0, 1], [2, 3]]


@M.check(f"{MESH}::InitDeviceMeshTest::test_raises_duplicate_mesh_dim_names")
def check_mesh_raises_duplicate_mesh_dim_names(T: Impl) -> None:
    _, init_device_mesh = mesh_api(T)
    torch_raises(RuntimeError, "Each mesh_dim_name must be unique.",
                 lambda: init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "dp"]))


@M.check(f"{MESH}::InitDeviceMeshTest::test_raises_mesh_shape_mesh_dim_names_mismatch")
def check_mesh_raises_mesh_shape_mesh_dim_names_mismatch(T: Impl) -> None:
    _, init_device_mesh = mesh_api(T)
    torch_raises(RuntimeError, "mesh_shape and mesh_dim_names should have same length!",
                 lambda: init_device_mesh("cpu", (4,), mesh_dim_names=["dp", "tp"]))


@M.check(f"{DMESH}::init_device_mesh (backend_override: torch's key errors)")
def check_mesh_backend_override(T: Impl) -> None:
    # init_device_mesh(..., backend_override={dim or name: backend}); a key that is
    # neither a dimension nor a name is refused with torch's words
    _, init_device_mesh = mesh_api(T)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"), backend_override={"tp": "gloo"})
    x = T.full(1, 1.0)
    T.dist.all_reduce(x, group=mesh.get_group("tp"))
    eq(x, [2.0], T)
    if not T.is_torch:  # gpucoll's options: that dimension's groups are made with new_group
        opts = T.dist.CPUOptions(transport="tcp")
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"), backend_override={0: ("cpu", opts)})
        assert mesh.get_group("dp").pg_options == opts
        assert T.dist.get_process_group_ranks(mesh.get_group("dp")) == [T.rank % 2, T.rank % 2 + 2]
        y = T.full(1, float(T.rank))
        T.dist.all_reduce(y, group=mesh.get_group("dp"))
        eq(y, [float(2 * (T.rank % 2) + 2)], T)
    torch_raises(RuntimeError, "Found invalid keys in backend_override",
                 lambda: init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"),
                                          backend_override={"pp": "gloo"}))
    torch_raises(RuntimeError, "Found redundant dim index 1 and name tp in backend_override",
                 lambda: init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"),
                                          backend_override={1: "gloo", "tp": "gloo"}))


@M.check(f"{MESH}::TestDeviceMeshGetItem::test_raises_no_mesh_dim_found")
def check_mesh_raises_no_mesh_dim_found(T: Impl) -> None:
    _, init_device_mesh = mesh_api(T)
    mesh = init_device_mesh("cpu", (2, 2))
    torch_raises(RuntimeError, "Cannot slice a DeviceMesh without mesh_dim_names!", lambda: mesh["DP"])
    torch_raises(KeyError, "No `mesh_dim_names` found.", lambda: mesh._get_mesh_dim_by_name("DP"))


@M.check(f"{MESH}::TestDeviceMeshGetItem::test_raises_invalid_mesh_dim_name")
def check_mesh_raises_invalid_mesh_dim_name(T: Impl) -> None:
    _, init_device_mesh = mesh_api(T)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"))
    torch_raises(KeyError, "Invalid mesh_dim_names", lambda: mesh["PP"])
    torch_raises(KeyError, "Mesh dimension 'PP' does not exist.", lambda: mesh._get_mesh_dim_by_name("PP"))


@M.check(f"{MESH}::TestDeviceMeshGetItem::test_get_item (on 4 ranks)")
def check_mesh_get_item(T: Impl) -> None:
    _, init_device_mesh = mesh_api(T)
    names = ("DP", "TP")
    mesh_2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    full = np.array(_ranks(T, mesh_2d.mesh))
    by_name = {n: np.swapaxes(full, -1, names.index(n)).reshape(-1, full.shape[names.index(n)]) for n in names}
    assert _ranks(T, mesh_2d["TP"].mesh) == by_name["TP"][T.rank // 2].tolist()
    assert _ranks(T, mesh_2d["DP"].mesh) == by_name["DP"][T.rank % 2].tolist()


@M.check(f"{MESH}::TestDeviceMeshGetItem::test_get_item_1d")
def check_mesh_get_item_1d(T: Impl) -> None:
    _, init_device_mesh = mesh_api(T)
    mesh = init_device_mesh("cpu", (T.ws,), mesh_dim_names=("dp",))
    assert mesh["dp"] == mesh
    torch_raises(KeyError, "Invalid mesh_dim_name", lambda: mesh["dim0"])


@M.check(f"{MESH}::DeviceMeshTest::test_get_local_rank_3d (on 4 ranks: (1, 2, 2))")
def check_mesh_get_local_rank_3d(T: Impl) -> None:
    _, init_device_mesh = mesh_api(T)
    mesh_3d = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp", "pp", "tp"))
    assert mesh_3d.get_local_rank("tp") == T.rank % 2
    assert mesh_3d.get_local_rank("pp") == T.rank // 2
    assert mesh_3d.get_local_rank("dp") == 0


# ============================================================================= groups
G = section("ported_groups", world_sizes=(2, 3, 4), pg_timeout=15.0, timeout=150.0)


@G.check(f"{C10D}::init_process_group (a second call: torch raises ValueError)")
def check_grp_init_twice(T: Impl) -> None:
    torch_raises(ValueError, "trying to initialize the default process group twice!",
                 lambda: T.dist.init_process_group("gloo", rank=T.rank, world_size=T.ws,
                                                   store=T.dist.HashStore()))


@G.check(f"{C10D}::ProcessGroup.bound_device_id (None without device_id=)")
def check_grp_bound_device_id(T: Impl) -> None:
    assert default_group(T).bound_device_id is None
    g = T.dist.new_group(list(range(T.ws)))
    assert g.bound_device_id is None


@G.check(f"{C10D}::get_group_rank / get_global_rank ('is not part of group')")
def check_grp_not_part_of_group(T: Impl) -> None:
    g = T.dist.new_group([0, 1])
    if T.rank not in (0, 1):
        return
    if T.ws > 2:
        torch_raises(ValueError, "Global rank 2 is not part of group", lambda: T.dist.get_group_rank(g, 2))
    torch_raises(ValueError, "Group rank 5 is not part of group", lambda: T.dist.get_global_rank(g, 5))


@G.check(f"{DT}::test_new_subgroups_group_size_exceeds_world_size")
def check_grp_new_subgroups_exceeds(T: Impl) -> None:
    torch_raises(ValueError, "must not exceed", lambda: T.dist.new_subgroups(100))
    torch_raises(ValueError, r"The arg 'group_size' \(0\) must be positive", lambda: T.dist.new_subgroups(0))


@G.check(f"{DT}::test_new_subgroups_world_size_not_divisible_by_group_size", world_sizes=(3, 4))
def check_grp_new_subgroups_not_divisible(T: Impl) -> None:
    size = 3 if T.ws == 4 else 2
    msg = f"The world size ({T.ws}) must be divisible by 'group_size={size}'"
    torch_raises(ValueError, re.escape(msg), lambda: T.dist.new_subgroups(size))


@G.check(f"{DT}::test_new_subgroups_by_enumeration_input_rank_exceeds_world_size", world_sizes=(3, 4))
def check_grp_new_subgroups_rank_exceeds(T: Impl) -> None:
    ws = T.dist.get_world_size()
    torch_raises(ValueError, f"Rank {ws} is out of range",
                 lambda: T.dist.new_subgroups_by_enumeration(ranks_per_subgroup_list=[[0, 1], [ws, 2]]))


@G.check(f"{DT}::test_new_subgroups_by_enumeration_negative_input_rank")
def check_grp_new_subgroups_negative_rank(T: Impl) -> None:
    torch_raises(ValueError, r"Rank -\d+ is out of range",
                 lambda: T.dist.new_subgroups_by_enumeration(ranks_per_subgroup_list=[[-1, -2], [-3, -4]]))


@G.check(f"{DT}::test_new_subgroups_overlap_not_allowed", world_sizes=(4,))
def check_grp_new_subgroups_overlap(T: Impl) -> None:
    torch_raises(ValueError, "Rank 1 has appeared in both subgroup",
                 lambda: T.dist.new_subgroups_by_enumeration(ranks_per_subgroup_list=[[0], [1, 2], [1, 3]]))


@G.check(f"{C10D}::new_subgroups_by_enumeration (an empty list: 'cannot be empty')")
def check_grp_new_subgroups_empty(T: Impl) -> None:
    torch_raises(ValueError, "The arg 'ranks_per_subgroup_list' cannot be empty",
                 lambda: T.dist.new_subgroups_by_enumeration([]))


@G.check(f"{DT}::test_all_reduce_complex_unsupported_ops")
def check_grp_all_reduce_complex_unsupported_ops(T: Impl) -> None:
    for name in ("MAX", "MIN", "BAND", "BOR", "BXOR"):
        torch_raises(ValueError, "all_reduce does not support",
                     lambda: T.dist.all_reduce(T.full(1, 1.0, "complex64"), T.op(name)))


@G.check(f"{DT}::test_all_reduce_complex_unsupported_ops (PRODUCT)")
def check_grp_all_reduce_complex_product_unsupported(T: Impl) -> None:
    torch_raises(ValueError, "all_reduce does not support",
                 lambda: T.dist.all_reduce(T.full(1, 1.0, "complex64"), T.op("PRODUCT")))


@G.check(f"{DT}::test_all_reduce_coalesced_max_complex_unsupported")
def check_grp_all_reduce_coalesced_max_complex(T: Impl) -> None:
    torch_raises(ValueError, "all_reduce does not support",
                 lambda: T.dist.all_reduce_coalesced([T.full(1, 1.0, "complex64")], T.op("MAX")))


def _noncontig(T: Impl, base: np.ndarray) -> Any:
    """A non-contiguous view (every other row) of ``base``."""
    if T.is_torch:
        t = T.torch.from_numpy(base.copy())[::2]
        assert not t.is_contiguous()
        return t
    a = base.copy()[::2]
    assert not a.flags.c_contiguous
    return a


@G.check(f"{C10D}::all_gather / gather / all_to_all_single with non-contiguous inputs (torch accepts "
         "them in all_gather and gather; gloo's all_to_all_single refuses one)")
def check_grp_noncontiguous_inputs(T: Impl) -> None:
    base = (np.arange(8, dtype=np.float32).reshape(4, 2) + 100 * T.rank)
    want = [(np.arange(8, dtype=np.float32).reshape(4, 2) + 100 * r)[::2] for r in range(T.ws)]
    inp = _noncontig(T, base)
    outs = [T.zeros((2, 2)) for _ in range(T.ws)]
    T.dist.all_gather(outs, inp)
    for r in range(T.ws):
        eq(outs[r], want[r], T, f"all_gather from {r}")
    lst = [T.zeros((2, 2)) for _ in range(T.ws)] if T.rank == 0 else None
    T.dist.gather(inp, lst, dst=0)
    if T.rank == 0:
        for r in range(T.ws):
            eq(lst[r], want[r], T, f"gather from {r}")
    # all_to_all_single: gloo refuses a non-contiguous input (on every rank alike)
    src = np.arange(2 * T.ws, dtype=np.float32).reshape(2 * T.ws, 1) + 100 * T.rank
    torch_raises(ValueError, "Tensors must be contiguous",
                 lambda: T.dist.all_to_all_single(T.zeros((T.ws, 1)), _noncontig(T, src)))


GLOO = "test/distributed/test_c10d_gloo.py::ProcessGroupGlooTest"


def _column(T: Impl, value: int) -> Any:
    """``fn(torch.tensor([value]))`` with torch's ``fn = lambda t: t.expand(2, 2).contiguous()[:, 0]``:
    a column of a 2x2 int64 array, not contiguous (stride 2)."""
    t = T.arr(np.broadcast_to(np.array([value], np.int64), (2, 2)).copy(), "int64")[:, 0]
    assert not (t.is_contiguous() if T.is_torch else t.flags.c_contiguous)
    return t


def _future_value(T: Impl, work: Any) -> Any:
    """torch's ``fut = work.get_future(); fut.wait(); fut.value()``, on both libraries."""
    fut = work.get_future()
    fut.wait()
    return fut.value()


def _eq_list(T: Impl, got: Any, want: list[np.ndarray], what: str) -> None:
    assert len(got) == len(want), (what, len(got), len(want))
    for i, (g, w) in enumerate(zip(got, want)):
        eq(g, w, T, f"{what}[{i}]")


@G.check(f"{GLOO}::test_allgather_noncontiguous_input (_test_allgather_basics, one input per rank)")
def check_gloo_allgather_noncontiguous_input(T: Impl) -> None:
    fn = lambda v: _column(T, v)  # noqa: E731  (torch's fn)
    inp = fn(T.rank)
    output = [fn(-1) for _ in range(T.ws)]
    expected = [np.full(2, i, np.int64) for i in range(T.ws)]
    result = _future_value(T, T.dist.all_gather(output, inp, async_op=True))
    _eq_list(T, result, expected, "future value")
    _eq_list(T, output, expected, "output")  # the caller's own (non-contiguous) arrays
    output = [fn(-1) for _ in range(T.ws)]
    T.dist.all_gather(output, fn(T.rank))  # the same, synchronous
    _eq_list(T, output, expected, "output (sync)")


@G.check(f"{GLOO}::test_gather_noncontiguous_input (_test_gather_basics)")
def check_gloo_gather_noncontiguous_input(T: Impl) -> None:
    fn = lambda v: _column(T, v)  # noqa: E731  (torch's fn)
    inp = fn(T.rank)
    outputs = [fn(-1) for _ in range(T.ws)]
    # take turns being the gather root and accumulate work items
    works = [T.dist.gather(inp, outputs if i == T.rank else None, dst=i, async_op=True) for i in range(T.ws)]
    expected = [np.full(2, r, np.int64) for r in range(T.ws)]
    for i in range(T.ws):
        result = _future_value(T, works[i])
        if i == T.rank:
            _eq_list(T, result, expected, "future value")
            _eq_list(T, outputs, expected, "outputs")
    lst = [fn(-1) for _ in range(T.ws)] if T.rank == 0 else None
    T.dist.gather(fn(T.rank), lst, dst=0)  # the same, synchronous
    if T.rank == 0:
        _eq_list(T, lst, expected, "gather_list (sync)")


@G.check(f"{C10D}::all_to_all / all_gather_coalesced with non-contiguous output (and input) lists, "
         "sync and async (gloo writes into the views)")
def check_grp_noncontiguous_output_lists(T: Impl) -> None:
    fn = lambda v: _column(T, v)  # noqa: E731
    for async_op in (False, True):
        outs = [fn(-1) for _ in range(T.ws)]
        work = T.dist.all_to_all(outs, [fn(10 * T.rank + j) for j in range(T.ws)], async_op=async_op)
        if async_op:
            work.wait()
        _eq_list(T, outs, [np.full(2, 10 * r + T.rank, np.int64) for r in range(T.ws)], f"all_to_all {async_op}")
        lists = [[fn(-1), fn(-1)] for _ in range(T.ws)]
        work = T.dist.all_gather_coalesced(lists, [fn(T.rank), fn(100 + T.rank)], async_op=async_op)
        if async_op:
            work.wait()
        for r in range(T.ws):
            _eq_list(T, lists[r], [np.full(2, r, np.int64), np.full(2, 100 + r, np.int64)],
                     f"all_gather_coalesced {async_op} from {r}")


@G.check(f"{DT}::test_monitored_barrier_gloo (the passing half: wait_all_ranks too)")
def check_grp_monitored_barrier_passes(T: Impl) -> None:
    x = T.full(10, T.rank)
    for _ in range(10):
        T.dist.all_reduce(x)
    T.dist.monitored_barrier(timeout=timedelta(seconds=10))
    for _ in range(10):
        T.dist.all_reduce(x)
    T.dist.monitored_barrier(timeout=timedelta(seconds=10), wait_all_ranks=True)


# ----------------------------------------------------------------------------- monitored_barrier failures
# Each leaves the group unusable on some ranks: one small section per test.

MB1 = section("ported_mb_gloo", world_sizes=(3,), pg_timeout=10.0, timeout=60.0)


@MB1.check(f"{DT}::test_monitored_barrier_gloo (rank 1 stays away)")
def check_mb_gloo_failure(T: Impl) -> None:
    timeout = timedelta(seconds=2)
    if T.rank == 0:
        torch_raises(RuntimeError, "Rank 1 failed to pass monitoredBarrier",
                     lambda: T.dist.monitored_barrier(timeout=timeout))
    elif T.rank != 1:
        torch_raises(RuntimeError, f"Rank {T.rank} successfully reached monitoredBarrier, but received errors "
                                   "while waiting for send/recv from rank 0",
                     lambda: T.dist.monitored_barrier(timeout=timeout))
    _harness_sync(T, "mb_gloo/done")  # torch's test: self._barrier(timeout=30)


MB2 = section("ported_mb_order", world_sizes=(3, 4), pg_timeout=10.0, timeout=60.0)


@MB2.check(f"{DT}::test_monitored_barrier_failure_order")
def check_mb_failure_order(T: Impl) -> None:
    timeout = timedelta(seconds=2)
    if T.rank == 0:
        torch_raises(RuntimeError, "Rank 2", lambda: T.dist.monitored_barrier(timeout=timeout))
    elif T.rank == 1:
        torch_raises(RuntimeError, "Rank 1 successfully reached monitoredBarrier, but received errors while "
                                   "waiting for send/recv from rank 0",
                     lambda: T.dist.monitored_barrier(timeout=timeout))


MB3 = section("ported_mb_all", world_sizes=(3, 4), pg_timeout=10.0, timeout=60.0)


@MB3.check(f"{DT}::test_monitored_barrier_wait_all_ranks")
def check_mb_wait_all_ranks(T: Impl) -> None:
    if T.rank == 0:
        ranks = ", ".join(str(i) for i in range(1, T.ws))
        torch_raises(RuntimeError, f"Ranks {ranks} failed to pass monitoredBarrier",
                     lambda: T.dist.monitored_barrier(timeout=timedelta(seconds=0.1), wait_all_ranks=True))


MB4 = section("ported_mb_rank0", world_sizes=(2, 3), pg_timeout=10.0, timeout=60.0)


def _harness_sync(T: Impl, key: str, ranks: Any = None) -> None:
    """Wait, outside the group under test, until ``ranks`` (all) have reached ``key``: what
    torch's test harness gives a test by keeping every process alive until all finish."""
    import os

    from gpucoll import FileStore

    store = FileStore(os.path.join(T.workdir, "sync"), T.ws)
    store.set(f"{key}/{T.rank}", b"1")
    store.wait([f"{key}/{r}" for r in (range(T.ws) if ranks is None else ranks)], timeout=60)


@MB4.check(f"{DT}::test_monitored_barrier_gloo_rank_0_timeout")
def check_mb_rank_0_timeout(T: Impl) -> None:
    pg = T.dist.new_group(ranks=list(range(T.ws)))
    _harness_sync(T, "mb_rank0/made")
    if T.rank == 0:
        torch_raises(RuntimeError, "Rank 0 timed out in monitoredBarrier",
                     lambda: pg.monitored_barrier(timedelta(seconds=0)))
    _harness_sync(T, "mb_rank0/done", [0])


MB5 = section("ported_mb_subgroup", world_sizes=(3,), pg_timeout=10.0, timeout=60.0)


@MB5.check(f"{DT}::test_monitored_barrier_gloo_subgroup")
def check_mb_subgroup(T: Impl) -> None:
    subgroup = T.dist.new_group(ranks=[0, 1])
    if T.rank == 1:
        return
    if T.rank == 0:
        torch_raises(RuntimeError, "Rank 1 failed to pass monitoredBarrier",
                     lambda: T.dist.monitored_barrier(subgroup, 0.1))
    else:
        # Other ranks call into monitored_barrier, but this should be a noop because they
        # are not part of the subgroup. Verify that there are no errors here.
        T.dist.monitored_barrier(subgroup, 0.1)


# ============================================================================= test_c10d_common.py
# AbstractCommTest (world size 2) and AbstractLargeCommTest (world size 4), as
# test_c10d_gloo.py's CommTest / LargeCommTest run them on gloo.
C = section("ported_common", world_sizes=(2, 4), pg_timeout=15.0, timeout=150.0)
CAT = f"{COMMON}::AbstractCommTest"
CLT = f"{COMMON}::AbstractLargeCommTest"


@C.check(f"{CAT}::_test_rank_membership (less DummyProcessGroup's 'not registered': no such class here)",
         world_sizes=(2,))
def check_common_rank_membership(T: Impl) -> None:
    # every rank runs the queries, as in torch's test: on rank 0, which the group leaves
    # out, new_group returned GroupMember.NON_GROUP_MEMBER and the answers are the group's
    assert T.ws > 1
    group = T.dist.new_group(ranks=[1])
    assert T.dist.get_group_rank(group, 1) == 0
    torch_raises(ValueError, "not part of group", lambda: T.dist.get_group_rank(group, 0))
    assert T.dist.get_global_rank(group, 0) == 1
    torch_raises(ValueError, "not part of group", lambda: T.dist.get_global_rank(group, 1))
    assert T.dist.get_process_group_ranks(group) == [1]


@C.check(f"{CAT}::_test_tensor_dtype_mismatch", world_sizes=(2,))
def check_common_tensor_dtype_mismatch(T: Impl) -> None:
    tensor = T.full((2, 2), 7.0)
    tensor_h = T.full((2, 2), 7.0, "float16")
    tensor_list = [T.zeros((2, 2)) for _ in range(T.ws)]
    tensor_list_h = list(tensor_list)
    tensor_list_h[1] = T.zeros((2, 2), "float16")
    msg = "tensors with different dtypes"
    torch_raises(ValueError, msg, lambda: T.dist.all_gather(tensor_list_h, tensor))
    torch_raises(ValueError, msg, lambda: T.dist.all_gather(tensor_list, tensor_h))
    torch_raises(ValueError, msg, lambda: T.dist.all_gather_coalesced([tensor_list_h], tensor_list))
    torch_raises(ValueError, msg, lambda: T.dist.all_reduce_coalesced(tensor_list_h))
    torch_raises(ValueError, msg, lambda: T.dist.reduce_scatter(tensor, tensor_list_h))
    torch_raises(ValueError, msg, lambda: T.dist.reduce_scatter(tensor_h, tensor_list))
    torch_raises(ValueError, msg, lambda: T.dist.all_to_all_single(tensor_h, tensor))
    torch_raises(ValueError, msg, lambda: T.dist.all_to_all(tensor_list_h, tensor_list))
    torch_raises(ValueError, msg, lambda: T.dist.all_to_all(tensor_list, tensor_list_h))
    torch_raises(ValueError, msg, lambda: T.dist.scatter(tensor, tensor_list_h))
    torch_raises(ValueError, msg, lambda: T.dist.gather(tensor_h, tensor_list))
    torch_raises(ValueError, msg, lambda: T.dist.gather(tensor, tensor_list_h))
    torch_raises(ValueError, msg, lambda: T.dist.scatter(tensor_h, tensor_list))


@C.check(f"{CAT}::_test_tensor_dtype_complex", world_sizes=(2,))
def check_common_tensor_dtype_complex(T: Impl) -> None:
    rng = np.random.default_rng(T.rank)
    tensor = T.arr(rng.random(2), "float32")
    tensor_c = T.arr(np.array(complex(*rng.random(2))), "complex64")  # view_as_complex of 2 floats: 0-d
    tensor_list = [T.arr(rng.random(2), "float32") for _ in range(T.ws)]
    tensor_list_c = list(tensor_list)
    tensor_list_c[1] = T.arr(np.array(complex(*rng.random(2))), "complex64")
    T.dist.all_gather(tensor_list, tensor)
    T.dist.all_gather(tensor_list, tensor_c)
    T.dist.all_gather(tensor_list_c, tensor)
    T.dist.all_gather(tensor_list_c, tensor_c)


@C.check(f"{CAT}::_test_bool_tensors", world_sizes=(2,))
def check_common_bool_tensors(T: Impl) -> None:
    tensor = T.arr([1, 0, 0, 1], "bool")
    out = T.arr([0, 0, 0, 0], "bool") if T.rank > 0 else tensor
    T.dist.broadcast(out, src=0)
    eq(out, np.array([1, 0, 0, 1], bool), T)


@C.check(f"{CAT}::_test_warn_not_in_group", world_sizes=(4,))
def check_common_warn_not_in_group(T: Impl) -> None:
    import warnings as _warnings

    in_group = [r for r in range(T.ws) if r % 2 == 0]
    group = T.dist.new_group(in_group)
    x = T.zeros((2, 2))
    xs = [T.zeros((2, 2)) for _ in in_group]
    calls = {"all_gather": lambda: T.dist.all_gather(xs, x, group=group),
             "all_reduce": lambda: T.dist.all_reduce(x, group=group),
             "barrier": lambda: T.dist.barrier(group=group),
             "broadcast": lambda: T.dist.broadcast(x, src=0, group=group)}
    for name, call in calls.items():
        if T.rank in in_group:
            call()
        else:  # assertWarnsOnceRegex(UserWarning, ".*{name}.*does not belong to.*")
            with _warnings.catch_warnings(record=True) as caught:
                _warnings.simplefilter("always")
                call()
            assert any(issubclass(w.category, UserWarning) and re.search(f".*{name}.*does not belong to.*",
                                                                          str(w.message)) for w in caught), caught


# torch names a locally synchronised group after its ranks: its tests start a fresh world
# for each, and so do these (two such tests in one gloo world hang torch)
LS1 = section("ported_common_ls1", world_sizes=(4,), pg_timeout=15.0, timeout=90.0)
LS2 = section("ported_common_ls2", world_sizes=(4,), pg_timeout=15.0, timeout=90.0)
LS3 = section("ported_common_ls3", world_sizes=(4,), pg_timeout=15.0, timeout=90.0)


@LS1.check(f"{CLT}::_test_new_group_local_sync")
def check_common_new_group_local_sync(T: Impl) -> None:
    rank = T.dist.get_rank()
    ranks_in = [rank, (rank + 2) % T.ws]
    ranks_out = [i for i in range(T.ws) if i not in ranks_in]
    assert rank in ranks_in and rank not in ranks_out
    out = T.dist.new_group(ranks=ranks_out, use_local_synchronization=True)
    if T.is_torch:
        # torch 2.13 returns None (which later calls read as the default group); torch's
        # test since then asserts GroupMember.NON_GROUP_MEMBER, as gpucoll returns
        # (docs/torch-differences.md)
        assert out is None, out
    else:
        assert out is T.dist.GroupMember.NON_GROUP_MEMBER, out
    new_pg = T.dist.new_group(ranks=ranks_in, use_local_synchronization=True)
    assert isinstance(new_pg, T.dist.ProcessGroup)
    ranks_in.sort()
    assert T.dist.get_group_rank(new_pg, rank) == ranks_in.index(rank)
    assert T.dist.get_process_group_ranks(new_pg) == ranks_in


def _pair_gather(T: Impl, new_pg: Any, pg_idx: int, ranks_in: list[int]) -> None:
    inp = T.arr([pg_idx, T.rank], "int64")
    outs = [T.arr([-1, -1], "int64") for _ in range(new_pg.size())]
    T.dist.all_gather(outs, inp, group=new_pg)
    for i, r in enumerate(ranks_in):
        eq(outs[i], np.array([pg_idx, r]), T, f"slot {i}")


@LS2.check(f"{CLT}::_test_new_group_local_sync_sanity_check")
def check_common_new_group_local_sync_sanity_check(T: Impl) -> None:
    pg_idx = T.rank // 2
    ranks_in = [pg_idx * 2, pg_idx * 2 + 1]
    _pair_gather(T, T.dist.new_group(ranks=ranks_in, use_local_synchronization=True), pg_idx, ranks_in)


@LS3.check(f"{CLT}::_test_new_group_local_sync_duplicate_pg")
def check_common_new_group_local_sync_duplicate_pg(T: Impl) -> None:
    pg_idx = T.rank // 2
    ranks_in = [pg_idx * 2, pg_idx * 2 + 1]
    pgs = [T.dist.new_group(ranks=ranks_in, use_local_synchronization=True) for _ in range(2)]
    for pg in pgs:
        _pair_gather(T, pg, pg_idx, ranks_in)


# ----------------------------------------------------------------------------- sequence numbers
# AbstractCommTest._test_sequence_num_*: torch's private ProcessGroup._get_sequence_number_for_group
# is gpucoll's ProcessGroup.get_sequence_number, and c10d._rank_not_in_group(g) is
# ``g is GroupMember.NON_GROUP_MEMBER`` (the same test torch's helper makes).

def _seq(T: Impl, pg: Any) -> int:
    return int(pg._get_sequence_number_for_group() if T.is_torch else pg.get_sequence_number())


def _not_in_group(T: Impl, group: Any) -> bool:
    if T.is_torch:
        return bool(T.dist.distributed_c10d._rank_not_in_group(group))
    return group is T.dist.GroupMember.NON_GROUP_MEMBER


def _all_reduce_on(T: Impl, t: Any, group: Any, async_op: bool = False) -> None:
    """``dist.all_reduce(t, group=group)`` as torch's test calls it on every rank (a non-member
    gets a warning and None)."""
    T.dist.all_reduce(t, group=group, async_op=async_op)


def _verify_sequence_number_across_pg(T: Impl, pg: Any, verify_pg: Any) -> int:
    seq_num = _seq(T, pg)
    obj_list: list[Any] = [None for _ in range(T.dist.get_world_size(verify_pg))]
    # a separate group verifies, or its collectives would advance the numbers under test
    T.dist.all_gather_object(obj_list, seq_num, group=verify_pg)
    assert len(set(obj_list)) == 1, obj_list
    return int(obj_list[0])


def _test_sequence_num_incremented(T: Impl, process_group: Any, ranks: list[int]) -> None:
    verify_pg = T.dist.new_group(ranks=ranks, backend="gloo")
    assert T.dist.get_world_size(process_group) == T.dist.get_world_size(verify_pg)
    initial_num = (_verify_sequence_number_across_pg(T, process_group, verify_pg)
                   if not _not_in_group(T, process_group) else -1)
    t = T.full(1, 1.0)
    for i in range(10):
        t = T.full(1, 1.0)
        _all_reduce_on(T, t, process_group)
        if not _not_in_group(T, process_group):
            seq_num = _verify_sequence_number_across_pg(T, process_group, verify_pg)
            assert initial_num + i + 1 == seq_num, (initial_num, i, seq_num)
    if T.dist.get_world_size(process_group) > 2:
        # ranks that issue no collective lag behind
        if T.dist.get_rank(process_group) not in [0, 2]:
            _all_reduce_on(T, t, process_group, async_op=True)
        if not _not_in_group(T, process_group):
            seq_num = _seq(T, process_group)
            rank = T.dist.get_rank(process_group)
            obj_list: list[Any] = [None for _ in range(T.dist.get_world_size(verify_pg))]
            T.dist.all_gather_object(obj_list, (rank, seq_num), group=verify_pg)
            rank_to_seq_num = dict(obj_list)
            assert len(set(rank_to_seq_num.values())) == 2, rank_to_seq_num
            assert rank_to_seq_num[0] == rank_to_seq_num[2], rank_to_seq_num
            expected_same = {rank_to_seq_num[i] for i in rank_to_seq_num if i not in [0, 2]}
            assert len(expected_same) == 1, rank_to_seq_num
            assert rank_to_seq_num[0] + 1 == rank_to_seq_num[1], rank_to_seq_num


# one world each: the lagging op left behind makes the group unusable afterwards
SQ1 = section("ported_common_seq_sub", world_sizes=(4,), pg_timeout=5.0, timeout=90.0)
SQ2 = section("ported_common_seq_default", world_sizes=(2, 3), pg_timeout=5.0, timeout=90.0)


@SQ1.check(f"{COMMON}::CommTest (test_c10d_gloo.py)::test_sequence_num_incremented_gloo_subgroup")
def check_common_sequence_num_incremented_subgroup(T: Impl) -> None:
    subgroup_ranks = [0, 1, 2]
    subgroup = T.dist.new_group(subgroup_ranks)
    _test_sequence_num_incremented(T, subgroup, subgroup_ranks)
    _harness_sync(T, "seq_sub/done")


@SQ2.check(f"{COMMON}::CommTest (test_c10d_gloo.py)::test_sequence_num_incremented_gloo_default")
def check_common_sequence_num_incremented_default(T: Impl) -> None:
    _test_sequence_num_incremented(T, default_group(T), list(range(T.dist.get_world_size())))
    _harness_sync(T, "seq_default/done")


@C.check(f"{CAT}::_test_sequence_num_set_default_pg")
def check_common_sequence_num_set_default_pg(T: Impl) -> None:
    seq_num = _seq(T, default_group(T))
    obj_list: list[Any] = [None for _ in range(T.dist.get_world_size())]
    T.dist.all_gather_object(obj_list, seq_num)
    assert len(set(obj_list)) == 1, obj_list


@C.check(f"{CAT}::_test_sequence_num_set_new_group")
def check_common_sequence_num_set_new_group(T: Impl) -> None:
    subgroup = T.dist.new_group([0, 1])
    if not _not_in_group(T, subgroup):
        subgroup_seq = _seq(T, subgroup)
        obj_list: list[Any] = [None for _ in range(T.dist.get_world_size(subgroup))]
        T.dist.all_gather_object(obj_list, subgroup_seq, group=subgroup)
        assert len(set(obj_list)) == 1, obj_list


@C.check(f"{CLT}::_test_new_group_ordered (sort_ranks=False)", world_sizes=(4,))
def check_common_new_group_ordered(T: Impl) -> None:
    rank = T.dist.get_rank()
    reversed_ranks = list(range(T.ws - 1, -1, -1))
    new_pg = T.dist.new_group(ranks=reversed_ranks, sort_ranks=False)
    assert T.dist.get_group_rank(new_pg, rank) == reversed_ranks.index(rank)
    assert T.dist.get_process_group_ranks(new_pg) == reversed_ranks
    outs = [T.arr([-1], "int64") for _ in range(T.ws)]
    T.dist.all_gather(outs, T.arr([rank], "int64"), group=new_pg)
    for i in range(T.ws):
        eq(outs[i], [reversed_ranks[i]], T, f"slot {i}")


# ============================================================================= distributed_test.py: groups
D = section("ported_dt_groups", world_sizes=(2, 3, 4), pg_timeout=15.0, timeout=120.0)


def _group_of_two(T: Impl) -> list[int]:
    return [1, 2] if T.dist.get_world_size() > 2 else [0, 1]


@D.check(f"{DT}::test_destroy_group")
def check_dt_destroy_group(T: Impl) -> None:
    group_id = T.dist.new_group(_group_of_two(T))
    _harness_sync(T, "dt_destroy_group")  # self._barrier()
    T.dist.destroy_process_group(group_id)


@D.check(f"{DT}::test_get_rank_size_group")
def check_dt_get_rank_size_group(T: Impl) -> None:
    group = _group_of_two(T)
    group_id = T.dist.new_group(group)
    if T.dist.get_rank() in group:
        assert T.dist.get_world_size(group_id) == 2
        assert T.dist.get_rank(group_id) in list(range(2))
    else:
        assert T.dist.get_world_size(group_id) == -1
        assert T.dist.get_rank(group_id) == -1


@D.check(f"{DT}::test_destroy_full_group")
def check_dt_destroy_full_group(T: Impl) -> None:
    group_id = T.dist.new_group()
    _harness_sync(T, "dt_destroy_full_group")
    T.dist.destroy_process_group(group_id)


def _init_global_test(T: Impl) -> tuple[list[int], Any, int]:
    """DistributedTest._init_global_test: the whole world, as ``dist.group.WORLD``."""
    return list(range(T.dist.get_world_size())), T.dist.group.WORLD, T.dist.get_rank()


@D.check(f"{DT}::test_all_reduce_sum (_init_global_test: group=dist.group.WORLD)")
def check_dt_all_reduce_sum_group_world(T: Impl) -> None:
    group, group_id, rank = _init_global_test(T)
    assert group_id is not None
    master_value, worker_value = 2, 10
    expected_value = 2 + (10 * (len(group) - 1))
    for src in group:
        n = src + 1
        tensor = T.full((n, n, n), master_value if rank == src else worker_value)
        T.dist.all_reduce(tensor, T.op("SUM"), group_id)
        eq(tensor, np.full((n, n, n), expected_value, np.float32), T, f"src {src}")
    _harness_sync(T, "dt_all_reduce_sum_group_world")  # self._barrier()


@D.check("test/distributed/test_c10d_gloo.py::ProcessGroupGlooTest::test_allreduce_coalesced_async")
def check_gloo_allreduce_coalesced_async(T: Impl) -> None:
    ws = T.ws

    def _expected_output(i: int) -> list[np.ndarray]:
        return 2 * [np.array([(i * ws) + (ws * (ws - 1) // 2)])]

    # ``2 * [t]``: one array listed twice, as torch's test builds it
    xs = [2 * [T.arr([i + T.rank], "int64")] for i in range(2)]
    futs = [T.dist.all_reduce_coalesced(x, async_op=True) for x in xs]
    if T.is_torch:
        T.torch.futures.wait_all(futs)
    else:
        for f in futs:  # torch.futures.wait_all: no such helper here; wait on each
            f.wait()
    for i, fut in enumerate(futs):
        got = fut.wait()
        assert isinstance(got, list) and len(got) == 2, got
        for k in range(2):
            eq(got[k], _expected_output(i)[k], T, f"Mismatch in iteration {i}, tensor {k}")


@D.check(f"{DT}::test_get_rank_size_full_group")
def check_dt_get_rank_size_full_group(T: Impl) -> None:
    group_id = T.dist.new_group()
    assert T.dist.get_world_size(group_id) == T.dist.get_world_size()
    assert T.dist.get_rank(group_id) == T.dist.get_rank()


def _barrier_timeout(T: Impl, group_id: Any, timeout: timedelta) -> None:
    import time

    if T.dist.get_rank(group_id) == 0:  # only group rank 0 calls: it times out
        expected = time.time() + timeout.total_seconds()
        err = torch_raises(Exception, " (Timed out|closed|timeout) ", lambda: T.dist.barrier(group_id))
        assert time.time() >= expected - 0.1, (time.time(), expected, err)


BT1 = section("ported_dt_barrier_timeout_group", world_sizes=(3,), pg_timeout=15.0, timeout=60.0)


@BT1.check(f"{DT}::test_barrier_timeout_group")
def check_dt_barrier_timeout_group(T: Impl) -> None:
    timeout = timedelta(seconds=5)
    group_id = T.dist.new_group([1, 2], timeout=timeout)
    if T.rank in (1, 2):
        _barrier_timeout(T, group_id, timeout)
    _harness_sync(T, "dt_barrier_timeout_group")


BT2 = section("ported_dt_barrier_timeout_full_group", world_sizes=(2, 3), pg_timeout=15.0, timeout=60.0)


@BT2.check(f"{DT}::test_barrier_timeout_full_group")
def check_dt_barrier_timeout_full_group(T: Impl) -> None:
    timeout = timedelta(seconds=1)
    group_id = T.dist.new_group(timeout=timeout)
    _barrier_timeout(T, group_id, timeout)
    _harness_sync(T, "dt_barrier_timeout_full_group")
