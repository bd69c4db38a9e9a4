"""Data-parallel gradient reduction on GPUs: gpucoll's Reducer over NCCL against torch DDP
over NCCL, on the gradient sets of bench/ddp_bench.py's three models (ResNet-50,
BERT-base, GPT-2 small), CuPy gradients on the GPU.

Ways, timed in the same run (float32 gradients; per iteration the device is synchronised,
the step issued, the host time to return taken, then the device synchronised again; the
slower rank's time, median over iterations):

- ``flat``: one all_reduce of one array holding everything (the floor); ``flat, AVG``;
- ``bucketed``: ``Reducer(params)`` (25 MiB buckets, the first 1 MiB) and
  ``reduce(grads)``: each bucket's gradients copied into it together (one launch of
  gpucoll's gather kernel), one all_reduce (AVG) per bucket;
- ``bucketed, mark_ready``: the same gradients handed over one by one (``mark_ready``, as a
  backward pass does), then ``wait()``: a copy each into its bucket;
- ``bucketed, views``: ``mark_ready`` and ``wait()`` with the gradients computed into the
  buckets (``Reducer.gradient_view``): no copy;
- ``per tensor``: one all_reduce per gradient;
- ``fp16``: the Reducer with ``fp16_compress_hook``;
- ``torch DDP``: ``DistributedDataParallel`` (NCCL, 25 MiB buckets,
  ``gradient_as_bucket_view=True``) over a module with the same parameters whose backward
  hands over precomputed CUDA gradients (no compute): DDP's reducer and NCCL;
  ``torch no_sync`` is the same backward without reduction.

Two figures per way: ``host``, the time until the step returned to Python (what a training
loop's CPU pays, the Reducer's own overhead), and ``total``, until the device finished. At
world size 1 NCCL's all_reduce is a device copy, so the figures are the libraries' own
cost; several ranks on one GPU time-slice it (every op ~4.5 ms), which shows correctness,
not speed.

gpucoll and torch take turns, ``--rounds`` times, each in processes of its own (torch's
NCCL and CuPy's never share one); each figure is the median over the rounds.

Usage::

    python bench/ddp_nccl_bench.py                        # world size 1, all three models
    python bench/ddp_nccl_bench.py --nproc 2 --models resnet50 --iters 3

Exits 2 (printing why) where no GPU or NCCL is usable.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
for _p in (_ROOT, _HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from ddp_bench import (SHAPES, common_args, ddp_steps, grads_for, parse_models, run_torch_workers,  # noqa: E402
                       take_turns, torch_world, write_json)

ENV = {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_NVLS_ENABLE": "0"}
WAYS = ("flat", "flat_avg", "bucketed", "bucketed_mark_ready", "bucketed_views", "per_tensor", "fp16")


def why_no_gpu() -> str | None:
    from gpucoll._env.devices import no_gpu_reason

    reason = no_gpu_reason()
    if reason is not None:
        return reason
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
        from cupy.cuda import nccl

        nccl.get_version()
    except Exception as exc:  # noqa: BLE001 - the reason is printed
        return f"CuPy/NCCL not usable: {type(exc).__name__}: {exc}"
    return None


def _worst(per_rank: list[list[tuple[float, float]]]) -> dict[str, float]:
    """The slower rank's (host, total) per iteration, median over iterations."""
    n = len(per_rank[0])
    host = statistics.median(max(r[i][0] for r in per_rank) for i in range(n))
    total = statistics.median(max(r[i][1] for r in per_rank) for i in range(n))
    return {"host": host, "total": total}


