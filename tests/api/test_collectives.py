"""Every collective x op x dtype on world sizes 1-4, against a NumPy reference.

Each rank makes its input from a seed (case, rank), so every rank can compute every
other rank's input and hence the expected result without communicating. One world
per size runs all the checks (process start is the expensive part).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gpucoll.testing import run_spmd

from _fake_arrays import FakeCudaArray
from _reference import np_dtype, reference

DTYPE_NAMES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
               "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
               "float8_e4m3fn", "float8_e5m2"]
OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"]
RTOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 1e-6, "float64": 1e-12, "complex64": 1e-6,
        "complex128": 1e-12, "float8_e4m3fn": 0.07, "float8_e5m2": 0.13}


def kind(name: str) -> str:
    from gpucoll._buffer import DTYPES

    return DTYPES[name].kind


def op_valid(op: str, name: str) -> bool:
    k = kind(name)
    if op in ("BAND", "BOR", "BXOR"):
        return k in "biu"
    if op in ("MIN", "MAX", "PRODUCT"):
        return k != "c"
    if op == "AVG":
        return k != "b"
    if op == "PREMUL_SUM":
        return k in "fc"
    return True


def make(name: str, shape: tuple[int, ...], rank: int, case: int) -> np.ndarray:
    """Small values, so that sums and products stay exact in every dtype we test."""
    rng = np.random.default_rng([case, rank, len(shape)])
    k = kind(name)
    if k == "b":
        return rng.random(shape) < 0.5
    if k == "u":
        return rng.integers(0, 6, shape).astype(np_dtype(name))
    ints = rng.integers(-2, 3, shape)
    if k == "c":
        return (ints + 1j * rng.integers(-2, 3, shape)).astype(np_dtype(name))
    return ints.astype(np_dtype(name))


def check(got: np.ndarray, want: np.ndarray, name: str, what: str) -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    if kind(name) in "fc":
        wide = np.complex128 if kind(name) == "c" else np.float64
        np.testing.assert_allclose(got.astype(wide), want.astype(wide), rtol=RTOL[name], atol=1e-9,
                                   err_msg=what)
    else:
        np.testing.assert_array_equal(got, want, err_msg=what)


def op_of(name: str) -> Any:
    import gpucoll

    return gpucoll.make_premul_sum(0.5) if name == "PREMUL_SUM" else gpucoll.ReduceOp[name]


# ----- the rank bodies -----

def reductions_body() -> int:
    import gpucoll

    r, n = gpucoll.get_rank(), gpucoll.get_world_size()
    shape = (3, 2)
    checked = 0
    for di, name in enumerate(DTYPE_NAMES):
        for oi, opname in enumerate(OPS):
            case = di * 100 + oi
            if not op_valid(opname, name):
                with pytest.raises(TypeError, match=opname):
                    gpucoll.all_reduce(make(name, shape, r, case), op=op_of(opname))
                continue
            op = op_of(opname)
            inputs = [make(name, shape, q, case) for q in range(n)]
            want = reference(inputs, name, opname)
            what = f"{opname} {name} n={n}"

            x = inputs[r].copy()
            gpucoll.all_reduce(x, op=op)
            check(x, want, name, "all_reduce " + what)

            x = inputs[r].copy()
            work = gpucoll.all_reduce(x, op=op, async_op=True)
            assert work is not None and work.wait() and work.is_completed() and work.is_success()
            assert work.exception() is None and work.result()[0] is x
            check(x, want, name, "async all_reduce " + what)

            x = inputs[r].copy()
            gpucoll.reduce(x, dst=n - 1, op=op)
            if r == n - 1:
                check(x, want, name, "reduce " + what)

            pair = [inputs[r].copy(), inputs[r][:1].copy()]
            gpucoll.all_reduce_coalesced(pair, op=op)
            check(pair[0], want, name, "all_reduce_coalesced[0] " + what)
            check(pair[1], reference([a[:1] for a in inputs], name, opname), name, "all_reduce_coalesced[1] " + what)

            # reduce_scatter: rank q's input is n chunks shaped like `shape`
            big = [np.concatenate([make(name, shape, q, case * 7 + c) for c in range(n)]) for q in range(n)]
            want_rs = reference([b[r * 3:(r + 1) * 3] for b in big], name, opname)
            out = np.empty(shape, np_dtype(name))
            gpucoll.reduce_scatter_single(out, big[r], op=op)
            check(out, want_rs, name, "reduce_scatter_single " + what)
            out = np.empty(shape, np_dtype(name))
            gpucoll.reduce_scatter(out, [big[r][c * 3:(c + 1) * 3].copy() for c in range(n)], op=op)
            check(out, want_rs, name, "reduce_scatter " + what)
            checked += 1
    return checked


def movement_body() -> int:
    import gpucoll

    r, n = gpucoll.get_rank(), gpucoll.get_world_size()
    checked = 0
    for di, name in enumerate(DTYPE_NAMES):
        dt = np_dtype(name)
        mine = make(name, (2, 3), r, di)
        every = [make(name, (2, 3), q, di) for q in range(n)]
        root = (di + 1) % n

        x = mine.copy()
        gpucoll.broadcast(x, src=root)
        check(x, every[root], name, f"broadcast {name}")

        outs = [np.empty((2, 3), dt) for _ in range(n)]
        gpucoll.all_gather(outs, mine)
        for q in range(n):
            check(outs[q], every[q], name, f"all_gather[{q}] {name}")

        single = np.empty((2 * n, 3), dt)
        gpucoll.all_gather_single(single, mine)
        check(single, np.concatenate(every), name, f"all_gather_single {name}")
        alias = np.empty((n, 2, 3), dt)
        gpucoll.all_gather_into_tensor(alias, mine)
        check(alias, np.stack(every), name, f"all_gather_into_tensor {name}")

        lists = [[np.empty((2, 3), dt), np.empty(1, dt)] for _ in range(n)]  # torch's [rank][input]
        gpucoll.all_gather_coalesced(lists, [mine, mine.reshape(-1)[:1].copy()])
        for q in range(n):
            check(lists[q][0], every[q], name, f"all_gather_coalesced {name}")
            check(lists[q][1], every[q].reshape(-1)[:1], name, f"all_gather_coalesced {name}")

        gl = [np.empty((2, 3), dt) for _ in range(n)] if r == root else None
        gpucoll.gather(mine, gl, dst=root)
        if gl is not None:
            for q in range(n):
                check(gl[q], every[q], name, f"gather {name}")

        pieces = [make(name, (4,), root, di * 10 + q) for q in range(n)]
        out = np.empty(4, dt)
        gpucoll.scatter(out, pieces if r == root else None, src=root)
        check(out, pieces[r], name, f"scatter {name}")

        # all_to_all with a different size per pair: rank q sends q + p + 1 elements to rank p
        send = [make(name, (r + p + 1,), r, di * 1000 + p) for p in range(n)]
        recv = [np.empty((q + r + 1,), dt) for q in range(n)]
        gpucoll.all_to_all(recv, send)
        for q in range(n):
            check(recv[q], make(name, (q + r + 1,), q, di * 1000 + r), name, f"all_to_all {name}")

        # all_to_all_single, equal and uneven splits (rows of 2 elements)
        inp = make(name, (2 * n, 2), r, di + 500)
        out = np.empty((2 * n, 2), dt)
        gpucoll.all_to_all_single(out, inp)
        want = np.concatenate([make(name, (2 * n, 2), q, di + 500)[2 * r:2 * r + 2] for q in range(n)])
        check(out, want, name, f"all_to_all_single {name}")
        in_splits = [(r + p) % 3 for p in range(n)]
        out_splits = [(q + r) % 3 for q in range(n)]
        inp = make(name, (sum(in_splits), 2), r, di + 700)
        out = np.empty((sum(out_splits), 2), dt)
        gpucoll.all_to_all_single(out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits)
        parts = []
        for q in range(n):
            theirs = make(name, (sum((q + p) % 3 for p in range(n)), 2), q, di + 700)
            start = sum((q + p) % 3 for p in range(r))
            parts.append(theirs[start:start + (q + r) % 3])
        check(out, np.concatenate(parts), name, f"all_to_all_single uneven {name}")
        checked += 1
    gpucoll.barrier()
    w = gpucoll.barrier(async_op=True)
    assert w is not None and w.wait()
    return checked


def p2p_body() -> list[int]:
    import gpucoll

    r, n = gpucoll.get_rank(), gpucoll.get_world_size()
    if n == 1:
        return []
    right, left = (r + 1) % n, (r - 1) % n
    sources = []
    # blocking ring (even ranks send first, so the ring cannot deadlock)
    x = np.full(5, r, np.int32)
    y = np.empty(5, np.int32)
    if r % 2 == 0:
        gpucoll.send(x, dst=right)
        sources.append(gpucoll.recv(y, src=left))
    else:
        sources.append(gpucoll.recv(y, src=left))
        gpucoll.send(x, dst=right)
    assert (y == left).all()
    # isend/irecv with tags, received out of order
    a, b = np.empty(3, np.float64), np.empty(3, np.float64)
    wa = gpucoll.irecv(a, src=left, tag=7)
    wb = gpucoll.irecv(b, src=left, tag=8)
    s1 = gpucoll.isend(np.full(3, 8.0 + r), dst=right, tag=8)
    s2 = gpucoll.isend(np.full(3, 7.0 + r), dst=right, tag=7)
    for w in (wa, wb, s1, s2):
        w.wait()
    assert (a == 7.0 + left).all() and (b == 8.0 + left).all()
    # any-source receive on rank 0 from every other rank (its own tag: the batch ring below
    # also sends rank n-1 -> rank 0 on tag 0, and any-source would happily take that)
    if r == 0:
        got = set()
        for _ in range(n - 1):
            buf = np.empty(1, np.int64)
            src = gpucoll.recv(buf, tag=11)
            assert buf[0] == src * 10
            got.add(src)
        assert got == set(range(1, n))
        buf = np.empty(1, np.int64)
        w = gpucoll.irecv(buf, tag=3)
        w.wait()
        assert w.source_rank() == buf[0] == n - 1
    else:
        gpucoll.send(np.array([r * 10], np.int64), dst=0, tag=11)
        if r == n - 1:
            gpucoll.send(np.array([r], np.int64), dst=0, tag=3)
    # batch_isend_irecv ring
    out = np.empty(4, np.int16)
    works = gpucoll.batch_isend_irecv([gpucoll.P2POp(gpucoll.isend, np.full(4, r, np.int16), right),
                                       gpucoll.P2POp(gpucoll.irecv, out, left)])
    assert len(works) == 2
    for w in works:
        w.wait()
    assert (out == left).all()
    # coalescing: all_reduces batched into one op, p2p batched into one
    xs = [np.full(3, r + 1.0), np.full(2, 2 * r + 1.0)]
    with gpucoll.coalescing() as cm:
        for v in xs:
            assert gpucoll.all_reduce(v) is None
    assert len(cm.works) == 1 and cm.works[0].op_type == "all_reduce_coalesced"
    assert (xs[0] == n * (n + 1) / 2).all() and (xs[1] == n * n).all()
    with gpucoll.coalescing(async_ops=True) as cm:
        recv_w = gpucoll.irecv(out, src=left)
        gpucoll.isend(np.full(4, 100 + r, np.int16), dst=right)
    cm.wait()
    recv_w.wait()
    assert (out == 100 + left).all()
    with gpucoll.coalescing() as cm:
        g = np.empty(2 * n, np.float32)
        wg = gpucoll.all_gather_single(g, np.full(2, r, np.float32), async_op=True)
    assert wg is not None and wg.wait()
    assert g.tolist() == [float(q) for q in range(n) for _ in range(2)]
    with pytest.raises(RuntimeError, match="coalescing"):
        with gpucoll.coalescing():
            gpucoll.broadcast(np.zeros(1), src=0)
    return sources


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_reductions_every_op_and_dtype(world_size: int) -> None:
    counts = run_spmd(reductions_body, world_size, timeout=240)
    assert counts[0] == sum(op_valid(o, d) for d in DTYPE_NAMES for o in OPS)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_data_movement_every_dtype(world_size: int) -> None:
    assert run_spmd(movement_body, world_size, timeout=180) == [len(DTYPE_NAMES)] * world_size


@pytest.mark.parametrize("world_size", [2, 3])
def test_point_to_point_and_coalescing(world_size: int) -> None:
    sources = run_spmd(p2p_body, world_size, timeout=120)
    assert sources == [[(r - 1) % world_size] for r in range(world_size)]


def test_reference_is_independent() -> None:
    """The reference itself, on cases worked out by hand."""
    a, b = np.array([1, -2], np.int8), np.array([3, 3], np.int8)
    assert reference([a, b], "int8", "SUM").tolist() == [4, 1]
    assert reference([a, b], "int8", "AVG").tolist() == [2, 0]  # -2+3=1, 1/2 truncates to 0
    assert reference([np.array([-3], np.int8), np.array([0], np.int8)], "int8", "AVG").tolist() == [-1]
    assert reference([a, b], "int8", "BXOR").tolist() == [1 ^ 3, -2 ^ 3]
    t, f = np.array([True, False]), np.array([True, True])
    assert reference([t, f], "bool", "SUM").tolist() == [True, True]
    assert reference([t, f], "bool", "PRODUCT").tolist() == [True, False]
    assert reference([t, f], "bool", "BXOR").tolist() == [False, True]
    assert reference([np.array([2.0]), np.array([4.0])], "float32", "PREMUL_SUM").tolist() == [3.0]


# ----- the device path, with a host stand-in for NCCL -----

class HostStandInForNCCL:
    """Plays the NCCL backend on fake device arrays by handing their (host) memory to a
    CPU backend of its own, so the group's device dispatch runs end to end here."""

    name = "nccl"
    instances: list[HostStandInForNCCL] = []

    def __init__(self, store: Any, rank: int, size: int, *, timeout: float, group_name: str,
                 device_id: int | None) -> None:
        from gpucoll._backends.cpu.backend import CPUBackend

        self.inner = CPUBackend(store, rank, size, timeout=timeout, group_name=group_name)
        self.rank, self.size, self.device_id = rank, size, device_id
        self.calls: list[str] = []
        HostStandInForNCCL.instances.append(self)

    def __getattr__(self, op: str) -> Any:
        from dataclasses import replace

        from gpucoll._buffer import Buffer, Device

        def host(x: Any) -> Any:
            if isinstance(x, Buffer):
                assert x.is_cuda, "the NCCL stand-in got host memory"
                return replace(x, device=Device("cpu"))
            if isinstance(x, (list, tuple)):
                return type(x)(host(v) for v in x)
            return x

        method = getattr(self.inner, op)

        def call(*args: Any) -> Any:
            self.calls.append(op)
            return method(*[host(a) for a in args])

        return call


