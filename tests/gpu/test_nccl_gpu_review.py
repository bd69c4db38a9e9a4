"""The ten findings of the NCCL backend's desk review, on a real GPU (docs/gpu-verification.md
lists them as the first things to check; tests/nccl/test_nccl_review_findings.py checks
the same on the fake GPU). ``pytest -m gpu tests/gpu --require-gpu``.

Ranks are spawned through gpucoll.testing.run_spmd (CUDA cannot be forked). Tests that
need two GPUs skip on a one-GPU machine; those with two ranks on one GPU need NCCL >= 2.30.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from _reference import reference

from gpucoll._reduce_op import ReduceOp
from gpucoll.testing import run_spmd

pytestmark = pytest.mark.gpu

ENV = {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_NVLS_ENABLE": "0", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


def _gpus() -> int:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def _nccl() -> tuple[int, ...]:
    try:
        from gpucoll._backends.nccl.backend import nccl_version

        return tuple(nccl_version())
    except Exception:
        return (0,)


TWO_GPUS = pytest.mark.skipif(_gpus() < 2, reason="needs two GPUs")
TWO_RANKS = pytest.mark.skipif(_nccl() < (2, 30, 0), reason="two ranks on one GPU need NCCL >= 2.30")


def _spmd(fn: Any, size: int, *, timeout: float = 300.0, env: dict[str, str] | None = None) -> list[Any]:
    return run_spmd(fn, world_size=size, init=False, backend="nccl", env={**ENV, **(env or {})},
                    start_method="spawn", timeout=timeout)


def _primary_context_active(device: int) -> bool:
    """cuDevicePrimaryCtxGetState through the driver (CuPy binds no such call)."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    assert cuda.cuDeviceGet(ctypes.byref(dev), device) == 0
    assert cuda.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)) == 0
    return bool(active.value)


# 1 and 2 -------------------------------------------------------------- devices and contexts

def _gpu1_body() -> dict[str, Any]:
    import cupy

    import gpucoll

    with cupy.cuda.Device(1):
        gpucoll.init_process_group("nccl", device_id=1, timeout=60.0)
        x = cupy.arange(4, dtype=cupy.float32)
        outs = [cupy.zeros(4, cupy.float32) for _ in range(gpucoll.get_world_size())]
        b = cupy.array([1, 2, 3], cupy.int16)
    out: dict[str, Any] = {}
    cupy.cuda.Device(0).use()  # the script's current device is 0, the group's is 1
    gpucoll.all_gather(outs, x)  # list output: temporaries on cuda:1
    gpucoll.all_reduce(b, op=ReduceOp.BXOR)  # 16-bit ints: a gpucoll kernel, with a temporary
    with cupy.cuda.Device(1):
        out["gather"] = [cupy.asnumpy(o).tolist() for o in outs]
        out["bxor"] = cupy.asnumpy(b).tolist()
    out["device_after"] = cupy.cuda.runtime.getDevice()
    gpucoll.destroy_process_group()
    return out


@TWO_GPUS
def test_finding_1_list_outputs_on_gpu_1_with_gpu_0_current() -> None:
    out = _spmd(_gpu1_body, 1)[0]
    assert out["gather"] == [[0.0, 1.0, 2.0, 3.0]] and out["bxor"] == [1, 2, 3], out
    assert out["device_after"] == 0, out


def _no_ctx0_body() -> dict[str, Any]:
    import cupy

    import gpucoll

    cupy.cuda.Device(1).use()
    gpucoll.init_process_group("nccl", device_id=1, timeout=60.0)
    x = cupy.ones(1 << 20, cupy.float32)
    for _ in range(20):
        gpucoll.all_reduce(x, async_op=True).wait()
    gpucoll.barrier()
    time.sleep(0.5)  # the watchdog polled meanwhile
    active = _primary_context_active(0)
    gpucoll.destroy_process_group()
    return {"ctx0": active}


@TWO_GPUS
def test_finding_2_the_watchdog_makes_no_context_on_gpu_0() -> None:
    assert _spmd(_no_ctx0_body, 1)[0] == {"ctx0": False}


# 3 -------------------------------------------------------------- another framework's stream