def timed_turns(ways: dict[str, Callable[[], Any]], iters: int, sync: Callable[[], Any],
                barrier: Callable[[], Any], gather: Callable[[Any], list[Any]]) -> dict[str, dict[str, float]]:
    """Each way once per iteration, in turn; one untimed turn first."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
    for it in range(iters + 1):
        for name, fn in ways.items():
            sync()
            barrier()
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            sync()
            t2 = time.perf_counter()
            if it:
                times[name].append((t1 - t0, t2 - t0))
    everyone = gather(times)
    return {name: _worst([e[name] for e in everyone]) for name in ways}


def gpucoll_rank(models: list[str], iters: int) -> dict[str, Any]:
    import cupy

    import gpucoll
    from gpucoll.ddp_comm_hooks import fp16_compress_hook

    rank = int(os.environ["RANK"])
    gpucoll.init_process_group("nccl", device_id=rank % cupy.cuda.runtime.getDeviceCount(), timeout=300)
    try:
        world = gpucoll.get_world_size()

        def gather(obj: Any) -> list[Any]:
            out: list[Any] = [None] * world
            gpucoll.all_gather_object(out, obj)
            return out

        def sync() -> None:
            cupy.cuda.get_current_stream().synchronize()

        barrier = gpucoll.barrier if world > 1 else (lambda: None)
        results: dict[str, Any] = {}
        for model in models:
            shapes = SHAPES[model]()
            grads = [cupy.asarray(g) for g in grads_for(shapes, rank)]
            params = [cupy.zeros(s, cupy.float32) for s in shapes]
            flat = cupy.concatenate([g.reshape(-1) for g in grads])
            reducer = gpucoll.Reducer(params)
            reducer.reduce(grads)  # the first iteration rebuilds the buckets
            views = [reducer.gradient_view(i) for i in range(len(grads))]
            for v, g in zip(views, grads):
                v[...] = g
            per_tensor = [g.copy() for g in grads]
            fp16 = gpucoll.Reducer(params)
            fp16.register_comm_hook(None, fp16_compress_hook)
            fp16.reduce(grads)

            def in_place() -> None:
                for i in reversed(range(len(views))):
                    reducer.mark_ready(i, views[i])
                reducer.wait()

            def one_by_one() -> None:  # a backward pass handing each gradient over as it comes
                for i in reversed(range(len(grads))):
                    reducer.mark_ready(i, grads[i])
                reducer.wait()

            def one_per_tensor() -> None:
                for g in per_tensor:
                    gpucoll.all_reduce(g)

            row: dict[str, Any] = {"tensors": len(shapes), "params": int(sum(g.size for g in grads)),
                                   "buckets": len(reducer.bucket_indices)}
            row.update(timed_turns({
                "flat": lambda: gpucoll.all_reduce(flat),
                "flat_avg": lambda: gpucoll.all_reduce(flat, op=gpucoll.ReduceOp.AVG),
                "bucketed": lambda: reducer.reduce(grads),
                "bucketed_mark_ready": one_by_one,
                "bucketed_views": in_place,
                "per_tensor": one_per_tensor,
                "fp16": lambda: fp16.reduce(grads),
            }, iters, sync, barrier, gather))
            # correctness: the mean of every rank's gradients (the ranks' seeds are their ranks)
            out = reducer.reduce(grads)
            others = [grads_for(shapes, k) for k in range(world)]
            worst = 0.0
            for i in range(len(shapes)):
                exact = np.mean([o[i].astype(np.float64) for o in others], axis=0)
                worst = max(worst, float(np.max(np.abs(cupy.asnumpy(out[i]) - exact))))
            row["max_abs_err"] = worst
            del reducer, fp16, flat, per_tensor, views, out
            cupy.get_default_memory_pool().free_all_blocks()
            results[model] = row
        return results
    finally:
        gpucoll.destroy_process_group()


def run_gpucoll(models: list[str], iters: int, nproc: int) -> dict[str, Any]:
    from gpucoll.testing import run_spmd

    res: dict[str, Any] = run_spmd(gpucoll_rank, nproc, args=(models, iters), timeout=1200, init=False,
                                   backend="nccl", env=ENV, start_method="spawn")[0]
    return res


# ----- torch DDP over NCCL (subprocess workers over a torch TCPStore on port 0) -----

def torch_worker(rank: int, world: int, port: int, models: list[str], iters: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    gather = torch_world("nccl", rank, world, port, device)

    results: dict[str, Any] = {}
    try:
        for model in models:
            shapes = SHAPES[model]()
            grads = [torch.from_numpy(g).to(device) for g in grads_for(shapes, rank)]

            step, no_sync = ddp_steps(shapes, grads, device)
            step()
            step()  # the first iteration rebuilds the buckets
            barrier = dist.barrier if world > 1 else (lambda: None)
            results[model] = timed_turns({"ddp": step, "no_sync": no_sync}, iters, torch.cuda.synchronize,
                                         barrier, gather)
            del step, no_sync, grads
            torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
    return results


def run_torch(models: list[str], iters: int, nproc: int) -> dict[str, Any] | str:
    return run_torch_workers(__file__, nproc, models, iters, ("--nproc", str(nproc)), {**os.environ, **ENV}, 1200.0)


# ----- report -----

def median_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for model, row in rounds[0].items():
        out[model] = {}
        for k, v in row.items():
            if isinstance(v, dict):
                out[model][k] = {f: statistics.median(r[model][k][f] for r in rounds) for f in v}
            elif isinstance(v, float):
                out[model][k] = statistics.median(r[model][k] for r in rounds)
            else:
                out[model][k] = v
    return out


def report(ours: dict[str, Any], theirs: dict[str, Any] | str, nproc: int, rounds: int) -> str:
    def us(s: float) -> str:
        return f"{s * 1e6:10.1f} µs"

    lines = [f"world size {nproc}, NCCL, float32 CuPy gradients; host = until the step returned, total = until "
             f"the device finished; slower rank, median over iterations, then over {rounds} round(s)", ""]
    names = {"flat": "flat (the floor)", "flat_avg": "flat, AVG", "bucketed": "bucketed (reduce)",
             "bucketed_mark_ready": "bucketed, mark_ready", "bucketed_views": "bucketed, views",
             "per_tensor": "per tensor", "fp16": "fp16 compress"}
    for model, row in ours.items():
        mib = row["params"] * 4 / 2**20
        lines.append(f"{model}: {row['tensors']} tensors, {row['params']:,} parameters ({mib:.1f} MiB), "
                     f"{row['buckets']} buckets; reduce() max abs error vs the float64 mean {row['max_abs_err']:.2e}")
        lines.append(f"  {'way':20s} {'host':>13s} {'total':>13s}")
        for way in WAYS:
            lines.append(f"  {names[way]:20s} {us(row[way]['host'])} {us(row[way]['total'])}")
        if isinstance(theirs, dict) and model in theirs:
            t = theirs[model]
            lines.append(f"  {'torch DDP (NCCL)':20s} {us(t['ddp']['host'])} {us(t['ddp']['total'])}")
            lines.append(f"  {'torch no_sync':20s} {us(t['no_sync']['host'])} {us(t['no_sync']['total'])}")
            for way in ("bucketed", "bucketed_mark_ready", "bucketed_views"):
                lines.append(f"  {names[way]} / torch DDP: host {row[way]['host'] / t['ddp']['host']:.2f}x, "
                             f"total {row[way]['total'] / t['ddp']['total']:.2f}x")
        lines.append("")
    if isinstance(theirs, str):
        lines.append(f"torch DDP: skipped ({theirs})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_args(ap, iters=10, rounds=2)
    ap.add_argument("--nproc", type=int, default=1, help="ranks (on the machine's GPUs, round robin)")
    args = ap.parse_args(argv)
    models = parse_models(ap, args.models)
    if args.nproc < 1:
        ap.error("--nproc must be at least 1")
    if args.worker:
        print(json.dumps(torch_worker(args.rank, args.nproc, args.port, models, args.iters)))
        return 0
    why = why_no_gpu()
    if why is not None:
        print(f"ddp_nccl_bench: cannot run: {why}", file=sys.stderr)
        return 2
    ours, theirs = take_turns(
        args.rounds, lambda: run_gpucoll(models, args.iters, args.nproc),
        None if args.skip_torch else lambda: run_torch(models, args.iters, args.nproc), median_rounds,
        # each round's report: a run killed at its time limit keeps what it measured
        lambda o, t, n: print(report(o, t, args.nproc, n), flush=True))
    write_json(args.json, ours, theirs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
