"""gpucoll-run under faults: the exit code and root cause are the first failed rank's,
every time, on one node and across two; a killed launcher leaves no scratch folder
and no rank behind.

The jobs are real ``python -m gpucoll.run`` runs; each costs one to two seconds.
The failing rank fails while the others are blocked in a collective with it, so
that they fail too (with a DistError) and race it to the launcher: the race the
root cause must not lose.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from _launch_jobs import (first_stderr_line, job_env, kill_tree, launcher_cmd, pids_printed, root_cause_rank,
                          scratch_left, shm_left, start, store_port, wait_gone, write_script)

VICTIM = """
    import os, signal, sys, time
    import numpy as np
    import gpucoll

    victim, mode = int(sys.argv[1]), sys.argv[2]
    gpucoll.init_process_group("cpu", timeout=10)
    rank = gpucoll.get_rank()
    print(f"PID {rank} {os.getpid()}", flush=True)
    x = np.ones(4)
    gpucoll.all_reduce(x)
    assert (x == gpucoll.get_world_size()).all()
    if rank == victim:
        time.sleep(0.3)  # the others are blocked in the next all_reduce by now
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        sys.exit(3)
    gpucoll.all_reduce(np.ones(4))
    raise AssertionError("all_reduce with a dead peer returned")
"""

REPEATS = 10


@pytest.mark.parametrize("mode, code", [("exit", 3), ("kill", 128 + signal.SIGKILL)])
def test_exit_code_and_root_cause_are_the_failed_ranks_every_time(tmp_path: Path, mode: str, code: int) -> None:
    script = write_script(tmp_path, "victim.py", VICTIM)
    tmpdir = tmp_path / "tmp"
    env = job_env(tmpdir)
    wrong = []
    for i in range(REPEATS):
        res = subprocess.run(launcher_cmd("--nproc-per-node", "3", "--grace-period", "3", script, "1", mode),
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
        root = root_cause_rank(res.stderr)
        if res.returncode != code or root != 1:
            wrong.append((i, res.returncode, root, res.stderr[-3000:]))
        pids = pids_printed(res.stdout)
        assert sorted(pids) == [0, 1, 2], res.stdout + res.stderr
        assert wait_gone(pids.values(), 5.0) == []
        assert shm_left(pids.values()) == [] and scratch_left(tmpdir) == []
    assert not wrong, f"{len(wrong)} of {REPEATS} runs got the exit code or root cause wrong; first: {wrong[0]}"


def test_a_sys_exit_is_recorded_with_its_traceback(tmp_path: Path) -> None:
    script = write_script(tmp_path, "victim.py", VICTIM)
    res = subprocess.run(launcher_cmd("--nproc-per-node", "2", script, "0", "exit"), cwd=tmp_path,
                         env=job_env(tmp_path / "tmp"), capture_output=True, text=True, timeout=60)
    assert res.returncode == 3, res.stderr
    summary = res.stderr[res.stderr.index("gpucoll-run: job failed"):]
    assert "root cause: rank 0 (" in summary and "error: SystemExit: 3" in summary
    assert "sys.exit(3)" in summary
    # rank 1's DistError is reported as a consequence, not as the cause
    assert "also failed: rank 1" in summary or "stopped by gpucoll-run: rank 1" in summary


def _two_nodes(tmp_path: Path, script: str, args: list[str], nproc: int = 2) -> tuple[list[int], list[str], str]:
    """Run the job on two launchers (node 0 and node 1) on this host; return their
    exit codes, stderrs and the ranks' stdout."""
    env = job_env(tmp_path / "tmp", GPUCOLL_STORE_TOKEN="two-node-secret")
    common = ["--nnodes", "2", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--grace-period", "3"]
    node0 = start(launcher_cmd(*common, "--node-rank", "0", "--master-port", "0", script, *args),
                  cwd=tmp_path, env=env)
    node1 = None
    try:
        line, rest = first_stderr_line(node0, 30)
        node1 = start(launcher_cmd(*common, "--node-rank", "1", "--master-port", store_port(line), script, *args),
                      cwd=tmp_path, env=env)
        out1, err1 = node1.communicate(timeout=60)
        out0, err0 = node0.communicate(timeout=60)
        return [node0.returncode, node1.returncode], [rest + err0, err1], out0 + out1
    finally:
        kill_tree(node0)
        if node1 is not None:
            kill_tree(node1)


@pytest.mark.parametrize("victim, mode, code", [
    (3, "kill", 128 + signal.SIGKILL),   # a rank of node 1
    (0, "exit", 3),                      # node 0's first rank (it hosts the shared-memory segment)
    (2, "exit", 3),
])
def test_two_nodes_agree_on_the_root_cause(tmp_path: Path, victim: int, mode: str, code: int) -> None:
    script = write_script(tmp_path, "victim.py", VICTIM)
    for _ in range(2):
        codes, errs, out = _two_nodes(tmp_path, script, [str(victim), mode])
        assert codes == [code, code], errs
        for err in errs:
            assert root_cause_rank(err) == victim, err[-3000:]
        pids = pids_printed(out)
        assert sorted(pids) == [0, 1, 2, 3]
        assert wait_gone(pids.values(), 5.0) == [] and shm_left(pids.values()) == []
        assert scratch_left(tmp_path / "tmp") == []


HANG = """
    import os, sys, time
    print(f"PID {os.environ['RANK']} {os.getpid()}", flush=True)
    with open(os.path.join(sys.argv[1], "started-" + os.environ["RANK"]), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)
"""


def test_a_sigkilled_launcher_leaves_no_scratch_folder_and_no_rank(tmp_path: Path) -> None:
    script = write_script(tmp_path, "hang.py", HANG)
    tmpdir = tmp_path / "tmp"
    marks = tmp_path / "started"
    marks.mkdir()
    proc = start(launcher_cmd("--nproc-per-node", "3", script, str(marks)), cwd=tmp_path, env=job_env(tmpdir))
    try:
        deadline = time.monotonic() + 30
        while not scratch_left(tmpdir) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(scratch_left(tmpdir)) == 1, "the launcher made no scratch folder"
        while len(list(marks.iterdir())) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)  # every rank has started and printed its pid
        assert len(list(marks.iterdir())) == 3, "the ranks did not start"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        out = proc.stdout.read() if proc.stdout else ""
    finally:
        kill_tree(proc)
    del out  # the launcher died before it could forward every rank's output: pids come from the marks
    pids = {int(m.name.split("-")[1]): int(m.read_text()) for m in marks.iterdir()}
    assert sorted(pids) == [0, 1, 2]
    assert wait_gone(pids.values(), 10.0) == [], "ranks outlived their SIGKILLed launcher"
    deadline = time.monotonic() + 10
    while scratch_left(tmpdir) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert scratch_left(tmpdir) == []


