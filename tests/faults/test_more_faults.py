"""More faults: init/destroy cycles, hostile store clients, a FileStore corrupted under a
running job, signals to gpucoll-run, and (marker ``soak``, run with ``--soak``) a long
series of peer deaths."""

from __future__ import annotations

import os
import random
import signal
import socket
import struct
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from _faultkit import OPS, PG_TIMEOUT, run_cases
from _launch_jobs import (job_env, kill_tree, launcher_cmd, pids_printed, scratch_left, shm_left, start,
                          wait_gone, write_script)
from gpucoll.testing import run_spmd


# -- init/destroy cycles ----------------------------------------------------------------

def cycles_body(n_cycles: int) -> list[str]:
    import gpucoll

    wrong = []
    for c in range(n_cycles):
        gpucoll.init_process_group("cpu", timeout=10)
        r, n = gpucoll.get_rank(), gpucoll.get_world_size()
        x = np.full(4, float(c * 10 + r))
        gpucoll.all_reduce(x)
        expected = sum(c * 10 + k for k in range(n))
        if not (x == expected).all():
            wrong.append(f"cycle {c}: all_reduce gave {x[0]}, expected {expected}")
        out: list[Any] = [None] * n
        gpucoll.all_gather_object(out, (r, c))
        if out != [(k, c) for k in range(n)]:
            wrong.append(f"cycle {c}: all_gather_object gave {out}")
        gpucoll.destroy_process_group()
    return wrong


def test_init_destroy_cycles_never_give_another_cycles_values() -> None:
    out = run_spmd(cycles_body, 2, args=(12,), init=False, timeout=120)
    assert out == [[], []]


# -- hostile store clients ----------------------------------------------------------------

def test_a_store_server_outlives_hostile_clients() -> None:
    from gpucoll.errors import DistError
    from gpucoll.store import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=10, token="good-token")
    hostile: list[socket.socket] = []
    try:
        port = int(server.port)
        for payload in (os.urandom(64), b"\xff" * 16, struct.pack("<Q", 1 << 30) + b"x", b""):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            if payload:
                s.sendall(payload)
            hostile.append(s)  # garbage, a huge announced length, a HELLO that never comes
        with pytest.raises(DistError):
            TCPStore("127.0.0.1", port, timeout=5, token="wrong-token")
        good = TCPStore("127.0.0.1", port, timeout=10, token="good-token")
        worst = 0.0
        for i in range(50):
            t0 = time.monotonic()
            good.set(f"k{i}", str(i))
            assert good.get(f"k{i}") == str(i).encode()
            worst = max(worst, time.monotonic() - t0)
        assert good.add("counter", 5) == 5
        assert worst < 1.0, f"a good client's worst round trip was {worst:.3f} s"
        good.close()
    finally:
        for s in hostile:
            s.close()
        server.close()


# -- a FileStore corrupted under a running job ---------------------------------------------

def filestore_body(path: str) -> tuple[str, float]:
    import gpucoll

    r = int(os.environ["RANK"])
    gpucoll.init_process_group("cpu", init_method=f"file://{path}", rank=r, world_size=2, timeout=PG_TIMEOUT)
    x = np.ones(3)
    gpucoll.all_reduce(x)
    assert (x == 2).all()
    gpucoll.barrier()
    if r == 0:
        with open(path, "ab") as f:  # a record that announces far more than the file holds
            f.write(struct.pack("<I", 0xFFFFFF00) + b"\x01garbage")
    gpucoll.barrier()
    t0 = time.monotonic()
    try:
        gpucoll.new_group([0, 1])
        outcome = "no error"
    except gpucoll.DistError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    elapsed = time.monotonic() - t0
    try:
        gpucoll.destroy_process_group()
    except Exception:  # noqa: BLE001 - the store is broken on purpose
        pass
    return outcome, elapsed


def test_a_filestore_corrupted_under_a_job_fails_its_store_ops(tmp_path: Path) -> None:
    out = run_spmd(filestore_body, 2, args=(str(tmp_path / "store"),), init=False, timeout=90)
    for outcome, elapsed in out:
        assert outcome.startswith("DistStore"), outcome
        assert elapsed < PG_TIMEOUT + 5, f"{elapsed:.1f} s"


# -- signals to gpucoll-run ----------------------------------------------------------------

BLOCKED = """
    import os, sys, time
    import numpy as np
    import gpucoll

    gpucoll.init_process_group("cpu", timeout=60)
    rank = gpucoll.get_rank()
    print(f"PID {rank} {os.getpid()}", flush=True)
    gpucoll.all_reduce(np.ones(4))
    open(f"ready.{rank}", "w").close()
    if rank != 1:
        gpucoll.all_reduce(np.ones(4))  # rank 1 never joins: the others are blocked here
    time.sleep(120)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_launcher_ends_every_rank(tmp_path: Path, sig: signal.Signals) -> None:
    script = write_script(tmp_path, "blocked.py", BLOCKED)
    tmpdir = tmp_path / "tmp"
    proc = start(launcher_cmd("--nproc-per-node", "3", "--grace-period", "2", script), cwd=tmp_path,
                 env=job_env(tmpdir))
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("ready.*"))) < 3:
            assert time.monotonic() < deadline and proc.poll() is None, "the ranks never got going"
            time.sleep(0.05)
        t0 = time.monotonic()
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        kill_tree(proc)
    assert proc.returncode == 128 + sig, err
    assert took < 2 + 5, f"the launcher took {took:.1f} s to stop the job"
    pids = pids_printed(out)
    assert len(pids) == 3 and wait_gone(pids.values(), 5.0) == []
    assert shm_left(pids.values()) == [] and scratch_left(tmpdir) == []
    assert f"interrupted by {sig.name}" in err


# -- soak ----------------------------------------------------------------------------------

@pytest.mark.soak
@pytest.mark.parametrize("n", [2, 3, 4])
def test_soak_peer_death_in_random_ops(n: int, tmp_path: Path) -> None:
    rng = random.Random(1234 + n)
    ops = [op for op in OPS if op not in ("monitored_barrier",)]
    cases = [(rng.choice(ops), rng.randrange(n), "kill") for _ in range(40)]
    out = run_spmd(run_cases, n, args=(cases,), init=False, timeout=len(cases) * 25 + 60,
                   env={"TMPDIR": str(tmp_path), "GPUCOLL_FLIGHT_RECORDER_DIR": str(tmp_path / "fr")})
    pids = [out[r][i]["pid"] for r in range(n) for i in range(len(cases)) if "pid" in out[r][i]]
    assert shm_left(pids) == []
    for i, (op, victim, _) in enumerate(cases):
        for r in range(n):
            rep = out[r][i]
            if r == victim:
                continue
            assert not rep.get("hung") and "setup_error" not in rep, (op, r, rep)
            if rep["raised"] is None:
                # As in test_peer_death: all_reduce_big's victim dies 2 ms into its own op,
                # and its data may all have gone out by then (the op completes, right).
                assert op in ("broadcast", "scatter", "reduce", "gather", "recv_streaming", "all_reduce_big") and \
                    rep["correct"] in (True, None), (op, r, rep)
            else:
                assert rep["dist"] and rep["elapsed"] < PG_TIMEOUT + 5, (op, r, rep)
