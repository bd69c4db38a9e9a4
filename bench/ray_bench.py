"""gpucoll on Ray: all_reduce among 2 Ray actors against the same under gpucoll-run, and
against ray.util.collective's "gloo" backend (torch's gloo) on the same actors; and the
latency of ``gpucoll.ray.run(fn, 2)`` for a trivial ``fn`` on a started cluster.

Measured, each the median over ``--rounds`` rounds in which the three take turns:

- ``ray``: gpucoll's CPU backend in 2 actors (``gpucoll.ray.init_group``);
- ``run``: the same loop in 2 ranks under ``gpucoll-run`` (a subprocess);
- ``gloo``: ``ray.util.collective.allreduce`` with backend "gloo" in the same 2 actors,
  on torch tensors (its native type).

Every loop is the same: a barrier, ``--iters`` all_reduce (SUM) of float32 arrays of the
size, and the slowest rank's time per op. Sizes: 8 B and 16 MiB by default.

Niceness: Ray starts its workers at nice 15, and ``gpucoll.ray`` leaves them there (it does
not lower a priority Ray chose). On a busy host that alone costs more than 2x, so the
``run`` ranks set themselves to the actors' niceness before measuring (``--nice``:
default ``ray``, the actors' own; a number sets both where the OS allows lowering).

Prints one row per size: time per op for each, and the ratios ray/run (target <= 1.1),
ray/gloo at 8 B (target <= 0.5) and bus bandwidth ray/gloo at 16 MiB (target >= 1.0),
then the seconds ``run(fn, 2)`` took from call to results.

Usage::

    python bench/ray_bench.py                 # starts a local cluster (num_cpus = 4)
    python bench/ray_bench.py --quick         # fewer iterations and rounds
    python bench/ray_bench.py --address auto  # an existing cluster
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

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))


def _set_nice(target: int | None) -> int:
    if target is not None:
        now = os.getpriority(os.PRIO_PROCESS, 0)
        if now != target:
            try:
                os.setpriority(os.PRIO_PROCESS, 0, target)
            except PermissionError:
                pass  # lowering needs privilege: reported as is
    return os.getpriority(os.PRIO_PROCESS, 0)


def gpucoll_loop(sizes: list[int], iters: int, warmup: int) -> dict[int, float]:
    """Seconds per all_reduce of each size (the slowest rank's), in the default group."""
    import gpucoll

    out = {}
    for nbytes in sizes:
        x = np.zeros(max(1, nbytes // 4), np.float32)  # zeros: a sum that never overflows
        n = iters if nbytes <= 1 << 16 else max(3, iters // 50)
        for _ in range(warmup):
            gpucoll.all_reduce(x)
        gpucoll.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            gpucoll.all_reduce(x)
        t = np.array([(time.perf_counter() - t0) / n])
        gpucoll.all_reduce(t, op=gpucoll.ReduceOp.MAX)
        out[nbytes] = float(t[0])
    return out


class BenchActor:
    """Both libraries' loops in one actor process."""

    def nice(self, target: int | None) -> int:
        return _set_nice(target)

    def gpucoll(self, sizes: list[int], iters: int, warmup: int) -> dict[int, float]:
        return gpucoll_loop(sizes, iters, warmup)

    def gloo_init(self, rank: int) -> None:
        import ray.util.collective as col

        col.init_collective_group(2, rank, backend="gloo", group_name="bench_gloo")

    def gloo(self, sizes: list[int], iters: int, warmup: int) -> dict[int, float]:
        import ray.util.collective as col
        import torch

        out = {}
        for nbytes in sizes:
            x = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
            n = iters if nbytes <= 1 << 16 else max(3, iters // 50)
            for _ in range(warmup):
                col.allreduce(x, group_name="bench_gloo")
            col.barrier(group_name="bench_gloo")
            t0 = time.perf_counter()
            for _ in range(n):
                col.allreduce(x, group_name="bench_gloo")
            t = torch.tensor([(time.perf_counter() - t0) / n], dtype=torch.float64)
            col.allreduce(t, group_name="bench_gloo", op=col.types.ReduceOp.MAX)
            out[nbytes] = float(t[0])
        return out


def _worker(args: argparse.Namespace) -> int:
    """One rank under gpucoll-run: the same loop as the actors', at the given niceness."""
    import gpucoll

    _set_nice(args.nice_value)
    gpucoll.init_process_group("cpu")
    res = gpucoll_loop(args.sizes, args.iters, args.warmup)
    if gpucoll.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({str(k): v for k, v in res.items()}, f)
    gpucoll.destroy_process_group()
    return 0


def _under_gpucoll_run(args: argparse.Namespace, nice: int) -> dict[int, float]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, "-m", "gpucoll.run", "--nproc-per-node", "2", __file__, "--worker",
           "--nice-value", str(nice), "--iters", str(args.iters), "--warmup", str(args.warmup), "--out", out,
           "--sizes", *map(str, args.sizes)]
    subprocess.run(cmd, check=True, timeout=600)
    with open(out) as f:
        res = {int(k): v for k, v in json.load(f).items()}
    os.unlink(out)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[8, 16 << 20])
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="200 iterations, 2 rounds")
    p.add_argument("--nice", default="ray", help="'ray' (the actors' niceness) or a number for every rank")
    p.add_argument("--address", default=None, help="an existing Ray cluster (ray.init(address=...))")
    p.add_argument("--skip-gloo", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--nice-value", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return _worker(args)
    if args.quick:
        args.iters, args.rounds = 200, 2
    import ray

    import gpucoll.ray as gray

    tmp = None
    if args.address is None:
        tmp = tempfile.mkdtemp(prefix="grb-", dir="/tmp")
        os.environ["HOME"] = tmp  # Ray's token and caches stay in the run's folder
        ray.init(num_cpus=4, _temp_dir=os.path.join(tmp, "ray"), include_dashboard=False, log_to_driver=False)
    else:
        ray.init(address=args.address)
    try:
        return _bench(args, ray, gray)
    finally:
        ray.shutdown()
        if tmp is not None:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)


def _bench(args: argparse.Namespace, ray: Any, gray: Any) -> int:
    cls = ray.remote(num_cpus=1)(BenchActor)
    actors = [cls.remote() for _ in range(2)]
    target = None if args.nice == "ray" else int(args.nice)
    nices = ray.get([a.nice.remote(target) for a in actors])
    group = gray.init_group(actors, backend="cpu")
    gloo = not args.skip_gloo
    if gloo:
        try:
            ray.get([a.gloo_init.remote(r) for r, a in enumerate(actors)], timeout=120)
        except Exception as exc:  # torch missing or gloo failing: reported, not fatal
            print(f"ray.util.collective gloo: unavailable ({type(exc).__name__}: {exc}); skipped")
            gloo = False
    rows: dict[str, list[dict[int, float]]] = {"ray": [], "run": [], "gloo": []}
    for _ in range(args.rounds):
        rows["ray"].append(ray.get([a.gpucoll.remote(args.sizes, args.iters, args.warmup) for a in actors])[0])
        rows["run"].append(_under_gpucoll_run(args, nices[0]))
        if gloo:
            rows["gloo"].append(ray.get([a.gloo.remote(args.sizes, args.iters, args.warmup) for a in actors])[0])
    group.destroy()
    for a in actors:
        ray.kill(a)
    med = {k: {s: statistics.median(r[s] for r in v) for s in args.sizes} for k, v in rows.items() if v}
    print(f"all_reduce SUM float32, 2 ranks, median of {args.rounds} rounds; every rank at nice {nices[0]} "
          f"(Ray's workers' niceness{'' if target is None else ', set'}); machine load: {os.getloadavg()[0]:.1f}")
    print(f"{'bytes':>10} {'ray us':>10} {'run us':>10} {'gloo us':>10} {'ray/run':>8} {'ray/gloo':>9} "
          f"{'busbw ray/gloo':>15}")
    for s in args.sizes:
        r, g = med["ray"][s], med["run"][s]
        gl = med.get("gloo", {}).get(s)
        cells = [f"{s:>10}", f"{r * 1e6:>10.1f}", f"{g * 1e6:>10.1f}",
                 f"{gl * 1e6:>10.1f}" if gl else f"{'-':>10}", f"{r / g:>8.2f}",
                 f"{r / gl:>9.2f}" if gl else f"{'-':>9}", f"{gl / r:>15.2f}" if gl else f"{'-':>15}"]
        print(" ".join(cells))

    def trivial() -> int:
        return os.getpid()

    gray.run(trivial, 2)  # the first run also starts worker processes for the actors' class
    times = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        gray.run(trivial, 2)
        times.append(time.perf_counter() - t0)
    print(f"gpucoll.ray.run(trivial, 2) on a started cluster: median {statistics.median(times):.2f} s "
          f"(of {len(times)}: {', '.join(f'{t:.2f}' for t in times)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
