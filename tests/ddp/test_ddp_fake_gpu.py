"""The Reducer and every hook on device arrays: a CuPy stand-in on the fake GPU, through
the NCCL backend (rank threads sharing one fake GPU), against NumPy."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from _fake_cupy import FakeCupy
from _fake_gpu_world import run_fake_gpu_worlds

SHAPES = [(32, 24), (24,), (24, 16), (16,), (3, 5, 4)]


def grads_of(rank: int, it: int) -> list[np.ndarray]:
    rng = np.random.default_rng(1000 * it + rank)
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


def mean_of(it: int, world: int) -> list[np.ndarray]:
    per_rank = [grads_of(r, it) for r in range(world)]
    return [np.mean([g[i].astype(np.float64) for g in per_rank], axis=0) for i in range(len(SHAPES))]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_reducer_and_hooks_on_device_arrays(world_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    import gpucoll
    from gpucoll import ddp_comm_hooks as hooks

    def body(world: Any, rt: Any, rank: int) -> str:
        xp = FakeCupy(rt)
        params = [xp.zeros(s, np.float32) for s in SHAPES]
        runs: list[tuple[Any, float, float]] = [(None, 1e-6, 1e-7), (hooks.allreduce_hook, 1e-6, 1e-7),
                                                (hooks.fp16_compress_hook, 2e-3, 1e-3),
                                                (hooks.bf16_compress_hook, 2e-2, 1e-2)]
        for hook, rtol, atol in runs:
            red = gpucoll.Reducer(params, bucket_cap_mb=0.001, first_bucket_cap_mb=0.0005)
            assert len(red.bucket_indices) >= 2
            if hook is not None:
                red.register_comm_hook(None, hook)
            for it in range(3):  # the third runs on buckets rebuilt in arrival order
                out = red.reduce([xp.wrap(g) for g in grads_of(rank, it)])
                for i, (got, want) in enumerate(zip(out, mean_of(it, world_size))):
                    assert got.shape == SHAPES[i] and got.dtype == np.float32
                    assert type(got).__name__ == "FakeCupyArray"
                    np.testing.assert_allclose(got.get(), want, rtol=rtol, atol=atol,
                                               err_msg=f"hook {hook}, iteration {it}, parameter {i}")
        # the fp16 wrapper; bf16's refuses device buffers (CuPy has no bfloat16 for the inner hook)
        red = gpucoll.Reducer(params, bucket_cap_mb=0.001, first_bucket_cap_mb=0.0005)
        red.register_comm_hook(None, hooks.fp16_compress_wrapper(hooks.allreduce_hook))
        for i, (got, want) in enumerate(zip(red.reduce([xp.wrap(g) for g in grads_of(rank, 0)]), mean_of(0, world_size))):
            np.testing.assert_allclose(got.get(), want, rtol=2e-3, atol=1e-3, err_msg=f"fp16 wrapper, parameter {i}")
        red = gpucoll.Reducer(params)
        red.register_comm_hook(None, hooks.bf16_compress_wrapper(hooks.allreduce_hook))
        with pytest.raises(TypeError, match="use bf16_compress_hook on device buffers"):
            red.reduce([xp.wrap(g) for g in grads_of(rank, 0)])
        # PowerSGD: rank-1 matrices exactly, vectors plainly, error feedback on device memory
        u = np.linspace(1, 2, 40, dtype=np.float32)[:, None]
        v = np.linspace(-1, 1, 30, dtype=np.float32)[None, :]
        for approx_rank in (1, 3):
            state = hooks.PowerSGDState(None, matrix_approximation_rank=approx_rank, start_powerSGD_iter=2)
            red = gpucoll.Reducer([xp.zeros((40, 30), np.float32), xp.zeros(30, np.float32)])
            red.register_comm_hook(state, hooks.powerSGD_hook)
            for it in range(4):
                out = red.reduce([xp.wrap(u @ v * (rank + 1)), xp.wrap(np.full(30, rank + 1.0, np.float32))])
                np.testing.assert_allclose(out[0].get(), u @ v * (world_size + 1) / 2, rtol=1e-4, atol=1e-4)
                np.testing.assert_allclose(out[1].get(), np.full(30, (world_size + 1) / 2), rtol=1e-6)
            assert type(state.error_dict[0]).__name__ == "FakeCupyArray" and state.iter == 4
        # broadcast_coalesced on device arrays
        arrays = [xp.wrap(np.full(s, rank + i, np.float32)) for i, s in enumerate(SHAPES)]
        gpucoll.broadcast_coalesced(None, arrays, 2000, src=0)
        for i, a in enumerate(arrays):
            np.testing.assert_array_equal(a.get(), np.full(SHAPES[i], i, np.float32))
        return "ok"

    assert run_fake_gpu_worlds(world_size, body, monkeypatch) == ["ok"] * world_size


def test_device_bfloat16_rounding_is_ml_dtypes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device path of bf16 compression (bit arithmetic: CuPy has no bfloat16) rounds as
    ml_dtypes does: to nearest, ties to even, overflow to inf, NaN kept."""
    import ml_dtypes

    from gpucoll._ddp import kinds

    f32 = np.float32
    ties = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x3F80C000, 0x3F807FFF], np.uint32).view(f32)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3.4e38, -3.4e38, 1e-40, -1e-40, 1.0], f32)
    values = np.concatenate([ties, special, np.random.default_rng(0).standard_normal(1000).astype(f32) * 1e3])

    def body(world: Any, rt: Any, rank: int) -> str:
        xp = FakeCupy(rt)
        carried = kinds.compress(xp.wrap(values), "bfloat16", 1)
        bits = carried.bits.get()
        want = values.astype(ml_dtypes.bfloat16)
        nan = np.isnan(values)
        assert np.isnan(want[nan].astype(f32)).all()
        assert np.isnan((bits[nan].astype(np.uint32) << 16).view(f32)).all()
        np.testing.assert_array_equal(bits[~nan], want[~nan].view(np.uint16))
        back = xp.zeros(values.size, f32)
        kinds.decompress_into(back, carried)
        np.testing.assert_array_equal(back.get()[~nan], want[~nan].astype(f32))
        return "ok"

    assert run_fake_gpu_worlds(1, body, monkeypatch) == ["ok"]


