"""The CPU backend used directly (no ProcessGroup): every collective, ReduceOp and dtype
against NumPy references, over shared memory and over TCP, with world sizes 1 to 4.

Each rank builds its inputs from (rank, case) alone, so every rank can compute every
other rank's inputs and the expected result independently of the backend. Reductions
are folded in rank order, widening float16/bfloat16/float8 to float32 (the documented
order), so float results must match exactly.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable

import numpy as np
import pytest

from gpucoll.testing import run_spmd

from _reference import np_dtype, reference

LOW = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
          "float8_e4m3fn", "float8_e5m2")
OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM")


# ----- helpers used inside the ranks -----

def buf(a: np.ndarray[Any, Any]) -> Any:
    """A Buffer over a NumPy array (the array layer's job, done by hand here)."""
    from gpucoll._buffer import Buffer, Device, dtype_by_name

    assert a.flags.c_contiguous
    return Buffer(a.ctypes.data, a.nbytes, dtype_by_name(a.dtype.name), a.shape, Device("cpu"),
                  readonly=not a.flags.writeable, owner=a)


def make_backend(name: str, *, transport: str = "auto", timeout: float = 30.0) -> Any:
    """A CPUBackend for this rank over the job's TCPStore, in namespace ``name``."""
    from gpucoll._backends.cpu.backend import TRANSPORT_ENV, CPUBackend
    from gpucoll.clusters.base import STORE_TOKEN_ENV
    from gpucoll.store import PrefixStore, TCPStore

    os.environ[TRANSPORT_ENV] = transport
    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout=timeout,
                     token=os.environ[STORE_TOKEN_ENV])
    return CPUBackend(PrefixStore(name, store), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                      timeout=timeout, group_name=name)


def data(rank: int, n: int, dtype: str, case: int, op: str = "SUM") -> np.ndarray[Any, Any]:
    """Rank ``rank``'s deterministic input: small values, so integer folds do not overflow."""
    rng = np.random.default_rng([rank, case, n])
    dt = np_dtype(dtype)
    if dtype == "bool":
        return rng.integers(0, 2, n).astype(bool)
    if dt.kind in "iu":
        lo, hi = (1, 3) if op == "PRODUCT" else (0 if dt.kind == "u" else -20, 20)
        return rng.integers(lo, hi + 1, n).astype(dt)
    if dtype in LOW:
        return rng.choice(np.array([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0]), n).astype(dt)
    vals = rng.standard_normal(n)
    if dt.kind == "c":
        vals = vals + 1j * rng.standard_normal(n)
    return vals.astype(dt)


def ref_reduce(parts: list[np.ndarray[Any, Any]], op: str) -> np.ndarray[Any, Any]:
    """The one oracle (tests/_reference.py), which the CPU backend meets bit for bit."""
    return reference(parts, parts[0].dtype.name, op)


def valid(op: str, dtype: str) -> bool:
    kind = np_dtype(dtype).kind
    if op in ("BAND", "BOR", "BXOR"):
        return kind in "biu"
    if op in ("MIN", "MAX"):
        return kind != "c"
    if op == "AVG":
        return kind != "b"
    if op == "PREMUL_SUM":
        return kind in "fc" or dtype in LOW
    return True


def reduce_op(op: str) -> Any:
    from gpucoll._reduce_op import ReduceOp, make_premul_sum

    return make_premul_sum(0.5) if op == "PREMUL_SUM" else ReduceOp[op]


def same(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any], what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    ok = np.array_equal(a.view(np.uint8), b.view(np.uint8)) or np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")
    if not ok:
        bad = np.flatnonzero(a != b)[:5]
        raise AssertionError(f"{what}: mismatch at {bad.tolist()}: got {a[bad]!r}, want {b[bad]!r}")


# ----- the SPMD bodies -----

