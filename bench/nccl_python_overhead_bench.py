"""The NCCL backend's own Python cost per op, without a GPU.

Drives ``gpucoll.all_reduce`` (array layer, ProcessGroup, watchdog, flight recorder,
NCCL backend) and the NCCL backend alone through a runtime whose CUDA and NCCL calls
do nothing, so what is timed is gpucoll's Python and nothing else. The "GPU" finishes
each op ``--lag`` ops after it is issued (event queries say so), as a busy GPU would,
so the completion path (the watchdog, the backend's pruning) runs as it does for real.

With ``--realistic`` the runtime is the fake GPU with costs (tests/_nccl_fake.py,
``TimedRuntime``): every CUDA and NCCL call takes ``--call-us`` (default 0.7 µs, an
H200's) and lets other threads run, as a C call that releases the GIL does, and
device work takes ``--op-us`` plus its bytes over the bandwidth, so event queries say
"not ready" until then. That is where threads trading the GIL show, as they did on the
GPU; each row also gives the CUDA and NCCL calls per op, by thread.

This is not the issue's benchmark (that is ``nccl_overhead_bench.py``, on a GPU,
against a bare ``cupy.cuda.nccl`` call and torch); it tracks the part of the host
cost that gpucoll controls, on any machine. Add the cost of the CUDA calls gpucoll
makes per op (two event records and two stream waits, plus the NCCL call itself) to
compare with a GPU run.

Usage::

    python bench/nccl_python_overhead_bench.py [--ops 50000] [--repeat 5] [--lag 20]
    python bench/nccl_python_overhead_bench.py --realistic [--call-us 0.7] [--op-us 5]
    python bench/nccl_python_overhead_bench.py --realistic --baseline ../gpucoll-old [--alternate 3]

With ``--baseline TREE`` the bench runs TREE's copy of itself and this tree's in turn,
``--alternate`` times each, so that "before" and "after" come from one run on one
machine load.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import threading
import time
from typing import Any, Callable

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
_TESTS = os.path.join(_ROOT, "tests")

from gpucoll._group import registry as _group  # noqa: E402
from gpucoll._buffer import DTYPES, Buffer, Device  # noqa: E402
from gpucoll._backends.nccl.lib import Features  # noqa: E402
from gpucoll._backends.nccl.backend import NCCLBackend  # noqa: E402
from gpucoll._reduce_op import ReduceOp  # noqa: E402
from gpucoll.array import as_buffer  # noqa: E402
from gpucoll.store import HashStore, PrefixStore  # noqa: E402


class _Event:
    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


def _nothing(*args: Any) -> None:
    return None


class _Comm:
    """A one-rank communicator whose calls return at once."""

    rank = 0
    size = 1
    all_reduce = reduce = broadcast = all_gather = reduce_scatter = send = recv = staticmethod(_nothing)

    def async_error(self) -> int:
        return 0

    def last_error(self) -> str:
        return ""

    def abort(self) -> None:
        pass

    def destroy(self) -> None:
        pass


class _Stream:
    ptr = 0x5000


class NoopRuntime:
    """A Runtime whose CUDA calls do nothing; event ``k`` has fired once ``lag`` more
    events were made after it."""

    features = Features(version=(2, 32, 3), all_to_all=True, gather=True, scatter=True)

    def __init__(self, lag: int) -> None:
        self._current = self._default = 0x7000
        self._count = itertools.count(1)
        self._made = 0
        self._lag = lag
        self.get_device: Callable[[], int] = lambda: 0
        self.set_device: Callable[[int], None] = _nothing
        self.record: Callable[[int, int], None] = _nothing
        self.wait_event: Callable[[int, int], None] = _nothing
        self.elapsed_ms: Callable[[int, int], float] = lambda a, b: 0.01
        self.is_capturing: Callable[[int], bool] = lambda s: False
        self.group_start: Callable[[], None] = _nothing
        self.group_end: Callable[[], None] = _nothing

    def device_count(self) -> int:
        return 1

    def compute_capability(self, device: int) -> tuple[int, int]:
        return (9, 0)

    def current_stream(self) -> int:
        return 0x7000

    def new_stream(self, high_priority: bool = False) -> Any:
        return _Stream()

    def event(self, pooled: bool = True, timing: bool = False, device: int = -1) -> Any:
        self._made = next(self._count)
        return _Event(self._made)

    def new_event(self, timing: bool = False) -> int:
        self._made = next(self._count)
        return self._made

    def destroy_event(self, event: int) -> None:
        pass

    can_exchange_capture_mode = True

    def current_stream_of(self, device: int) -> int:
        return 0x7000

    def stream_of(self, stream: Any, device: int) -> int | None:
        return 0x7000 if stream.ptr == 0 else int(stream.ptr) if stream.device_id == device else None

    def has_context(self) -> bool:
        return True

    def exchange_capture_mode(self, mode: int) -> int:
        return mode

    def query(self, event: int) -> bool:
        return event <= self._made - self._lag

    def finish_all(self) -> None:
        """The GPU catches up: every event made so far has fired."""
        self._lag = 0

    def memcpy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        pass

    def alloc(self, nbytes: int, stream: Any) -> tuple[int, Any]:
        return 0x100000, object()

    def prepare(self, kernel: str, device: int) -> None:
        pass

    def launch(self, kernel: str, n: int, args: tuple[Any, ...], stream: Any, device: int) -> None:
        pass

    def unique_id(self) -> bytes:
        return bytes(128)

    def new_comm(self, size: int, uid: bytes, rank: int, config: Any = None) -> Any:
        return _Comm()

    def check_config(self, config: Any) -> None:
        pass


class DeviceArray:
    """A 1 KiB float32 device array as Numba or torch publish one (CAI v3)."""

    class _Device:
        id = 0

    device = _Device()

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (256,), "typestr": "<f4", "data": (0x200000, False), "version": 3,
                "strides": None, "stream": 1}


def _interleaved(rows: dict[str, Callable[[], Any]], ops: int, repeat: int, costs: Any = None,
                 clock: Callable[[], float] = time.perf_counter) -> dict[str, tuple[list[float], str]]:
    """Each row's µs per call in each of ``repeat`` rounds, the rows interleaved within a
    round (so a ratio taken within a round sees one machine load); with ``costs``
    (realistic mode), also the CUDA and NCCL calls per op of the timed runs, by thread."""
    for call in rows.values():
        for _ in range(min(ops, 2000)):
            call()
    times: dict[str, list[float]] = {name: [] for name in rows}
    counts: dict[str, dict[int, dict[str, int]]] = {name: {} for name in rows}
    for _ in range(repeat):
        for name, call in rows.items():
            if costs is not None:
                costs.reset()
            t0 = clock()
            for _ in range(ops):
                call()
            times[name].append((clock() - t0) / ops * 1e6)
            if costs is not None:
                for thread, c in costs.counts.items():
                    mine = counts[name].setdefault(thread, {})
                    for k, v in c.items():
                        mine[k] = mine.get(k, 0) + v
    me = threading.get_ident()
    out: dict[str, tuple[list[float], str]] = {}
    for name in rows:
        parts = []
        for thread, c in sorted(counts[name].items(), key=lambda kv: kv[0] != me):
            who = "caller" if thread == me else "other thread"
            parts.append(f"{who}: cuda {c.get('cuda', 0) / (ops * repeat):.3f}, "
                         f"nccl {c.get('nccl', 0) / (ops * repeat):.3f}, cupy {c.get('cupy', 0) / (ops * repeat):.3f}")
        out[name] = (times[name], "; ".join(parts))
    return out


QUIET = "backend: all_reduce_quiet(buf) (synchronous, no Work)"


def _strip_baseline(argv: list[str]) -> list[str]:
    """``argv`` without --baseline and --alternate (and their values)."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--baseline", "--alternate"):
            skip = True
        elif not a.startswith(("--baseline=", "--alternate=")):
            out.append(a)
    return out


