"""The single-copy large all_reduce (process_vm_readv, gpucoll/_backends/cpu/cma.py).

Checked: results bit for bit against the NumPy oracle at world sizes 2-4 for every kind
of fold the path takes (plain ufuncs, AVG of floats and integers, low-precision floats,
PREMUL_SUM; ranks >= 2 fold through rank 0's scratch chunk, or a scratch block when widening), that ops past ``CMA_MIN_BYTES``
do read the peers' memory and smaller ones do not, and the fallback to the segment's
copies when one rank refuses (``GPUCOLL_CPU_CMA=0``) or the kernel says EPERM: every rank
then takes the other algorithm alike, with the same results; and per op, when one rank's
array cannot be read (memory mapped from a device). Ranks that disagree on the
algorithm fail on every rank instead of reading an address not published for the op. A
peer that dies inside a single-copy op is named, and a read of a dead process raises an
error naming the rank. (A filled all_reduce mixed with a plain one across ranks, past
4 MiB: tests/cpu/test_all_reduce_gathered.py.)
"""

from __future__ import annotations

import errno
import os
from typing import Any

import numpy as np
import pytest

from gpucoll.testing import run_spmd

from test_cpu_backend import buf, data, make_backend, ref_reduce, reduce_op, same

CASES = (("float32", "SUM", 1_100_003), ("float32", "AVG", 1_048_577), ("int32", "AVG", 1_100_001),
         ("int64", "MAX", 600_001), ("bfloat16", "AVG", 2_200_003), ("float64", "PREMUL_SUM", 600_007),
         ("uint8", "BXOR", 4_400_001), ("complex64", "AVG", 600_011), ("float64", "MIN", 1 << 20))


def _counting(be: Any) -> list[int]:
    """Count the peer reads of ``be``'s single-copy reader (none when it has none), not the
    probes of this rank's own array."""
    calls = [0]
    reader = be._coll._cma
    if reader is not None:
        real = reader.read

        def read(peer: int, *args: Any) -> None:
            calls[0] += peer != be.rank
            real(peer, *args)

        reader.read = read
    return calls


def _run_cases(be: Any, r: int, n: int, tag: int) -> int:
    checks = 0
    for case, (dtype, op, numel) in enumerate(CASES):
        x = data(r, numel, dtype, 100 * tag + case, op)
        be.all_reduce(buf(x), reduce_op(op)).wait()
        want = ref_reduce([data(p, numel, dtype, 100 * tag + case, op) for p in range(n)], op)
        same(x, want, f"all_reduce {op} {dtype} x{numel} (rank {r} of {n}, cma {be._coll._cma is not None})")
        checks += 1
    return checks


