"""The start-up head count at scale: N ranks of a job join through one store server.

Every rank of ``init_process_group`` counts itself in and waits for the others
(gpucoll/_group/join.py). This times the real ``await_all_joined`` for N ranks, each a
real TCPStore client in a thread (N / 8 threads in each of 8 processes), against one
gpucoll store server in its own process. The ranks do not arrive at once: each
starts after a random delay of up to ``--spread`` seconds, as the processes of a
large job start over seconds. Reported per run: the time from the start until the
last rank returned, and the server's CPU seconds over it (from /proc/<pid>/stat).

    python bench/store_join_bench.py --ranks 2048,8192 --spread 3 --repeats 2

It measures whichever gpucoll it imports: run it with ``PYTHONPATH`` set to another
checkout to compare two versions on the same machine.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import resource
import sys
import threading
import time
from typing import Any

# Runnable from a checkout; PYTHONPATH (another checkout) comes first.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_PROCESSES = 8


def _raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _serve(conn: Any) -> None:
    _raise_nofile()
    from gpucoll.store import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=300,
                     use_unix_socket=False)
    conn.send(store.port)
    conn.recv()
    store.close()


def _ranks(port: int, world: int, first: int, count: int, spread: float, tag: str,
           start: Any, results: Any) -> None:
    _raise_nofile()
    from gpucoll._group.join import await_all_joined
    from gpucoll.store import PrefixStore, TCPStore

    stores = [PrefixStore(tag, TCPStore("127.0.0.1", port, timeout=120, use_unix_socket=False))
              for _ in range(count)]
    rnd = random.Random(first)
    delays = [rnd.uniform(0, spread) for _ in range(count)]
    ends: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    go = threading.Event()

    def one(i: int) -> None:
        go.wait()
        time.sleep(delays[i])
        try:
            await_all_joined(stores[i], first + i, world, 120.0)
        except Exception as e:  # reported to the parent
            with lock:
                errors.append(f"{type(e).__name__}: {e}")
            return
        with lock:
            ends.append(time.monotonic())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    results.put("ready")
    start.wait()
    go.set()
    for t in threads:
        t.join()
    results.put((ends, errors))


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="1024,4096", help="comma-separated world sizes")
    ap.add_argument("--spread", type=float, default=2.0, help="ranks start within this many seconds")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    server = ctx.Process(target=_serve, args=(there,), daemon=True)
    server.start()
    port = here.recv()
    import gpucoll

    print(f"# gpucoll from {os.path.dirname(gpucoll.__file__)}; ranks start within {args.spread:g} s")
    print("| ranks | time to the last rank joined (s) | server CPU (s) |")
    print("|---|---|---|")
    run = 0
    for world in (int(x) for x in args.ranks.split(",")):
        for _ in range(args.repeats):
            run += 1
            start, results = ctx.Event(), ctx.Queue()
            per = [world // _PROCESSES + (1 if i < world % _PROCESSES else 0) for i in range(_PROCESSES)]
            firsts = [sum(per[:i]) for i in range(_PROCESSES)]
            procs = [ctx.Process(target=_ranks, args=(port, world, f, k, args.spread, f"run{run}", start, results),
                                 daemon=True) for f, k in zip(firsts, per) if k]
            for p in procs:
                p.start()
            for _ in procs:
                if results.get(timeout=300) != "ready":
                    raise RuntimeError("rank process out of step")
            cpu0 = _cpu_seconds(server.pid)  # type: ignore[arg-type]
            t0 = time.monotonic()
            start.set()
            ends: list[float] = []
            for _ in procs:
                got, errors = results.get(timeout=300)
                if errors:
                    raise RuntimeError(f"{len(errors)} ranks failed to join: {errors[0]}")
                ends += got
            used = _cpu_seconds(server.pid) - cpu0  # type: ignore[arg-type]
            for p in procs:
                p.join(30)
            print(f"| {world:,} | {max(ends) - t0:.3f} | {used:.2f} |", flush=True)
    here.send(None)
    server.join(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
