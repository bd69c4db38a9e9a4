"""CPU collectives: gpucoll's CPU backend against torch's gloo (and mpi4py + Open MPI).

Measures, in the same run and with the same method for every library:

- all_reduce of float32 arrays from 8 B to 64 MiB: time per op and bus bandwidth
  (nccl-tests' formula, busbw = algbw * 2(n-1)/n);
- all_gather_object of a ~1 KiB dict, and barrier: latency.

Each row prints gpucoll's figure and each anchor's, with the ratio gpucoll/anchor
(time ratio: lower is better; busbw ratio: higher is better).

Usage::

    python bench/cpu_collectives_bench.py            # 2 ranks, full sweep
    python bench/cpu_collectives_bench.py --quick    # a few sizes, fewer iterations
    python bench/cpu_collectives_bench.py --ranks 4 --json results.json
    python bench/cpu_collectives_bench.py --transport tcp --skip mpi   # the TCP path
    python bench/cpu_collectives_bench.py --load     # the sweep quiet, then beside busy processes
    python bench/cpu_collectives_bench.py --bind-to none   # gpucoll's ranks left unbound

Each library's sweep runs ``--rounds`` times (default 3), the libraries taking turns, and
each row is the median over the rounds: on a shared machine bandwidth drifts by 2x within
a minute, and one sweep after the other would compare different moments.

gpucoll's ranks are bound to a core each (``run_spmd(bind_to="core")``, what
``gpucoll-run --bind-to core`` does), as ``mpirun`` binds Open MPI's: with up to two
ranks it binds each to a core by default (``--report-bindings`` shows it); torch's gloo
workers are not bound, as torchrun does not bind.

``--load`` runs the whole sweep twice, every library each time: quiet, then with one
busy process per core beside the ranks (an oversubscribed machine); it prints both
tables and, per row and library, the loaded time over the quiet one. Beside them it
runs a control: as many processes as ranks, each doing only the local memory work of
its share of an all_reduce (copy the bytes once, fold them once) with no communication
and no waiting. What the load does to the control is what the machine's scheduler does
to any rank's own work, however it communicates: with one busy process per core, each
process gets about half a core, so work bound by the CPU takes about twice as long.

Anchors that are not installed (torch, mpirun + mpi4py) are skipped with a note.
"""

from __future__ import annotations

import argparse
import json
import os
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

FULL_SIZES = sorted({8 << (2 * k) for k in range(12)} | {16 << 20, 64 << 20})  # 8 B ... 64 MiB
QUICK_SIZES = [8, 1024, 65536, 1 << 20, 16 << 20]
OBJ = {f"key{i:02d}": "v" * 12 for i in range(40)}  # pickles to about 1 KiB


