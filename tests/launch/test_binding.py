"""Binding local ranks to cores: ``gpucoll-run --bind-to core``, ``run_spmd(bind_to=)``.

The plan is checked on made-up topologies (hardware threads, more ranks than cores);
the binding itself against what the kernel reports for every thread of each rank
(``os.sched_getaffinity`` of each task under ``/proc/<pid>/task``), in real jobs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from gpucoll._launch import binding
from gpucoll.testing import run_spmd

REPO = Path(__file__).resolve().parents[2]
CORES = binding.cores()
needs_two_cores = pytest.mark.skipif(len(CORES) < 2, reason="needs two cores to bind two ranks apart")


# -- the plan ------------------------------------------------------------------------------

def test_plan_gives_local_rank_i_core_i_and_nothing_when_oversubscribed() -> None:
    allowed = {0, 1, 2, 3}
    assert binding.plan("none", 2, allowed) is None
    assert binding.plan("core", 2, allowed) == [frozenset({0}), frozenset({1})]
    assert binding.plan("core", 4, allowed) == [frozenset({c}) for c in range(4)]
    assert binding.plan("core", 5, allowed) is None  # more ranks than cores: no binding, as mpirun


def test_plan_binds_a_rank_to_every_hardware_thread_of_its_core(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two cores with two threads each, numbered as Linux numbers them: 0,1 then their siblings 2,3.
    topo = {0: (0, 0), 1: (0, 1), 2: (0, 0), 3: (0, 1)}
    monkeypatch.setattr(binding, "_topology", lambda cpu: topo[cpu])
    assert binding.cores({0, 1, 2, 3}) == [frozenset({0, 2}), frozenset({1, 3})]
    assert binding.plan("core", 2, {0, 1, 2, 3}) == [frozenset({0, 2}), frozenset({1, 3})]
    assert binding.plan("core", 3, {0, 1, 2, 3}) is None
    # Same core number on two packages: two cores.
    topo = {0: (0, 0), 1: (1, 0)}
    assert binding.cores({0, 1}) == [frozenset({0}), frozenset({1})]


def test_bad_plan_arguments_name_the_value() -> None:
    with pytest.raises(ValueError, match="bind_to must be one of none, core; got 'socket'"):
        binding.plan("socket", 2)
    with pytest.raises(ValueError, match="local ranks must be >= 1; got 0"):
        binding.plan("core", 0)
    with pytest.raises(ValueError, match="bind_to must be one of"):
        run_spmd(_affinity, 1, bind_to="cores")


@pytest.mark.parametrize("value, cpus", [("3", {3}), ("2,66", {2, 66}), (" 0,1 ", {0, 1})])
def test_parse_reads_the_launchers_value(value: str, cpus: set[int]) -> None:
    assert binding.parse(value.strip()) == cpus
    assert binding.parse(binding.env_value(frozenset(cpus))) == cpus


@pytest.mark.parametrize("value", ["x", "1,,2", "-1", "0;1"])
def test_parse_refuses_what_is_not_a_cpu_list(value: str) -> None:
    with pytest.raises(ValueError, match=f"GPUCOLL_CPU_BIND must be a comma-separated list of CPU numbers; got {value!r}"):
        binding.parse(value)


# -- binding a process ---------------------------------------------------------------------

_THREADS = textwrap.dedent("""
    import json, os, sys, threading
    sys.path.insert(0, sys.argv[1])
    from gpucoll._launch.binding import apply_from_env
    started = threading.Event(); done = threading.Event()
    def idle():
        started.set(); done.wait()
    t = threading.Thread(target=idle); t.start(); started.wait()   # a thread from before the binding
    got = apply_from_env()
    later = {}
    def report():
        later["cpus"] = sorted(os.sched_getaffinity(0))             # a thread started after it
    t2 = threading.Thread(target=report); t2.start(); t2.join()
    tasks = {tid: sorted(os.sched_getaffinity(int(tid))) for tid in os.listdir("/proc/self/task")}
    done.set(); t.join()
    print(json.dumps({"got": sorted(got) if got is not None else None, "tasks": tasks, "later": later["cpus"]}))
