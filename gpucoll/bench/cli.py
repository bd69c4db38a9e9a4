"""``gpucoll-bench OP``: the command line, in nccl-tests' flags.

Three ways to run:

- plain ``gpucoll-bench all_reduce``: starts a local job itself, ``--nproc`` ranks
  (default: every visible GPU with NCCL; 2 ranks on the CPU backend);
- under a launcher (``gpucoll-run``, ``torchrun``, ``srun``, ``mpirun``): every
  process runs one rank in place, the launcher decides the world;
- ``gpucoll-bench plot A.json [B.json ...] --plot OUT.png``: draw saved runs, no benchmark.

Nothing heavy is imported before the arguments are parsed; matplotlib only for ``--plot``.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
from typing import Sequence

from .ops import op_names
from .options import BenchConfig, parse_size, resolve_datatypes, resolve_redops, size_sweep

__all__ = ["main", "build_parser", "config_from_args", "local_job_size", "CORRUPT_ENV"]

from .._env import BENCH_COMMAND_ENV
from .._env import BENCH_CORRUPT_ENV as CORRUPT_ENV

_EPILOG = """\
examples:
  gpucoll-bench all_reduce -b 8 -e 64M -f 4           sweep 8 B .. 64 MiB, x4 per step
  gpucoll-bench all_reduce -b 8 -e 8G -f 2 -g 8       8 ranks on this node, one process per GPU
  gpucoll-bench all_reduce -g 8 -m 4 -R 2             4 ops per group call, symmetric windows
  gpucoll-bench all_gather -d bfloat16 --json run.json
  srun -N2 --ntasks-per-node 8 gpucoll-bench all_reduce -b 1M -e 1G -f 2
  gpucoll-bench plot a.json b.json --plot compare.png  compare saved runs
"""


_NO_ARGS_HINT = """\
Name a collective to measure, e.g.:
  gpucoll-bench all_reduce                     2 ranks on the CPU, or one per GPU with NCCL
  gpucoll-bench all_reduce -b 8 -e 64M -f 2    nccl-tests' size sweep flags
  gpucoll-bench plot run.json --plot run.png   draw a saved run
