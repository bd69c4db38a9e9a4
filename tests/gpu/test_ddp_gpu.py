"""The Reducer, every built-in hook, broadcast_coalesced and the mismatch check on CuPy
arrays through NCCL, on the GPU, against NumPy (world size 1, and 2 on one GPU where NCCL
allows it)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gpucoll.testing import run_spmd

pytestmark = pytest.mark.gpu

ENV = {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_NVLS_ENABLE": "0", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
SHAPES = [(64, 48), (48,), (48, 32), (32,), (3, 5, 4)]


def _why_not_two() -> str | None:
    try:
        from gpucoll._backends.nccl.backend import nccl_version

        version = nccl_version()
    except Exception as exc:
        return f"NCCL not loadable: {exc}"
    return None if version >= (2, 30, 0) else f"two ranks on one GPU need NCCL >= 2.30; this is {version}"


_WHY = _why_not_two()
SIZES = [1, pytest.param(2, marks=pytest.mark.skipif(_WHY is not None, reason=str(_WHY)))]


def grads_of(rank: int, it: int) -> list[np.ndarray]:
    rng = np.random.default_rng(1000 * it + rank)
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


def body() -> str:
    import cupy

    import gpucoll
    from gpucoll import ddp_comm_hooks as hooks

    gpucoll.init_process_group("nccl", device_id=0, timeout=120)
    try:
        r, w = gpucoll.get_rank(), gpucoll.get_world_size()
        params = [cupy.zeros(s, cupy.float32) for s in SHAPES]

        def mean(it: int) -> list[np.ndarray]:
            per = [grads_of(k, it) for k in range(w)]
            return [np.mean([g[i].astype(np.float64) for g in per], axis=0) for i in range(len(SHAPES))]

        for hook, rtol, atol in [(None, 1e-6, 1e-6), (hooks.allreduce_hook, 1e-6, 1e-6),
                                 (hooks.fp16_compress_hook, 2e-3, 1e-3), (hooks.bf16_compress_hook, 2e-2, 1e-2),
                                 (hooks.fp16_compress_wrapper(hooks.allreduce_hook), 2e-3, 1e-3)]:
            red = gpucoll.Reducer(params, bucket_cap_mb=0.004, first_bucket_cap_mb=0.002)
            if hook is not None:
                red.register_comm_hook(None, hook)
            for it in range(3):
                out = red.reduce([cupy.asarray(g) for g in grads_of(r, it)])
                for i, (got, want) in enumerate(zip(out, mean(it))):
                    assert isinstance(got, cupy.ndarray) and got.shape == SHAPES[i], type(got)
                    np.testing.assert_allclose(cupy.asnumpy(got), want, rtol=rtol, atol=atol,
                                               err_msg=f"{hook}, iteration {it}, parameter {i}")
            # buckets of several gradients were filled by the gather kernel, one launch each
            # (the addresses changed between iterations: new arrays, so the table re-uploaded)
            launched = [b.gather.launches for b in red._buckets if len(b.indices) > 1 and b.gather is not None]
            assert launched and all(n >= 2 for n in launched), (hook, launched, red.bucket_indices)
        # the same arrays again (the table not re-uploaded), and a part on another stream
        red = gpucoll.Reducer(params, bucket_cap_mb=0.004, first_bucket_cap_mb=0.002)
        same = [cupy.asarray(g) for g in grads_of(r, 0)]
        for it in range(3):
            with (cupy.cuda.Stream(non_blocking=True) if it == 2 else cupy.cuda.get_current_stream()):
                out = [cupy.asnumpy(o) for o in red.reduce(same)]
            for i, (got, want) in enumerate(zip(out, mean(0))):
                np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=f"same arrays, {it}, {i}")
        # PowerSGD: rank-1 gradients go exactly; vectors plainly
        u = np.linspace(1, 2, 64, dtype=np.float32)[:, None]
        v = np.linspace(-1, 1, 48, dtype=np.float32)[None, :]
        for rank in (1, 3):
            state = hooks.PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=2)
            red = gpucoll.Reducer([cupy.zeros((64, 48), cupy.float32), cupy.zeros(48, cupy.float32)])
            red.register_comm_hook(state, hooks.powerSGD_hook)
            for it in range(4):
                out = red.reduce([cupy.asarray(u @ v * (r + 1)), cupy.full(48, r + 1.0, cupy.float32)])
                np.testing.assert_allclose(cupy.asnumpy(out[0]), u @ v * (w + 1) / 2, rtol=1e-3, atol=1e-3)
                np.testing.assert_allclose(cupy.asnumpy(out[1]), np.full(48, (w + 1) / 2), rtol=1e-6)
        arrays = [cupy.full(s, r + i, cupy.float32) for i, s in enumerate(SHAPES)]
        gpucoll.broadcast_coalesced(None, arrays, 4000, src=0)
        for i, a in enumerate(arrays):
            np.testing.assert_array_equal(cupy.asnumpy(a), np.full(SHAPES[i], i, np.float32))
        if w > 1:
            red = gpucoll.Reducer(params)
            g = [cupy.asarray(x) for x in grads_of(r, 0)]
            for i in range(len(SHAPES)):
                if not (r == 1 and i == 2):
                    red.mark_ready(i, g[i])
            with pytest.raises(gpucoll.ParameterMismatchError, match=r"parameter 2 \(48, 32\) float32 \(missing on rank"):
                red.wait()
        return "ok"
    finally:
        gpucoll.destroy_process_group()


@pytest.mark.parametrize("size", SIZES)
def test_reducer_and_hooks_on_cupy(size: int) -> None:
    out = run_spmd(body, world_size=size, init=False, backend="nccl", env=ENV, start_method="spawn", timeout=300)
    assert out == ["ok"] * size
