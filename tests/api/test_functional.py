"""gpucoll.functional: out-of-place collectives that return the caller's array type."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gpucoll.testing import run_spmd

from _fake_arrays import skip_without_jax


def rank_data(rank: int, shape: tuple[int, ...] = (4, 3)) -> np.ndarray:
    return (np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) + 100 * rank)


def numpy_body() -> str:
    import gpucoll
    import gpucoll.functional as F

    r, n = gpucoll.get_rank(), gpucoll.get_world_size()
    every = [rank_data(q) for q in range(n)]
    x = every[r].copy()
    before = x.copy()

    y = F.all_reduce(x)
    assert type(y) is np.ndarray and y is not x
    np.testing.assert_array_equal(y, sum(every))
    np.testing.assert_array_equal(x, before)  # input untouched

    np.testing.assert_array_equal(F.all_reduce(x, op=gpucoll.ReduceOp.MAX), every[-1])
    ys = F.all_reduce_coalesced([x, x[:1]])
    np.testing.assert_array_equal(ys[1], sum(e[:1] for e in every))

    np.testing.assert_array_equal(F.broadcast(x, src=n - 1), every[-1])
    red = F.reduce(x, dst=0)
    assert (red is None) == (r != 0)
    if r == 0:
        np.testing.assert_array_equal(red, sum(every))

    np.testing.assert_array_equal(F.all_gather(x), np.concatenate(every, axis=0))
    np.testing.assert_array_equal(F.all_gather(x, axis=1), np.concatenate(every, axis=1))
    np.testing.assert_array_equal(F.all_gather(x, axis=-1), np.concatenate(every, axis=1))
    assert F.all_gather(np.array(float(r))).tolist() == [float(q) for q in range(n)]

    big = [rank_data(q, (2 * n, 3)) for q in range(n)]
    np.testing.assert_array_equal(F.reduce_scatter(big[r]), sum(big)[2 * r:2 * r + 2])
    wide = [rank_data(q, (2, 3 * n)) for q in range(n)]
    np.testing.assert_array_equal(F.reduce_scatter(wide[r], axis=1), sum(wide)[:, 3 * r:3 * r + 3])

    a2a_in = [rank_data(q, (n, 2)) for q in range(n)]
    np.testing.assert_array_equal(F.all_to_all_single(a2a_in[r]), np.stack([a[r] for a in a2a_in]))

    # non-contiguous input: copied, not refused (the in-place API refuses it)
    strided = rank_data(r, (4, 6))[:, ::2]
    assert not strided.flags.c_contiguous
    np.testing.assert_array_equal(F.all_reduce(strided), sum(rank_data(q, (4, 6))[:, ::2] for q in range(n)))
    with pytest.raises(ValueError, match="C-contiguous"):
        gpucoll.all_reduce(strided)
    # read-only input is fine here
    ro = x.copy()
    ro.flags.writeable = False
    np.testing.assert_array_equal(F.all_reduce(ro), sum(every))
    with pytest.raises(ValueError, match="not divisible"):
        F.reduce_scatter(np.zeros((2 * n + 1, 2)))
    return "ok"


def jax_body() -> list[str]:
    import jax
    import jax.numpy as jnp
    import ml_dtypes

    import gpucoll
    import gpucoll.functional as F

    r, n = gpucoll.get_rank(), gpucoll.get_world_size()
    every = [rank_data(q) for q in range(n)]
    x = jnp.asarray(every[r])
    with pytest.raises(ValueError, match="immutable"):
        gpucoll.all_reduce(x)
    kinds = []
    y = F.all_reduce(x)
    assert isinstance(y, jax.Array) and y.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(y), sum(every))
    np.testing.assert_array_equal(np.asarray(x), every[r])
    kinds.append(type(y).__name__)

    g = F.all_gather(x, axis=1)
    assert isinstance(g, jax.Array)
    np.testing.assert_array_equal(np.asarray(g), np.concatenate(every, axis=1))
    b = F.broadcast(x, src=0)
    assert isinstance(b, jax.Array)
    np.testing.assert_array_equal(np.asarray(b), every[0])
    rs = F.reduce_scatter(jnp.asarray(rank_data(r, (2 * n, 2))))
    np.testing.assert_array_equal(np.asarray(rs), sum(rank_data(q, (2 * n, 2)) for q in range(n))[2 * r:2 * r + 2])

    # bfloat16 and int32 keep their dtype; jitted code can use the result
    xb = jnp.asarray(np.full(5, r + 1, ml_dtypes.bfloat16))
    yb = F.all_reduce(xb)
    assert isinstance(yb, jax.Array) and yb.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(yb).astype(np.float32), np.full(5, n * (n + 1) / 2))
    xi = jnp.arange(4, dtype=jnp.int32) * (r + 1)
    yi = F.all_reduce(xi, op=gpucoll.ReduceOp.BXOR)
    want = np.bitwise_xor.reduce([np.arange(4, dtype=np.int32) * (q + 1) for q in range(n)])
    assert yi.dtype == jnp.int32 and np.asarray(jax.jit(lambda v: v + 0)(yi)).tolist() == want.tolist()
    kinds.append(str(yb.dtype))
    return kinds


@pytest.mark.parametrize("world_size", [2, 3])
def test_functional_numpy(world_size: int) -> None:
    assert run_spmd(numpy_body, world_size, timeout=90) == ["ok"] * world_size


def test_functional_jax_cpu_arrays() -> None:
    skip_without_jax()
    out = run_spmd(jax_body, 2, timeout=120, env={"JAX_PLATFORMS": "cpu"})
    assert out[0][1] == "bfloat16" and out[0] == out[1]


def test_functional_world_of_one_keeps_types() -> None:
    import gpucoll
    import gpucoll.functional as F
    from gpucoll.store import HashStore

    gpucoll.init_process_group("cpu", store=HashStore(), rank=0, world_size=1, timeout=20)
    try:
        buf = bytearray(b"\x01\x02")
        out: Any = F.all_reduce(buf)
        assert isinstance(out, np.ndarray) and out.tolist() == [1, 2]
        assert buf == bytearray(b"\x01\x02")
    finally:
        gpucoll.destroy_process_group()


def cupy_body() -> str:
    import cupy

    import gpucoll
    import gpucoll.functional as F

    assert gpucoll.get_backend() == "nccl"
    x = cupy.arange(4, dtype=cupy.float32)
    y = F.all_reduce(x)
    assert isinstance(y, cupy.ndarray) and y.data.ptr != x.data.ptr
    g = F.all_gather(x.reshape(2, 2), axis=1)
    gpucoll.all_reduce(x)  # in place, ordered on the current stream
    cupy.cuda.get_current_stream().synchronize()
    assert cupy.asnumpy(y).tolist() == [0, 1, 2, 3] and g.shape == (2, 2)
    assert cupy.asnumpy(x).tolist() == [0, 1, 2, 3]
    return "ok"


@pytest.mark.gpu
def test_functional_cupy_on_nccl_world_of_one() -> None:
    assert run_spmd(cupy_body, 1, backend="nccl", timeout=240) == ["ok"]