def _iters(nbytes: int, quick: bool) -> tuple[int, int]:
    """(warmup, timed iterations per batch) for one size."""
    if nbytes <= 64 << 10:
        it = 200
    elif nbytes <= 1 << 20:
        it = 40
    else:
        it = max(3, int(64 << 20) // nbytes * 2)
    if quick:
        it = max(3, it // 4)
    return max(2, it // 10), it


# ----- the measurement, shared by every library -----

def measure(rank: int, world: int, quick: bool, sizes: list[int],
            all_reduce: Callable[[Any], Any], make: Callable[[int], Any],
            gather_obj: Callable[[Any], Any], barrier: Callable[[], Any],
            max_over_ranks: Callable[[float], float]) -> dict[str, Any]:
    """Time every row on this rank; per batch, the slowest rank's time counts."""
    batches = 3 if quick else 5
    out: dict[str, Any] = {"all_reduce": {}}

    def timed(fn: Callable[[], Any], warm: int, iters: int) -> float:
        for _ in range(warm):
            fn()
        samples = []
        for _ in range(batches):
            barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            samples.append(max_over_ranks((time.perf_counter() - t0) / iters))
        return statistics.median(samples)

    # Settle first (connections, caches, lazily built state) so the first row is not penalised.
    x = make(8)
    for _ in range(50 if quick else 200):
        all_reduce(x)
        barrier()
    for nbytes in sizes:
        x = make(nbytes)
        warm, iters = _iters(nbytes, quick)
        out["all_reduce"][str(nbytes)] = timed(lambda: all_reduce(x), warm, iters)
    n_obj = 50 if quick else 200
    out["all_gather_object"] = timed(lambda: gather_obj(OBJ), 10, n_obj)
    out["barrier"] = timed(barrier, 10, n_obj)
    return out


# ----- gpucoll (through its public API, in run_spmd's ranks) -----

def gpucoll_rank(quick: bool, sizes: list[int]) -> dict[str, Any]:
    import gpucoll

    rank, world = gpucoll.get_rank(), gpucoll.get_world_size()
    objs: list[Any] = [None] * world
    t = np.zeros(1, np.float64)

    def max_over_ranks(v: float) -> float:
        t[0] = v
        gpucoll.all_reduce(t, op=gpucoll.ReduceOp.MAX)
        return float(t[0])

    return measure(rank, world, quick, sizes,
                   all_reduce=lambda x: gpucoll.all_reduce(x),
                   make=lambda nb: np.zeros(max(1, nb // 4), np.float32),
                   gather_obj=lambda o: gpucoll.all_gather_object(objs, o),
                   barrier=gpucoll.barrier, max_over_ranks=max_over_ranks)


def run_gpucoll(world: int, quick: bool, sizes: list[int], transport: str, bind_to: str) -> dict[str, Any]:
    from gpucoll._backends.cpu.backend import TRANSPORT_ENV
    from gpucoll.testing import run_spmd

    # A stuck op fails after pg_timeout, a stuck job after timeout, each with the ranks' stacks.
    res: dict[str, Any] = run_spmd(gpucoll_rank, world, args=(quick, sizes), timeout=900,
                                   backend="cpu", pg_timeout=60.0, env={TRANSPORT_ENV: transport},
                                   bind_to=bind_to)[0]
    return res


# ----- the control: each rank's local work, with no communication -----

def control_worker(world: int, quick: bool, sizes: list[int]) -> dict[str, Any]:
    """The memory work of a rank's share of an all_reduce of each size (its bytes copied
    once and folded once, about what one rank of a shared-memory all_reduce reads and
    writes), timed the same way, alone: no peer, no flag, no wait."""
    import pickle

    spare: dict[int, np.ndarray[Any, Any]] = {}

    def work(x: np.ndarray[Any, Any]) -> None:
        y = spare.get(x.size)
        if y is None:
            y = spare[x.size] = np.empty_like(x)
        np.copyto(y, x)
        np.add(y, x, out=y)

    return measure(0, world, quick, sizes, all_reduce=work,
                   make=lambda nb: np.zeros(max(1, nb // 4), np.float32),
                   gather_obj=lambda o: pickle.loads(pickle.dumps(o)),
                   barrier=lambda: None, max_over_ranks=lambda v: v)


def run_control(world: int, quick: bool, sizes: list[int]) -> dict[str, Any] | str:
    """``world`` control processes at once (as many as ranks); per row, the slowest one."""
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", "control", "--ranks", str(world),
                               "--sizes", ",".join(map(str, sizes))] + (["--quick"] if quick else []),
                              stdout=subprocess.PIPE, text=True) for _ in range(world)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    if any(p.returncode for p in procs):
        return f"control processes failed (exit codes {[p.returncode for p in procs]})"
    each = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    return {"all_reduce": {k: max(e["all_reduce"][k] for e in each) for k in each[0]["all_reduce"]},
            "all_gather_object": max(e["all_gather_object"] for e in each),
            "barrier": max(e["barrier"] for e in each)}


# ----- torch gloo (subprocess workers over a torch TCPStore on port 0) -----

def gloo_worker(rank: int, world: int, port: int, quick: bool, sizes: list[int]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, world, is_master=False)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    objs: list[Any] = [None] * world
    t = torch.zeros(1, dtype=torch.float64)

    def max_over_ranks(v: float) -> float:
        t[0] = v
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t[0])

    try:
        return measure(rank, world, quick, sizes,
                       all_reduce=lambda x: dist.all_reduce(x),
                       make=lambda nb: torch.zeros(max(1, nb // 4), dtype=torch.float32),
                       gather_obj=lambda o: dist.all_gather_object(objs, o),
                       barrier=dist.barrier, max_over_ranks=max_over_ranks)
    finally:
        dist.destroy_process_group()


def run_gloo(world: int, quick: bool, sizes: list[int]) -> dict[str, Any] | str:
    try:
        import torch.distributed as dist
    except ImportError:
        return "torch is not installed"
    master = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True,  # type: ignore[attr-defined]
                           wait_for_workers=False)
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", "gloo", "--rank", str(r), "--ranks", str(world),
                               "--port", str(master.port), "--sizes", ",".join(map(str, sizes))]
                              + (["--quick"] if quick else []),
                              stdout=subprocess.PIPE, text=True) for r in range(world)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    if any(p.returncode for p in procs):
        return f"gloo workers failed (exit codes {[p.returncode for p in procs]})"
    res: dict[str, Any] = json.loads(outs[0].strip().splitlines()[-1])
    return res


# ----- mpi4py + Open MPI (mpirun --oversubscribe) -----

def mpi_worker(quick: bool, sizes: list[int]) -> dict[str, Any]:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD

    def max_over_ranks(v: float) -> float:
        return float(comm.allreduce(v, op=MPI.MAX))

    return measure(comm.Get_rank(), comm.Get_size(), quick, sizes,
                   all_reduce=lambda x: comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM),
                   make=lambda nb: np.zeros(max(1, nb // 4), np.float32),
                   gather_obj=lambda o: comm.allgather(o),
                   barrier=comm.Barrier, max_over_ranks=max_over_ranks)


def run_mpi(world: int, quick: bool, sizes: list[int]) -> dict[str, Any] | str:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        return "mpirun is not installed"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed"
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = [mpirun, "-n", str(world), "--oversubscribe", sys.executable, __file__,
           "--worker", "mpi", "--sizes", ",".join(map(str, sizes))] + (["--quick"] if quick else [])
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if p.returncode:
        return f"mpirun failed ({p.returncode}): {p.stderr.strip()[-300:]}"
    lines = [ln for ln in p.stdout.strip().splitlines() if ln.startswith("{")]
    res: dict[str, Any] = json.loads(lines[-1])
    return res


# ----- report -----

def _fmt_t(s: float) -> str:
    return f"{s * 1e6:.1f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms"


def _busbw(nbytes: int, seconds: float, world: int) -> float:
    return nbytes / seconds * 2 * (world - 1) / world / 1e9 if world > 1 else nbytes / seconds / 1e9


def report(results: dict[str, Any], world: int, sizes: list[int]) -> str:
    names = [k for k in ("gpucoll", "gloo", "mpi") if isinstance(results.get(k), dict)]
    anchors = [k for k in names if k != "gpucoll"]
    head = "| row | " + " | ".join(names) + " | " + " | ".join(f"gpucoll/{a}" for a in anchors) + " |"
    lines = [head, "|" + "---|" * (1 + len(names) + len(anchors))]
    for nb in sizes:
        ts = {k: results[k]["all_reduce"][str(nb)] for k in names}
        cells = [f"{_fmt_t(ts[k])}, {_busbw(nb, ts[k], world):.2f} GB/s" for k in names]
        ratios = [f"{_busbw(nb, ts['gpucoll'], world) / _busbw(nb, ts[a], world):.2f}x busbw" for a in anchors]
        lines.append(f"| all_reduce {nb} B | " + " | ".join(cells + ratios) + " |")
    for row in ("all_gather_object", "barrier"):
        ts = {k: results[k][row] for k in names}
        ratios = [f"{ts['gpucoll'] / ts[a]:.2f}x time" for a in anchors]
        label = "all_gather_object (1 KiB dict)" if row == "all_gather_object" else row
        lines.append(f"| {label} | " + " | ".join(_fmt_t(ts[k]) for k in names) + " | " + " | ".join(ratios) + " |")
    for k in ("gloo", "mpi"):
        if isinstance(results.get(k), str):
            lines.append(f"\n{k}: skipped ({results[k]})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2, help="number of ranks (default 2)")
    ap.add_argument("--quick", action="store_true", help="a few sizes and fewer iterations")
    ap.add_argument("--sizes", default="", help="comma-separated all_reduce sizes in bytes")
    ap.add_argument("--skip", default="", help="comma-separated anchors to skip: gloo, mpi")
    ap.add_argument("--transport", choices=("auto", "shm", "tcp"), default="auto",
                    help="gpucoll's CPU transport (GPUCOLL_CPU_TRANSPORT; default auto)")
    ap.add_argument("--bind-to", choices=("core", "none"), default="core",
                    help="bind gpucoll's ranks to a core each ('core', the default: what mpirun does with its "
                         "ranks here, as its --report-bindings shows for up to 2 ranks) or not ('none')")
    ap.add_argument("--rounds", type=int, default=3,
                    help="sweeps per library, the libraries taking turns; each row is the median (default 3)")
    ap.add_argument("--json", default="", help="also write the raw results to this file")
    ap.add_argument("--load", action="store_true",
                    help="also run the sweep with one busy process per core beside the ranks")
    ap.add_argument("--worker", choices=("gloo", "mpi", "control"), help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s] or (QUICK_SIZES if args.quick else FULL_SIZES)
    if args.worker == "gloo":
        res = gloo_worker(args.rank, args.ranks, args.port, args.quick, sizes)
        if args.rank == 0:
            print(json.dumps(res))
        return 0
    if args.worker == "control":
        print(json.dumps(control_worker(args.ranks, args.quick, sizes)))
        return 0
    if args.worker == "mpi":
        res = mpi_worker(args.quick, sizes)
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_rank() == 0:
            print(json.dumps(res))
        return 0
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1; got {args.rounds}")
    skip = set(filter(None, args.skip.split(",")))
    header = (f"{args.ranks} ranks, {os.cpu_count()} CPUs, {args.rounds} rounds (median), "
              f"gpucoll transport {args.transport}, "
              f"gpucoll ranks bound: {args.bind_to}; time per op "
              "(median of batches, slowest rank), busbw = algbw * 2(n-1)/n")
    results = sweep(args, sizes, skip)
    print(header)
    print(report(results, args.ranks, sizes))
    loaded: dict[str, Any] = {}
    if args.load:
        busy = start_load()
        try:
            loaded = sweep(args, sizes, skip)
        finally:
            stop_load(busy)
        print(f"\nwith --load: {len(busy)} busy processes beside the ranks; " + header)
        print(report(loaded, args.ranks, sizes))
        print("\n" + load_report(results, loaded, sizes))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": args.ranks, "sizes": sizes, "results": results, "loaded": loaded}, f, indent=1)
    return 0


def sweep(args: argparse.Namespace, sizes: list[int], skip: set[str]) -> dict[str, Any]:
    """Every library's sweep, ``--rounds`` times, the libraries taking turns (the order
    rotating each round), so that drift in the machine's speed over a minute, which on a
    shared machine moves bandwidth by 2x, falls on every library alike; per row and
    library, the median over the rounds."""
    runs: dict[str, Callable[[], Any]] = {
        "gpucoll": lambda: run_gpucoll(args.ranks, args.quick, sizes, args.transport, args.bind_to),
        "gloo": lambda: run_gloo(args.ranks, args.quick, sizes),
        "mpi": lambda: run_mpi(args.ranks, args.quick, sizes),
    }
    if args.load:
        runs["control"] = lambda: run_control(args.ranks, args.quick, sizes)
    names = [k for k in runs if k not in skip]
    got: dict[str, list[Any]] = {k: [] for k in names}
    for r in range(args.rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            got[k].append(runs[k]())
    results: dict[str, Any] = {k: "--skip given" for k in runs if k in skip}
    for k, each in got.items():
        failed = [e for e in each if isinstance(e, str)]
        results[k] = failed[0] if failed else median_of(each)
    return results


def median_of(each: list[dict[str, Any]]) -> dict[str, Any]:
    """Per row, the median of the rounds' figures (a round's figure is already a median of batches)."""
    return {"all_reduce": {nb: statistics.median(e["all_reduce"][nb] for e in each) for nb in each[0]["all_reduce"]},
            "all_gather_object": statistics.median(e["all_gather_object"] for e in each),
            "barrier": statistics.median(e["barrier"] for e in each)}


def start_load() -> list[subprocess.Popen[bytes]]:
    """One busy (spinning) process per core this process may run on."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]


def stop_load(busy: list[subprocess.Popen[bytes]]) -> None:
    for p in busy:
        p.kill()
    for p in busy:
        p.wait()


def load_report(quiet: dict[str, Any], loaded: dict[str, Any], sizes: list[int]) -> str:
    """Per row and library: the time with --load over the quiet time (lower is better);
    the control's column (its all_reduce rows only) is what the load does to work with
    no communication at all."""
    names = [k for k in ("gpucoll", "gloo", "mpi", "control")
             if isinstance(quiet.get(k), dict) and isinstance(loaded.get(k), dict)]
    lines = ["| row (loaded / quiet time) | " + " | ".join("control (no communication)" if k == "control" else k
                                                         for k in names) + " |",
             "|" + "---|" * (1 + len(names))]
    rows: list[tuple[str, tuple[str, ...]]] = [(f"all_reduce {nb} B", ("all_reduce", str(nb))) for nb in sizes]
    rows += [(row, (row,)) for row in ("all_gather_object", "barrier")]

    def get(res: dict[str, Any], path: tuple[str, ...]) -> float:
        v: Any = res
        for part in path:
            v = v[part]
        return float(v)

    for label, path in rows:
        lines.append(f"| {label} | " + " | ".join(
            "-" if k == "control" and path[0] != "all_reduce" else f"{get(loaded[k], path) / get(quiet[k], path):.2f}x"
            for k in names) + " |")
    for res in (quiet, loaded):
        if isinstance(res.get("control"), str):
            lines.append(f"\ncontrol: {res['control']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