def test_the_next_launch_removes_a_dead_launchers_scratch_folder(tmp_path: Path) -> None:
    from gpucoll._launch.agent import _pid_namespace

    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    child = subprocess.Popen(["true"])
    child.wait()
    dead = tmpdir / f"gpucoll-run-{_pid_namespace()}-{child.pid}-abc"  # its launcher is gone
    live = tmpdir / f"gpucoll-run-{_pid_namespace()}-{os.getpid()}-abc"  # a running launcher's
    other_ns = tmpdir / f"gpucoll-run-ffff{_pid_namespace()}-{child.pid}-abc"  # another pid namespace's
    for d in (dead, live, other_ns):
        d.mkdir()
        (d / "error-rank0.json").write_text("{}")
    script = write_script(tmp_path, "ok.py", "print('fine')\n")
    res = subprocess.run(launcher_cmd(script), cwd=tmp_path, env=job_env(tmpdir), capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert scratch_left(tmpdir) == sorted([live.name, other_ns.name])


def test_a_rank_traceback_reaches_the_console_once(tmp_path: Path) -> None:
    """The rank printed its traceback; the summary points to it instead of a second copy.
    With --log-dir (no --tee) the console has no rank output, so the summary shows it."""
    script = write_script(tmp_path, "typo.py", "import gpucoll\ngpucoll.init_process_group('glooo')\n")
    res = subprocess.run(launcher_cmd("--nproc-per-node", "1", script), cwd=tmp_path,
                         env=job_env(tmp_path / "tmp"), capture_output=True, text=True, timeout=60)
    assert res.returncode == 1, res.stderr
    assert res.stderr.count("Traceback (most recent call last)") == 1, res.stderr
    summary = res.stderr[res.stderr.index("gpucoll-run: job failed"):]
    assert "where (the whole traceback is above, in rank 0's output):" in summary
    assert "gpucoll.init_process_group('glooo')" in summary and "normalize_backend" not in summary, summary
    res = subprocess.run(launcher_cmd("--nproc-per-node", "1", "--log-dir", str(tmp_path / "logs"), script),
                         cwd=tmp_path, env=job_env(tmp_path / "tmp"), capture_output=True, text=True, timeout=60)
    assert res.returncode == 1, res.stderr
    assert res.stderr.count("Traceback (most recent call last)") == 1, res.stderr
    assert "got 'glooo'" in res.stderr.split("traceback")[-1]
