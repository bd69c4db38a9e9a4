"""gpucoll.functional inside jax.jit (XLA FFI custom calls) on the CPU backend, against
NumPy as the reference, at world sizes 1-4. JAX runs only inside the ranks."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gpucoll.testing import run_spmd

from _fake_arrays import skip_without_jax

REDUCERS = {"sum": np.add, "product": np.multiply, "min": np.minimum, "max": np.maximum}


def data(rank: int, dtype: str) -> np.ndarray:
    return (np.arange(6, dtype=dtype).reshape(2, 3) % 4) + rank + 1


def all_reduce_body() -> str:
    import functools

    import jax
    import jax.numpy as jnp

    import gpucoll
    import gpucoll.functional as F
    from gpucoll._jax import ffi_api

    rank, n = gpucoll.get_rank(), gpucoll.get_world_size()
    ffi_api.check_sizes()  # the ctypes mirrors match c_api.h's STRUCT_SIZE values

    # one jitted function, reused for every dtype (op is a static argument)
    @functools.partial(jax.jit, static_argnames="op")
    def step(x: Any, op: str) -> Any:
        return F.all_reduce(x * 1 + 0, op=getattr(gpucoll.ReduceOp, op.upper())) + 1

    for dtype in ("float32", "int32", "float16"):  # JAX keeps x64 off by default
        for op, ufunc in REDUCERS.items():
            ref = functools.reduce(ufunc, [data(k, dtype) for k in range(n)]) + 1
            out = np.asarray(step(jnp.asarray(data(rank, dtype)), op))
            assert out.dtype == np.dtype(dtype), (out.dtype, dtype)
            np.testing.assert_array_equal(out, ref, err_msg=f"{op} {dtype}")

    # two all_reduces in one program, the second fed by the first; a third whose result is unused
    @jax.jit
    def chain(x: Any) -> Any:
        y = F.all_reduce(x)
        F.all_reduce(x * 0)  # result unused: still issued on every rank (a side effect)
        return F.all_reduce(y * 2, op=gpucoll.ReduceOp.MAX)

    x = data(rank, "float32")
    total = sum(data(k, "float32") for k in range(n))
    for _ in range(20):
        np.testing.assert_array_equal(np.asarray(chain(jnp.asarray(x))), 2 * total)
    # the unused call was not dropped: the next collective outside jit still pairs up
    np.testing.assert_array_equal(np.asarray(F.all_reduce(np.full(3, rank, np.int64))),
                                  np.full(3, n * (n - 1) // 2))
    # grad through all_reduce(SUM): the cotangent is all_reduced (sum over ranks of c_k)
    c = jnp.arange(1.0, 7.0).reshape(2, 3) * (rank + 1)
    grad = jax.jit(jax.grad(lambda v: jnp.sum(F.all_reduce(v) * c)))(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(grad),
                                  sum(np.arange(1.0, 7.0).reshape(2, 3) * (k + 1) for k in range(n)))
    # vmap batches the reduction: each batch row is reduced across ranks
    batch = np.stack([x, 2 * x, -x])
    out = jax.jit(jax.vmap(lambda v: F.all_reduce(v, op=gpucoll.ReduceOp.MAX)))(jnp.asarray(batch))
    np.testing.assert_array_equal(np.asarray(out),
                                  np.maximum.reduce([np.stack([d, 2 * d, -d]) for d in
                                                     (data(k, "float32") for k in range(n))]))
    # a PREMUL_SUM inside jit is refused at trace time, on every rank alike
    with pytest.raises(TypeError, match=r"all_reduce inside jax.jit: op=.* is not supported"):
        jax.jit(lambda v: F.all_reduce(v, op=gpucoll.make_premul_sum(2.0)))(jnp.ones(2))
    return "ok"


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_all_reduce_inside_jit_matches_numpy(world_size: int) -> None:
    skip_without_jax()
    assert run_spmd(all_reduce_body, world_size, timeout=300,
                    env={"JAX_PLATFORMS": "cpu"}) == ["ok"] * world_size


def interleaved_body(rounds: int) -> str:
    import jax
    import jax.numpy as jnp

    import gpucoll
    import gpucoll.functional as F

    rank, n = gpucoll.get_rank(), gpucoll.get_world_size()

    nxt, prv = (rank + 1) % n, (rank - 1) % n

    # all_reduce, all_gather and send/recv interleaved in one compiled program, one result
    # unused; the sends and receives have no data dependence on the collectives around them
    @jax.jit
    def step(x: Any) -> Any:
        s = F.all_reduce(x)
        F.send(x + 1, dst=nxt)
        g = F.all_gather(x * 2, axis=0)
        F.all_gather(x[:1])  # unused: still issued on every rank
        p = F.recv(jnp.zeros_like(x), src=prv)
        m = F.all_reduce(g[rank * 3:rank * 3 + 3] + s[0], op=gpucoll.ReduceOp.MAX)
        F.send(m, dst=prv, tag=5)
        g2 = F.all_gather(jnp.stack([x, x]), axis=1)
        q = F.recv(jnp.zeros_like(x), src=nxt, tag=5)
        return s, g, m, g2, p, q

    xs = [np.arange(3, dtype=np.float32) + 10 * k for k in range(n)]
    for i in range(rounds):
        mine = [x + np.float32(i) for x in xs]
        s, g, m, g2, p, q = (np.asarray(a) for a in step(jnp.asarray(mine[rank])))
        np.testing.assert_array_equal(s, sum(mine))
        np.testing.assert_array_equal(g, np.concatenate([2 * v for v in mine]))
        np.testing.assert_array_equal(m, 2 * mine[n - 1] + sum(mine)[0])
        np.testing.assert_array_equal(g2, np.concatenate([np.stack([v, v]) for v in mine], axis=1))
        np.testing.assert_array_equal(p, mine[prv] + 1)
        np.testing.assert_array_equal(q, m)  # every rank's m is the same
    # the list all_to_all keeps its TypeError on tracers
    with pytest.raises(TypeError, match=r"all_to_all: xs\[0\] is a JAX tracer"):
        jax.jit(lambda v: F.all_to_all([v] * n))(jnp.ones(2))
    return "ok"


def test_interleaved_all_reduce_all_gather_send_recv_inside_jit_100_times_world_size_3() -> None:
    skip_without_jax()
    assert run_spmd(interleaved_body, 3, args=(100,), timeout=300,
                    env={"JAX_PLATFORMS": "cpu"}) == ["ok"] * 3