def _torch_stream_body() -> Any:
    try:
        import torch

        if not torch.cuda.is_available():
            return "skipped: torch without CUDA"
    except ImportError:
        return "skipped: no torch"
    import gpucoll

    gpucoll.init_process_group("nccl", device_id=0, timeout=60.0)
    size = gpucoll.get_world_size()
    side = torch.cuda.Stream()
    ok = []
    with torch.cuda.stream(side):
        for _ in range(5):
            x = torch.full((1 << 22,), float(gpucoll.get_rank() + 1), device="cuda")
            gpucoll.all_reduce(x)
            y = x.clone()  # torch's next kernel, on its own side stream
            side.synchronize()  # that stream only: no device-wide sync
            ok.append(bool((y == float(sum(range(1, size + 1)))).all().item()))
    gpucoll.destroy_process_group()
    return ok


@pytest.mark.parametrize("size", [1, pytest.param(2, marks=TWO_RANKS)])
def test_finding_3_in_place_on_a_torch_side_stream(size: int) -> None:
    for out in _spmd(_torch_stream_body, size):
        if isinstance(out, str):
            pytest.skip(out)
        assert all(out), out


# 4 -------------------------------------------------------------- capture in global mode

def _global_capture_body() -> dict[str, Any]:
    import cupy

    import gpucoll

    gpucoll.init_process_group("nccl", device_id=0, timeout=60.0)
    size = gpucoll.get_world_size()
    big = cupy.ones(1 << 24, cupy.float32)
    x = cupy.ones(1024, cupy.float32)
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        gpucoll.all_reduce(x)  # connect outside the capture
    s.synchronize()
    x.fill(1)
    # The test's own array is made before the capture: CuPy's cudaMalloc inside a
    # global-mode capture is refused (cudaErrorStreamCaptureUnsupported) whatever gpucoll
    # does. gpucoll's own steps for the BXOR (its kernel load, its temporary) are made
    # inside the capture, in relaxed mode.
    b = cupy.array([1, 2], cupy.int16)
    with s:
        b.fill(1)
    pending = gpucoll.all_reduce(big, async_op=True)  # the watchdog polls it during the capture
    with s:
        s.begin_capture(cupy.cuda.runtime.streamCaptureModeGlobal)
        gpucoll.all_reduce(x)
        gpucoll.all_reduce(b, op=ReduceOp.BXOR)  # first BXOR: a kernel load and a temporary in capture
        time.sleep(0.2)
        graph = s.end_capture()
    graph.launch(stream=s)
    s.synchronize()
    pending.wait()
    out = {"x": float(cupy.asnumpy(x[0])), "b": cupy.asnumpy(b).tolist(), "size": size}
    gpucoll.destroy_process_group()
    return out


@pytest.mark.parametrize("size", [1, pytest.param(2, marks=TWO_RANKS)])
def test_finding_4_watchdog_during_a_global_mode_capture(size: int) -> None:
    for out in _spmd(_global_capture_body, size):
        assert out["x"] == float(size), out
        assert out["b"] == [size % 2] * 2, out  # 1 XOR-ed over the ranks


# 5 -------------------------------------------------------------- abort while issuing

def _abort_race_body() -> dict[str, Any]:
    import cupy

    import gpucoll
    from gpucoll.errors import DistBackendError

    gpucoll.init_process_group("nccl", device_id=0, timeout=60.0)
    x = cupy.ones(16, cupy.float32)
    gpucoll.all_reduce(x)
    from gpucoll import _world

    backend = _world.default_group()._nccl
    t = threading.Timer(0.05, lambda: backend.abort("aborted by the test"))
    t.start()
    failed = ""
    try:
        for _ in range(100000):
            gpucoll.all_reduce(x)
    except DistBackendError as exc:
        failed = str(exc)
    t.join()
    gpucoll.destroy_process_group()
    return {"failed": failed}


def test_finding_5_abort_from_another_thread_while_issuing() -> None:
    out = _spmd(_abort_race_body, 1)[0]
    assert "aborted by the test" in out["failed"], out  # and the rank did not crash


# 6 -------------------------------------------------------------- first collective, no peer

def _no_peer_body() -> dict[str, Any]:
    import cupy

    import gpucoll
    from gpucoll.errors import DistBackendError

    gpucoll.init_process_group("nccl", device_id=0, timeout=5.0)
    if gpucoll.get_rank() == 1:
        time.sleep(12.0)  # never joins; leaves after rank 0 has failed
        return {}
    t0 = time.monotonic()
    try:
        gpucoll.all_reduce(cupy.ones(4, cupy.float32))
        err = ""
    except DistBackendError as exc:
        err = str(exc)
    return {"err": err, "took": time.monotonic() - t0}


