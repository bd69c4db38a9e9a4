"""Process groups, PREMUL_SUM and cross-rank mismatches: distributed_test.py's
test_new_group*, test_*_group (collectives on a subgroup), test_new_subgroups*,
test_c10d_common.py's group tests, and DETAIL-mode collective fingerprint checks
(test_c10d_gloo.py::ProcessGroupGlooTest / distributed_test.py::test_ddp_*mismatch /
test_collective_mismatch via ProcessGroupWrapper).

Checks that leave a group unusable or may hang live in small sections of their own,
each with a short group timeout, so they cannot take other checks down with them.
"""

from __future__ import annotations

import warnings

import numpy as np

from _conf_core import Impl, eq, raises, section

DT = "torch/testing/_internal/distributed/distributed_test.py::DistributedTest"
COMMON = "test/distributed/test_c10d_common.py"
G = section("groups", world_sizes=(3, 4), pg_timeout=15.0, timeout=120.0)

warnings.filterwarnings("ignore")


def _val(r: int, n: int = 3) -> np.ndarray:
    return (np.arange(n) + 10 * r + 1).astype(np.float32)


@G.check(f"{DT}::test_all_reduce_group_sum / test_new_group")
def check_subgroup_all_reduce(T: Impl) -> None:
    members = list(range(T.ws - 1))  # all but the last rank
    g = T.dist.new_group(members)
    if T.rank in members:
        assert g is not T.dist.GroupMember.NON_GROUP_MEMBER
        assert T.dist.get_world_size(g) == len(members)
        assert T.dist.get_rank(g) == members.index(T.rank)
        x = T.arr(_val(T.rank))
        T.dist.all_reduce(x, group=g)
        eq(x, sum(_val(r) for r in members), T)
    else:
        assert g is T.dist.GroupMember.NON_GROUP_MEMBER or g == T.dist.GroupMember.NON_GROUP_MEMBER, g


@G.check(f"{DT}::test_broadcast_group / test_reduce_group_sum (src/dst are global ranks)")
def check_subgroup_roots_are_global(T: Impl) -> None:
    members = list(range(1, T.ws))  # all but rank 0: global rank != group rank
    g = T.dist.new_group(members)
    if T.rank not in members:
        return
    root = members[-1]
    x = T.arr(_val(T.rank))
    T.dist.broadcast(x, src=root, group=g)
    eq(x, _val(root), T, "broadcast")
    y = T.arr(_val(T.rank))
    T.dist.reduce(y, dst=root, group=g)
    if T.rank == root:
        eq(y, sum(_val(r) for r in members), T, "reduce")
    out = [T.zeros(3) for _ in members] if T.rank == root else None
    T.dist.gather(T.arr(_val(T.rank)), gather_list=out, dst=root, group=g)
    if T.rank == root:
        for i, r in enumerate(members):
            eq(out[i], _val(r), T, f"gather from {r}")


@G.check(f"{DT}::test_get_group_rank / test_get_global_rank")
def check_group_rank_translation(T: Impl) -> None:
    members = [T.ws - 1, 0]  # unsorted on purpose: torch sorts the ranks
    g = T.dist.new_group(members)
    if T.rank in members:
        assert T.dist.get_process_group_ranks(g) == [0, T.ws - 1], T.dist.get_process_group_ranks(g)
        assert T.dist.get_group_rank(g, T.ws - 1) == 1
        assert T.dist.get_global_rank(g, 1) == T.ws - 1
        raises((ValueError, RuntimeError), lambda: T.dist.get_group_rank(g, 1 if T.ws > 2 else 5))


@G.check(f"{DT}::test_new_subgroups")
def check_new_subgroups(T: Impl) -> None:
    if T.ws % 2:
        T.skip("new_subgroups(group_size=2) needs an even world size")
    cur, groups = T.dist.new_subgroups(group_size=2)
    assert len(groups) == T.ws // 2
    assert T.dist.get_world_size(cur) == 2
    x = T.full(2, T.rank)
    T.dist.all_reduce(x, group=cur)
    base = T.rank - T.rank % 2
    eq(x, np.full(2, base + base + 1, np.float32), T)


@G.check(f"{DT}::test_new_subgroups_by_enumeration")
def check_new_subgroups_by_enumeration(T: Impl) -> None:
    parts = [[0, T.ws - 1], list(range(1, T.ws - 1))]
    cur, groups = T.dist.new_subgroups_by_enumeration(parts)
    assert len(groups) == 2
    mine = next(p for p in parts if T.rank in p)
    x = T.full(1, T.rank + 1)
    T.dist.all_reduce(x, group=cur)
    eq(x, [float(sum(r + 1 for r in mine))], T)


@G.check(f"{DT}::test_all_gather_group / test_scatter_group")
def check_subgroup_gather_scatter(T: Impl) -> None:
    members = list(range(0, T.ws, 2))
    g = T.dist.new_group(members)
    if T.rank not in members:
        return
    out = [T.zeros(3) for _ in members]
    T.dist.all_gather(out, T.arr(_val(T.rank)), group=g)
    for i, r in enumerate(members):
        eq(out[i], _val(r), T, f"all_gather from {r}")
    x = T.zeros(3)
    lst = [T.arr(_val(r)) for r in members] if T.rank == members[-1] else None
    T.dist.scatter(x, scatter_list=lst, src=members[-1], group=g)
    eq(x, _val(T.rank), T, "scatter")


