"""A peer lost in the middle of a loop of 1 MiB all_reduces on a GPU: what the CPU fault
suite (tests/faults) proves on host arrays, on the NCCL backend. World 2 on one GPU
(NCCL >= 2.30, ``NCCL_MULTI_RANK_GPU_ENABLE=1``).

Two cases, one after the other: rank 1 is killed (SIGKILL), or stopped (SIGSTOP), while
both ranks loop over a 1 MiB all_reduce. Rank 0 must get a ``DistBackendError`` naming
the op, its sequence number and the group within the group's timeout + 5 s (never a
hang, never a result), its ``destroy_process_group`` must return within a bound (a
clean return, or the named "ncclCommDestroy did not return" error), and a new
two-rank group made afterwards on the same GPU (rank 0's same process, and a fresh
process for rank 1) must give right results.

The harness ranks (``run_spmd``) never touch CUDA: each case runs in a fresh Python
process per rank (``subprocess``: CUDA does not survive a fork, and the harness's ranks
are daemonic, so multiprocessing may not start children there), which writes its report
to a file; the children meet through the harness's store, under a prefix per case. A
harness rank kills whatever child outlives its deadline, so a hang fails the test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import pytest

from _gpu_two_ranks import why_not_two_ranks_on_one_gpu

from gpucoll.testing import run_spmd

pytestmark = pytest.mark.gpu

ENV = {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_NVLS_ENABLE": "0"}
PG_TIMEOUT = 6.0           # the case groups' timeout, seconds
DESTROY_BOUND = 20.0       # destroy_process_group of the broken group returns within this
N = 1 << 18                # float32 elements: 1 MiB
CASE_DEADLINE = 120.0      # a case child still running after this is killed (a hang)


_WHY_NOT_TWO = why_not_two_ranks_on_one_gpu()


def _store(prefix: str) -> Any:
    from gpucoll.store import PrefixStore, TCPStore

    base = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout=CASE_DEADLINE,
                    token=os.environ.get("GPUCOLL_STORE_TOKEN"))
    return PrefixStore(prefix, base)


def _ones_all_reduced(gpucoll: Any, cupy: Any, n_ranks: int) -> bool:
    """One synchronous all_reduce SUM of ones, read back: every element == n_ranks."""
    x = cupy.ones(N, dtype=cupy.float32)
    gpucoll.all_reduce(x)
    return bool((cupy.asnumpy(x) == n_ranks).all())


def _case_child(how: str, rank: int, out: str) -> None:
    """One rank of one case: the group, the warm-up, the loop; the victim's signal; the
    survivor's error, destroy and new group. Writes its report to ``out``."""
    report: dict[str, Any] = {"rank": rank}
    try:
        import cupy

        import gpucoll

        cupy.cuda.Device(0).use()
        store = _store(f"gpu-fault-{how}")
        gpucoll.init_process_group("nccl", store=store, rank=rank, world_size=2, device_id=0, timeout=PG_TIMEOUT)
        report["warm"] = all(_ones_all_reduced(gpucoll, cupy, 2) for _ in range(3))
        x = cupy.ones(N, dtype=cupy.float32)
        MAX = gpucoll.ReduceOp.MAX
        store.set(f"looping/{rank}", b"1")
        store.wait([f"looping/{1 - rank}"])
        if rank == 1:  # the victim: dies (or stops) in the middle of its loop
            t_end = time.monotonic() + 0.3
            while time.monotonic() < t_end:
                gpucoll.all_reduce(x, op=MAX)
            gpucoll.all_reduce(x, op=MAX, async_op=True)
            os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
            time.sleep(CASE_DEADLINE)  # a stopped victim is killed by its parent
            return
        # The survivor: synchronous all_reduces, the host waiting on every 16th.
        ops = 0
        t_wait = time.monotonic()
        try:
            while True:
                for _ in range(15):
                    gpucoll.all_reduce(x, op=MAX)
                t_wait = time.monotonic()
                gpucoll.all_reduce(x, op=MAX, async_op=True).synchronize()
                ops += 16
                if time.monotonic() - t_wait > PG_TIMEOUT + 30:
                    break
            report["raised"] = None
        except Exception as exc:  # noqa: BLE001  (the type is what is checked)
            report.update(raised=type(exc).__name__, dist=isinstance(exc, gpucoll.DistBackendError), msg=str(exc),
                          after_s=time.monotonic() - t_wait, ops=ops)
        store.set("survivor/reported", b"1")
        t0 = time.monotonic()
        try:
            gpucoll.destroy_process_group()
            report["destroy"] = "ok"
        except Exception as exc:  # noqa: BLE001
            report["destroy"] = f"{type(exc).__name__}: {exc}"
        report["destroy_s"] = time.monotonic() - t0
        # A new group on the same GPU, with a fresh process for rank 1.
        gpucoll.init_process_group("nccl", store=_store(f"gpu-fault-{how}-after"), rank=0, world_size=2,
                                   device_id=0, timeout=60.0)
        report["after"] = _ones_all_reduced(gpucoll, cupy, 2)
        gpucoll.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001  (reported, then the test fails on it)
        report["setup_error"] = f"{type(exc).__name__}: {exc}"
        if rank == 0:
            try:  # the victim's parent stops waiting for the survivor
                _store(f"gpu-fault-{how}").set("survivor/reported", b"failed")
            except Exception:  # noqa: BLE001
                pass
    _write(out, report)


