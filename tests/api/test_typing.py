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
