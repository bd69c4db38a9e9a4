"""CPU time per large all_reduce: gpucoll's CPU backend against Open MPI, alternated.

With more ranks than cores both libraries are bound by the CPU of all their ranks
together: the wall time of an op follows the sum of the ranks' CPU time over the cores,
and that sum is the work each library does per op. Wall times taken a minute apart on a
shared machine differ by 2x; CPU time per op moves much less with the load, so it is
what this compares. Per size, each library runs ``--batches`` batches of ops; per batch
every rank reads its own ``getrusage`` (user and system time, voluntary and involuntary
context switches) around the ops, and the batch's figures are the slowest rank's wall
time and the sum over the ranks of the rest, per op. The libraries take turns
``--pairs`` times (the one that starts alternating), each turn a fresh job, so that a
change in the machine's load falls on both alike; each pair prints its own row, and the
last rows give the median over the pairs and the ratio gpucoll / Open MPI.

Usage::

    python bench/cpu_large_cost.py                              # 4 ranks, 1 MiB and 16 MiB, 3 pairs
    python bench/cpu_large_cost.py --ranks 2 --sizes 16777216,67108864 --pairs 5
    python bench/cpu_large_cost.py --skip mpi --pairs 1 --batches 2   # gpucoll alone

Open MPI runs through ``mpirun --oversubscribe`` and mpi4py, ``Allreduce`` in place;
gpucoll through ``gpucoll.all_reduce`` in ``run_spmd``'s ranks, not bound to cores (as
``mpirun`` binds none when there are more ranks than cores). Both use float32 arrays.
When mpirun or mpi4py is missing, gpucoll runs alone with a note.

``--floor`` adds a third party: as many processes as ranks, each moving, alone and in its
own memory, the bytes one rank of gpucoll's single-copy all_reduce moves (its slice of
n - 1 other arrays read in the same chunks into a scratch block and folded in rank order
into its own array, then n - 1 slices of the other arrays copied into its array), with
NumPy copies instead of ``process_vm_readv``, no peer, no flag and no wait: the CPU an op
of that design costs where nothing but the copies and folds is paid for. (Each process
holds n arrays of the size, so that its reads come from memory no cache holds.)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import numpy as np

# Runnable from a checkout without installing: the repository root holds the package.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

FIELDS = ("wall", "cpu", "sys", "vcsw", "ivcsw")  # cpu: user + system time


def _iters(nbytes: int) -> int:
    """Ops per batch: about 64 MiB of array per batch, 3 to 200 ops."""
    return max(3, min(200, (64 << 20) // max(nbytes, 1)))


def measure(sizes: list[int], batches: int, all_reduce: Callable[[Any], Any],
            barrier: Callable[[], Any]) -> dict[str, list[list[float]]]:
    """This rank's figures per size: for each batch, ``FIELDS`` per op (seconds, switches)."""
    out: dict[str, list[list[float]]] = {}
    for nbytes in sizes:
        x = np.ones(max(1, nbytes // 4), np.float32)
        iters = _iters(nbytes)
        for _ in range(2):
            all_reduce(x)
        rows = []
        for _ in range(batches):
            barrier()
            t0, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
            for _ in range(iters):
                all_reduce(x)
            r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            rows.append([(t1 - t0) / iters, (r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime) / iters,
                         (r1.ru_stime - r0.ru_stime) / iters, (r1.ru_nvcsw - r0.ru_nvcsw) / iters,
                         (r1.ru_nivcsw - r0.ru_nivcsw) / iters])
            x.fill(1.0)  # keep the values small: the sums grow by n per op
        out[str(nbytes)] = rows
    return out


def combine(per_rank: list[dict[str, list[list[float]]]]) -> dict[str, dict[str, float]]:
    """Per size, the median over batches of the slowest rank's wall time and of the sums
    over the ranks of the other fields (all per op)."""
    res: dict[str, dict[str, float]] = {}
    for size in per_rank[0]:
        nb = len(per_rank[0][size])
        batch = [[max(r[size][b][0] for r in per_rank)]
                 + [sum(r[size][b][k] for r in per_rank) for k in range(1, len(FIELDS))] for b in range(nb)]
        res[size] = {f: statistics.median(row[k] for row in batch) for k, f in enumerate(FIELDS)}
    return res


def gpucoll_rank(sizes: list[int], batches: int) -> dict[str, list[list[float]]]:
    import gpucoll

    return measure(sizes, batches, all_reduce=lambda x: gpucoll.all_reduce(x), barrier=gpucoll.barrier)


def run_gpucoll(world: int, sizes: list[int], batches: int) -> dict[str, dict[str, float]]:
    from gpucoll.testing import run_spmd

    return combine(run_spmd(gpucoll_rank, world, args=(sizes, batches), timeout=600, backend="cpu",
                            pg_timeout=60.0))


def floor_rank(sizes: list[int], batches: int) -> dict[str, list[list[float]]]:
    from gpucoll._backends.cpu.cma import chunk_bytes
    from gpucoll._backends.cpu.tcp_algos import chunk_bounds

    r, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    others: dict[int, list[np.ndarray[Any, Any]]] = {}
    scratch = [np.empty(chunk_bytes(n) // 4, np.float32) for _ in range(n)]

    def work(x: np.ndarray[Any, Any]) -> None:
        peers = others.get(x.size)
        if peers is None:
            peers = others[x.size] = [np.ones_like(x) for _ in range(n)]  # (entry r unused)
        bounds = chunk_bounds(x.size, n)
        lo, hi = bounds[r]
        step = scratch[0].size
        for start in range(lo, hi, step):
            stop = min(start + step, hi)
            m = stop - start
            parts = [x[start:stop] if j == r else scratch[j][:m] for j in range(n)]
            for j in range(n):
                if j != r:
                    np.copyto(parts[j], peers[j][start:stop])
            acc = parts[0] if r != 0 else x[start:stop]
            np.add(parts[0], parts[1], out=acc)
            for j in range(2, n - 1):
                np.add(acc, parts[j], out=acc)
            if n > 2:
                np.add(acc, parts[n - 1], out=x[start:stop])
            elif r == 1:
                x[start:stop] = acc
        for j in range(n):
            if j != r:
                plo, phi = bounds[j]
                np.copyto(x[plo:phi], peers[j][plo:phi])

    return measure(sizes, batches, all_reduce=work, barrier=lambda: None)


def run_floor(world: int, sizes: list[int], batches: int) -> dict[str, dict[str, float]]:
    from gpucoll.testing import run_spmd

    return combine(run_spmd(floor_rank, world, args=(sizes, batches), timeout=600, init=False))


def mpi_worker(sizes: list[int], batches: int) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    mine = measure(sizes, batches, all_reduce=lambda x: comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM),
                   barrier=comm.Barrier)
    every = comm.gather(mine, root=0)  # (None on the other ranks)
    if every is not None:
        print(json.dumps(combine(every)))


def mpi_missing() -> str | None:
    """Why Open MPI cannot run here, or None."""
    if shutil.which("mpirun") is None:
        return "mpirun is not installed"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed"
    return None


def run_mpi(world: int, sizes: list[int], batches: int) -> dict[str, dict[str, float]]:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = [shutil.which("mpirun") or "mpirun", "-n", str(world), "--oversubscribe", sys.executable, __file__,
           "--worker", "--sizes", ",".join(map(str, sizes)), "--batches", str(batches)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if p.returncode:
        raise RuntimeError(f"mpirun failed ({p.returncode}): {p.stderr.strip()[-300:]}")
    res: dict[str, dict[str, float]] = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("{")][-1])
    return res


def _row(label: str, r: dict[str, float]) -> str:
    return (f"| {label} | {r['wall'] * 1e3:.3f} | {r['cpu'] * 1e3:.3f} | {r['sys'] * 1e3:.3f} "
            f"| {r['vcsw']:.1f} | {r['ivcsw']:.1f} |")


def report(runs: dict[str, list[dict[str, dict[str, float]]]], sizes: list[int]) -> str:
    """One table per size: each turn's row, each library's median, and the ratios."""
    lines = []
    for nb in sizes:
        size = str(nb)
        lines += [f"\nall_reduce {nb} B: per op; wall = the slowest rank, the rest summed over the ranks",
                  "| library, turn | wall ms | CPU ms | of it system ms | voluntary switches | involuntary |",
                  "|---|---|---|---|---|---|"]
        med: dict[str, dict[str, float]] = {}
        for lib, each in runs.items():
            for i, res in enumerate(each):
                lines.append(_row(f"{lib} {i + 1}", res[size]))
            med[lib] = {f: statistics.median(res[size][f] for res in each) for f in FIELDS}
        for lib in runs:
            lines.append(_row(f"{lib}, median", med[lib]))
        g = med["gpucoll"]
        for lib, name in (("mpi", "Open MPI"), ("floor", "the floor")):
            if lib in med:
                m = med[lib]
                lines.append(f"gpucoll / {name} (medians): wall {g['wall'] / m['wall']:.2f}x, "
                             f"CPU {g['cpu'] / m['cpu']:.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4, help="number of ranks (default 4)")
    ap.add_argument("--sizes", default="1048576,16777216", help="comma-separated all_reduce sizes in bytes")
    ap.add_argument("--pairs", type=int, default=3, help="turns of each library, alternated (default 3)")
    ap.add_argument("--batches", type=int, default=5, help="batches per size and turn; the median counts")
    ap.add_argument("--skip", default="", help="'mpi' to run gpucoll alone")
    ap.add_argument("--floor", action="store_true",
                    help="also run the floor: each rank's copies and folds alone, in user space (see above)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if not sizes or min(sizes) < 4:
        ap.error(f"--sizes needs sizes of at least 4 bytes; got {args.sizes!r}")
    if args.pairs < 1 or args.batches < 1 or args.ranks < 2:
        ap.error(f"--pairs and --batches must be >= 1 and --ranks >= 2; got {args.pairs}, {args.batches}, {args.ranks}")
    if args.worker:
        mpi_worker(sizes, args.batches)
        return 0
    why = "--skip mpi given" if "mpi" in args.skip.split(",") else mpi_missing()
    libs: dict[str, Callable[[], dict[str, dict[str, float]]]] = {
        "gpucoll": lambda: run_gpucoll(args.ranks, sizes, args.batches)}
    if why is None:
        libs["mpi"] = lambda: run_mpi(args.ranks, sizes, args.batches)
    if args.floor:
        libs["floor"] = lambda: run_floor(args.ranks, sizes, args.batches)
    runs: dict[str, list[dict[str, dict[str, float]]]] = {k: [] for k in libs}
    load = [os.getloadavg()[0]]
    for p in range(args.pairs):
        for k in (list(libs) if p % 2 == 0 else list(libs)[::-1]):
            runs[k].append(libs[k]())
        load.append(os.getloadavg()[0])
    print(f"{args.ranks} ranks, {os.cpu_count()} CPUs, {args.pairs} turns each, {args.batches} batches; "
          f"load {min(load):.1f}-{max(load):.1f}" + (f"; Open MPI skipped: {why}" if why else ""))
    print(report(runs, sizes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
