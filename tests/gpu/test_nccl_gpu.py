"""The NCCL backend on a real GPU (``pytest -m gpu tests/gpu --require-gpu``; see
tests/gpu/run_gpu_suite.sh and docs/gpu-verification.md).

Every test runs its ranks through gpucoll.testing.run_spmd with the spawn start
method (CUDA cannot be forked). World size 1 always; world size 2 on the one GPU
when the loaded NCCL is 2.30 or newer (NCCL_MULTI_RANK_GPU_ENABLE=1). Results are
checked against NumPy references computed on the host (tests/_reference.py).

At import time this module only reads NCCL's version through CuPy (which starts
neither CUDA nor NCCL): the spawned ranks import it to find their function, and
their environment (NCCL_MULTI_RANK_GPU_ENABLE) must be in place before NCCL starts.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import pytest

from _reference import DTYPE_NAMES, OPS, close, defined, make_input, np_dtype, reference
from _shared_bodies import check_debug_detail, debug_detail_body

from gpucoll._buffer import DTYPES
from gpucoll._reduce_op import PremulSum, ReduceOp, make_premul_sum
from gpucoll.testing import run_spmd

pytestmark = pytest.mark.gpu

# Two ranks share the one GPU (time-sliced without MPS): NVLS off keeps NCCL's setup lean.
ENV = {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_NVLS_ENABLE": "0", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
RAW = ("bfloat16", "float8_e4m3fn", "float8_e5m2")  # CuPy has no such dtypes: carried as uint


def _two_ranks_on_one_gpu() -> str | None:
    """Why two ranks cannot share the GPU here, or None if they can."""
    try:
        from gpucoll._backends.nccl.backend import nccl_version

        version = nccl_version()
    except Exception as exc:  # no CuPy/NCCL: the gpu marker skips these tests anyway
        return f"NCCL not loadable: {exc}"
    if version < (2, 30, 0):
        return f"two ranks on one GPU need NCCL >= 2.30; this is {'.'.join(map(str, version))}"
    return None


_WHY_NOT_TWO = _two_ranks_on_one_gpu()
SIZES = [1, pytest.param(2, marks=pytest.mark.skipif(_WHY_NOT_TWO is not None, reason=str(_WHY_NOT_TWO)))]


def _spmd(fn: Any, size: int, *, timeout: float = 600.0, args: tuple[Any, ...] = ()) -> list[Any]:
    return run_spmd(fn, world_size=size, init=False, backend="nccl", env=ENV, start_method="spawn",
                    timeout=timeout, args=args)


# ----- rank-side helpers (run in the spawned ranks) -----

class RawDeviceArray:
    """A device array of a dtype CuPy lacks (bfloat16, float8): CuPy's unsigned integers
    of the same width, published through __cuda_array_interface__ with an opaque
    typestr and a ``dtype`` naming the real type, as other frameworks do."""

    def __init__(self, carrier: Any, dtype: str) -> None:
        self.carrier = carrier
        self.dtype = dtype
        self.device = carrier.device

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        cai = dict(self.carrier.__cuda_array_interface__)
        cai["typestr"] = f"|V{self.carrier.dtype.itemsize}"
        cai["descr"] = [("", cai["typestr"])]
        return cai


def to_device(host: np.ndarray, name: str) -> Any:
    import cupy

    if name in RAW:
        bits = host.view(f"uint{8 * host.dtype.itemsize}")
        return RawDeviceArray(cupy.asarray(bits), name)
    return cupy.asarray(host)


def to_host(arr: Any, name: str) -> np.ndarray:
    import cupy

    host: np.ndarray
    if isinstance(arr, RawDeviceArray):
        host = cupy.asnumpy(arr.carrier).view(np_dtype(name))
    else:
        host = cupy.asnumpy(arr)
    return host


def _init(timeout: float = 120.0) -> int:
    import gpucoll

    gpucoll.init_process_group("nccl", device_id=0, timeout=timeout)
    return gpucoll.get_rank()


def _pg_defined(name: str, op: Any, fp8: bool) -> bool:
    # The ProcessGroup allows PREMUL_SUM on floating and complex arrays only.
    if isinstance(op, PremulSum) and DTYPES[name].kind not in "fc":
        return False
    return defined(name, op, fp8)


def _reduction_sweep_body(n: int) -> list[str]:
    import cupy

    import gpucoll

    rank = _init()
    size = gpucoll.get_world_size()
    cc = cupy.cuda.Device(0).compute_capability
    from gpucoll._backends.nccl.backend import nccl_version
    fp8 = nccl_version() >= (2, 24, 0) and int(cc) >= 90
    bad: list[str] = []
    for name in DTYPE_NAMES:
        dt = np_dtype(name)
        for op in OPS:
            ok = _pg_defined(name, op, fp8)
            ins = [make_input(name, n, r) for r in range(size)]
            want = reference(ins, name, op, size) if ok else None
            for coll in ("all_reduce", "reduce", "reduce_scatter_single", "reduce_scatter", "all_reduce_coalesced"):
                what = f"{coll} {name} {op}"
                try:
                    if coll == "all_reduce":
                        x = to_device(ins[rank], name)
                        gpucoll.all_reduce(x, op=op)
                        got, expect = to_host(x, name), want
                    elif coll == "reduce":
                        x = to_device(ins[rank], name)
                        gpucoll.reduce(x, dst=size - 1, op=op)
                        got = to_host(x, name)
                        expect = want if rank == size - 1 else None
                    elif coll == "all_reduce_coalesced":
                        a, b = to_device(ins[rank], name), to_device(ins[rank][::-1].copy(), name)
                        gpucoll.all_reduce_coalesced([a, b], op=op)
                        got = np.concatenate([to_host(a, name), to_host(b, name)])
                        want_b = reference([x[::-1].copy() for x in ins], name, op, size) if ok else None
                        expect = np.concatenate([want, want_b]) if ok else None
                    else:
                        mine = [make_input(name, n, rank, salt=j) for j in range(size)]
                        out = to_device(np.zeros(n, dt), name)
                        if coll == "reduce_scatter_single":
                            gpucoll.reduce_scatter_single(out, to_device(np.concatenate(mine), name), op=op)
                        else:
                            gpucoll.reduce_scatter(out, [to_device(c, name) for c in mine], op=op)
                        got = to_host(out, name)
                        expect = reference([make_input(name, n, r, salt=rank) for r in range(size)], name, op,
                                           size) if ok else None
                except TypeError as exc:
                    if ok:
                        bad.append(f"{what}: unexpected TypeError: {exc}")
                    continue
                if not ok:
                    bad.append(f"{what}: no TypeError for an undefined reduction")
                elif expect is not None and not close(got, expect, name):
                    bad.append(f"{what}: got {got!r}, want {expect!r}")
    gpucoll.destroy_process_group()
    return bad


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("n", [7, 4096 + 3])
def test_every_reduction_op_and_dtype(size: int, n: int) -> None:
    bad = [b for r in _spmd(_reduction_sweep_body, size, args=(n,)) for b in r]
    assert not bad, "\n".join(bad[:40])


def _movement_body() -> list[str]:
    import cupy

    import gpucoll

    rank = _init()
    size = gpucoll.get_world_size()
    bad: list[str] = []

    def same(a: np.ndarray, b: np.ndarray) -> bool:
        return a.tobytes() == b.tobytes()
    for name in ("bfloat16", "float8_e5m2", "int16", "complex128", "bool", "float32", "uint64"):
        dt = np_dtype(name)
        for n in (0, 5, 100_003):
            mine = make_input(name, n, rank)
            alls = [make_input(name, n, r) for r in range(size)]
            b = to_device(mine, name)
            gpucoll.broadcast(b, src=size - 1)
            if not same(to_host(b, name), alls[-1]):
                bad.append(f"broadcast {name} {n}")
            outs = [to_device(np.zeros(n, dt), name) for _ in range(size)]
            gpucoll.all_gather(outs, to_device(mine, name))
            if not all(same(to_host(o, name), alls[r]) for r, o in enumerate(outs)):
                bad.append(f"all_gather {name} {n}")
            flat = to_device(np.zeros(n * size, dt), name)
            gpucoll.all_gather_single(flat, to_device(mine, name))
            if not same(to_host(flat, name), np.concatenate(alls)):
                bad.append(f"all_gather_single {name} {n}")
            g = [to_device(np.zeros(n, dt), name) for _ in range(size)] if rank == 0 else None
            gpucoll.gather(to_device(mine, name), g, dst=0)
            if g is not None and not all(same(to_host(o, name), alls[r]) for r, o in enumerate(g)):
                bad.append(f"gather {name} {n}")
            s_out = to_device(np.zeros(n, dt), name)
            s_in = [to_device(make_input(name, n, r, salt=9), name) for r in range(size)] if rank == 0 else None
            gpucoll.scatter(s_out, s_in, src=0)
            if not same(to_host(s_out, name), make_input(name, n, rank, salt=9)):
                bad.append(f"scatter {name} {n}")
            a_out = [to_device(np.zeros(n, dt), name) for _ in range(size)]
            gpucoll.all_to_all(a_out, [to_device(make_input(name, n, rank, salt=j), name) for j in range(size)])
            if not all(same(to_host(o, name), make_input(name, n, r, salt=rank)) for r, o in enumerate(a_out)):
                bad.append(f"all_to_all {name} {n}")
        in_split = [(rank + j) % 3 + 1 for j in range(size)]
        out_split = [(j + rank) % 3 + 1 for j in range(size)]
        payload = np.concatenate([make_input(name, in_split[j], rank, salt=j) for j in range(size)])
        out = to_device(np.zeros(sum(out_split), dt), name)
        gpucoll.all_to_all_single(out, to_device(payload, name), output_split_sizes=out_split,
                                  input_split_sizes=in_split)
        want = np.concatenate([make_input(name, out_split[j], j, salt=rank) for j in range(size)])
        if not same(to_host(out, name), want):
            bad.append(f"all_to_all_single {name}")
        # point to point around a ring, as one batch
        if size > 1:
            got = to_device(np.zeros(5, dt), name)
            ops = [gpucoll.P2POp(gpucoll.isend, to_device(make_input(name, 5, rank), name), (rank + 1) % size),
                   gpucoll.P2POp(gpucoll.irecv, got, (rank - 1) % size)]
            for w in gpucoll.batch_isend_irecv(ops):
                w.wait()
            if not same(to_host(got, name), make_input(name, 5, (rank - 1) % size)):
                bad.append(f"batch_isend_irecv {name}")
    cupy.cuda.runtime.deviceSynchronize()
    gpucoll.destroy_process_group()
    return bad


@pytest.mark.parametrize("size", SIZES)
def test_data_movement(size: int) -> None:
    bad = [b for r in _spmd(_movement_body, size) for b in r]
    assert not bad, bad


def _streams_hooks_memory_body() -> dict[str, Any]:
    import cupy

    import gpucoll
    from gpucoll._world import default_group

    rank = _init()
    size = gpucoll.get_world_size()
    infos: list[Any] = []
    default_group().register_on_completion_hook(infos.append)
    out: dict[str, Any] = {}
    warm = cupy.ones(1024, cupy.float32)
    gpucoll.all_reduce(warm)  # NCCL connects peers during the first collective: not timed
    cupy.cuda.runtime.deviceSynchronize()
    # async_op=False orders the caller's (non-default) stream, and the host goes on at once.
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        x = cupy.full(64 << 20, rank + 1, cupy.float32)  # 256 MiB: long enough to see the host run ahead
        s.synchronize()
        t0 = time.perf_counter()
        gpucoll.all_reduce(x)
        out["issue_s"] = time.perf_counter() - t0
        y = x * 2  # queued on s after the all_reduce
        out["y_ok"] = bool((y[:1000] == 2 * sum(range(1, size + 1))).all())
    s.synchronize()
    # async_op=True: wait() orders the current stream; is_completed() eventually True.
    w = gpucoll.all_reduce(x, async_op=True)
    assert w is not None
    w.wait()
    deadline = time.monotonic() + 30
    while not w.is_completed() and time.monotonic() < deadline:
        time.sleep(0.001)
    out["async_completed"] = w.is_completed() and w.is_success()
    # hooks fire from the watchdog with CUDA-event durations
    deadline = time.monotonic() + 30
    while len(infos) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    out["hooks"] = [(i.op_type, i.seq, i.active_duration, i.time_finished - i.time_started) for i in infos]
    # in-place all_reduce allocates no device memory
    pool = cupy.get_default_memory_pool()
    z = cupy.ones(1 << 20, cupy.float32)
    gpucoll.all_reduce(z)
    cupy.cuda.runtime.deviceSynchronize()
    used, total = pool.used_bytes(), pool.total_bytes()
    for _ in range(20):
        gpucoll.all_reduce(z)
        gpucoll.all_reduce(z, op=ReduceOp.MAX)
    cupy.cuda.runtime.deviceSynchronize()
    out["pool"] = (used, total, pool.used_bytes(), pool.total_bytes())
    gpucoll.destroy_process_group()
    return out


@pytest.mark.parametrize("size", SIZES)
def test_streams_hooks_and_memory(size: int) -> None:
    for out in _spmd(_streams_hooks_memory_body, size):
        assert out["y_ok"] and out["async_completed"]
        assert out["issue_s"] < 0.05, f"async_op=False blocked the host for {out['issue_s']:.3f} s"
        hooks = out["hooks"]
        assert len(hooks) >= 2 and all(h[0] == "all_reduce" and h[1] >= 1 for h in hooks)
        for _, _, active, wall in hooks:
            assert 0.0 <= active <= wall + 0.05, hooks
        if size > 1:
            # the 256 MiB all_reduce took measurable time (on one rank NCCL skips an
            # in-place all_reduce: nothing runs between the two events)
            assert max(h[2] for h in hooks) > 0.0, hooks
        used, total, used2, total2 = out["pool"]
        assert used2 == used and total2 == total


def _graph_body() -> list[float]:
    import cupy

    import gpucoll

    rank = _init()
    x = cupy.ones(1024, cupy.float32)
    s = cupy.cuda.Stream(non_blocking=True)
    op = make_premul_sum(2.0)
    with s:
        gpucoll.all_reduce(x, op=op)  # warm up outside the capture
    s.synchronize()
    with s:
        s.begin_capture()
        gpucoll.all_reduce(x, op=op)
        graph = s.end_capture()
    for _ in range(3):
        graph.launch(stream=s)
    s.synchronize()
    got: list[float] = cupy.asnumpy(x[:4]).tolist()
    gpucoll.destroy_process_group()
    del rank
    return got


@pytest.mark.parametrize("size", SIZES)
def test_cuda_graph_capture(size: int) -> None:
    for got in _spmd(_graph_body, size):
        # warm-up, then three replays: each multiplies by 2 * size
        assert got == [float((2 * size) ** 4)] * 4


def _interop_body() -> dict[str, Any]:
    import cupy

    import gpucoll
    import gpucoll.functional as F

    rank = _init()
    size = gpucoll.get_world_size()
    total = sum(range(1, size + 1))
    out: dict[str, Any] = {}
    c = cupy.arange(8, dtype=cupy.float32) * (rank + 1)
    y = F.all_reduce(c)
    out["cupy_type"] = type(y).__module__.split(".")[0]
    out["cupy_ok"] = bool((cupy.asnumpy(y) == np.arange(8) * total).all()) and bool((c == cupy.arange(8) * (rank + 1)).all())
    try:
        import jax
        import jax.numpy as jnp

        gpu = jax.devices("gpu")[0]
    except Exception as exc:
        out["jax"] = f"skipped: no JAX GPU backend ({type(exc).__name__}: {exc})"
    else:
        x = jax.device_put(jnp.arange(8, dtype=jnp.float32) * (rank + 1), gpu)
        y = F.all_reduce(x)
        xb = jax.device_put(jnp.full((4,), rank + 1, dtype=jnp.bfloat16), gpu)
        yb = F.all_reduce(xb)
        g = F.all_gather(x)
        out["jax"] = {
            "type": isinstance(y, jax.Array) and isinstance(yb, jax.Array),
            "values": np.asarray(y).tolist() == (np.arange(8) * total).tolist(),
            "bf16": str(yb.dtype) == "bfloat16" and np.asarray(yb.astype(jnp.float32)).tolist() == [float(total)] * 4,
            "gather": np.asarray(g).tolist() == np.concatenate([np.arange(8) * (r + 1) for r in range(size)]).tolist(),
            "on_gpu": all(d.platform == "gpu" for d in y.devices()),
        }
    gpucoll.destroy_process_group()
    return out


@pytest.mark.parametrize("size", SIZES)
def test_cupy_and_jax_interop(size: int) -> None:
    for out in _spmd(_interop_body, size):
        assert out["cupy_type"] == "cupy" and out["cupy_ok"]
        if isinstance(out["jax"], str):
            pytest.skip(out["jax"])
        assert all(out["jax"].values()), out["jax"]


def _torch_body() -> dict[str, Any]:
    import gpucoll
    import gpucoll.functional as F

    rank = _init()
    size = gpucoll.get_world_size()
    total = sum(range(1, size + 1))
    out: dict[str, Any] = {}
    try:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("torch.cuda.is_available() is False")
    except Exception as exc:
        gpucoll.destroy_process_group()
        return {"skip": f"no torch with CUDA ({type(exc).__name__}: {exc})"}
    # torch publishes CAI v2 (no stream) and DLPack: gpucoll takes the DLPack handshake,
    # here with work pending on a torch side stream.
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        t = torch.arange(1 << 20, dtype=torch.float32, device="cuda") * (rank + 1)
        gpucoll.all_reduce(t)  # in place
        b = torch.full((5,), rank + 1, dtype=torch.bfloat16, device="cuda")
        yb = F.all_reduce(b)  # a new tensor of the caller's type
    torch.cuda.synchronize()
    want = torch.arange(1 << 20, dtype=torch.float32) * total
    out["in_place"] = bool(torch.equal(t.cpu(), want))
    out["bf16"] = isinstance(yb, torch.Tensor) and yb.dtype == torch.bfloat16 and yb.is_cuda and \
        yb.float().cpu().tolist() == [float(total)] * 5
    out["input_kept"] = b.float().cpu().tolist() == [float(rank + 1)] * 5
    gpucoll.destroy_process_group()
    return out


@pytest.mark.parametrize("size", SIZES)
def test_torch_interop(size: int) -> None:
    for out in _spmd(_torch_body, size):
        if "skip" in out:
            pytest.skip(out["skip"])
        assert all(out.values()), out


def _debug_detail_body() -> dict[str, Any]:
    import cupy

    import gpucoll

    os.environ["GPUCOLL_DEBUG"] = "DETAIL"  # read when the group is created
    rank = _init()
    out = debug_detail_body(rank, cupy.asarray, lambda a: cupy.asnumpy(a).tolist())
    gpucoll.destroy_process_group()
    return out


@pytest.mark.skipif(_WHY_NOT_TWO is not None, reason=str(_WHY_NOT_TWO))
def test_debug_detail_catches_mismatched_collectives() -> None:
    # The same body and checks run on the fake GPU in CI
    # (tests/nccl/test_nccl_groups.py::test_debug_detail_body_on_the_fake_gpu).
    for out in _spmd(_debug_detail_body, 2, timeout=300.0):
        check_debug_detail(out)


def _new_groups_body() -> dict[str, Any]:
    import cupy

    import gpucoll

    rank = _init()
    size = gpucoll.get_world_size()
    out: dict[str, Any] = {}

    def total(group: Any) -> float:
        x = cupy.full(1024, rank + 1, cupy.float32)
        gpucoll.all_reduce(x, group=group)
        values = cupy.asnumpy(x)
        assert (values == values[0]).all()
        return float(values[0])

    from gpucoll._world import default_group

    everyone = gpucoll.new_group()
    out["can_split"] = bool(default_group()._nccl.can_split)
    out["everyone"] = total(everyone)
    first = gpucoll.new_group([0])  # rank 1 (if any) takes part in the split as a non-member
    out["first"] = total(first) if rank == 0 else None
    halves = gpucoll.split_group(split_ranks=[[r] for r in range(size)][::-1])
    out["half"] = total(halves)
    out["default"] = total(None)  # the parent still works after the splits
    gpucoll.destroy_process_group()
    return out


@pytest.mark.parametrize("size", SIZES)
def test_new_groups_split_the_default_communicator(size: int) -> None:
    whole = size * (size + 1) / 2
    for rank, out in enumerate(_spmd(_new_groups_body, size, timeout=300.0)):
        assert out["everyone"] == whole and out["default"] == whole, out
        assert out["first"] == (1.0 if rank == 0 else None), out
        assert out["half"] == rank + 1, out
        assert isinstance(out["can_split"], bool), out


_ABORT_TIMEOUT_S = 4.0


def _abort_body() -> dict[str, Any]:
    import cupy

    import gpucoll
    from gpucoll.clusters.base import STORE_TOKEN_ENV
    from gpucoll.store import TCPStore

    # Two ranks time-slice one GPU, each op ~4.5 ms: 4 s is ample for the ops that
    # complete, and the whole test (init, the timeout, the abort, teardown) stays well
    # within 30 s.
    rank = _init(timeout=_ABORT_TIMEOUT_S)
    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                     timeout=120.0, token=os.environ[STORE_TOKEN_ENV])
    x = cupy.ones(1 << 16, cupy.float32)
    gpucoll.all_reduce(x)  # both ranks: the communicator works
    cupy.cuda.runtime.deviceSynchronize()
    out: dict[str, Any] = {}
    if rank == 0:
        w = gpucoll.all_reduce(x, async_op=True)  # rank 1 never joins this one
        assert w is not None
        t0 = time.monotonic()
        try:
            w.wait(timeout=60.0)  # an explicit timeout blocks the host until done or failed
            out["first"] = "completed?!"
        except gpucoll.DistBackendError as exc:
            out["first"] = str(exc)
        out["after_s"] = time.monotonic() - t0
        try:
            gpucoll.all_reduce(x)
            out["later"] = "completed?!"
        except gpucoll.DistBackendError as exc:
            out["later"] = str(exc)
        store.set("abort_test/done", "1")
    else:
        store.wait(["abort_test/done"], 120.0)
    # Rank 1's communicator outlives its aborted peer: NCCL's ncclCommDestroy there waits
    # for the peer's proxies (seen on the H200 with 2.32.3), so the bounded destroy names
    # itself rather than hang; rank 0's, after its abort, returns.
    try:
        gpucoll.destroy_process_group()
        out["destroy"] = "ok"
    except gpucoll.DistBackendError as exc:
        out["destroy"] = str(exc)
    return out


@pytest.mark.skipif(_WHY_NOT_TWO is not None, reason=str(_WHY_NOT_TWO))
def test_watchdog_aborts_a_collective_that_one_rank_never_joins() -> None:
    import re

    t0 = time.monotonic()
    out, peer = _spmd(_abort_body, 2, timeout=60.0)
    took = time.monotonic() - t0
    assert out["destroy"] == "ok", out
    assert peer["destroy"] == "ok" or re.search(r"ncclCommDestroy did not return within [\d.]+ s", peer["destroy"]), peer
    first, later = out["first"], out["later"]
    m = re.search(r"all_reduce \(seq (\d+)\) on group 'default'", first)
    assert m, out
    assert "did not complete within the group's timeout" in first, out
    assert _ABORT_TIMEOUT_S * 0.9 <= out["after_s"] < _ABORT_TIMEOUT_S + 5.0, out
    assert took < 30.0, (took, out)
    assert later != "completed?!", out
    # the later op names itself (a later seq) and the abort's reason
    m2 = re.search(r"all_reduce \(seq (\d+)\) on group 'default' failed", later)
    assert m2 and int(m2.group(1)) > int(m.group(1)) and "did not complete" in later, out
