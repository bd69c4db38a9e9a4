"""The CPU backend's async ops against its synchronous ones: a batch of ``async_op=True``
ops, waited at the end, should cost at most 1.5x the same batch done synchronously.

Two measurements, in the same sitting, taking turns for ``--rounds`` rounds (a shared
machine's speed drifts within a minute; alternating lets the drift fall on both):

1. **batches** (gpucoll's public API in ``run_spmd`` ranks, bound to a core each as
   ``bench/cpu_collectives_bench.py`` binds them), per size and per round: ``--batches``
   batches of each kind, the kinds interleaved, each batch after a barrier, timed as the
   slowest rank's time per op; per kind the median over batches, then over rounds:

   - ``sync``: ``gpucoll.all_reduce(x)``, one after another (cpu_collectives_bench.py's loop);
   - ``async``: ``gpucoll.all_reduce(x, async_op=True)`` issued back to back, then every
     Work waited (gpucoll-bench's loop, which is nccl-tests');
   - ``async_oop``: the same through gpucoll-bench's out-of-place call (a copy, then the
     reduction in place, as the CPU backend does it).

   Ratio = async kind / sync; the target is at most 1.5. The best batch of each kind is
   printed too: on a shared machine it bounds what the code costs (as timeit advises).

2. **the two benches themselves**: ``bench/cpu_collectives_bench.py --sizes 8 --rounds 1
   --skip gloo,mpi`` (its gpucoll all_reduce 8 B row, the synchronous op) and
   ``gpucoll-bench all_reduce --backend cpu -b 8 -e 8`` (its out-of-place and in-place
   columns: async ops, 20 per measurement, one measurement per run), each run once per
   round; per column the median over rounds, and its ratio to the synchronous op.

Usage::

    python bench/cpu_async_bench.py                    # 2 ranks, 8 B and 1 KiB, 5 rounds
    python bench/cpu_async_bench.py --ranks 3 --sizes 8,65536 --rounds 3
    python bench/cpu_async_bench.py --skip-benches     # only the batches
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
from typing import Any, Callable

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
if _ROOT not in sys.path:  # runnable from a checkout: the repository root holds the package
    sys.path.insert(0, _ROOT)

KINDS = ("sync", "async", "async_oop")


def batches_rank(sizes: list[int], iters: int, batches: int) -> dict[str, dict[str, float]]:
    """One round on this rank: per size, the median time per op (µs) of each kind, and
    the best (``<kind>_best``)."""
    import gpucoll
    from gpucoll.bench.ops import Call, get_op

    rank, world = gpucoll.get_rank(), gpucoll.get_world_size()
    t = np.zeros(1, np.float64)

    def slowest(v: float) -> float:
        t[0] = v
        gpucoll.all_reduce(t, op=gpucoll.ReduceOp.MAX)
        return float(t[0])

    out_of_place = get_op("all_reduce").out_of_place
    assert out_of_place is not None
    res: dict[str, dict[str, float]] = {}
    for nbytes in sizes:
        x = np.zeros(max(1, nbytes // 4), np.float32)
        y = np.zeros_like(x)
        call = Call(x, y, gpucoll.ReduceOp.SUM, 0, rank, world, True)

        def sync() -> None:
            for _ in range(iters):
                gpucoll.all_reduce(x)

        def async_() -> None:
            pending = [gpucoll.all_reduce(x, async_op=True) for _ in range(iters)]
            for w in pending:
                assert w is not None
                w.wait()

        def async_oop() -> None:
            pending: list[Any] = []
            for _ in range(iters):
                pending.extend(out_of_place(call))
            for w in pending:
                w.wait()

        kinds: dict[str, Callable[[], None]] = {"sync": sync, "async": async_, "async_oop": async_oop}
        for fn in kinds.values():  # plans made, connections warm
            fn()
        samples: dict[str, list[float]] = {k: [] for k in kinds}
        for _ in range(batches):
            for k, fn in kinds.items():
                gpucoll.barrier()
                t0 = time.perf_counter()
                fn()
                samples[k].append(slowest((time.perf_counter() - t0) / iters) * 1e6)
        res[str(nbytes)] = {k: statistics.median(v) for k, v in samples.items()}
        res[str(nbytes)].update({f"{k}_best": min(v) for k, v in samples.items()})
    return res


def run_batches(ranks: int, sizes: list[int], iters: int, batches: int) -> dict[str, dict[str, float]]:
    from gpucoll.testing import run_spmd

    got: dict[str, dict[str, float]] = run_spmd(batches_rank, ranks, args=(sizes, iters, batches),
                                                timeout=600, backend="cpu", pg_timeout=60.0, bind_to="core")[0]
    return got


def run_sync_bench(ranks: int) -> float:
    """bench/cpu_collectives_bench.py's gpucoll all_reduce 8 B, in µs (its own run, one round)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "sync.json")
        subprocess.run([sys.executable, os.path.join(_HERE, "cpu_collectives_bench.py"), "--ranks", str(ranks),
                        "--sizes", "8", "--rounds", "1", "--skip", "gloo,mpi", "--json", path],
                       check=True, stdout=subprocess.DEVNULL, env=_env())
        with open(path) as f:
            return float(json.load(f)["results"]["gpucoll"]["all_reduce"]["8"]) * 1e6