def _write(out: str, report: dict[str, Any]) -> None:
    with open(out + ".tmp", "w") as f:
        json.dump(report, f)
    os.replace(out + ".tmp", out)


def _replacement_child(how: str, out: str) -> None:
    """Rank 1 of the new group made after the case."""
    report: dict[str, Any] = {"rank": 1}
    try:
        import cupy

        import gpucoll

        cupy.cuda.Device(0).use()
        gpucoll.init_process_group("nccl", store=_store(f"gpu-fault-{how}-after"), rank=1, world_size=2,
                                   device_id=0, timeout=60.0)
        report["after"] = _ones_all_reduced(gpucoll, cupy, 2)
        gpucoll.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001
        report["setup_error"] = f"{type(exc).__name__}: {exc}"
    _write(out, report)


def _start(name: str, *args: Any) -> tuple[subprocess.Popen[bytes], str]:
    """``name(*args, out)`` of this module in a fresh Python process; its report's path."""
    fd, out = tempfile.mkstemp(prefix="gpucoll-gpu-fault-", suffix=".json")
    os.close(fd)
    os.unlink(out)
    here = os.path.dirname(os.path.abspath(__file__))
    code = (f"import sys; sys.path.insert(0, {here!r}); import {__name__.rpartition('.')[2]} as m; "
            f"m.{name}(*{args!r}, {out!r})")
    return subprocess.Popen([sys.executable, "-c", code]), out


def _reap(proc: subprocess.Popen[bytes], out: str, deadline: float) -> dict[str, Any]:
    """The child's report, or what became of it; killed once past ``deadline``."""
    try:
        proc.wait(max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)
        report: dict[str, Any] = {"hung": True}
    else:
        report = {}
    try:
        with open(out) as f:
            report.update(json.load(f))
        os.unlink(out)
    except (OSError, ValueError) as exc:
        report.setdefault("setup_error", f"no report ({type(exc).__name__}: {exc})")
    report["status"] = proc.returncode
    return report


def _harness_rank() -> dict[str, Any]:
    rank = int(os.environ["RANK"])
    out: dict[str, Any] = {}
    for how in ("kill", "stop"):
        proc, path = _start("_case_child", how, rank)
        deadline = time.monotonic() + CASE_DEADLINE
        if rank == 0:
            out[how] = _reap(proc, path, deadline)
            continue
        # The victim's parent: wait for the survivor's report (a stopped victim is killed
        # then), then start rank 1 of the new group.
        store = _store(f"gpu-fault-{how}")
        try:
            store.wait(["survivor/reported"], timeout=CASE_DEADLINE)
        except Exception as exc:  # noqa: BLE001
            out[f"{how}/wait"] = f"{type(exc).__name__}: {exc}"
        if proc.poll() is None:
            proc.kill()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        out[how] = {"victim_status": proc.returncode, "victim_report": _reap(proc, path, time.monotonic())}
        proc2, path2 = _start("_replacement_child", how)
        out[f"{how}/replacement"] = _reap(proc2, path2, time.monotonic() + CASE_DEADLINE)
    return out


@pytest.mark.skipif(_WHY_NOT_TWO is not None, reason=str(_WHY_NOT_TWO))
def test_a_peer_killed_or_stopped_mid_loop_is_a_named_error_in_time_and_a_new_group_works() -> None:
    import re

    survivor, victim_side = run_spmd(_harness_rank, world_size=2, init=False, env=ENV, start_method="spawn",
                                     timeout=2 * 3 * CASE_DEADLINE)
    for how in ("kill", "stop"):
        rep = survivor[how]
        assert "setup_error" not in rep, f"{how}: rank 0: {rep['setup_error']}"
        assert not rep.get("hung"), f"{how}: rank 0 hung (killed after {CASE_DEADLINE} s): {rep}"
        assert rep["warm"], f"{how}: the warm-up all_reduce gave a wrong result"
        assert rep["raised"] is not None, f"{how}: rank 0's loop never failed: {rep}"
        assert rep["dist"], f"{how}: rank 0 raised {rep['raised']}, not a DistBackendError: {rep['msg']}"
        msg = rep["msg"]
        assert re.search(r"all_reduce \(seq \d+\) on group", msg), f"{how}: the error names no op: {msg}"
        assert "rank 0 of 2" in msg, f"{how}: the error names no rank: {msg}"
        assert rep["after_s"] < PG_TIMEOUT + 5, f"{how}: the error came after {rep['after_s']:.1f} s: {msg}"
        assert rep["destroy_s"] < DESTROY_BOUND, f"{how}: destroy took {rep['destroy_s']:.1f} s"
        assert rep["destroy"] == "ok" or re.search(r"ncclCommDestroy did not return within [\d.]+ s",
                                                   rep["destroy"]), f"{how}: destroy: {rep['destroy']}"
        assert rep["after"] is True, f"{how}: the new group's all_reduce gave a wrong result"
        assert victim_side[how]["victim_status"] == -signal.SIGKILL, f"{how}: victim ended {victim_side[how]}"
        repl = victim_side[f"{how}/replacement"]
        assert "setup_error" not in repl and not repl.get("hung"), f"{how}: rank 1 of the new group: {repl}"
        assert repl["after"] is True, f"{how}: the new group's all_reduce gave rank 1 a wrong result"
