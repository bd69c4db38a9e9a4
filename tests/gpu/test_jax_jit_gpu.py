"""gpucoll.functional inside jax.jit on a real GPU: the CUDA platform's FFI handler runs
the group's NCCL op on XLA's stream (gpucoll/_jax/handler.py, make_gpu_handler).

Needs jax with CUDA (skipped, with the reason, where JAX has no GPU backend). The fake
GPU covers the same handler in tests/nccl/test_nccl_jax_gpu_handler.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from test_nccl_gpu import SIZES, _init, _spmd

pytestmark = pytest.mark.gpu


def _jit_body() -> Any:
    try:
        import jax
        import jax.numpy as jnp

        gpu = jax.devices("gpu")[0]
    except Exception as exc:
        return f"skipped: no JAX GPU backend ({type(exc).__name__}: {exc})"
    import gpucoll
    import gpucoll.functional as F

    rank = _init()
    n = gpucoll.get_world_size()
    out: dict[str, Any] = {}
    data = [np.arange(6, dtype=np.float32) * (k + 1) + k for k in range(n)]

    @jax.jit
    def step(x: Any) -> Any:
        s = F.all_reduce(x)
        m = F.all_reduce(x * 1, op=gpucoll.ReduceOp.MAX)
        b = F.broadcast(x * 1, src=n - 1)
        g = F.all_gather(x)
        return s, m, b, g

    x = jax.device_put(jnp.asarray(data[rank]), gpu)
    s, m, b, g = step(x)
    out["all_reduce"] = np.asarray(s).tolist() == sum(data).tolist()
    out["max"] = np.asarray(m).tolist() == np.maximum.reduce(data).tolist()
    out["broadcast"] = np.asarray(b).tolist() == data[n - 1].tolist()
    out["all_gather"] = np.asarray(g).tolist() == np.concatenate(data).tolist()
    out["on_gpu"] = all(d.platform == "gpu" for d in s.devices())
    if n > 1:
        @jax.jit
        def ring(v: Any) -> Any:
            if rank % 2 == 0:
                F.send(v, dst=(rank + 1) % n)
                return F.recv(v, src=(rank - 1) % n)
            got = F.recv(v, src=(rank - 1) % n)
            F.send(v, dst=(rank + 1) % n)
            return got

        out["ring"] = np.asarray(ring(x)).tolist() == data[(rank - 1) % n].tolist()

    # a jitted loop of small all_reduces, and its grad step
    @jax.jit
    def loop(v: Any) -> Any:
        return jax.lax.fori_loop(0, 200, lambda i, w: F.all_reduce(w) / n, v)

    out["loop"] = np.allclose(np.asarray(loop(x)), sum(data) / n)
    c = jnp.arange(1.0, 7.0, dtype=jnp.float32) * (rank + 1)
    grad = jax.jit(jax.grad(lambda v: jnp.sum(F.all_reduce(v) * c)))(x)
    out["grad"] = np.asarray(grad).tolist() == sum(np.arange(1.0, 7.0) * (k + 1) for k in range(n)).tolist()
    gpucoll.destroy_process_group()
    return out


@pytest.mark.parametrize("size", SIZES)
def test_collectives_inside_jit_on_the_gpu(size: int) -> None:
    for out in _spmd(_jit_body, size):
        if isinstance(out, str):
            pytest.skip(out)
        assert all(out.values()), out