def _rows(text: str) -> dict[str, tuple[float, float]]:
    """A run's table rows: name -> (µs per op, ratio to the backend's Work-less op); the
    async + wait line under "async / sync"."""
    rows: dict[str, tuple[float, float]] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) >= 3:
            try:
                rows[cells[0]] = (float(cells[1]), float(cells[2]))
            except ValueError:
                pass
        elif line.startswith("# async + wait against"):
            rows["async / sync"] = (0.0, float(line.rsplit(":", 1)[1].strip().rstrip("x")))
    return rows


def _alternate(baseline: str, times: int, argv: list[str]) -> int:
    """Run the baseline tree's bench and this tree's alternately; print both trees' medians."""
    import subprocess

    trees = {"before": os.path.abspath(baseline), "after": _ROOT}
    runs: dict[str, list[dict[str, tuple[float, float]]]] = {"before": [], "after": []}
    for i in range(times):
        for label, tree in trees.items():
            env = dict(os.environ, PYTHONPATH=tree)
            done = subprocess.run([sys.executable, os.path.join(tree, "bench", "nccl_python_overhead_bench.py"), *argv],
                                  cwd=tree, env=env, capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                print(done.stdout + done.stderr, file=sys.stderr)
                raise SystemExit(f"the {label} tree's bench failed ({tree}, exit {done.returncode})")
            runs[label].append(_rows(done.stdout))
            print(f"# run {i + 1}/{times}: {label} ({tree}) done", file=sys.stderr)
    print(f"# before: {trees['before']}; after: {trees['after']}; {times} runs of each, alternated; "
          f"options: {' '.join(argv)}; medians over runs of each run's medians and ratios")
    print("| path | before µs | before ratio | after µs | after ratio |")
    print("|---|---|---|---|---|")
    names = list(runs["after"][0])
    for name in names:
        cells = []
        for label in ("before", "after"):
            got = [r[name] for r in runs[label] if name in r]
            if not got:
                cells += ["-", "-"]
                continue
            cells += [f"{statistics.median(g[0] for g in got):.2f}", f"{statistics.median(g[1] for g in got):.2f}"]
        print(f"| {name} | " + " | ".join(cells) + " |")
    # Each run's ratios of the target rows: the realistic fake fits its calls once per
    # process, so one process's ratio can sit well off the others' (docs/nccl-backend.md).
    for name in names:
        if name.startswith("+ module function") or name == "async / sync":
            each = {label: " ".join(f"{r[name][1]:.2f}" for r in runs[label] if name in r) for label in runs}
            print(f"# each run, {name}: before {each['before']}; after {each['after']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", type=int, default=50000, help="ops per timed run")
    ap.add_argument("--repeat", type=int, default=5, help="timed rounds (rows interleaved); medians are reported")
    ap.add_argument("--lag", type=int, default=20, help="ops the fake GPU runs behind the host")
    ap.add_argument("--realistic", action="store_true",
                    help="the fake GPU with costs: each CUDA/NCCL call takes its H200 time, device work --op-us")
    ap.add_argument("--call-us", type=float, default=0.7,
                    help="realistic: host µs of a CUDA or NCCL call without an H200 figure of its own")
    ap.add_argument("--op-us", type=float, default=5.0, help="realistic: device µs per op (plus bytes/bandwidth)")
    ap.add_argument("--array", choices=("cupy", "cai"), default=None,
                    help="the device array: a cupy.ndarray over fake memory (default where CuPy is installed), "
                         "or an object publishing __cuda_array_interface__ from Python")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="time rows (and, realistic, the fake's calls) by the wall clock, or by this thread's CPU "
                         "time: on a loaded machine a preempted op then costs what it ran, not what it waited")
    ap.add_argument("--baseline", default=None, metavar="TREE",
                    help="another checkout of gpucoll (e.g. a git worktree of an older commit): run its copy of "
                         "this bench and this tree's alternately, --alternate times each (same options), and "
                         "report both trees' medians side by side")
    ap.add_argument("--alternate", type=int, default=3, help="with --baseline: runs of each tree")
    args = ap.parse_args(argv)
    if args.baseline is not None:
        return _alternate(args.baseline, args.alternate, _strip_baseline(sys.argv[1:] if argv is None else argv))
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter

    import gpucoll

    costs: Any = None
    rt: Any
    if _TESTS not in sys.path:
        sys.path.insert(0, _TESTS)
    if args.realistic:
        from _nccl_fake import CallCosts, TimedRuntime

        costs = CallCosts(args.call_us, op_us=args.op_us)
        if args.clock == "cpu":
            costs.use_cpu_clock()
        rt = TimedRuntime(costs)
        if args.ops == 50000:
            args.ops = 5000  # each op takes tens of µs here
    else:
        rt = NoopRuntime(args.lag)
    from _fake_cupy_costs import CupyOnFake, cupy_or_none

    kind = args.array or ("cupy" if cupy_or_none() is not None else "cai")
    cupy_fake = None
    if kind == "cupy":
        cupy_fake = CupyOnFake(rt)
        cupy_fake.install()
        x: Any = cupy_fake.array(256, "float32", ptr=0x200000)
    else:
        x = DeviceArray()
    buf = Buffer(0x200000, 1024, DTYPES["float32"], (256,), Device("cuda", 0), stream=None)
    saved = _group.BACKENDS["nccl"]
    _group.BACKENDS["nccl"] = lambda store, rank, size, *, timeout, group_name, device_id: NCCLBackend(
        store, rank, size, timeout=timeout, group_name=group_name, device_id=device_id, _runtime=rt)
    try:
        gpucoll.init_process_group("nccl", store=HashStore(), rank=0, world_size=1, device_id=0, timeout=60.0)
        from gpucoll._world import default_group

        pg = default_group()
        backend = pg._nccl
        SUM = ReduceOp.SUM
        backend.all_reduce(buf, SUM).wait()  # planned once: later calls take the hot path

        def quiet() -> None:
            if not backend.all_reduce_quiet(buf, SUM, 1, None, ""):
                backend.all_reduce(buf, SUM).wait()
        pg.all_reduce(x)
        plan = next(iter(pg._plans.values()))  # the op's plan in the group (its Work-less form)
        issuer, quiet_form = pg._issuer, plan.quiet
        xbuf = as_buffer(x, writable=True)
        # The layers, each row adding one on top of the one before (same array memory).
        rows: dict[str, Callable[[], Any]] = {
            QUIET: quiet,
            "+ issuer (seq, flight recorder, watchdog): issuer.call_quiet(buf)":
                lambda: issuer.call_quiet(backend, quiet_form, xbuf, SUM, x, "all_reduce", SUM),
            "+ group (checks, plan look-up): ProcessGroup.all_reduce(buf)": lambda: pg.all_reduce(xbuf),
            "+ array layer: ProcessGroup.all_reduce(array)": lambda: pg.all_reduce(x),
            "+ module function: gpucoll.all_reduce(array)": lambda: gpucoll.all_reduce(x),
            "array layer alone: as_buffer(array)": lambda: as_buffer(x, writable=True),
            "backend: all_reduce(buf).wait()": lambda: backend.all_reduce(buf, SUM).wait(),
            "gpucoll.all_reduce(array, async_op=True).wait()": lambda: gpucoll.all_reduce(x, async_op=True).wait(),
        }
        result = _interleaved(rows, args.ops, args.repeat, costs, clock)
        rt.finish_all()  # the fake GPU catches up, so shutdown's drain returns at once
        gpucoll.destroy_process_group()
    finally:
        _group.BACKENDS["nccl"] = saved
        if cupy_fake is not None:
            cupy_fake.uninstall()
        rt.finish_all()
    array = ("a cupy.ndarray over fake memory (CuPy's own attribute reads; its current-stream look-up "
             "stood in for)" if kind == "cupy" else "a __cuda_array_interface__ object (a Python property)")
    sync = statistics.median
    quiet_runs = result[QUIET][0]
    if costs is not None:
        print(f"# gpucoll per op on the realistic fake GPU (CUDA/NCCL calls at their H200 host times, "
              f"device work {args.op_us} µs + bytes/bandwidth), {array}; median of {args.repeat} interleaved "
              f"rounds x {args.ops} ops ({args.clock} clock); ratio: median over rounds of the row against the backend's "
              f"Work-less op")
        print("| path | µs per op | ratio | calls per op |")
        print("|---|---|---|---|")
    else:
        print(f"# gpucoll's Python per op, no-op CUDA runtime (GPU {args.lag} ops behind), {array}; median of "
              f"{args.repeat} interleaved rounds x {args.ops} ops; ratio against the backend's Work-less op")
        print("| path | µs per op | ratio |")
        print("|---|---|---|")
    for name, (runs, counts) in result.items():
        ratio = sync([a / b for a, b in zip(runs, quiet_runs)])
        print(f"| {name} | {sync(runs):.2f} | {ratio:.2f} |" + (f" {counts} |" if costs is not None else ""))
    sync_runs = result["+ module function: gpucoll.all_reduce(array)"][0]
    async_runs = result["gpucoll.all_reduce(array, async_op=True).wait()"][0]
    print(f"# async + wait against the synchronous gpucoll.all_reduce: "
          f"{sync([a / b for a, b in zip(async_runs, sync_runs)]):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
