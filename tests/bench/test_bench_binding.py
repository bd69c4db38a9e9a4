"""gpucoll-bench's local job binds each rank to a core of its own on the CPU backend (as
mpirun binds up to two ranks), leaves them unbound with ``--bind-to none`` or more ranks
than cores, and a rank binds itself to what the job planned before it measures."""

from __future__ import annotations

import contextlib
import io
import os
from typing import Any

import pytest

from gpucoll._env import CPU_BIND_ENV
from gpucoll._launch import binding
from gpucoll.bench import spawn
from gpucoll.testing import run_spmd


class _Done:
    """A finished rank process (what run_local polls)."""

    returncode = 0

    def poll(self) -> int:
        return 0

    def wait(self, timeout: float | None = None) -> int:
        return 0

    def kill(self) -> None:
        pass


def _planned(monkeypatch: pytest.MonkeyPatch, nproc: int, **kw: Any) -> list[str]:
    """Each rank's GPUCOLL_CPU_BIND as run_local sets it (the processes are not started)."""
    envs: list[dict[str, str]] = []

    def popen(cmd: list[str], env: dict[str, str], **_: Any) -> _Done:
        envs.append(env)
        return _Done()
    monkeypatch.setattr(spawn.subprocess, "Popen", popen)
    monkeypatch.setenv(CPU_BIND_ENV, "0")  # an outer launcher's value must not leak into the ranks
    assert spawn.run_local(nproc, ["all_reduce"], timeout=10.0, **kw) == 0
    return [e[CPU_BIND_ENV] for e in envs]


def test_the_local_job_binds_each_rank_to_its_own_core(monkeypatch: pytest.MonkeyPatch) -> None:
    cores = binding.cores()
    n = min(2, len(cores))
    got = _planned(monkeypatch, n, bind_to="core")
    assert got == [binding.env_value(c) for c in cores[:n]]
    assert len(set(got)) == n


def test_no_binding_when_asked_or_when_ranks_outnumber_cores(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert _planned(monkeypatch, 2, bind_to="none") == ["", ""]
    many = len(binding.cores()) + 1
    assert _planned(monkeypatch, many, bind_to="core") == [""] * many
    assert "no rank is bound" in capsys.readouterr().err
    assert _planned(monkeypatch, many, bind_to="core", quiet_unbound=True) == [""] * many
    assert capsys.readouterr().err == ""


def _rank_body(cpu: int) -> tuple[int, list[int]]:
    from gpucoll.bench import main

    os.environ[CPU_BIND_ENV] = str(cpu)  # as run_local sets it for this rank
    with contextlib.redirect_stdout(io.StringIO()):
        code = main(["all_reduce", "-b", "8", "-e", "8", "-n", "2", "-w", "1", "--backend", "cpu"])
    return code, sorted(os.sched_getaffinity(0))


def test_a_rank_binds_itself_to_the_planned_cpus_before_measuring() -> None:
    cpu = max(os.sched_getaffinity(0))
    results = run_spmd(_rank_body, 2, args=(cpu,), init=False, timeout=120)
    assert results == [(0, [cpu]), (0, [cpu])]


@pytest.mark.parametrize("flag, want", [([], ("core", True)), (["--bind-to", "core"], ("core", False)),
                                        (["--bind-to", "none"], ("none", False))])
def test_the_cli_binds_cpu_jobs_by_default(monkeypatch: pytest.MonkeyPatch, flag: list[str],
                                            want: tuple[str, bool]) -> None:
    from gpucoll.bench import main

    seen: list[tuple[str, bool]] = []

    def run_local(nproc: int, argv: list[str], *, bind_to: str, quiet_unbound: bool, **_: Any) -> int:
        seen.append((bind_to, quiet_unbound))
        return 0
    monkeypatch.setattr(spawn, "run_local", run_local)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert main(["all_reduce", "-b", "8", "-e", "8", "--backend", "cpu", *flag]) == 0
    assert seen == [want]