def collectives_body(transport: str) -> dict[str, Any]:
    """Every collective on this rank, checked against references; returns what ran."""
    be = make_backend("coll", transport=transport)
    r, n = be.rank, be.size
    checks = 0

    def check(got: np.ndarray[Any, Any], want: np.ndarray[Any, Any], what: str) -> None:
        nonlocal checks
        same(got, want, f"{what} (rank {r} of {n}, {be.transport})")
        checks += 1

    # Every ReduceOp with every dtype (small arrays: one step; and a large float/int/bf16 case).
    case = 0
    for dtype in DTYPES:
        for op in OPS:
            case += 1
            x = data(r, 7, dtype, case, op)
            if not valid(op, dtype):
                with pytest.raises(TypeError):
                    be.all_reduce(buf(x), reduce_op(op))
                continue
            be.all_reduce(buf(x), reduce_op(op)).wait()
            check(x, ref_reduce([data(p, 7, dtype, case, op) for p in range(n)], op), f"all_reduce {op} {dtype}")
    for dtype, op, numel in (("float32", "SUM", 700_001), ("int64", "MAX", 300_003), ("bfloat16", "AVG", 600_001),
                             ("float64", "PREMUL_SUM", 40_000), ("int32", "AVG", 1 << 18), ("uint8", "BXOR", 5_000_000),
                             # AVG of floats past the small slot: the sum divided as it is copied out
                             ("float32", "AVG", 700_001), ("float64", "AVG", 300_007), ("complex64", "AVG", 200_003)):
        case += 1
        x = data(r, numel, dtype, case, op)
        be.all_reduce(buf(x), reduce_op(op)).wait()
        check(x, ref_reduce([data(p, numel, dtype, case, op) for p in range(n)], op), f"all_reduce {op} {dtype} x{numel}")

    # special values past the small slot (the folded sums are copied out by a multiplication
    # by one, AVG's by 1/n): subnormals, signed zeros, infinities, NaN and the largest
    # finite values keep their bits
    for dtype in ("float32", "float64"):
        for op in ("SUM", "AVG", "MAX"):
            case += 1
            info = np.finfo(np.dtype(dtype))
            special = np.array([info.smallest_subnormal, -info.smallest_subnormal * 3, -0.0, 0.0, np.inf, -np.inf,
                                np.nan, info.max, -info.max / 2, info.tiny, 1.0, -2.5], dtype)
            x = np.resize(np.roll(special, r), 300_007)
            be.all_reduce(buf(x), reduce_op(op)).wait()
            want = ref_reduce([np.resize(np.roll(special, p), 300_007) for p in range(n)], op)
            check(x, want, f"all_reduce {op} {dtype} special values")

    # reduce to the last rank; non-destination inputs stay unchanged.
    for numel, op in ((5, "SUM"), (400_003, "SUM"), (400_003, "AVG")):
        case += 1
        x = data(r, numel, "float32", case)
        be.reduce(buf(x), n - 1, reduce_op(op)).wait()
        want = ref_reduce([data(p, numel, "float32", case) for p in range(n)], op) if r == n - 1 \
            else data(r, numel, "float32", case)
        check(x, want, f"reduce {op} x{numel}")

    # reduce_scatter (list and single): rank j's input j goes to rank j.
    for numel in (3, 150_001):
        case += 1
        inputs = [data(r * n + j, numel, "int32", case, "MIN") for j in range(n)]
        out = np.empty(numel, np.int32)
        be.reduce_scatter(buf(out), [buf(i) for i in inputs], reduce_op("MIN")).wait()
        check(out, ref_reduce([data(p * n + r, numel, "int32", case) for p in range(n)], "MIN"), f"reduce_scatter x{numel}")
        flat = np.concatenate(inputs)
        out[:] = 0
        be.reduce_scatter_single(buf(out), buf(flat), reduce_op("SUM")).wait()
        check(out, ref_reduce([data(p * n + r, numel, "int32", case) for p in range(n)], "SUM"),
              f"reduce_scatter_single x{numel}")

    # broadcast from the last rank, small and pipelined.
    for numel in (1, 9, 3_000_017):
        case += 1
        x = data(r, numel, "float64", case)
        be.broadcast(buf(x), n - 1).wait()
        check(x, data(n - 1, numel, "float64", case), f"broadcast x{numel}")

    # all_gather (list, single, in place, coalesced), gather, scatter.
    for numel in (0, 11, 700_001):
        case += 1
        inp = data(r, numel, "int16", case)
        outs = [np.empty(numel, np.int16) for _ in range(n)]
        be.all_gather([buf(o) for o in outs], buf(inp)).wait()
        for p in range(n):
            check(outs[p], data(p, numel, "int16", case), f"all_gather x{numel} from {p}")
        flat = np.empty(n * numel, np.int16)
        be.all_gather_single(buf(flat), buf(inp)).wait()
        check(flat, np.concatenate([data(p, numel, "int16", case) for p in range(n)]), f"all_gather_single x{numel}")
        flat[:] = 0
        flat[r * numel:(r + 1) * numel] = inp
        be.all_gather_single(buf(flat), buf(flat[r * numel:(r + 1) * numel])).wait()
        check(flat, np.concatenate([data(p, numel, "int16", case) for p in range(n)]), f"in-place all_gather x{numel}")
        dst = n // 2
        gl = [np.empty(numel, np.int16) for _ in range(n)] if r == dst else None
        be.gather([buf(o) for o in gl] if gl else None, buf(inp), dst).wait()
        if gl is not None:
            for p in range(n):
                check(gl[p], data(p, numel, "int16", case), f"gather x{numel} from {p}")
        src = n - 1
        sl = [data(100 + j, numel, "int16", case) for j in range(n)] if r == src else None
        out = np.empty(numel, np.int16)
        be.scatter(buf(out), [buf(s) for s in sl] if sl else None, src).wait()
        check(out, data(100 + r, numel, "int16", case), f"scatter x{numel}")
    case += 1
    a, b = data(r, 5, "float32", case), data(r, 300_000, "uint8", case)
    oa = [np.empty(5, np.float32) for _ in range(n)]
    ob = [np.empty(300_000, np.uint8) for _ in range(n)]
    be.all_gather_coalesced([[buf(o) for o in oa], [buf(o) for o in ob]], [buf(a), buf(b)]).wait()
    for p in range(n):
        check(oa[p], data(p, 5, "float32", case), "all_gather_coalesced a")
        check(ob[p], data(p, 300_000, "uint8", case), "all_gather_coalesced b")
    xs = [data(r, 6, "float32", case), data(r, 200_001, "int64", case), data(r, 3, "complex128", case)]
    be.all_reduce_coalesced([buf(x) for x in xs], reduce_op("SUM")).wait()
    for k, (numel, dt) in enumerate(((6, "float32"), (200_001, "int64"), (3, "complex128"))):
        check(xs[k], ref_reduce([data(p, numel, dt, case) for p in range(n)], "SUM"), f"all_reduce_coalesced {k}")

    # all_to_all with uneven (and empty) pieces; all_to_all_single with splits, also in place.
    for scale in (1, 90_001):
        case += 1

        def piece(i: int, j: int) -> np.ndarray[Any, Any]:
            return data(i * n + j, ((i + 2 * j) % 3) * scale, "float32", case)

        ins = [piece(r, j) for j in range(n)]
        outs = [np.empty(((j + 2 * r) % 3) * scale, np.float32) for j in range(n)]
        be.all_to_all([buf(o) for o in outs], [buf(i) for i in ins]).wait()
        for p in range(n):
            check(outs[p], piece(p, r), f"all_to_all x{scale} from {p}")
        flat_in = np.concatenate(ins)
        flat_out = np.empty(sum(o.size for o in outs), np.float32)
        be.all_to_all_single(buf(flat_out), buf(flat_in), [o.size for o in outs], [i.size for i in ins]).wait()
        check(flat_out, np.concatenate([piece(p, r) for p in range(n)]), f"all_to_all_single x{scale}")
        sq = np.concatenate([data(r * n + j, scale, "int64", case) for j in range(n)])
        be.all_to_all_single(buf(sq), buf(sq), [scale] * n, [scale] * n).wait()
        check(sq, np.concatenate([data(p * n + r, scale, "int64", case) for p in range(n)]),
              f"in-place all_to_all_single x{scale}")

    # Async ops complete in issue order with the right data; barrier.
    works, arrays = [], []
    for k in range(4):
        x = data(r, 300_000 if k % 2 else 10, "float32", 1000 + k)
        arrays.append(x)
        works.append(be.all_reduce(buf(x), reduce_op("SUM")))
    works.append(be.barrier())
    for k, w in enumerate(works[:-1]):
        w.wait()
        numel = 300_000 if k % 2 else 10
        check(arrays[k], ref_reduce([data(p, numel, "float32", 1000 + k) for p in range(n)], "SUM"), f"async {k}")
    works[-1].wait()
    assert all(w.is_completed() and w.is_success() for w in works)

    p2p = p2p_checks(be) if n > 1 else 0
    be.shutdown()
    be.shutdown()  # idempotent
    return {"transport": be.transport, "checks": checks, "p2p": p2p}