def nccl_dispatch_body() -> list[str]:
    import gpucoll
    from gpucoll._group import registry as group_module

    group_module.BACKENDS["nccl"] = HostStandInForNCCL
    gpucoll.init_process_group("nccl", timeout=30)
    r, n = gpucoll.get_rank(), gpucoll.get_world_size()
    assert gpucoll.get_backend() == "nccl" and not HostStandInForNCCL.instances  # created on first use
    dev = FakeCudaArray(np.full(4, r + 1.0, np.float32))
    gpucoll.all_reduce(dev)
    assert dev.a.tolist() == [n * (n + 1) / 2] * 4
    host = np.full(2, r, np.int64)
    gpucoll.all_reduce(host)  # host memory: the group's CPU backend
    assert host.tolist() == [n * (n - 1) // 2] * 2
    out = FakeCudaArray(np.empty(2 * n, np.float32))
    w = gpucoll.all_gather_single(out, FakeCudaArray(np.full(2, r, np.float32)), async_op=True)
    assert w is not None and w.wait()
    assert out.a.tolist() == [float(q) for q in range(n) for _ in range(2)]
    with pytest.raises(TypeError, match="cannot mix memory kinds"):
        gpucoll.all_gather_single(np.empty(2 * n, np.float32), FakeCudaArray(np.zeros(2, np.float32)))
    objs: list[Any] = [None] * n
    gpucoll.all_gather_object(objs, r)
    gpucoll.barrier()
    assert objs == list(range(n))
    sub = gpucoll.new_group([0, n - 1])
    if r in (0, n - 1):
        v = FakeCudaArray(np.array([r], np.int32))
        gpucoll.broadcast(v, src=n - 1, group=sub)
        assert v.a.tolist() == [n - 1]
    (stand_in,) = HostStandInForNCCL.instances[:1]
    assert stand_in.device_id == 0
    gpucoll.destroy_process_group()
    return stand_in.calls


def test_nccl_groups_send_device_arrays_to_the_device_backend() -> None:
    calls = run_spmd(nccl_dispatch_body, 3, init=False, timeout=90)
    # objects and the barrier never went to the device backend
    assert calls == [["all_reduce", "all_gather_single", "shutdown"]] * 3


def coalesced_aliasing_body() -> list[Any]:
    import gpucoll

    r, n = gpucoll.get_rank(), gpucoll.get_world_size()
    x = np.array([r + 1], np.int64)
    w = gpucoll.all_reduce_coalesced([x, x], async_op=True)  # torch's test: 2 * [t]
    assert w is not None
    got = w.wait()
    assert isinstance(got, list) and got[0] is x and got[1] is x
    base = np.arange(4, dtype=np.float32) + r
    with pytest.raises(ValueError, match="overlaps tensors\\[0\\]"):
        gpucoll.all_reduce_coalesced([base[:3], base[1:]])
    with pytest.raises(ValueError, match="tensors with different dtypes"):
        gpucoll.all_reduce_coalesced([base, x])
    return [int(x[0]), n]


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_reduce_coalesced_same_array_twice_is_reduced_once(world_size: int) -> None:
    # reduced once: the sum over ranks of r + 1 (twice would be world_size times that)
    want = world_size * (world_size + 1) // 2
    assert run_spmd(coalesced_aliasing_body, world_size, timeout=60) == [[want, world_size]] * world_size


def noncontiguous_inputs_body() -> bool:
    import gpucoll
    from gpucoll.array import NotContiguousError

    r, n = gpucoll.get_rank(), gpucoll.get_world_size()

    def data(q: int) -> np.ndarray:
        return np.arange(24, dtype=np.float64).reshape(4, 6) + 100 * q

    for view in (lambda a: a[:, ::2], lambda a: a.T, lambda a: a[::2, 1:5]):
        src = data(r)
        x = view(src)
        assert not x.flags.c_contiguous
        before = src.copy()
        outs = [np.empty(x.shape) for _ in range(n)]
        gpucoll.all_gather(outs, x)
        for q in range(n):
            np.testing.assert_array_equal(outs[q], view(data(q)))
        gl = [np.empty(x.shape) for _ in range(n)] if r == 1 else None
        gpucoll.gather(x, gl, dst=1)
        if gl is not None:
            for q in range(n):
                np.testing.assert_array_equal(gl[q], view(data(q)))
        np.testing.assert_array_equal(src, before)  # the input is only read
    # a single array written in place: still refused, naming the argument (torch's gloo
    # writes such an output as if it were contiguous)
    with pytest.raises(NotContiguousError, match="tensor"):
        gpucoll.all_reduce(data(r)[:, ::2])
    # the arrays of an output list may be views: filled in, the rest of their base untouched,
    # sync and async, small (run inline) and large (past the inline size)
    for rows, async_op in ((4, False), (4, True), (1 << 16, True), (1 << 16, False)):
        mine = np.arange(rows * 3, dtype=np.float64).reshape(rows, 3) + 100 * r
        bases = [np.full((rows, 6), -1.0) for _ in range(n)]
        outs = [b[:, ::2] for b in bases]
        work = gpucoll.all_gather(outs, mine, async_op=async_op)
        if async_op:
            assert work is not None and work.wait() is True and work.is_completed()
            assert all(a is b for a, b in zip(work.result(), outs))  # the caller's arrays, not stand-ins
        for q in range(n):
            np.testing.assert_array_equal(bases[q][:, ::2], mine - 100 * r + 100 * q)
            np.testing.assert_array_equal(bases[q][:, 1::2], -1.0)
    return True


def test_all_gather_and_gather_copy_a_non_contiguous_input() -> None:
    assert run_spmd(noncontiguous_inputs_body, 3, timeout=60) == [True] * 3