def run_gpucoll_bench(ranks: int) -> tuple[float, float]:
    """``gpucoll-bench all_reduce --backend cpu -b 8 -e 8``: (out-of-place, in-place) µs."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.json")
        subprocess.run([sys.executable, "-m", "gpucoll.bench", "all_reduce", "--backend", "cpu", "-b", "8",
                        "-e", "8", "--nproc", str(ranks), "--json", path],
                       check=True, stdout=subprocess.DEVNULL, env=_env())
        with open(path) as f:
            row = json.load(f)["rows"][0]
        return float(row["oop_time_us"]), float(row["ip_time_us"])


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, env.get("PYTHONPATH", "")]))
    return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2, help="number of ranks (default 2)")
    ap.add_argument("--sizes", default="8,1024", help="comma-separated all_reduce sizes in bytes (default 8,1024)")
    ap.add_argument("--iters", type=int, default=200, help="ops per batch (default 200)")
    ap.add_argument("--batches", type=int, default=5, help="batches of each kind per round (default 5)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    ap.add_argument("--skip-benches", action="store_true",
                    help="only the batches, not cpu_collectives_bench.py and gpucoll-bench")
    ap.add_argument("--json", default="", help="also write the raw results to this file")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if args.rounds < 1 or args.iters < 1 or args.batches < 1 or not sizes:
        ap.error("--rounds, --iters and --batches must be >= 1, and --sizes non-empty")
    rounds: list[dict[str, Any]] = []
    for _ in range(args.rounds):
        one: dict[str, Any] = {"batches": run_batches(args.ranks, sizes, args.iters, args.batches)}
        if not args.skip_benches:
            one["sync_bench_us"] = run_sync_bench(args.ranks)
            one["gpucoll_bench_us"] = run_gpucoll_bench(args.ranks)
        rounds.append(one)
    print(f"{args.ranks} ranks, {os.cpu_count()} CPUs, {args.rounds} rounds; time per op in µs "
          f"(median over rounds of the median over {args.batches} batches of {args.iters} ops, slowest rank)")
    print("| size | sync | async | async out of place | async / sync | async oop / sync |")
    print("|---|---|---|---|---|---|")
    for nb in sizes:
        med = {k: statistics.median(r["batches"][str(nb)][k] for r in rounds) for k in KINDS}
        print(f"| {nb} B | {med['sync']:.2f} | {med['async']:.2f} | {med['async_oop']:.2f} | "
              f"{med['async'] / med['sync']:.2f}x | {med['async_oop'] / med['sync']:.2f}x |")
    # As timeit advises: on a shared machine the best batch bounds what the code costs; the
    # slower ones measure other processes' interference as much as the code.
    print(f"\nbest batch of all {args.rounds * args.batches} of each kind:")
    print("| size | sync | async | async out of place | async / sync | async oop / sync |")
    print("|---|---|---|---|---|---|")
    for nb in sizes:
        best = {k: min(r["batches"][str(nb)][f"{k}_best"] for r in rounds) for k in KINDS}
        print(f"| {nb} B | {best['sync']:.2f} | {best['async']:.2f} | {best['async_oop']:.2f} | "
              f"{best['async'] / best['sync']:.2f}x | {best['async_oop'] / best['sync']:.2f}x |")
    if not args.skip_benches:
        sync = statistics.median(r["sync_bench_us"] for r in rounds)
        oop = statistics.median(r["gpucoll_bench_us"][0] for r in rounds)
        ip = statistics.median(r["gpucoll_bench_us"][1] for r in rounds)
        print(f"\nthe benches, 8 B, median of {args.rounds} runs each (every run's figure in --json):")
        print("| cpu_collectives_bench.py (sync) | gpucoll-bench out-of-place | gpucoll-bench in-place "
              "| out-of-place / sync | in-place / sync |")
        print("|---|---|---|---|---|")
        print(f"| {sync:.2f} | {oop:.2f} | {ip:.2f} | {oop / sync:.2f}x | {ip / sync:.2f}x |")
        print("each run: " + "; ".join(f"{r['sync_bench_us']:.1f} / {r['gpucoll_bench_us'][0]:.1f} / "
                                      f"{r['gpucoll_bench_us'][1]:.1f}" for r in rounds))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": args.ranks, "sizes": sizes, "iters": args.iters, "rounds": rounds}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