def p2p_checks(be: Any) -> int:
    """send/recv, tags, any-source, FIFO order, batch ring, a large message, a bad size."""
    from gpucoll.errors import DistBackendError

    r, n = be.rank, be.size
    done = 0
    # Tags pick the message: rank 0 sends tag 1 then tag 2 to rank 1, which receives 2 first.
    if r == 0:
        be.send(buf(np.full(3, 1.0)), 1, 1).wait()
        be.send(buf(np.full(3, 2.0)), 1, 2).wait()
    elif r == 1:
        a, b = np.empty(3), np.empty(3)
        be.recv(buf(b), 0, 2).wait()
        be.recv(buf(a), 0, 1).wait()
        assert a[0] == 1.0 and b[0] == 2.0
        done += 1
    # Any source: rank 0 gets one message from every other rank; FIFO per sender and tag.
    if r == 0:
        seen = []
        for _ in range(2 * (n - 1)):
            x = np.empty(2, np.int64)
            w = be.recv(buf(x), None, 9)
            w.wait()
            assert w.source_rank() == x[0], (w.source_rank(), x)
            seen.append((int(x[0]), int(x[1])))
        for p in range(1, n):
            assert [k for s, k in seen if s == p] == [0, 1], seen
        done += 1
    else:
        for k in range(2):
            be.send(buf(np.array([r, k], np.int64)), 0, 9).wait()
    # A ring through batch_p2p, receives posted before sends, 4 MiB each.
    s = np.full(1 << 19, r, np.float64)
    got = np.empty_like(s)
    be.batch_p2p([("recv", buf(got), (r - 1) % n, 3), ("send", buf(s), (r + 1) % n, 3)]).wait()
    assert (got == (r - 1) % n).all()
    done += 1
    # A receive of the wrong size fails without breaking the group.
    if r == 0:
        be.send(buf(np.zeros(5, np.float32)), 1, 4).wait()
    elif r == 1:
        with pytest.raises(DistBackendError, match="bytes"):
            be.recv(buf(np.empty(6, np.float32)), 0, 4).wait()
        done += 1
    be.barrier().wait()
    return done


