"""The large all_reduce pipeline without its entry step (gpucoll/_backends/cpu/shm_algos.py).

A pipelined all_reduce or reduce skips the entry step when the op before it left this
rank's first bulk buffer free: that op used no bulk buffer, or it was the pipeline
ending in the other buffer. Checked at 2-4 ranks over shared memory, in one world:
every op's result against NumPy (each op with fresh data, so a buffer overwritten
while a peer still read it would show), and the number of times each op raised this
rank's counter (2 per block, plus 1 for an entry step), after every kind of large op
that uses the bulk buffers (broadcast, all_gather, all_to_all, reduce_scatter, a single
copy all_reduce that fell back to the pipeline), after small ops and after another
pipeline, with a rank-dependent delay before some ops to vary who arrives first.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import pytest

from gpucoll.testing import run_spmd

from test_cpu_backend import buf, make_backend, reduce_op, same

MIB = 1 << 20


def _blocks(numel: int, isz: int, n: int, bulk: int) -> int:
    cap = bulk // n // 64 * 64 // isz
    return -(-numel // (cap * n))


def pipeline_entry_body() -> int:
    from gpucoll._backends.cpu import cma
    from gpucoll._backends.cpu.shm_algos import BULK_BYTES

    be = make_backend("pipe", transport="shm")
    r, n = be.rank, be.size
    coll = be._coll
    seg = coll.seg
    rng = np.random.default_rng([r, 7])
    case = [0]
    checks = 0

    def inputs(numel: int, dtype: Any, c: int) -> list[np.ndarray[Any, Any]]:
        return [np.random.default_rng([p, c, numel]).integers(-50, 50, numel).astype(dtype) for p in range(n)]

    def all_reduce(numel: int, posts: int | None, dtype: Any = np.float32, dst: int | None = None) -> None:
        """One all_reduce (or reduce to ``dst``) of fresh data; ``posts``: the counter raises
        expected with an entry step (1) or without (0) on top of 2 per block, or None."""
        nonlocal checks
        case[0] += 1
        parts = inputs(numel, dtype, case[0])
        x = parts[r].copy()
        if case[0] % 3 == r % 3:
            time.sleep(float(rng.uniform(0, 0.002)))  # vary who arrives first
        before = seg.count
        if dst is None:
            be.all_reduce(buf(x), reduce_op("SUM")).wait()
        else:
            be.reduce(buf(x), dst, reduce_op("SUM")).wait()
        want = np.sum(np.stack(parts), axis=0, dtype=dtype)
        if dst is None or r == dst:
            same(x, want, f"op {case[0]}: {numel} x {np.dtype(dtype).name}, rank {r} of {n}")
        if posts is not None:
            got = seg.count - before
            expected = 2 * _blocks(numel, np.dtype(dtype).itemsize, n, BULK_BYTES) + posts
            assert got == expected, (f"op {case[0]} ({numel} elements): raised the counter {got} times, "
                                     f"expected {expected} ({'with' if posts else 'without'} the entry step)")
        checks += 1

    def small() -> None:
        y = np.full(5, r + 1.0, np.float32)
        be.all_reduce(buf(y), reduce_op("SUM")).wait()
        assert (y == n * (n + 1) / 2).all(), y

    one = 300_001  # one block of float32 at any world size here; more than a small slot
    many = 700_003  # three or more blocks
    for _ in range(2):
        all_reduce(one, None)  # (the op before: whatever ran last)
        all_reduce(one, 0)  # after a one-block pipeline
        all_reduce(many, 0)
        all_reduce(one, 0)  # after a pipeline of several blocks
        all_reduce(many // 2, 0, np.int64)
        all_reduce(one, 0, dst=n - 1)  # a reduce is the same pipeline
        all_reduce(many, 0)
        small()
        all_reduce(one, 0)  # after a small op, before it a pipeline: skipped
        big = np.full(3 * MIB // 4 + 5, float(r), np.float32)
        be.broadcast(buf(big), 1).wait()
        assert (big == 1.0).all()
        all_reduce(one, 1)  # right after a broadcast through the bulk buffers: the entry step
        be.broadcast(buf(big), 0).wait()
        small()
        all_reduce(many, 0)  # a small op between: the broadcast's buffers are free
        outs = [np.empty(MIB // 4, np.float32) for _ in range(n)]
        be.all_gather([buf(o) for o in outs], buf(np.full(MIB // 4, float(r), np.float32))).wait()
        assert all((outs[p] == p).all() for p in range(n))
        all_reduce(many, 1)
        sends = [np.full(MIB // 4, float(10 * r + p), np.float32) for p in range(n)]
        recvs = [np.empty(MIB // 4, np.float32) for _ in range(n)]
        be.all_to_all([buf(o) for o in recvs], [buf(s) for s in sends]).wait()
        assert all((recvs[p] == 10 * p + r).all() for p in range(n))
        all_reduce(one, 1)
        out = np.empty(MIB // 4, np.float32)
        be.reduce_scatter(buf(out), [buf(np.full(MIB // 4, 1.0, np.float32)) for _ in range(n)],
                          reduce_op("SUM")).wait()
        assert (out == n).all()
        all_reduce(one, 1)
    # A single-copy all_reduce that falls back to the pipeline (the last rank's array cannot
    # be read): its step 1 is the entry step; the pipeline after it skips its own.
    if coll._cma is not None:
        real = cma.readable
        if r == n - 1:
            cma.readable = lambda *_: False
        try:
            all_reduce(cma.MIN_BYTES // 4, 1)
        finally:
            cma.readable = real
        all_reduce(one, 0)
        all_reduce(cma.MIN_BYTES // 4, None)  # read directly (no bulk buffer)
        all_reduce(many, 0)
    be.shutdown()
    return checks


@pytest.mark.parametrize("world", [2, 3, 4])
def test_pipeline_skips_its_entry_step_only_where_the_buffer_is_free(world: int) -> None:
    results = run_spmd(pipeline_entry_body, world, init=False, timeout=240)
    assert all(c >= 30 for c in results), results