@pytest.mark.parametrize("world_size", [1, 3])
def test_the_default_average_launches_nothing_per_gradient(world_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Device buckets of a floating type average in the bucket's all_reduce (AVG): handing
    over a gradient computed into its bucket (``gradient_view``) launches no kernel, and
    ``reduce`` copies each bucket's gradients in with one launch. On an H200 a CuPy launch costs 7-9 us of
    host time: a division per gradient made the Reducer's ResNet-50 step 1.8 ms of host
    time. One NCCL call per bucket either way, and the results are the mean."""
    import gpucoll

    def body(world: Any, rt: Any, rank: int) -> str:
        xp = FakeCupy(rt)
        params = [xp.zeros(s, np.float32) for s in SHAPES]
        red = gpucoll.Reducer(params, bucket_cap_mb=0.002, first_bucket_cap_mb=0.0001)
        red.reduce([xp.wrap(g) for g in grads_of(rank, 0)])  # the rebuild
        views = [red.gradient_view(i) for i in range(len(SHAPES))]
        for it in (1, 2):
            for v, g in zip(views, grads_of(rank, it)):
                v.nd[...] = g  # "computed into the bucket" (not a launch of the Reducer's)
            xp.kernels.clear()
            for i in reversed(range(len(SHAPES))):
                red.mark_ready(i, views[i])
            out = red.wait()
            assert xp.kernels == {}, xp.kernels
            for got, want in zip(out, mean_of(it, world_size)):
                np.testing.assert_allclose(got.get(), want, rtol=1e-6, atol=1e-7)
        grads = [xp.wrap(g) for g in grads_of(rank, 3)]
        xp.kernels.clear()
        out = red.reduce(grads)
        # one launch per bucket: a bucket's gradients go in together (concatenate into it)
        many = sum(len(b) > 1 for b in red.bucket_indices)
        assert many and many < len(red.bucket_indices), red.bucket_indices  # both kinds of bucket
        assert xp.kernels == {k: v for k, v in (("concatenate", many), ("copy", len(red.bucket_indices) - many)) if v}, \
            (xp.kernels, red.bucket_indices)
        for got, want in zip(out, mean_of(3, world_size)):
            np.testing.assert_allclose(got.get(), want, rtol=1e-6, atol=1e-7)
        return "ok"

    assert run_fake_gpu_worlds(world_size, body, monkeypatch) == ["ok"] * world_size