@G.check(f"{DT}::test_barrier_group / test_barrier_timeout_group")
def check_subgroup_barrier_and_timeout(T: Impl) -> None:
    from datetime import timedelta

    g = T.dist.new_group(list(range(T.ws)), timeout=timedelta(seconds=7))
    T.dist.barrier(group=g)
    x = T.full(1, 1.0)
    T.dist.all_reduce(x, group=g)
    eq(x, [float(T.ws)], T)


@G.check(f"{COMMON}::test_collectives_non_member (non-members' collective calls return)")
def check_non_member_call_is_noop(T: Impl) -> None:
    g = T.dist.new_group([0, 1])
    if T.rank >= 2:
        # torch warns and returns None on a non-member; it must not block or raise
        x = T.full(1, 5.0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert T.dist.all_reduce(x, group=g) is None
        assert any("all_reduce" in str(w.message) and "does not belong to" in str(w.message) for w in caught), caught
        eq(x, [5.0], T)
    else:
        x = T.full(1, 1.0)
        T.dist.all_reduce(x, group=g)
        eq(x, [2.0], T)


# ----------------------------------------------------------------- local synchronization
L = section("local_sync", world_sizes=(4,), pg_timeout=5.0, timeout=45.0)


@L.check(f"{DT}::test_new_group_local_sync / test_new_group_local_sync_sanity_check")
def check_new_group_local_sync_disjoint(T: Impl) -> None:
    # ranks 0,1 create [0, 1]; ranks 2,3 create [2, 3]; nobody calls for the other group
    mine = [0, 1] if T.rank < 2 else [2, 3]
    g = T.dist.new_group(mine, use_local_synchronization=True)
    out = [T.zeros(2) for _ in mine]
    T.dist.all_gather(out, T.full(2, T.rank), group=g)
    for i, r in enumerate(mine):
        eq(out[i], np.full(2, r, np.float32), T, f"all_gather from {r}")
    x = T.full(1, T.rank)
    T.dist.all_reduce(x, group=g)
    eq(x, [float(sum(mine))], T, "all_reduce")


# ----------------------------------------------------------------- PREMUL_SUM
P = section("premul", world_sizes=(3,), pg_timeout=6.0, timeout=45.0)


@P.check("torch.distributed._make_nccl_premul_sum (same factor on every rank)")
def check_premul_sum_same_factor(T: Impl) -> None:
    T.only_gpucoll("gloo has no PREMUL_SUM")
    x = T.arr(_val(T.rank, 4), "float32")
    T.dist.all_reduce(x, op=T.dist.make_premul_sum(0.5))
    eq(x, 0.5 * sum(_val(r, 4) for r in range(T.ws)), T)


@P.check("torch.distributed._make_nccl_premul_sum (factor differs per rank: its documented use)")
def check_premul_sum_per_rank_factor(T: Impl) -> None:
    T.only_gpucoll("gloo has no PREMUL_SUM")
    # each rank scales its own contribution: sum_r (r + 1) * x_r
    x = T.arr(_val(T.rank, 4), "float64")
    T.dist.all_reduce(x, op=T.dist.make_premul_sum(float(T.rank + 1)))
    eq(x, sum((r + 1) * _val(r, 4).astype(np.float64) for r in range(T.ws)), T)


# ----------------------------------------------------------------- mismatch errors
# torch names each rank's collective only under TORCH_DISTRIBUTED_DEBUG=DETAIL; gpucoll
# should always do so. Each mismatch breaks the world, so one per section.

def _mismatch_section(name: str) -> object:
    return section(name, world_sizes=(3,), pg_timeout=5.0, timeout=45.0,
                   env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})


def _expect_named(T: Impl, fn: object, *alternatives: tuple[str, ...]) -> None:
    try:
        fn()  # type: ignore[operator]
    except Exception as exc:
        text = str(exc).lower().replace("_", "")
        for alts in alternatives:
            if not any(a.lower().replace("_", "") in text for a in alts):
                raise AssertionError(f"error does not name any of {alts}: {type(exc).__name__}: {exc}") from exc
        return
    raise AssertionError("no error raised for mismatched collectives")


M1 = _mismatch_section("mismatch_op")


@M1.check("test/distributed/test_pg_wrapper.py::test_collective_hang / _test_collectives_op_mismatch")
def check_mismatch_names_ops(T: Impl) -> None:
    x = T.full(4, 1.0)
    if T.rank == 0:
        _expect_named(T, lambda: T.dist.broadcast(x, src=0), ("broadcast",), ("allreduce",))
    else:
        _expect_named(T, lambda: T.dist.all_reduce(x), ("broadcast",), ("allreduce",))


M2 = _mismatch_section("mismatch_dtype")


@M2.check("test/distributed/test_pg_wrapper.py::_test_collective_shape_mismatch (dtype)")
def check_mismatch_names_dtypes(T: Impl) -> None:
    x = T.full(4, 1.0, "float64" if T.rank == 0 else "float32")
    _expect_named(T, lambda: T.dist.all_reduce(x), ("float64", "double"), ("float32", "float"))


M3 = _mismatch_section("mismatch_count")


@M3.check("test/distributed/test_pg_wrapper.py::_test_collective_shape_mismatch (count)")
def check_mismatch_names_counts(T: Impl) -> None:
    x = T.full(5 if T.rank == 0 else 7, 1.0)
    _expect_named(T, lambda: T.dist.all_reduce(x), ("[5]", "(5,)", "5 elem", "count 5", "numel 5", "size 5"),
                  ("[7]", "(7,)", "7 elem", "count 7", "numel 7", "size 7"))
