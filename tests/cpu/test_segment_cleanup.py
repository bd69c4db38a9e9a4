"""Shared-memory segments never outlive a job: a rank killed while the segment is set up
(before every peer mapped it) leaves it behind, and then the launcher (for its own ranks)
or the next job (for any dead creator) removes it; a file gpucoll did not create is never
removed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gpucoll._backends.cpu import segments
from gpucoll.testing import run_spmd

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm") or sys.platform != "linux",
                                reason="needs Linux /dev/shm")

KILLED_IN_INIT = """
import os, signal, sys
import gpucoll._backends.cpu.shm as shm

if os.environ["RANK"] == "0":
    open(sys.argv[1], "w").write(str(os.getpid()))
    real = shm.os.posix_fallocate

    def created_then_killed(fd, off, n):
        real(fd, off, n)  # the segment exists under its name; no peer has mapped it yet
        os.kill(os.getpid(), signal.SIGKILL)

    shm.os.posix_fallocate = created_then_killed
import gpucoll
gpucoll.init_process_group("cpu", timeout=20.0)
"""


def _ours(pid: int) -> list[str]:
    ns = segments._pidns()
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"gpucoll-{ns}-{pid}-")]


def test_rank0_killed_in_init_leaves_no_segment_under_the_launcher(tmp_path: Path) -> None:
    script = tmp_path / "killed.py"
    script.write_text(textwrap.dedent(KILLED_IN_INIT))
    pidfile = tmp_path / "pid0"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GPUCOLL_STORE_TOKEN")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["GPUCOLL_CPU_TRANSPORT"] = "shm"
    res = subprocess.run([sys.executable, "-m", "gpucoll.run", "--nproc-per-node", "3", str(script), str(pidfile)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "SIGKILL" in res.stderr, res.stderr
    pid = int(pidfile.read_text())
    assert _ours(pid) == [], "the killed rank's segment was left in /dev/shm"


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _make(name: str) -> Path:
    path = Path("/dev/shm") / name
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    os.close(fd)
    return path


def next_job_body() -> Any:
    import gpucoll
    from gpucoll._world import default_group

    x = np.ones(4)
    gpucoll.all_reduce(x)
    return default_group()._cpu.transport, x.tolist()


def test_the_next_job_removes_a_dead_creators_segment_and_nothing_else(tmp_path: Path) -> None:
    ns = segments._pidns()
    dead = _dead_pid()
    left = _make(f"gpucoll-{ns}-{dead}-{'ab' * 8}")
    alive = _make(f"gpucoll-{ns}-{os.getpid()}-{'cd' * 8}")    # its creator (this process) lives
    odd = _make(f"gpucoll-{ns}-{dead}x-{'ab' * 8}")            # not a name gpucoll makes
    other_ns = _make(f"gpucoll-1-{dead}-{'ef' * 8}")            # another pid namespace's pid
    try:
        res = run_spmd(next_job_body, 2, timeout=60, env={"GPUCOLL_CPU_TRANSPORT": "shm"})
        assert res == [("shm", [2.0] * 4)] * 2
        assert not left.exists()
        for keep in (alive, odd, other_ns):
            assert keep.exists(), keep
    finally:
        for p in (left, alive, odd, other_ns):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass


def test_a_link_at_a_segments_name_is_left_alone(tmp_path: Path) -> None:
    target = tmp_path / "someones-data"
    target.write_text("keep me")
    link = Path("/dev/shm") / f"gpucoll-{segments._pidns()}-{_dead_pid()}-{'12' * 8}"
    link.symlink_to(target)
    try:
        assert str(link) not in segments.sweep_orphans()
        assert link.is_symlink() and target.read_text() == "keep me"
    finally:
        os.unlink(link)


def test_remove_segments_of_takes_only_the_named_dead_creators() -> None:
    ns = segments._pidns()
    a, b = _dead_pid(), _dead_pid()
    pa = _make(f"gpucoll-{ns}-{a}-{'01' * 8}")
    pb = _make(f"gpucoll-{ns}-{b}-{'02' * 8}")
    mine = _make(f"gpucoll-{ns}-{os.getpid()}-{'03' * 8}")
    try:
        assert segments.remove_segments_of([a, os.getpid()]) == [str(pa)]
        assert not pa.exists() and pb.exists() and mine.exists()
    finally:
        for p in (pa, pb, mine):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