# ----- tests -----

@pytest.mark.parametrize("world,transport", [(1, "auto"), (2, "shm"), (3, "shm"), (4, "shm"), (2, "tcp"), (3, "tcp")])
def test_collectives(world: int, transport: str) -> None:
    results = run_spmd(collectives_body, world, args=(transport,), init=False, timeout=240)
    for res in results:
        assert res["transport"] == ("local" if world == 1 else transport)
        assert res["checks"] > 150
    if world > 1:
        assert results[0]["p2p"] == 2 and results[1]["p2p"] == 3


def faults_body(transport: str) -> dict[str, float]:
    """Mismatches, abort, a peer that dies, a peer that stops participating."""
    import threading
    import time

    from gpucoll.errors import DistBackendError

    r, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    times: dict[str, float] = {}

    # A peer process that dies mid-job (its sockets are closed by the kernel): rank 1
    # forks the child that plays rank 1 of group "die" and exits without shutting down.
    if r == 1:
        pid = os.fork()
        if pid == 0:
            try:
                _die_in_group(transport)
            finally:
                os._exit(4)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 3, status
    else:
        be = make_backend("die", transport=transport, timeout=30.0)
        x = np.ones(1000, np.float32)
        be.barrier().wait()
        t0 = time.monotonic()
        with pytest.raises(DistBackendError, match="rank 1"):
            be.all_reduce(buf(x), reduce_op("SUM")).wait()
        times["death"] = time.monotonic() - t0
        with pytest.raises(DistBackendError):
            be.all_reduce(buf(x), reduce_op("SUM")).wait()  # the group stays broken
        be.shutdown()

    sync = make_backend("sync", transport="tcp")
    # The shared-memory segment is gone from /dev/shm once every rank mapped it.
    if transport == "shm":
        be = make_backend("clean", transport=transport)
        sync.barrier().wait()
        assert not os.path.exists(be._coll.seg.path), be._coll.seg.path
        be.shutdown()

    # A full /dev/shm on rank 0 (posix_fallocate fails): every rank falls back to TCP alike.
    if transport == "shm":
        import errno
        from unittest import mock

        def full(*_: Any) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        with mock.patch("os.posix_fallocate", full) if r == 0 else contextlib.nullcontext():
            be = make_backend("full", transport="auto")
        assert be.transport == "tcp" and "No space left" in be.shm_unavailable, (be.transport, be.shm_unavailable)
        x = np.full(3, r, np.int32)
        be.all_reduce(buf(x), reduce_op("SUM")).wait()
        assert (x == sum(range(n))).all()
        be.shutdown()

    # Mismatched collectives raise on every rank, well before the timeout.
    small, big = np.ones(10, np.float32), np.ones(1 << 19, np.float32)
    odd = (lambda b: b.all_reduce(buf(small), reduce_op("SUM")), lambda b: b.all_reduce(buf(big), reduce_op("SUM")))
    scenarios: list[tuple[str, Callable[[Any], Any], Callable[[Any], Any]]] = [
        ("size", odd[0], lambda b: b.all_reduce(buf(np.ones(20, np.float32)), reduce_op("SUM"))),
        ("small-vs-large", odd[0], odd[1]),
        ("dtype", odd[0], lambda b: b.all_reduce(buf(np.ones(10, np.int32)), reduce_op("SUM"))),
        ("op", odd[0], lambda b: b.all_reduce(buf(small), reduce_op("MAX"))),
        ("kind", odd[0], lambda b: b.broadcast(buf(small), 0)),
        ("splits", lambda b: b.all_to_all_single(buf(np.empty(6, np.float32)), buf(np.ones(6, np.float32)),
                                                 [3] * (n - 1) + [6 - 3 * (n - 1)], [3] * (n - 1) + [6 - 3 * (n - 1)]),
         lambda b: b.all_to_all_single(buf(np.empty(8, np.float32)), buf(np.ones(8, np.float32)),
                                       [4] * (n - 1) + [8 - 4 * (n - 1)], [4] * (n - 1) + [8 - 4 * (n - 1)])),
    ]
    for name, even, odd_fn in scenarios:
        be = make_backend(f"mm-{name}", transport=transport, timeout=20.0)
        t0 = time.monotonic()
        with pytest.raises(DistBackendError, match="differ across ranks"):
            (even if r % 2 == 0 else odd_fn)(be).wait()
        times[f"mismatch-{name}"] = time.monotonic() - t0
        with pytest.raises(DistBackendError, match="unusable"):
            be.barrier().wait()
        sync.barrier().wait()
        be.shutdown()

    # abort() from another thread unblocks a rank waiting for a peer that never comes.
    be = make_backend("abort", transport=transport, timeout=20.0)
    if r == 0:
        pending = be.recv(buf(np.empty(4)), 1, 77)  # never sent: abort must fail it too
        timer = threading.Timer(0.3, be.abort, ("aborted by the test",))
        timer.start()
        t0 = time.monotonic()
        with pytest.raises(DistBackendError, match="aborted by the test"):
            be.all_reduce(buf(small), reduce_op("SUM")).wait()
        times["abort"] = time.monotonic() - t0
        with pytest.raises(DistBackendError, match="aborted by the test"):
            pending.wait(1.0)
        with pytest.raises(DistBackendError, match="aborted by the test"):
            be.barrier().wait()
    sync.barrier().wait()
    be.shutdown()

    # A peer that stops participating: every other rank fails within the timeout (+ a little).
    be = make_backend("stuck", transport=transport, timeout=2.0)
    if r == n - 1:
        time.sleep(3.0)
    else:
        t0 = time.monotonic()
        with pytest.raises(DistBackendError, match="timed out"):
            be.all_reduce(buf(big), reduce_op("SUM")).wait(10.0)
        times["stuck"] = time.monotonic() - t0
    sync.barrier().wait()
    be.shutdown()
    sync.shutdown()
    return times


