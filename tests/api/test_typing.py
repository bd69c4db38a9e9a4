"""The package type-checks under ``mypy --strict`` (pyproject's [tool.mypy])."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_package_is_mypy_strict_clean(tmp_path: Path) -> None:
    pytest.importorskip("mypy")
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(tmp_path / "cache"), "gpucoll"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "MYPY_FORCE_COLOR": "0"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


USER_CODE = '''
import numpy as np
import gpucoll
import gpucoll.functional as F
from gpucoll import ReduceOp, make_premul_sum

x = np.ones(4, np.float32)
gpucoll.all_reduce(x)
gpucoll.all_reduce(x, op=ReduceOp.MAX)
gpucoll.all_reduce(x, op=make_premul_sum(0.5))
gpucoll.all_gather([np.empty_like(x), np.empty_like(x)], x)
gpucoll.broadcast(bytearray(16), src=0)
gpucoll.broadcast(memoryview(bytearray(16)), src=0)
y = F.all_reduce(x, op=ReduceOp.SUM)
gpucoll.all_reduce([1.0, 2.0])  # E: a list is no array
gpucoll.all_reduce(x, op=3)  # E: an int is no reduce op
F.all_reduce("abc")  # E: a str is no array
gpucoll.init_process_group("cpu", pg_options=gpucoll.CPUOptions(), device_id="cuda:0")
gpucoll.init_process_group("nccl", device_id=0)
gpucoll.new_group([0], pg_options=3)  # E: an int is no options object
gpucoll.init_process_group("cpu", device_id=1.5)  # E: a float is no device
gpucoll.make_premul_sum(np.float32(0.5))
gpucoll.make_premul_sum("0.5")  # E: a str is no factor
gpucoll.shrink_group([1])
gpucoll.shrink_group(1)  # E: ranks_to_exclude is a list of ranks
gpucoll.DeviceMesh("cpu", [[0, 1], [2, 3]])
'''


def test_public_signatures_accept_arrays_and_reduce_ops_and_reject_others(tmp_path: Path) -> None:
    """Public signatures name what they accept (ArrayLike, ReduceOpLike), so a type
    checker catches a list or a bad op at the call site."""
    pytest.importorskip("mypy")
    src = tmp_path / "user.py"
    src.write_text(USER_CODE)
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent", "--cache-dir", str(tmp_path / "cache"),
         str(src)], cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "MYPY_FORCE_COLOR": "0"},
    )
    lines = USER_CODE.splitlines()
    want = {i + 1 for i, line in enumerate(lines) if "# E:" in line}
    got = {int(m.split(":")[1]) for m in proc.stdout.splitlines() if m.startswith(str(src)) and ": error:" in m}
    assert got == want, proc.stdout + proc.stderr
