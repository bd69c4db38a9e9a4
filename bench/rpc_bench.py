"""gpucoll.rpc against torch.distributed.rpc (TensorPipe) in the same run, same machine.

Three worker processes per library (worker0 is the callee; worker1 measures; worker2 is
the second caller of the fan-in row), started fresh for each library, alternating
libraries ``--repeat`` times; each row's median over repeats is compared:

- ``rpc_sync`` of a no-op: median round trip;
- ``remote()`` + ``to_here()`` of a no-op: median;
- the RRef protocol's messages someone waits for (medians): ``remote()`` then a wait on
  its creation future (``rref._get_future().wait()``); ``remote()`` then polling
  ``rref.confirmed_by_owner()``; ``rpc_sync`` to worker2 with an RRef owned by worker0 as
  its argument (worker2 runs the call once the owner has confirmed its fork);
- echo of a 1 MiB and a 64 MiB float32 NumPy array: throughput (bytes both ways / time);
- ``--fanin`` (10,000) ``rpc_async`` no-ops from worker1 and worker2 together to worker0:
  time until all complete.

Targets (issue 45): ratios gpucoll/torch <= 0.5, <= 0.5, >= 1.0 (throughput), <= 1.0.

gpucoll's workers talk over the same-host transport (a Unix socket) as they do by
default; ``--tcp-too`` adds a third column, gpucoll with ``GPUCOLL_RPC_UNIX=0`` (TCP over
loopback), run alternately with the others: an A/B of the transport in one run. The
transport each gpucoll run used is printed (from the agent's debug info).

Usage::

    python bench/rpc_bench.py [--calls 2000] [--fanin 10000] [--repeat 3] [--only gpucoll|torch] [--tcp-too]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import socket
import statistics
import sys
import time
from typing import Any

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # (this checkout's gpucoll, in the spawned workers too)
    sys.path.insert(0, _ROOT)


def noop() -> None:
    return None


def echo(x: Any) -> Any:
    return x


def take(rref: Any) -> None:
    """A callee given an RRef it does not own (it runs once its fork is confirmed)."""
    return None


def _confirm(rpc: Any) -> None:
    rref = rpc.remote("worker0", noop)
    while not rref.confirmed_by_owner():
        time.sleep(0)


def _rpc(lib: str) -> Any:
    if lib == "torch":
        import torch.distributed.rpc as rpc
    else:
        import gpucoll.rpc as rpc
    return rpc


def fire(lib: str, to: str, n: int) -> float:
    """Send ``n`` async no-ops to ``to``; seconds until all have completed."""
    rpc = _rpc(lib)
    t = time.perf_counter()
    futs = [rpc.rpc_async(to, noop) for _ in range(n)]
    for f in futs:
        f.wait()
    return time.perf_counter() - t


def _median_time(fn: Any, n: int) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(lib: str, calls: int, fanin: int) -> dict[str, Any]:
    rpc = _rpc(lib)
    out: dict[str, Any] = {}
    for _ in range(max(calls // 10, 20)):
        rpc.rpc_sync("worker0", noop)
    out["rpc_sync no-op (us)"] = _median_time(lambda: rpc.rpc_sync("worker0", noop), calls) * 1e6
    out["remote+to_here (us)"] = _median_time(lambda: rpc.remote("worker0", noop).to_here(),
                                              max(calls // 4, 20)) * 1e6
    n_rref = max(calls // 4, 20)
    out["remote, creation wait (us)"] = _median_time(lambda: rpc.remote("worker0", noop)._get_future().wait(),
                                                     n_rref) * 1e6
    out["remote, confirmed_by_owner (us)"] = _median_time(lambda: _confirm(rpc), n_rref) * 1e6
    owned = rpc.remote("worker0", echo, args=(1,))
    owned.to_here()
    rpc.rpc_sync("worker2", take, args=(owned,))
    out["RRef arg to a third worker (us)"] = _median_time(lambda: rpc.rpc_sync("worker2", take, args=(owned,)),
                                                          n_rref) * 1e6
    del owned
    for label, mib, n in (("1 MiB", 1, max(calls // 20, 10)), ("64 MiB", 64, 5)):
        a = np.ones(mib << 18, dtype=np.float32)
        rpc.rpc_sync("worker0", echo, args=(a,))
        t = _median_time(lambda: rpc.rpc_sync("worker0", echo, args=(a,)), n)
        out[f"echo {label} (GB/s)"] = 2 * a.nbytes / t / 1e9
    if fanin:
        rpc.rpc_sync("worker0", noop)
        rpc.rpc_sync("worker2", noop)
        t = time.perf_counter()
        other = rpc.rpc_async("worker2", fire, args=(lib, "worker0", fanin // 2))
        fire(lib, "worker0", fanin - fanin // 2)
        other.wait()
        out[f"{fanin} rpc_async, 2 callers (ms)"] = (time.perf_counter() - t) * 1e3
    if lib != "torch":
        out["_transport"] = rpc._get_debug_info().get("agent.connections", "?")
    return out


def _worker(lib: str, rank: int, port: int, calls: int, fanin: int, q: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if lib.startswith("gpucoll"):  # the same-host transport: on for "gpucoll" (the default), off for "gpucoll-tcp"
        os.environ["GPUCOLL_RPC_UNIX"] = "0" if lib == "gpucoll-tcp" else "1"
    rpc = _rpc(lib)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=300)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3, rpc_backend_options=opts)
    result = measure(lib, calls, fanin) if rank == 1 else None
    rpc.shutdown()
    if rank == 1:
        q.put(result)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(lib: str, calls: int, fanin: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(lib, r, port, calls, fanin, q)) for r in range(3)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + 600
        while True:  # a worker that died (an import error, a crash) ends the run at once, named
            try:
                result: dict[str, Any] = q.get(timeout=1.0)
                break
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    raise SystemExit(f"rpc_bench: {lib} worker(s) (rank, exit code) {dead} died; see their output above")
                if time.monotonic() > deadline:
                    raise SystemExit(f"rpc_bench: {lib}'s run gave no result within 600 s")
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--fanin", type=int, default=10000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", choices=("gpucoll", "torch"), default=None)
    ap.add_argument("--tcp-too", action="store_true", help="also gpucoll with GPUCOLL_RPC_UNIX=0 (TCP)")
    args = ap.parse_args(argv)
    libs = [args.only] if args.only else ["gpucoll", "torch"]
    if args.tcp_too and "gpucoll" in libs:
        libs.insert(1, "gpucoll-tcp")
    runs: dict[str, list[dict[str, Any]]] = {lib: [] for lib in libs}
    for _ in range(args.repeat):
        for lib in libs:
            runs[lib].append(run(lib, args.calls, args.fanin))
    rows = [k for k in runs[libs[0]][0] if not k.startswith("_")]
    med = {lib: {k: statistics.median(r[k] for r in runs[lib]) for k in rows} for lib in libs}
    pairs = [lib for lib in libs if lib != "torch"] if "torch" in libs else []
    print(f"{'row':34s}" + "".join(f"{lib:>12s}" for lib in libs)
          + "".join(f"{lib + '/torch':>20s}" for lib in pairs))
    for k in rows:
        line = f"{k:34s}" + "".join(f"{med[lib][k]:12.1f}" for lib in libs)
        line += "".join(f"{med[lib][k] / med['torch'][k]:19.2f}x" for lib in pairs)
        print(line)
    for lib in libs:
        if lib != "torch":
            print(f"{lib} connections of worker1: " + "; ".join(sorted({r['_transport'] for r in runs[lib]})))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
