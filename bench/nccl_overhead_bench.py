"""Host-side cost of a small all_reduce: gpucoll vs a bare cupy.cuda.nccl call vs torch.

Measures, in the same run, on one GPU, the host time each library spends per call of
an in-place SUM all_reduce of a small float32 array (default 1 KiB), with the same
method for every library: ``--batch`` calls back to back, timed with
``time.perf_counter`` *before* synchronising (so the figure is host overhead, not
GPU time), then a device synchronise; the median over ``--batches`` batches is
reported, along with the GPU-inclusive time per call (synchronise included).

Modes (each in its own process, so that torch's and CuPy's NCCL never share one):

- ``bare``: ``cupy.cuda.nccl.NcclCommunicator.allReduce`` on the current stream, the
  floor any Python wrapper stands on;
- ``gpucoll``: ``gpucoll.all_reduce(x)`` on a CuPy array (async_op=False: the
  caller's stream is ordered, the host is not blocked), through the array layer,
  the ProcessGroup and the NCCL backend;
- ``gpucoll-backend``: the NCCL backend alone with a prepared Buffer, through the
  synchronous (Work-less) form ``all_reduce(x)`` uses (``all_reduce_quiet``): the
  floor under the array layer and the ProcessGroup;
- ``async+wait``: ``gpucoll.all_reduce(x, async_op=True).wait()`` (the communication
  stream, a Work, and wait() ordering the caller's stream);
- ``torch``: ``torch.distributed.all_reduce`` with ProcessGroupNCCL (if torch with
  CUDA is installed).

It also checks that in-place all_reduce allocates no device memory (CuPy's pool
usage is unchanged). Targets (host µs per call, 1 KiB, one rank): gpucoll <= 6 and
<= 0.25x torch; gpucoll-backend <= 4; async+wait <= 10.

Usage::

    python bench/nccl_overhead_bench.py                 # world size 1, 1 KiB
    python bench/nccl_overhead_bench.py --quick
    python bench/nccl_overhead_bench.py --ranks 2       # two ranks on the GPU (NCCL >= 2.30)
    python bench/nccl_overhead_bench.py --json out.json

Exits 2 (printing why) where no GPU/NCCL is usable.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

MODES = ("bare", "gpucoll", "gpucoll-backend", "async+wait", "torch")
# Host µs per call each mode should stay within (1 KiB, one rank, an H100/H200).
TARGET_US = {"gpucoll": 6.0, "gpucoll-backend": 4.0, "async+wait": 10.0}
TARGET_VS_TORCH = 0.25  # gpucoll's host time against torch's


# ----- one rank of one mode (a child process) -----

def _timed(call: Any, sync: Any, batch: int, batches: int, warmup: int) -> dict[str, float]:
    for _ in range(warmup):
        call()
    sync()
    host, total = [], []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(batch):
            call()
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        host.append((t1 - t0) / batch * 1e6)
        total.append((t2 - t0) / batch * 1e6)
    return {"host_us": statistics.median(host), "host_us_min": min(host), "total_us": statistics.median(total)}


def _child(mode: str, rank: int, size: int, nbytes: int, batch: int, batches: int, uid_file: str) -> dict[str, Any]:
    n = max(1, nbytes // 4)
    warmup = max(20, batch // 5)
    if mode == "torch":
        return _child_torch(rank, size, n, batch, batches, warmup, uid_file)
    if mode == "bare":
        return _child_bare(rank, size, n, batch, batches, warmup, uid_file)
    return _child_gpucoll(mode, rank, size, n, batch, batches, warmup, uid_file)


def _child_torch(rank: int, size: int, n: int, batch: int, batches: int, warmup: int, uid_file: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        return {"skipped": "torch has no CUDA here"}
    torch.cuda.set_device(0)
    store = dist.FileStore(uid_file + ".torch", size)  # type: ignore[attr-defined]
    dist.init_process_group("nccl", store=store, rank=rank, world_size=size, device_id=torch.device("cuda:0"))
    t = torch.ones(n, dtype=torch.float32, device="cuda")
    res: dict[str, Any] = dict(_timed(lambda: dist.all_reduce(t), torch.cuda.synchronize, batch, batches, warmup))
    res["torch"] = torch.__version__
    res["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))  # type: ignore[no-untyped-call]
    dist.destroy_process_group()
    return res


def _child_bare(rank: int, size: int, n: int, batch: int, batches: int, warmup: int, uid_file: str) -> dict[str, Any]:
    import cupy
    from cupy.cuda import nccl

    from gpucoll._backends.nccl.lib import comm_id_arg, normalise_unique_id
    from gpucoll.store import FileStore

    cupy.cuda.Device(0).use()
    x = cupy.ones(n, cupy.float32)
    store = FileStore(uid_file, size)
    if rank == 0:
        store.set("uid", normalise_unique_id(nccl.get_unique_id()))
    uid = normalise_unique_id(store.get("uid"))
    comm = nccl.NcclCommunicator(size, comm_id_arg(uid, cupy.__version__), rank)
    stream = cupy.cuda.get_current_stream()
    ptr, sptr = x.data.ptr, stream.ptr
    res = dict(_timed(lambda: comm.allReduce(ptr, ptr, n, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, sptr),
                      stream.synchronize, batch, batches, warmup))
    comm.destroy()
    return res


def _child_gpucoll(mode: str, rank: int, size: int, n: int, batch: int, batches: int, warmup: int,
                   uid_file: str) -> dict[str, Any]:
    import cupy

    import gpucoll
    from gpucoll import array as garray
    from gpucoll._backends.nccl.backend import nccl_version
    from gpucoll.store import FileStore
    from gpucoll._world import default_group

    cupy.cuda.Device(0).use()
    x = cupy.ones(n, cupy.float32)
    gpucoll.init_process_group("nccl", store=FileStore(uid_file, size), rank=rank, world_size=size, device_id=0)
    pool = cupy.get_default_memory_pool()
    sync = cupy.cuda.runtime.deviceSynchronize
    res: dict[str, Any]
    if mode == "gpucoll":
        gpucoll.all_reduce(x)
        sync()
        used, total = pool.used_bytes(), pool.total_bytes()
        res = dict(_timed(lambda: gpucoll.all_reduce(x), sync, batch, batches, warmup))
        res["pool_unchanged"] = (pool.used_bytes(), pool.total_bytes()) == (used, total)
    elif mode == "async+wait":
        res = dict(_timed(lambda: gpucoll.all_reduce(x, async_op=True).wait(), sync, batch, batches, warmup))
    else:
        backend = default_group()._nccl
        if backend is None:
            return {"skipped": "the default group has no NCCL backend"}
        buf = garray.as_buffer(x, writable=True)
        SUM = gpucoll.ReduceOp.SUM
        backend.all_reduce(buf, SUM).wait()  # the first call plans the op; later ones take its hot path

        def quiet() -> None:
            if not backend.all_reduce_quiet(buf, SUM, 1, None, ""):
                backend.all_reduce(buf, SUM).wait()
        res = dict(_timed(quiet, sync, batch, batches, warmup))
    res["nccl"] = ".".join(map(str, nccl_version()))
    res["cupy"] = cupy.__version__
    gpucoll.destroy_process_group()
    return res


# ----- the parent -----

def _run_mode(mode: str, size: int, nbytes: int, batch: int, batches: int, timeout: float) -> dict[str, Any]:
    env = dict(os.environ)
    env.setdefault("NCCL_MULTI_RANK_GPU_ENABLE", "1")
    tmp = tempfile.mkdtemp(prefix="gpucoll-bench-")
    uid_file = os.path.join(tmp, "store")
    procs = []
    for rank in range(size):
        outp = os.path.join(tmp, f"out{rank}.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--rank", str(rank), "--ranks", str(size),
               "--bytes", str(nbytes), "--batch", str(batch), "--batches", str(batches), "--uid-file", uid_file,
               "--out", outp]
        procs.append((subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT), outp))
    results: list[dict[str, Any]] = []
    for proc, outp in procs:
        try:
            log, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p, _ in procs:
                p.kill()
            return {"error": f"timed out after {timeout:.0f} s"}
        if proc.returncode != 0:
            for p, _ in procs:
                p.kill()
            return {"error": f"exit code {proc.returncode}: {log.decode(errors='replace')[-2000:]}"}
        with open(outp) as f:
            results.append(json.load(f))
    return results[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=1, help="processes on the one GPU (2 needs NCCL >= 2.30)")
    ap.add_argument("--bytes", type=int, default=1024, help="all_reduce size in bytes (default 1 KiB)")
    ap.add_argument("--batch", type=int, default=500, help="calls per timed batch")
    ap.add_argument("--batches", type=int, default=15, help="timed batches (the median is reported)")
    ap.add_argument("--quick", action="store_true", help="100 calls x 5 batches")
    ap.add_argument("--skip", action="append", default=[], choices=MODES, help="leave out a mode")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per mode")
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--uid-file", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.batch, args.batches = 100, 5
    if args.child:
        res = _child(args.child, args.rank, args.ranks, args.bytes, args.batch, args.batches, args.uid_file)
        with open(args.out, "w") as f:
            json.dump(res, f)
        return 0

    from gpucoll._backends.nccl.backend import nccl_unavailable_reason

    reason = nccl_unavailable_reason()
    if reason is not None:
        print(f"nccl_overhead_bench: cannot run here: {reason}", file=sys.stderr)
        return 2
    results: dict[str, Any] = {"ranks": args.ranks, "bytes": args.bytes, "batch": args.batch,
                               "batches": args.batches, "modes": {}}
    for mode in MODES:
        if mode in args.skip:
            continue
        res = _run_mode(mode, args.ranks, args.bytes, args.batch, args.batches, args.timeout)
        results["modes"][mode] = res
    modes = results["modes"]
    print(f"all_reduce SUM of {args.bytes} B float32, {args.ranks} rank(s) on one GPU; "
          f"median of {args.batches} batches of {args.batch} calls")
    print(f"{'mode':<16} {'host us/call':>13} {'min':>8} {'with GPU us/call':>17}  notes")
    for mode, res in modes.items():
        if "host_us" in res:
            note = " ".join(f"{k}={res[k]}" for k in ("nccl", "cupy", "torch", "pool_unchanged") if k in res)
            print(f"{mode:<16} {res['host_us']:>13.2f} {res['host_us_min']:>8.2f} {res['total_us']:>17.2f}  {note}")
        else:
            print(f"{mode:<16} {'-':>13} {'-':>8} {'-':>17}  {res.get('skipped') or res.get('error')}")
    ratios = {}
    for mode, target in TARGET_US.items():
        us = modes.get(mode, {}).get("host_us")
        if us:
            ratios[f"{mode}/target"] = round(us / target, 3)
            verdict = "meets" if us <= target else "misses"
            print(f"{mode} host time: {us:.2f} us = {us / target:.2f}x the target <= {target:g} us ({verdict} it)")
    g = modes.get("gpucoll", {}).get("host_us")
    for anchor, target in (("torch", TARGET_VS_TORCH), ("bare", None)):
        a = modes.get(anchor, {}).get("host_us")
        if g and a:
            ratios[f"gpucoll/{anchor}"] = round(g / a, 3)
            if target is None:
                print(f"gpucoll/{anchor} host time: {g / a:.2f}x")
            else:
                verdict = "meets" if g / a <= target else "misses"
                print(f"gpucoll/{anchor} host time: {g / a:.2f}x ({verdict} the target <= {target}x)")
    results["ratios"] = ratios
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    failed = [m for m, r in modes.items() if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