""")


def test_apply_binds_every_thread_the_process_has_and_later_ones_inherit() -> None:
    cpu = max(os.sched_getaffinity(0))
    env = dict(os.environ, GPUCOLL_CPU_BIND=str(cpu))
    out = subprocess.run([sys.executable, "-c", _THREADS, str(REPO)], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["got"] == [cpu]
    assert len(res["tasks"]) >= 2 and all(cpus == [cpu] for cpus in res["tasks"].values()), res
    assert res["later"] == [cpu]
    # Unset or empty: nothing is bound.
    env["GPUCOLL_CPU_BIND"] = ""
    out = subprocess.run([sys.executable, "-c", _THREADS, str(REPO)], env=env, capture_output=True, text=True,
                         timeout=60)
    res = json.loads(out.stdout)
    assert res["got"] is None and res["later"] == sorted(os.sched_getaffinity(0))


# -- real jobs -----------------------------------------------------------------------------

def _affinity() -> dict[str, Any]:
    tasks = []
    for t in os.listdir(f"/proc/{os.getpid()}/task"):
        try:
            tasks.append(sorted(os.sched_getaffinity(int(t))))
        except ProcessLookupError:
            pass  # that thread ended after the listing
    return {"cpus": sorted(os.sched_getaffinity(0)), "tasks": tasks}


@needs_two_cores
def test_run_spmd_binds_rank_i_to_core_i() -> None:
    res = run_spmd(_affinity, 2, bind_to="core", timeout=60)
    for rank, r in enumerate(res):
        assert r["cpus"] == sorted(CORES[rank])
        assert all(t == r["cpus"] for t in r["tasks"]), r  # the gpucoll threads too
    unbound = run_spmd(_affinity, 2, timeout=60)
    assert all(r["cpus"] == sorted(os.sched_getaffinity(0)) for r in unbound)


def test_run_spmd_binds_nothing_with_more_ranks_than_cores() -> None:
    res = run_spmd(_affinity, len(CORES) + 1, bind_to="core", timeout=120)
    assert all(r["cpus"] == sorted(os.sched_getaffinity(0)) for r in res)


# One write of a whole line (under 4 KiB, so atomic on a pipe): print() writes the line and
# its newline separately where stdout is unbuffered (PYTHONUNBUFFERED), and with --no-prefix
# two ranks' lines could then interleave.
_REPORT = """
import json, os, sys
sys.stdout.write(json.dumps({"rank": int(os.environ["RANK"]), "cpus": sorted(os.sched_getaffinity(0)),
                             "env": os.environ.get("GPUCOLL_CPU_BIND")}) + "\\n")
"""


def _launch(tmp_path: Path, *argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "report.py"
    script.write_text(_REPORT)
    full = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT", "GPUCOLL_STORE_TOKEN")}
    full["PYTHONPATH"] = os.pathsep.join([str(REPO), full.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    full.update(env)
    return subprocess.run([sys.executable, "-m", "gpucoll.run", "--no-prefix", *argv, str(script)], cwd=tmp_path,
                          env=full, capture_output=True, text=True, timeout=60)


def _lines(out: str) -> dict[int, dict[str, Any]]:
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {r["rank"]: r for r in rows}


@needs_two_cores
def test_gpucoll_run_bind_to_core(tmp_path: Path) -> None:
    # An outer job's value in the launcher's environment is not passed on.
    got = _launch(tmp_path, "--nproc-per-node", "2", "--bind-to", "core", GPUCOLL_CPU_BIND="0")
    assert got.returncode == 0, got.stderr
    ranks = _lines(got.stdout)
    assert [ranks[r]["cpus"] for r in (0, 1)] == [sorted(CORES[0]), sorted(CORES[1])]
    got = _launch(tmp_path, "--nproc-per-node", "2", GPUCOLL_CPU_BIND="0")
    assert got.returncode == 0, got.stderr
    assert all(r["cpus"] == sorted(os.sched_getaffinity(0)) and r["env"] is None for r in _lines(got.stdout).values())


def test_gpucoll_run_bind_to_core_oversubscribed_says_so_and_binds_nothing(tmp_path: Path) -> None:
    n = len(CORES) + 1
    got = _launch(tmp_path, "--nproc-per-node", str(n), "--bind-to", "core")
    assert got.returncode == 0, got.stderr
    assert f"--bind-to core: {n} local ranks but {len(CORES)} cores to run on; no rank is bound" in got.stderr
    assert len(_lines(got.stdout)) == n
    assert all(r["cpus"] == sorted(os.sched_getaffinity(0)) for r in _lines(got.stdout).values())


def test_gpucoll_run_refuses_an_unknown_binding(tmp_path: Path) -> None:
    got = _launch(tmp_path, "--bind-to", "socket")
    assert got.returncode == 2 and "invalid choice: 'socket'" in got.stderr


def test_a_worker_given_a_bad_binding_fails_before_the_program(tmp_path: Path) -> None:
    script = tmp_path / "never.py"
    script.write_text("print('ran')\n")
    env = dict(os.environ, GPUCOLL_CPU_BIND="zero",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    got = subprocess.run([sys.executable, "-m", "gpucoll._launch.worker", str(script)], env=env,
                         capture_output=True, text=True, timeout=60)
    assert got.returncode == 1 and "ran" not in got.stdout
    assert "cannot bind to the CPUs its launcher planned (GPUCOLL_CPU_BIND)" in got.stderr
    assert "got 'zero'" in got.stderr
