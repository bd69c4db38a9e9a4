"""gpucoll-bench with the NCCL backend (GPU machines; skipped elsewhere)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from gpucoll.bench.ops import OPS

pytestmark = pytest.mark.gpu


def _bench(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    clean.update(env or {})
    return subprocess.run([sys.executable, "-m", "gpucoll.bench", *args], capture_output=True, text=True,
                          timeout=300, env=clean)


@pytest.mark.parametrize("op", [o for o in OPS if o != "sendrecv"])
def test_every_op_every_type_on_one_gpu(op: str, tmp_path: Any) -> None:
    path = str(tmp_path / "r.json")
    proc = _bench([op, "--backend", "nccl", "--nproc", "1", "-d", "all", "-o", "all",
                   "-b", "1K", "-e", "256K", "-f", "16", "-n", "3", "-w", "1", "--json", path])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.load(open(path))
    assert doc["env"]["backend"] == "nccl" and "nccl" in doc["env"]
    assert doc["rows"] and doc["summary"]["ok"]
    assert {r["type"] for r in doc["rows"]} >= {"float", "half", "bfloat16", "int8", "double"}


def test_two_ranks_on_one_gpu_and_the_check_fails_when_corrupted() -> None:
    from gpucoll._backends.nccl.backend import nccl_version

    if nccl_version() < (2, 30, 0):
        pytest.skip(f"two ranks on one GPU need NCCL >= 2.30; this is {'.'.join(map(str, nccl_version()))}")
    env = {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_NVLS_ENABLE": "0"}
    ok = _bench(["all_reduce", "--backend", "nccl", "--nproc", "2", "-b", "8", "-e", "64M", "-f", "8",
                 "-n", "5", "-w", "2"], env)
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
    assert "# Out of bounds values : 0 OK" in ok.stdout
    bad = _bench(["all_gather", "--backend", "nccl", "--nproc", "2", "-b", "1M", "-e", "1M", "-d", "bfloat16",
                  "-n", "2", "-w", "1"], {**env, "GPUCOLL_BENCH_CORRUPT": "1"})
    assert bad.returncode == 1 and "FAILED" in bad.stdout, bad.stdout[-3000:] + bad.stderr[-3000:]


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter", "broadcast"])
def test_cudagraph_launches_replay_the_captured_ops(op: str, tmp_path: Any) -> None:
    """-G N (nccl-tests' meaning): the ops are captured once, the graph launched N times;
    the data check still passes."""
    path = str(tmp_path / "g.json")
    proc = _bench([op, "--backend", "nccl", "--nproc", "1", "-G", "4", "-b", "1K", "-e", "1M", "-f", "32",
                   "-n", "10", "-w", "2", "-d", "float", "-o", "sum", "--json", path])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.load(open(path))
    assert doc["config"]["cudagraph"] == 4 and doc["rows"] and doc["summary"]["ok"], doc


@pytest.mark.parametrize("extra", [["-R", "1"], ["-m", "4"], ["-R", "2", "-m", "4"]])
def test_registration_and_aggregation_on_one_gpu(extra: list[str], tmp_path: Any) -> None:
    """-R 1 (ncclMemAlloc buffers, ncclCommRegister), -R 2 (windows, NCCL >= 2.27) and -m 4
    (4 ops per group call) on one GPU: the check passes and the header says which."""
    from gpucoll._backends.nccl.backend import nccl_version

    if extra[:2] == ["-R", "2"] and nccl_version() < (2, 27, 0):
        pytest.skip("symmetric windows need NCCL >= 2.27")
    path = str(tmp_path / "r.json")
    proc = _bench(["all_reduce", "--backend", "nccl", "-g", "1", "-b", "8", "-e", "64M", "-f", "8", "-n", "5",
                   "-w", "2", *extra, "--json", path])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.load(open(path))
    assert doc["summary"]["ok"] and doc["rows"]
    if "-R" in extra:
        assert "# Buffer registration: " in proc.stdout
    if "-m" in extra:
        assert " agg iters: 4 " in proc.stdout
