"""gpucoll scripts under real torchrun (torch 2.13): rank 0 joins the agent's store.

Each job starts once and checks many things inside it: a collective on the world,
new_group, object collectives, the restart namespace and the time from worker start to
the first collective. Every job has a hard timeout and its process group is killed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="torchrun comes with torch (a test-only dependency)")

REPO = Path(__file__).resolve().parents[2]
JOB_TIMEOUT = 60.0

WORKER = textwrap.dedent('''
    import json, os, sys, time
    t_start = time.time()
    import numpy as np
    import gpucoll as dist

    out_dir = sys.argv[1]
    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    x = np.full(4, rank + 1, dtype=np.float64)
    dist.all_reduce(x)
    t_first = time.time()
    res = {"rank": rank, "world": world, "sum": x.tolist(), "first_collective_s": t_first - t_start,
           "t_start": t_start}
    sub = dist.new_group([0, world - 1])
    if rank in (0, world - 1):
        y = np.array([float(rank)])
        dist.all_reduce(y, group=sub)
        res["sub"] = y.tolist()
    objs = [None] * world
    dist.all_gather_object(objs, {"r": rank, "s": "x" * rank})
    res["objs"] = objs
    lst = [{"from": 0, "restart": os.environ.get("TORCHELASTIC_RESTART_COUNT")}] if rank == 0 else [None]
    dist.broadcast_object_list(lst, src=0)
    res["bcast"] = lst[0]
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    crash = os.environ.get("GPUCOLL_TEST_CRASH_ONCE") == "1" and restart == 0
    res["restart"] = restart
    dist.barrier()
    if crash:
        # The first attempt dies after using the store; the second must not see its keys.
        dist.destroy_process_group()
        sys.exit(3)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()
''')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_", "TORCHELASTIC", "GPUCOLL_STORE"))}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra or {})
    return env


def _run(launchers: list[list[str]], tmp: Path, extra: dict[str, str] | None = None) -> list[dict]:
    script = tmp / "worker.py"
    script.write_text(WORKER)
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args, str(script), str(tmp)],
                              env=_env(extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              start_new_session=True, text=True) for args in launchers]
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=JOB_TIMEOUT)
            outs.append(out)
    except subprocess.TimeoutExpired:
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)
        pytest.fail(f"torchrun job did not finish within {JOB_TIMEOUT} s")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(len(list(tmp.glob("rank*.json"))))]


def _check(results: list[dict], world: int) -> None:
    assert len(results) == world
    expected = float(sum(range(1, world + 1)))
    for res in results:
        r = res["rank"]
        assert res["world"] == world
        assert res["sum"] == [expected] * 4
        if r in (0, world - 1):
            assert res["sub"] == [float(world - 1)]
        assert res["objs"] == [{"r": i, "s": "x" * i} for i in range(world)]
        assert res["bcast"]["from"] == 0


@pytest.mark.parametrize("world,launch", [
    (2, ["--standalone"]),
    (3, ["--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:{port}"]),
    (2, ["--rdzv-backend=static", "--master-addr=127.0.0.1", "--master-port={port}", "--node-rank=0"]),
])
def test_one_node(tmp_path: Path, world: int, launch: list[str]) -> None:
    port = _free_port()
    args = ["--nnodes=1", f"--nproc-per-node={world}", *[a.format(port=port) for a in launch]]
    results = _run([args], tmp_path)
    _check(results, world)
    if world == 2 and "--standalone" in launch:
        # Worker start to the end of the first all_reduce (interpreter start and imports
        # included); the figure is reported by docs/launching.md, the bound here is loose.
        slowest = max(r["first_collective_s"] for r in results)
        print(f"first collective {slowest:.3f} s after worker start")
        assert slowest < 10.0


def test_two_nodes_on_loopback(tmp_path: Path) -> None:
    port = _free_port()
    common = ["--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
              "--rdzv-id=gpucoll-2n"]
    results = _run([common, common], tmp_path)
    _check(results, 2)


def test_restart_reads_no_stale_keys(tmp_path: Path) -> None:
    port = _free_port()
    args = ["--nnodes=1", "--nproc-per-node=3", "--max-restarts=1", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}"]
    results = _run([args], tmp_path, {"GPUCOLL_TEST_CRASH_ONCE": "1"})
    _check(results, 3)
    assert all(r["restart"] == 1 for r in results)
    assert results[0]["bcast"]["restart"] == "1"
