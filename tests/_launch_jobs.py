"""Helpers for tests that run real ``gpucoll-run`` jobs and check what they leave behind.

Every subprocess gets a hard timeout, and the helpers kill whole process groups in
``finally`` blocks, so that a hung launcher fails the test instead of the run.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Iterable

REPO = Path(__file__).resolve().parents[1]

_RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
              "MASTER_PORT", "GPUCOLL_STORE_TOKEN", "GPUCOLL_STORE_HOSTED", "TORCHELASTIC_RUN_ID")


def job_env(tmpdir: Path, **extra: str) -> dict[str, str]:
    """This environment, minus rank variables, with this checkout first on PYTHONPATH
    and TMPDIR pointing at ``tmpdir`` (so that the launcher's scratch folder can be
    checked for leaks without seeing other jobs')."""
    env = {k: v for k, v in os.environ.items() if k not in _RANK_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    tmpdir.mkdir(parents=True, exist_ok=True)
    env["TMPDIR"] = str(tmpdir)
    env.update(extra)
    return env


def write_script(where: Path, name: str, body: str) -> str:
    path = where / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def launcher_cmd(*argv: str) -> list[str]:
    return [sys.executable, "-m", "gpucoll.run", *argv]


def start(cmd: list[str], *, cwd: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    """Start a launcher in its own session (so that ``kill_tree`` reaches everything)."""
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def kill_tree(proc: subprocess.Popen[str]) -> None:
    """SIGKILL a launcher started by :func:`start` and its process group; reap it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.communicate(timeout=10)
    except (subprocess.TimeoutExpired, ValueError):
        pass


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def wait_gone(pids: Iterable[int], within: float) -> list[int]:
    pids = list(pids)
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def kill_pids(pids: Iterable[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def scratch_left(tmpdir: Path) -> list[str]:
    """The launcher scratch folders under ``tmpdir``."""
    return sorted(n for n in os.listdir(tmpdir) if n.startswith("gpucoll-run-"))


def shm_left(pids: Iterable[int]) -> list[str]:
    """The CPU backend's /dev/shm segments named after any of ``pids``."""
    wanted = {str(p) for p in pids}
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return []
    return sorted(n for n in names if n.startswith("gpucoll-") and n.split("-")[1:2] and n.split("-")[1] in wanted)


def pids_printed(text: str) -> dict[int, int]:
    """``{rank: pid}`` from lines ``PID <rank> <pid>`` a job printed."""
    return {int(m.group(1)): int(m.group(2)) for m in re.finditer(r"PID (\d+) (\d+)", text)}


def root_cause_rank(stderr: str) -> int | None:
    m = re.search(r"root cause: rank (\d+) ", stderr)
    return int(m.group(1)) if m else None


def first_stderr_line(proc: subprocess.Popen[str], within: float) -> tuple[str, str]:
    """Read the launcher's first stderr line (node 0 prints its store's port there)
    without blocking past ``within`` seconds. Returns ``(line, what followed it)``."""
    import select

    assert proc.stderr is not None
    fd = proc.stderr.fileno()
    data = b""
    deadline = time.monotonic() + within
    while b"\n" not in data:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise AssertionError(f"no line from the launcher within {within} s (got {data!r})")
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    line, _, rest = data.decode("utf-8", "replace").partition("\n")
    return line, rest


def store_port(line: str) -> str:
    assert "--master-port" in line, line
    return line.rsplit("--master-port", 1)[1].strip()