def _die_in_group(transport: str) -> None:
    be = make_backend("die", transport=transport, timeout=30.0)
    be.barrier().wait()
    import time

    time.sleep(0.3)  # the peer is inside its all_reduce by now
    os._exit(3)


@pytest.mark.parametrize("world,transport", [(2, "shm"), (3, "shm"), (2, "tcp")])
def test_faults(world: int, transport: str) -> None:
    results = run_spmd(faults_body, world, args=(transport,), init=False, timeout=120)
    for r, times in enumerate(results):
        for key, seconds in times.items():
            limit = {"stuck": 2.0 + 3.0, "death": 0.3 + 3.0}.get(key, 3.0)
            assert seconds < limit, (r, key, seconds)
        if r != world - 1:
            assert times["stuck"] >= 1.9, times
    assert "death" in results[0] and "abort" in results[0]


def public_api_body() -> dict[str, Any]:
    """The same backend under the public API: default group, object collectives, async."""
    import gpucoll
    from gpucoll._world import default_group

    r, n = gpucoll.get_rank(), gpucoll.get_world_size()
    x = data(r, 300_001, "float64", 1)
    w = gpucoll.all_reduce(x, async_op=True)
    assert w is not None
    w.wait()
    same(x, ref_reduce([data(p, 300_001, "float64", 1) for p in range(n)], "SUM"), "public all_reduce")
    objs: list[Any] = [None] * n
    gpucoll.all_gather_object(objs, {"rank": r, "pad": "x" * (100 * r)})
    assert [o["rank"] for o in objs] == list(range(n))
    lst: list[Any] = [f"from {r}", r]
    gpucoll.broadcast_object_list(lst, src=n - 1)
    assert lst == [f"from {n - 1}", n - 1]
    gpucoll.barrier()
    return {"transport": getattr(default_group()._cpu, "transport")}


def test_public_api() -> None:
    results = run_spmd(public_api_body, 3, timeout=120)
    assert [res["transport"] for res in results] == ["shm"] * 3