collectives: """ + ", ".join(op_names()) + """
gpucoll-bench --help lists every flag; docs/benchmark.md explains the table."""


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (nccl-tests' short and long flags plus gpucoll's own)."""
    p = argparse.ArgumentParser(
        prog="gpucoll-bench", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_EPILOG,
        description="Collective bandwidth benchmark with nccl-tests' flags and table.")
    p.add_argument("collective", metavar="OP", choices=[*op_names(), "plot"],
                   help="the collective: " + ", ".join(op_names()) + "; or 'plot' to draw saved runs")
    p.add_argument("files", nargs="*", metavar="RUN.json", help="(plot only) runs saved with --json")
    p.add_argument("-b", "--minbytes", type=_size, default=32 << 20, help="smallest size (default 32M)")
    p.add_argument("-e", "--maxbytes", type=_size, default=32 << 20, help="largest size (default 32M)")
    p.add_argument("-i", "--stepbytes", type=_size, default=1 << 20,
                   help="size increment when the step factor is 1 (default 1M)")
    p.add_argument("-f", "--stepfactor", type=int, default=1, help="size multiplier per step (default 1)")
    p.add_argument("-n", "--iters", type=int, default=20, help="timed iterations per size (default 20)")
    p.add_argument("-w", "--warmup_iters", type=int, default=5, help="warm-up iterations per size (default 5)")
    p.add_argument("-c", "--check", type=int, default=1,
                   help="checked runs per size; 0 skips the check (default 1)")
    p.add_argument("-d", "--datatype", default="float",
                   help="float, half, bfloat16, double, int8, uint8, int32, uint32, int64, uint64, "
                        "f8e4m3, f8e5m2, or all (default float)")
    p.add_argument("-o", "--op", dest="redop", default="sum",
                   help="reduction: sum, prod, max, min, avg, premulsum, band, bor, bxor, or all (default sum)")
    p.add_argument("-r", "--root", type=int, default=0, help="root of rooted ops; -1: every rank in turn")
    p.add_argument("-z", "--blocking", type=int, default=0, help="1: wait for each op before the next")
    p.add_argument("-G", "--cudagraph", type=int, default=0,
                   help="CUDA graph launches (nccl-tests' meaning: the timed ops are captured into a graph, "
                        "launched this many times; nccl backend only; default 0, no graph)")
    # nccl-tests' remaining flags, so that a pasted all_reduce_perf command line works.
    p.add_argument("-t", "--nthreads", type=int, default=None,
                   help="nccl-tests' threads per process; with -g, the local job runs -t x -g ranks, each "
                        "its own process (gpucoll runs one rank per process) with one GPU (default 1)")
    p.add_argument("-g", "--ngpus", type=int, default=None,
                   help="nccl-tests' GPUs per thread: -g 8 runs 8 ranks on one node, one process per GPU, "
                        "and fails naming the GPU count when there are fewer (default 1; on the cpu "
                        "backend -t x -g ranks run as well)")
    p.add_argument("-a", "--average", type=int, default=3, choices=(0, 1, 2, 3),
                   help="time reported over ranks: 0 rank 0, 1 average, 2 minimum, 3 maximum "
                        "(default 3; nccl-tests' default is 1)")
    p.add_argument("-m", "--agg_iters", type=int, default=1,
                   help="ops aggregated per group call: each timed iteration issues M ops inside one "
                        "gpucoll.coalescing() block (one ncclGroupStart/End); time per op is divided by M "
                        "(all_reduce, all_gather, reduce_scatter; default 1)")
    p.add_argument("-p", "--parallel_init", type=int, default=0,
                   help="initialise threads in parallel (nccl-tests); one thread per process here: must be 0")
    p.add_argument("-N", "--run_cycles", type=int, default=1,
                   help="run the whole sweep this many times (default 1; nccl-tests' 0, forever, is refused)")
    p.add_argument("-C", "--report_cputime", type=int, default=0, choices=(0, 1),
                   help="1: time only the issuing of the ops (host time until the last op is queued), "
                        "not their completion (default 0)")
    p.add_argument("-T", "--timeout_s", dest="timeout_short", type=float, default=None, metavar="S",
                   help="same as --timeout, in seconds (nccl-tests' -T; --timeout is gpucoll's own)")
    p.add_argument("-R", "--local_register", type=int, default=0, choices=(0, 1, 2),
                   help="buffer registration: 1 buffers from the NCCL memory pool (ncclMemAlloc) registered "
                        "with ncclCommRegister, 2 registered as symmetric windows (ncclCommWindowRegister, "
                        "NCCL >= 2.27); a no-op on the cpu backend (default 0)")
    p.add_argument("--backend", choices=("auto", "nccl", "cpu"), default="auto",
                   help="nccl (GPU arrays), cpu (NumPy arrays), or auto: nccl when a GPU is usable")
    p.add_argument("--nproc", type=int, default=None,
                   help="ranks of the local job to start (default: GPUs visible with nccl, 2 with cpu); "
                        "not needed under gpucoll-run, srun or mpirun")
    p.add_argument("--bind-to", "--bind_to", dest="bind_to", choices=("auto", "core", "none"), default="auto",
                   help="the local job's ranks (no launcher): 'core' binds each to a core of its own, as "
                        "mpirun binds up to two ranks; 'auto' (default) does so on the cpu backend only")
    p.add_argument("--timeout", type=float, default=300.0, help="process-group timeout in seconds (default 300)")
    p.add_argument("--json", metavar="FILE", help="write every row and the environment as JSON")
    p.add_argument("--csv", metavar="FILE", help="write every row and the environment as CSV")
    p.add_argument("--plot", metavar="FILE.png",
                   help="draw busbw and latency against size, in-place and out-of-place (needs matplotlib)")
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    return p


def _version() -> str:
    from .. import __version__

    return __version__


_REFUSED_UNLESS = (
    # (attribute, flag, accepted value, why any other value cannot mean anything here)
    ("parallel_init", "-p/--parallel_init", 0,
     "there is one thread per process, so there is nothing to initialise in parallel"),
)


def _check_nccl_tests_flags(args: argparse.Namespace) -> None:
    """Refuse, with the reason, values of nccl-tests' flags that mean nothing here."""
    for attr, flag, ok, why in _REFUSED_UNLESS:
        value = getattr(args, attr)
        if value != ok:
            raise ValueError(f"{flag} {value}: {why}. Use {flag.split('/')[0]} {ok} or leave it out.")
    for attr, flag in (("nthreads", "-t/--nthreads"), ("ngpus", "-g/--ngpus"), ("agg_iters", "-m/--agg_iters")):
        value = getattr(args, attr)
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1; got {value}")
    if args.run_cycles < 1:
        raise ValueError(f"-N/--run_cycles {args.run_cycles}: gpucoll-bench runs a finite number of "
                         "sweeps; give -N 1 or more (0, nccl-tests' 'forever', is not supported)")
    if args.timeout_short is not None:
        if args.timeout_short <= 0:
            raise ValueError(f"-T {args.timeout_short}: the timeout must be > 0 seconds")
        args.timeout = args.timeout_short


