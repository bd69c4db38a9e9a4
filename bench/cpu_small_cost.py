"""One rank's own cost of a small CPU all_reduce, layer by layer, with its peer faked.

Two ranks share a segment over a FileStore; after a few real all_reduce ops of one kind
(a float32 array of ``--nbytes``), rank 1 stops and rank 0 runs ``--ops`` more, writing
rank 1's progress counter and op header into the segment before each one (what rank 1
would have written), so that no op waits: what is left is rank 0's own work. The same
loop calls each layer in turn:

- ``module``: ``gpucoll.all_reduce(x)``;
- ``group``: ``ProcessGroup.all_reduce(x, op, False)`` (the group's fast path down);
- ``run_host``: ``Issuer.run_host`` (numbering, the flight recorder's entry, down);
- ``bound``: the kind's bound runner (``HostRun.run``: the backend's issuing and the
  transport's protocol);
- ``fake``: the faking alone.

Without ``--callgrind`` each layer is timed (best of ``--repeats`` loops, µs per op);
timings this short move by 2x with a shared machine's load. With ``--callgrind`` rank 0
runs under ``valgrind --tool=callgrind`` twice for each layer asked, with no faked ops and
with ``--ops``, collected only inside the timed loop (``--toggle-collect``), and the
difference is printed as instructions per op: the same on a loaded machine as on an idle
one, and from one run to the next, so two trees can be compared by it. With
``--opcodes [ROWS]`` rank 0 counts the bytecode instructions that gpucoll's own files run
per op (``sys.settrace``), in all and by line.

Usage::

    python bench/cpu_small_cost.py                         # timings, 4 KiB
    python bench/cpu_small_cost.py --nbytes 8
    python bench/cpu_small_cost.py --callgrind --layers module,bound --ops 40000
    python bench/cpu_small_cost.py --opcodes 40 --layers module     # bytecode per op, by line
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import numpy as np

# Runnable from a checkout without installing: the repository root holds the package.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

LAYERS = ("module", "group", "run_host", "bound", "fake")
WARM_OPS = 3  # real ops first: the first plans the kind, the second binds it
TIMEOUT = 600.0  # seconds for the group (rank 0 may run under valgrind, ~50x slower)


def opcode_profile(loop: Callable[[int], Any], ops: int) -> list[tuple[str, float]]:
    """Bytecode instructions per op that gpucoll's own files run in ``loop(ops)``
    (``sys.settrace``'s opcode events, in gpucoll's frames only), by function and line,
    most first, with the total first (``"total"``)."""
    package = os.path.join(_ROOT, "gpucoll") + os.sep
    counts: dict[tuple[str, str, int], int] = {}

    def trace(frame: Any, event: str, arg: Any) -> Any:
        code = frame.f_code
        if not code.co_filename.startswith(package):
            return None
        frame.f_trace_opcodes = True
        if event == "opcode":
            key = (code.co_filename[len(package):], code.co_name, frame.f_lineno)
            counts[key] = counts.get(key, 0) + 1
        return trace

    sys.settrace(trace)
    try:
        loop(ops)
    finally:
        sys.settrace(None)
    rows = sorted(counts.items(), key=lambda kv: -kv[1])
    out = [("total", sum(counts.values()) / ops)]
    out += [(f"{f}:{line}:{name}", n / ops) for (f, name, line), n in rows]
    return out


def rank_main(rank: int, workdir: str, nbytes: int, layers: list[str], ops: int, repeats: int,
              opcodes: bool = False) -> None:
    """One rank of the measurement (run as ``--worker``): rank 0 prints ``layer value`` lines."""
    import gpucoll
    from gpucoll._collectives import _world

    store = gpucoll.FileStore(os.path.join(workdir, "store"), 2)
    gpucoll.init_process_group("cpu", store=store, rank=rank, world_size=2, timeout=TIMEOUT)
    x = np.ones(max(1, nbytes // 4), np.float32)
    for _ in range(WARM_OPS):
        gpucoll.all_reduce(x)
    done, warm = os.path.join(workdir, "done"), os.path.join(workdir, "warm")
    deadline = time.monotonic() + TIMEOUT
    if rank == 1:  # its part is faked from here on; it only waits to be told to leave
        open(warm, "w").close()  # (its last real op has returned: rank 0 may write its record)
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.05)
        os._exit(0)  # (no shutdown: the segment's counters were faked, a barrier would not meet)
    code = 1
    try:
        while not os.path.exists(warm):  # rank 1 may still be in its last real op
            if time.monotonic() > deadline:
                raise RuntimeError("rank 1 did not finish its first ops")
            time.sleep(0.01)
        pg = _world._WORLD.default
        coll = pg._cpu._coll
        if type(coll).__name__ != "ShmCollectives":
            raise RuntimeError(f"the group's transport is {pg._cpu.transport!r}, not shared memory")
        seg, ctl = coll.seg, coll.seg.ctl
        _, ci, hdrs = coll._words[0]
        sig = int(ctl[coll._my_hdr[coll._u & 1] + 1])  # the kind's signature, from rank 0's own header
        fast = pg._host_runs[(x.dtype, x.shape, "SUM")]
        op, issuer, ar = gpucoll.ReduceOp.SUM, pg._issuer, gpucoll.all_reduce
        calls: dict[str, Callable[[], Any]] = {
            "module": lambda: ar(x),
            "group": lambda: pg.all_reduce(x, op, False),
            "run_host": lambda: issuer.run_host(fast, x, x),
            "bound": lambda: fast.run(x, fast.reducer),
            "fake": lambda: None,
        }

        def loop(call: Callable[[], Any], n: int) -> float:
            t0 = time.perf_counter()
            for _ in range(n):
                u = coll._u + 1  # what rank 1 would have written for op u: its post and header
                ctl[ci] = seg.count + 1
                h = hdrs[u & 1]
                ctl[h] = u
                ctl[h + 1] = sig
                call()
            return (time.perf_counter() - t0) / max(n, 1)

        if opcodes:
            for name in layers:
                for where, n in opcode_profile(lambda n: loop(calls[name], n), ops):
                    print(f"{name} {n!r} {where}", flush=True)
        else:
            # (each loop runs inside functools.reduce, a C function nothing else here calls:
            # under callgrind, --toggle-collect counts only what runs inside it)
            best = {name: min(functools.reduce(lambda _, f: f(), [lambda: loop(calls[name], ops)], 0.0)
                              for _ in range(repeats)) for name in layers}
            for name in layers:
                print(f"{name} {best[name]!r}", flush=True)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        open(done, "w").close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # (no shutdown: the faked counters would not meet a barrier)


def run_pair(nbytes: int, layers: list[str], ops: int, repeats: int, valgrind: list[str],
             opcodes: bool = False) -> tuple[str, str]:
    """Both ranks, rank 0 under ``valgrind`` (a command prefix) if given, counting bytecode
    instructions instead of timing if ``opcodes``: (rank 0's stdout, its stderr)."""
    workdir = tempfile.mkdtemp(prefix="gpucoll-small-cost-")
    try:
        def cmd(rank: int) -> list[str]:
            return [sys.executable, os.path.abspath(__file__), "--worker", str(rank), "--workdir", workdir,
                    "--nbytes", str(nbytes), "--layers", ",".join(layers), "--ops", str(ops),
                    "--repeats", str(repeats)] + (["--opcodes"] if opcodes else [])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")])))
        if valgrind:  # counts that repeat: one string-hash seed (dict layouts), no idle BLAS threads counted
            env.update(PYTHONHASHSEED="0", OPENBLAS_NUM_THREADS="1")
        peer = subprocess.Popen(cmd(1), env=env)
        try:
            zero = subprocess.run(valgrind + cmd(0), env=env, capture_output=True, text=True, timeout=TIMEOUT)
        finally:
            try:
                peer.wait(timeout=30)
            except subprocess.TimeoutExpired:
                peer.kill()
        if zero.returncode != 0:
            raise SystemExit(f"rank 0 failed (exit {zero.returncode}):\n{zero.stderr[-3000:]}")
        return zero.stdout, zero.stderr
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def instructions(nbytes: int, layer: str, ops: int) -> int:
    """Instructions rank 0 executes in ``ops`` faked ops of ``layer``: callgrind's total,
    collected only inside the timed loop (its ``functools.reduce``), so that the waits of
    the start (the rendezvous, the peer's first ops) do not count."""
    _, err = run_pair(nbytes, [layer], ops, 1, ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
                                                "--toggle-collect=functools_reduce"])
    m = re.search(r"Collected\s*:\s*(\d+)", err)
    if m is None:
        raise SystemExit(f"no instruction count in valgrind's output:\n{err[-3000:]}")
    return int(m.group(1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nbytes", type=int, default=4096, help="bytes of the float32 array (default 4096)")
    ap.add_argument("--layers", default=",".join(LAYERS), help=f"comma-separated, of {', '.join(LAYERS)}")
    ap.add_argument("--ops", type=int, default=20000, help="faked ops per timed loop or per count (default 20000)")
    ap.add_argument("--repeats", type=int, default=5, help="timed loops per layer; the best counts (default 5)")
    ap.add_argument("--callgrind", action="store_true", help="count instructions per op under valgrind instead")
    ap.add_argument("--opcodes", type=int, nargs="?", const=25, default=0, metavar="ROWS",
                    help="count the bytecode instructions gpucoll's files run per op instead (sys.settrace), "
                         "and show the ROWS lines that run most (default 25)")
    ap.add_argument("--worker", type=int, choices=(0, 1), help=argparse.SUPPRESS)
    ap.add_argument("--workdir", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    layers = [s for s in args.layers.split(",") if s]
    bad = [s for s in layers if s not in LAYERS]
    if bad or not layers:
        ap.error(f"--layers must name some of {', '.join(LAYERS)}; got {args.layers!r}")
    if args.worker is not None:  # (ops may be 0 here: the count's baseline)
        rank_main(args.worker, args.workdir, args.nbytes, layers, args.ops, args.repeats, bool(args.opcodes))
        return 0
    if args.ops < 1 or args.repeats < 1 or args.nbytes < 4:
        ap.error(f"--ops and --repeats must be >= 1 and --nbytes >= 4; got {args.ops}, {args.repeats}, {args.nbytes}")
    print(f"{args.nbytes} B float32 all_reduce, 2 ranks on shared memory, rank 1's part faked; "
          f"load average {os.getloadavg()[0]:.1f}")
    if args.callgrind:
        if shutil.which("valgrind") is None:
            raise SystemExit("--callgrind needs valgrind on PATH")
        for layer in layers:
            base, full = instructions(args.nbytes, layer, 0), instructions(args.nbytes, layer, args.ops)
            print(f"{layer:9s} {(full - base) / args.ops:9.0f} instructions per op (faking included)")
        return 0
    if args.opcodes:
        out, _ = run_pair(args.nbytes, layers, min(args.ops, 2000), 1, [], opcodes=True)
        shown: dict[str, int] = {}
        for line in out.splitlines():
            name, value, where = line.split(maxsplit=2)
            if shown.setdefault(name, 0) <= args.opcodes:
                print(f"{name:9s} {float(value):8.1f} bytecode instructions per op  {where}")
            shown[name] += 1
        return 0
    out, _ = run_pair(args.nbytes, layers, args.ops, args.repeats, [])
    for line in out.splitlines():
        name, value = line.split()
        print(f"{name:9s} {float(value) * 1e6:7.2f} us per op (faking included; best of {args.repeats})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
