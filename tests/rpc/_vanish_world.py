"""Run inside a fresh network namespace (``unshare -n``): two RPC workers on its loopback;
worker0 has a call pending on worker1 (a long nap) when the namespace's loopback goes
down, so worker1's host "vanishes": nothing is closed, nothing is answered or ACKed.
Prints one JSON line: what worker0's pending call and a new call raised, and after how long.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time
from typing import Any


def nap(seconds: float) -> str:
    time.sleep(seconds)
    return "rested"


def _worker(rank: int, port: int, q: Any) -> None:
    import gpucoll.rpc as rpc

    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=0)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    if rank == 1:
        time.sleep(40)
        os._exit(0)
    assert rpc.rpc_sync("worker1", nap, args=(0,)) == "rested"
    fut = rpc.rpc_async("worker1", nap, args=(30,))  # no timeout: only liveness can end it
    time.sleep(0.5)
    subprocess.run(["ip", "link", "set", "lo", "down"], check=True)
    t = time.monotonic()
    out: dict[str, Any] = {}
    try:
        fut.wait()
        out["pending"] = ["returned"]
    except Exception as e:  # noqa: BLE001 -- what it raised is the result
        out["pending"] = [type(e).__name__, str(e)]
    out["pending_s"] = time.monotonic() - t
    try:
        rpc.rpc_sync("worker1", nap, args=(0,))
        out["new"] = ["returned"]
    except Exception as e:  # noqa: BLE001
        out["new"] = [type(e).__name__, str(e)]
    q.put(out)
    q.close()
    q.join_thread()  # the result is written before the process ends without RPC's shutdown
    os._exit(0)


def main() -> int:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, q), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        print(json.dumps(q.get(timeout=60)))
    finally:
        for p in procs:
            p.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