def config_from_args(args: argparse.Namespace, backend: str) -> BenchConfig:
    """Validate parsed arguments into a :class:`BenchConfig` for ``backend``.

    Raises:
        ValueError: an argument is out of range.
    """
    _check_nccl_tests_flags(args)
    if args.cudagraph < 0:
        raise ValueError(f"-G/--cudagraph must be >= 0; got {args.cudagraph}")
    if args.cudagraph and backend != "nccl":
        raise ValueError(f"-G/--cudagraph {args.cudagraph}: CUDA graphs need the nccl backend (GPU arrays); "
                         f"this run uses {backend!r}. Use -G 0, or --backend nccl on a GPU")
    if args.cudagraph and args.blocking:
        raise ValueError("-G/--cudagraph with -z 1: a captured op cannot be waited on from the host; "
                         "use one of them")
    if args.blocking not in (0, 1):
        raise ValueError(f"-z/--blocking must be 0 or 1; got {args.blocking}")
    sizes = size_sweep(args.minbytes, args.maxbytes, args.stepbytes, args.stepfactor)
    return BenchConfig(
        op=args.collective, sizes=tuple(sizes), minbytes=args.minbytes, maxbytes=args.maxbytes,
        stepbytes=args.stepbytes, stepfactor=args.stepfactor, iters=args.iters,
        warmup_iters=args.warmup_iters, check=args.check,
        datatypes=resolve_datatypes(args.datatype), redops=resolve_redops(args.redop),
        root=args.root, blocking=bool(args.blocking), cudagraph=args.cudagraph, backend=backend,
        timeout=args.timeout, corrupt=os.environ.get(CORRUPT_ENV, "") == "1",
        average=args.average, run_cycles=args.run_cycles, report_cputime=bool(args.report_cputime),
        nthreads=args.nthreads or 1, ngpus=args.ngpus or 1, agg_iters=args.agg_iters,
        local_register=args.local_register)


def _per_node(args: argparse.Namespace) -> int | None:
    """``-t x -g`` when either was given, else None."""
    if args.nthreads is None and args.ngpus is None:
        return None
    return (args.nthreads or 1) * (args.ngpus or 1)


def local_job_size(args: argparse.Namespace, backend: str, gpus: int) -> int:
    """How many ranks the local job runs: ``--nproc``, or ``-t x -g``, or by default every
    visible GPU with nccl and 2 on the CPU.

    Raises:
        ValueError: ``--nproc`` and ``-t x -g`` disagree, or ``-t x -g`` asks the nccl backend
            for more GPUs than are visible (one rank per GPU).
    """
    per_node = _per_node(args)
    t, g = args.nthreads or 1, args.ngpus or 1
    if per_node is not None and args.nproc is not None and args.nproc != per_node:
        raise ValueError(f"--nproc {args.nproc} and -t {t} -g {g} disagree: -t x -g is {per_node} ranks; "
                         "give one of them, or values that agree")
    if per_node is not None and backend == "nccl" and per_node > gpus:
        raise ValueError(f"-t {t} -g {g} runs {per_node} ranks, one per GPU, but this machine has {gpus} GPU"
                         f"{'' if gpus == 1 else 's'} visible (CUDA_VISIBLE_DEVICES="
                         f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); use -g {gpus} or fewer, or "
                         "--nproc to place several ranks on one GPU")
    if args.nproc is not None:
        return int(args.nproc)
    if per_node is not None:
        return per_node
    return gpus if backend == "nccl" else 2


def _gpu_count() -> tuple[int, str]:
    """Usable CUDA devices here, and why there are none. CuPy is imported only when a
    device node exists, so a CPU-only machine answers without loading CUDA."""
    if sys.platform.startswith("linux") and not glob.glob("/dev/nvidia[0-9]*"):
        return 0, "no /dev/nvidia* device"
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount()), "no CUDA device"
    except Exception as exc:  # ImportError, CUDARuntimeError: both mean "no usable GPU"
        return 0, f"{type(exc).__name__}: {exc}"


