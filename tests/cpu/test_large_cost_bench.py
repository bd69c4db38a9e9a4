"""bench/cpu_large_cost.py: its per-batch combination across ranks, and a smoke run of
gpucoll alone at 2 ranks (the figures' size is not checked, only that each op was timed
and charged CPU)."""

from __future__ import annotations

import importlib.util
import os
import re
import statistics
import subprocess
import sys
from typing import Any

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "cpu_large_cost.py")


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location("cpu_large_cost", _PATH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_combine_takes_the_slowest_wall_and_sums_the_rest_then_the_median_over_batches() -> None:
    b = _bench()
    # two ranks, three batches of (wall, user, sys, vcsw, ivcsw)
    r0 = {"8": [[1.0, 0.1, 0.2, 1, 2], [3.0, 0.3, 0.1, 0, 0], [2.0, 0.2, 0.4, 5, 1]]}
    r1 = {"8": [[2.0, 0.5, 0.0, 0, 1], [1.0, 0.1, 0.1, 2, 2], [4.0, 0.0, 0.1, 1, 1]]}
    got = b.combine([r0, r1])["8"]
    per_batch = [[max(a[0], c[0])] + [a[k] + c[k] for k in range(1, 5)] for a, c in zip(r0["8"], r1["8"])]
    want = {f: statistics.median(row[k] for row in per_batch) for k, f in enumerate(b.FIELDS)}
    assert got == pytest.approx(want)
    assert got["wall"] == 3.0  # batch walls 2, 3, 4: not the median of each rank's own walls


def test_gpucoll_alone_smoke() -> None:
    p = subprocess.run([sys.executable, _PATH, "--ranks", "2", "--skip", "mpi", "--pairs", "1", "--batches", "1",
                        "--sizes", "4096,1048576"], capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-2000:]
    out = p.stdout
    assert "Open MPI skipped: --skip mpi given" in out
    for size in ("4096", "1048576"):
        rows = re.findall(rf"all_reduce {size} B:.*?\n.*?\n.*?\n\| gpucoll 1 \| ([0-9.]+) \| ([0-9.]+) \|", out, re.S)
        assert rows, out
        wall, cpu = map(float, rows[0])
        assert wall > 0 and cpu > 0, out


def test_bad_arguments_are_refused() -> None:
    b = _bench()
    with pytest.raises(SystemExit):
        b.main(["--sizes", "2"])
    with pytest.raises(SystemExit):
        b.main(["--pairs", "0"])