@TWO_RANKS
def test_finding_6_first_collective_without_a_peer_times_out() -> None:
    out = _spmd(_no_peer_body, 2, timeout=120.0)[0]
    assert "rank 1" in out["err"] and "first collective" in out["err"], out
    assert out["took"] < 10.0, out


# 7 -------------------------------------------------------------- NCCL_COMM_BLOCKING=0

def _blocking_body() -> str:
    import gpucoll
    from gpucoll.errors import BackendUnavailableError, DistError

    try:
        gpucoll.init_process_group("nccl", device_id=0, timeout=30.0)
    except (BackendUnavailableError, DistError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "initialised"


def test_finding_7_nccl_comm_blocking_0_is_refused() -> None:
    out = _spmd(_blocking_body, 1, env={"NCCL_COMM_BLOCKING": "0"})[0]
    assert "NCCL_COMM_BLOCKING=0" in out and "KeyError" not in out, out


# 8 -------------------------------------------------------------- a stream gone before wait()

def _stream_gone_body() -> list[float]:
    import gc

    import cupy

    import gpucoll

    gpucoll.init_process_group("nccl", device_id=0, timeout=60.0)
    size = gpucoll.get_world_size()
    works, arrays = [], []
    for _ in range(10):
        s = cupy.cuda.Stream(non_blocking=True)
        with s:
            x = cupy.full(1 << 20, 1.0, cupy.float32)
            works.append(gpucoll.all_reduce(x, async_op=True))
        arrays.append(x)
        del s
        gc.collect()  # the user's stream object is gone
    for w in works:
        w.wait()
    cupy.cuda.get_current_stream().synchronize()
    got = [float(cupy.asnumpy(a[:1])[0]) for a in arrays]
    gpucoll.destroy_process_group()
    return [g / size for g in got]


@pytest.mark.parametrize("size", [1, pytest.param(2, marks=TWO_RANKS)])
def test_finding_8_wait_after_the_callers_stream_is_gone(size: int) -> None:
    for got in _spmd(_stream_gone_body, size):
        assert got == [1.0] * 10


# 9 -------------------------------------------------------------- events without timing

def _timing_body() -> dict[str, Any]:
    import cupy

    import gpucoll
    from gpucoll import _world

    gpucoll.init_process_group("nccl", device_id=0, timeout=60.0)
    pg = _world.default_group()
    backend = pg._nccl
    x = cupy.ones(1 << 20, cupy.float32)
    w = gpucoll.all_reduce(x, async_op=True)
    end = w._end
    w.synchronize()
    try:
        backend._rt.elapsed_ms(end.ptr, end.ptr)
        untimed = "timing enabled"
    except Exception as exc:  # cudaErrorInvalidResourceHandle: made with cudaEventDisableTiming
        untimed = type(exc).__name__
    infos: list[Any] = []
    pg.register_on_completion_hook(infos.append)
    gpucoll.all_reduce(x, async_op=True).synchronize()
    gpucoll.destroy_process_group()
    return {"untimed": untimed, "timed": [i.active_duration for i in infos]}


def test_finding_9_events_time_only_when_a_hook_asks() -> None:
    out = _spmd(_timing_body, 1)[0]
    assert out["untimed"] != "timing enabled", out
    assert out["timed"] and all(d >= 0.0 for d in out["timed"]), out


# 10 -------------------------------------------------------------- integer AVG

def _int_avg_body() -> list[str]:
    import cupy

    import gpucoll

    gpucoll.init_process_group("nccl", device_id=0, timeout=60.0)
    rank, size = gpucoll.get_rank(), gpucoll.get_world_size()
    bad = []
    for name in ("int8", "uint8", "int32", "uint32", "int64", "uint64"):
        info = np.iinfo(name)
        ins = [np.array([min(max(v, int(info.min)), int(info.max)) for v in
                         (-7, 7, -1, 1, int(info.max) - r, int(info.min) + r, 5 * r - 4, 3)], dtype=name)
               for r in range(size)]
        x = cupy.asarray(ins[rank])
        gpucoll.all_reduce(x, op=ReduceOp.AVG)
        got = cupy.asnumpy(x)
        want = reference(ins, name, ReduceOp.AVG, size)
        if not np.array_equal(got, want):
            bad.append(f"{name}: got {got.tolist()}, want {want.tolist()}")
    gpucoll.destroy_process_group()
    return bad


@pytest.mark.parametrize("size", [1, pytest.param(2, marks=TWO_RANKS)])
def test_finding_10_integer_avg_truncates_toward_zero(size: int) -> None:
    for bad in _spmd(_int_avg_body, size):
        assert not bad, bad