def _resolve_backend(requested: str, wanted: int | None = None) -> tuple[str, int]:
    """``(backend, visible GPUs)``; "auto" picks nccl when a GPU is usable.

    Raises:
        BackendUnavailableError: nccl was asked for and no GPU is usable.
    """
    if requested == "cpu":
        return "cpu", 0
    count, why = _gpu_count()
    if count > 0:
        return "nccl", count
    if requested == "nccl":
        from ..errors import BackendUnavailableError

        asked = "" if wanted is None else f" (-t x -g asks for {wanted}, one rank per GPU)"
        raise BackendUnavailableError(f"--backend nccl needs a usable CUDA GPU{asked}; this machine has 0 ({why})")
    return "cpu", 0


def _launcher_world() -> int | None:
    """The world size a launcher gave this process, or None outside any launcher."""
    from ..clusters import detect

    found = detect()
    return None if found is None else found.world_size


def _check_output_paths(args: argparse.Namespace) -> None:
    for flag in ("json", "csv", "plot"):
        path = getattr(args, flag)
        if path is not None:
            parent = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(parent):
                raise ValueError(f"--{flag} {path}: directory {parent} does not exist")
    if args.plot is not None:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            raise ImportError("--plot needs matplotlib: pip install 'gpucoll[bench]'")


def _plot_saved(args: argparse.Namespace) -> int:
    from .plot import plot_runs, run_label
    from .report import read_json

    if not args.files:
        raise ValueError("plot needs one or more RUN.json files (written with --json)")
    if not args.plot:
        raise ValueError("plot needs --plot FILE.png, the image to write")
    runs = [(run_label(doc, path), doc) for path in args.files for doc in [read_json(path)]]
    plot_runs(runs, args.plot)
    print(f"# wrote {args.plot} ({len(runs)} run{'s' if len(runs) > 1 else ''})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``gpucoll-bench``; returns the exit status (0 ok, 1 failed or wrong results, 2 usage).

    Args:
        argv: the arguments without the program name; ``sys.argv[1:]`` when None.

    Example:
        >>> from gpucoll.bench import main
        >>> main(["all_reduce", "-b", "8", "-e", "1M", "-f", "4", "--backend", "cpu"])  # doctest: +SKIP
        0
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv:
        parser.print_usage()
        print(_NO_ARGS_HINT)
        return 2
    args = parser.parse_args(argv)
    try:
        if args.collective == "plot":
            return _plot_saved(args)
        if args.files:
            raise ValueError(f"unexpected arguments {args.files}: only 'plot' takes files")
        _check_output_paths(args)
        # Validate everything before starting anything: against the backend asked for,
        # or for "auto" against nccl, which it may become; what depends on the backend
        # is checked again below, once a GPU has been looked for.
        config_from_args(args, "nccl" if args.backend == "auto" else args.backend)
        if args.nproc is not None and args.nproc < 1:
            raise ValueError(f"--nproc must be >= 1; got {args.nproc}")
        world = _launcher_world()
        if world is None:
            backend, gpus = _resolve_backend(args.backend, _per_node(args))
            nproc = local_job_size(args, backend, gpus)
            from .runner import check_config
            from .spawn import run_local

            check_config(config_from_args(args, backend), nproc)

            bind_to = args.bind_to if args.bind_to != "auto" else ("core" if backend == "cpu" else "none")
            return run_local(nproc, [*argv, "--backend", backend], timeout=args.timeout,
                             typed=argv, bind_to=bind_to, quiet_unbound=args.bind_to == "auto")
        per_node = _per_node(args)
        # A rank of gpucoll-bench's own local job (which ran -t x -g processes) has the job's command.
        if per_node is not None and per_node != 1 and not os.environ.get(BENCH_COMMAND_ENV):
            raise ValueError(f"-t {args.nthreads or 1} -g {args.ngpus or 1} under a launcher that started {world} "
                             "ranks: gpucoll runs one rank (one GPU) per process, so start -t x -g processes per "
                             "node with the launcher and leave -t/-g out")
        if args.nproc is not None and args.nproc != world:
            raise ValueError(f"--nproc {args.nproc} given, but the launcher started {world} ranks; "
                             "drop --nproc under gpucoll-run, srun or mpirun")
        backend, _ = _resolve_backend(args.backend)
        from .._launch.binding import apply_from_env
        from .session import run_session

        apply_from_env()  # a rank of the local job: the CPUs run_local planned for it, if any

        return run_session(config_from_args(args, backend), argv, json_path=args.json,
                           csv_path=args.csv, plot_path=args.plot)
    except (ValueError, TypeError, ImportError) as exc:
        parser.exit(2, f"gpucoll-bench: error: {exc}\n")
    except Exception as exc:
        from ..errors import DistError

        if not isinstance(exc, (DistError, OSError)):
            raise
        print(f"gpucoll-bench: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
