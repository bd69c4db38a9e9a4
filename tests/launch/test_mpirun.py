"""``mpirun -n 2`` (Open MPI) running a gpucoll script that calls init_process_group() with no arguments.

Skipped only when ``mpirun`` is absent (CI installs Open MPI). The ranks never call
MPI themselves: gpucoll reads OMPI_COMM_WORLD_* and derives the store's port from
the job id, so both ranks meet rank 0's store without any variable set by hand.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpucoll.clusters.base import SCHEDULER_PORT_BASE, SCHEDULER_PORT_SPAN

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun (Open MPI) is not installed")

SCRIPT = """
    import json, sys
    import numpy as np
    import gpucoll
    from gpucoll.clusters import detect

    env = detect()
    gpucoll.init_process_group()
    rank, size = gpucoll.get_rank(), gpucoll.get_world_size()
    x = np.full(3, rank + 1, dtype=np.int64)
    gpucoll.all_reduce(x)
    # A file per rank: mpirun's output forwarding may splice the ranks' lines together.
    with open(f"result.{rank}.json", "w") as f:
        json.dump({"source": env.source, "rank": env.rank, "world_size": env.world_size,
                   "local_rank": env.local_rank, "master_addr": env.master_addr,
                   "master_port": env.master_port, "pg_rank": rank, "pg_size": size,
                   "sum": x.tolist()}, f)
    gpucoll.destroy_process_group()
"""


def _mpirun_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith(("OMPI_COMM_WORLD", "SLURM_", "PMI_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    # Open MPI refuses to run as root (CI containers) without both of these.
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def test_mpirun_two_ranks_init_process_group_without_arguments(tmp_path: Path) -> None:
    script = tmp_path / "mpi_job.py"
    script.write_text(textwrap.dedent(SCRIPT))
    mpirun = shutil.which("mpirun")
    assert mpirun is not None
    res = subprocess.run([mpirun, "-n", "2", "--oversubscribe", sys.executable, str(script)],
                         cwd=tmp_path, env=_mpirun_env(), capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    results = sorted((json.loads(p.read_text()) for p in tmp_path.glob("result.*.json")),
                     key=lambda r: int(r["rank"]))
    assert [r["rank"] for r in results] == [0, 1], res.stdout + res.stderr
    for r in results:
        assert r["source"] == "openmpi"
        assert (r["world_size"], r["local_rank"], r["pg_rank"], r["pg_size"]) == (2, r["rank"], r["rank"], 2)
        assert r["master_addr"] == "127.0.0.1"
        assert SCHEDULER_PORT_BASE <= r["master_port"] < SCHEDULER_PORT_BASE + SCHEDULER_PORT_SPAN
        assert r["sum"] == [1 + 2] * 3
    assert results[0]["master_port"] == results[1]["master_port"]


def test_the_docs_say_oversubscribe_where_mpirun_needs_it() -> None:
    """docs/launching.md's `mpirun -n 4`: Open MPI refuses more ranks than cores without
    --oversubscribe (checked here on this machine), and the page says so next to it."""
    mpirun = shutil.which("mpirun")
    assert mpirun is not None
    n = (os.cpu_count() or 1) + 1
    bare = subprocess.run([mpirun, "-n", str(n), "true"], env=_mpirun_env(), capture_output=True, text=True,
                          timeout=60)
    assert bare.returncode != 0 and "slots" in (bare.stdout + bare.stderr).lower()
    over = subprocess.run([mpirun, "--oversubscribe", "-n", str(n), "true"], env=_mpirun_env(),
                          capture_output=True, text=True, timeout=60)
    assert over.returncode == 0, over.stdout + over.stderr
    lines = (REPO / "docs" / "launching.md").read_text().splitlines()
    for i, line in enumerate(lines):
        if "mpirun -n" in line:
            near = "\n".join(lines[max(0, i - 3): i + 6])
            assert "--oversubscribe" in near, f"docs/launching.md:{i + 1} {line!r} without a word on --oversubscribe"