def single_copy_body() -> dict[str, Any]:
    from gpucoll._backends.cpu import cma
    from gpucoll._backends.cpu.cma import MIN_BYTES as CMA_MIN_BYTES

    r, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out: dict[str, Any] = {}

    # Every rank may read every peer here: the group reads directly past CMA_MIN_BYTES.
    be = make_backend("cma", transport="shm")
    assert be._coll._cma is not None, be._coll.cma_unavailable
    calls = _counting(be)
    out["checks"] = _run_cases(be, r, n, 1)
    out["reads"] = calls[0]
    small = np.full((CMA_MIN_BYTES - 4) // 4, r + 1, np.float32)  # just below: the bulk buffers
    calls[0] = 0
    be.all_reduce(buf(small), reduce_op("SUM")).wait()
    assert (small == n * (n + 1) // 2).all()
    out["reads_below_min"] = calls[0]
    # The caller may write its array as soon as the op returns: peers are done reading it.
    for k in range(3):
        y = np.full(CMA_MIN_BYTES // 8, float(r + k), np.float64)
        be.all_reduce(buf(y), reduce_op("SUM")).wait()
        assert (y == sum(p + k for p in range(n))).all(), (k, y[:4])
        y[:] = -1.0

    # One rank's array cannot be read (device-mapped memory, simulated on the last rank):
    # every rank runs that op through the bulk buffers, without an error, and reads nothing.
    real_readable = cma.readable
    if r == n - 1:
        cma.readable = lambda *_: False
    try:
        for case, (dtype, op, numel) in enumerate(CASES[:3]):
            calls[0] = 0
            x = data(r, numel, dtype, 300 + case, op)
            be.all_reduce(buf(x), reduce_op(op)).wait()
            same(x, ref_reduce([data(p, numel, dtype, 300 + case, op) for p in range(n)], op), f"unreadable {op}")
            assert calls[0] == 0, calls
    finally:
        cma.readable = real_readable
    x = data(r, 1_100_003, "float32", 9)  # and the next one reads again
    be.all_reduce(buf(x), reduce_op("SUM")).wait()
    same(x, ref_reduce([data(p, 1_100_003, "float32", 9) for p in range(n)], "SUM"), "readable again")
    out["reads_after_unreadable"] = calls[0]
    be.shutdown()

    # Ranks that disagree on the algorithm (a bug, simulated): an error on every rank, never
    # a read of an address the peer did not publish for this op.
    from gpucoll.errors import DistBackendError

    be = make_backend("split", transport="shm", timeout=20.0)
    if r == n - 1:
        be._coll._cma = None
    x = np.ones(CMA_MIN_BYTES // 4, np.float32)
    with pytest.raises(DistBackendError, match="did not publish its array" if r < n - 1 else "rank"):
        be.all_reduce(buf(x), reduce_op("SUM")).wait()
    be.shutdown()

    # One rank refuses: every rank keeps the segment's copies, with the same results.
    if r == n - 1:
        os.environ[cma.ENV] = "0"
    try:
        be = make_backend("nocma", transport="shm")
    finally:
        os.environ.pop(cma.ENV, None)
    assert be._coll._cma is None and f"{cma.ENV}=0" in be._coll.cma_unavailable, be._coll.cma_unavailable
    out["checks"] += _run_cases(be, r, n, 2)
    be.shutdown()

    # The kernel refuses (EPERM, as under Yama's ptrace_scope or a seccomp profile) on rank 0.
    real_readv = cma._readv

    def refused(*_: Any) -> int:
        import ctypes

        ctypes.set_errno(errno.EPERM)
        return -1

    if r == 0:
        cma._readv = refused
    try:
        be = make_backend("eperm", transport="shm")
    finally:
        cma._readv = real_readv
    assert be._coll._cma is None and "rank 0 could not read" in be._coll.cma_unavailable, be._coll.cma_unavailable
    x = data(r, 1_100_003, "float32", 7)
    be.all_reduce(buf(x), reduce_op("SUM")).wait()
    same(x, ref_reduce([data(p, 1_100_003, "float32", 7) for p in range(n)], "SUM"), "all_reduce after EPERM")
    be.shutdown()
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_single_copy_all_reduce_and_its_fallbacks(world: int) -> None:
    results = run_spmd(single_copy_body, world, init=False, timeout=240)
    for res in results:
        assert res["checks"] == 2 * len(CASES)
        assert res["reads"] >= len(CASES) * (world - 1) * 2, res  # reduce-scatter and all-gather reads
        assert res["reads_below_min"] == 0, res
        assert res["reads_after_unreadable"] > 0, res


def dies_inside_body() -> float:
    """Rank 1 (a forked stand-in) posts step 1 of a single-copy all_reduce and dies."""
    import time

    from gpucoll.errors import DistBackendError

    r = int(os.environ["RANK"])
    if r == 1:
        pid = os.fork()
        if pid == 0:
            try:
                be = make_backend("die", transport="shm")
                assert be._coll._cma is not None
                be.barrier().wait()
                seg = be._coll.seg
                real_post = seg.post

                def post_then_die() -> None:
                    real_post()
                    os._exit(3)

                seg.post = post_then_die
                be.all_reduce(buf(np.ones(2 << 20, np.float32)), reduce_op("SUM")).wait()
            finally:
                os._exit(4)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 3, status
        return 0.0
    be = make_backend("die", transport="shm", timeout=30.0)
    be.barrier().wait()
    x = np.ones(2 << 20, np.float32)
    t0 = time.monotonic()
    with pytest.raises(DistBackendError, match="rank 1"):
        be.all_reduce(buf(x), reduce_op("SUM")).wait()
    took = time.monotonic() - t0
    be.shutdown()
    return took


def test_a_peer_that_dies_inside_a_single_copy_all_reduce_is_named() -> None:
    took = run_spmd(dies_inside_body, 2, init=False, timeout=120)[0]
    assert took < 5.0, took


def test_reading_a_dead_process_names_the_rank() -> None:
    import ctypes

    from gpucoll._backends.cpu import cma

    word = ctypes.c_uint64(0x1234)
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    reader = cma.CmaReader([os.getpid(), pid])
    got = ctypes.c_uint64(0)
    with pytest.raises(OSError) as info:
        reader.read(1, ctypes.addressof(got), ctypes.addressof(word), 8)
    assert info.value.errno == errno.ESRCH
    err = cma.read_error("all_reduce #3", 1, info.value, lambda peer: None)
    assert "rank 1" in str(err) and "all_reduce #3" in str(err)
    dead = cma.read_error("all_reduce #3", 1, info.value, lambda peer: "died (its connection closed)")
    assert str(dead) == "all_reduce #3: rank 1 died (its connection closed)"
    # A live process (this one) reads fine.
    cma.CmaReader([os.getpid()]).read(0, ctypes.addressof(got), ctypes.addressof(word), 8)
    assert got.value == 0x1234
