"""Faults and bad input: dead and stuck ranks, cross-rank mismatches, arguments that must raise."""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import numpy as np
import pytest

from gpucoll.testing import run_spmd

PG_TIMEOUT = 3.0


def _teardown_quietly() -> None:
    import gpucoll

    try:
        if gpucoll.is_initialized():
            gpucoll.destroy_process_group()
    except Exception:
        pass  # the group is broken on purpose


def _victim() -> None:
    import gpucoll

    gpucoll.init_process_group("cpu", timeout=PG_TIMEOUT)
    gpucoll.all_reduce(np.ones(4))
    os.kill(os.getpid(), signal.SIGKILL)


def killed_rank_body(victim: int) -> Any:
    import gpucoll

    r = int(os.environ["RANK"])
    if r == victim:
        # This rank's place in the group is taken by a child that dies mid-job, so the
        # harness itself sees every rank finish.
        pid = os.fork()
        if pid == 0:
            try:
                _victim()
            finally:
                os._exit(3)  # only reached if the victim failed to die by SIGKILL
        _, status = os.waitpid(pid, 0)
        return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    gpucoll.init_process_group("cpu", timeout=PG_TIMEOUT)
    x = np.ones(4)
    gpucoll.all_reduce(x)
    assert (x == gpucoll.get_world_size()).all()
    t0 = time.monotonic()
    try:
        gpucoll.all_reduce(np.ones(4))
    except gpucoll.DistError as exc:
        elapsed, msg = time.monotonic() - t0, str(exc)
    else:
        raise AssertionError("all_reduce with a dead peer did not raise")
    try:  # the group stays failed
        gpucoll.all_reduce(np.ones(4))
        again = ""
    except gpucoll.DistError as exc:
        again = str(exc)
    _teardown_quietly()
    return elapsed, msg, again


def test_after_a_peer_death_the_group_stays_failed() -> None:
    """What test_peer_death.py does not check: once an op failed on a dead peer, the next
    op on the group fails too (it never pairs with a later op of a survivor)."""
    out = run_spmd(killed_rank_body, 3, args=(1,), init=False, timeout=90)
    assert out[1] == -signal.SIGKILL
    for r in (0, 2):
        elapsed, msg, again = out[r]
        assert elapsed < PG_TIMEOUT + 5, f"rank {r} took {elapsed:.1f} s"
        assert "all_reduce" in msg and again


def stuck_rank_body(fr_dir: str) -> Any:
    import gpucoll

    r = gpucoll.get_rank()
    gpucoll.all_reduce(np.ones(2))
    if r == 1:
        time.sleep(PG_TIMEOUT + 3)  # alive, but never joins the second all_reduce
        _teardown_quietly()
        return None
    t0 = time.monotonic()
    try:
        gpucoll.all_reduce(np.ones(2))
    except gpucoll.DistBackendError as exc:
        elapsed, msg = time.monotonic() - t0, str(exc)
    else:
        raise AssertionError("all_reduce with a stuck peer did not raise")
    _teardown_quietly()
    dumps = [f for f in os.listdir(fr_dir) if f.startswith(f"default-rank{r}-")]
    entries = json.loads(open(os.path.join(fr_dir, dumps[0])).read())["entries"] if dumps else []
    return elapsed, msg, [(e["seq"], e["op_type"], e["state"]) for e in entries]


def test_a_stuck_rank_times_out_with_a_named_op_and_a_flight_recorder(tmp_path: Any) -> None:
    out = run_spmd(stuck_rank_body, 3, args=(str(tmp_path),), pg_timeout=PG_TIMEOUT, timeout=90,
                   env={"GPUCOLL_FLIGHT_RECORDER_DIR": str(tmp_path)})
    for r in (0, 2):
        elapsed, msg, entries = out[r]
        assert PG_TIMEOUT - 0.5 < elapsed < PG_TIMEOUT + 5
        assert "all_reduce (seq 2) on group 'default'" in msg and "timeout of 3 s" in msg
        assert str(tmp_path) in msg
        assert entries[0] == (1, "all_reduce", "completed") and entries[1][:2] == (2, "all_reduce")
        assert entries[1][2] in ("scheduled", "failed")


def mismatch_body() -> list[str]:
    import gpucoll

    r = gpucoll.get_rank()
    errors = []
    cases = [
        ("shape", lambda: gpucoll.all_reduce(np.ones(4 + 4 * r, np.float32), group=g)),
        ("dtype", lambda: gpucoll.all_reduce(np.ones(4, np.float32 if r else np.int32), group=g)),
        ("op", lambda: gpucoll.all_reduce(np.ones(4), op=gpucoll.ReduceOp.MAX if r else gpucoll.ReduceOp.SUM,
                                          group=g)),
    ]
    for what, call in cases:
        g = gpucoll.new_group()  # a mismatch breaks a group: a fresh one per case
        try:
            call()
        except gpucoll.DistBackendError as exc:
            errors.append(what)
            assert "differ" in str(exc) or "mismatch" in str(exc).lower(), str(exc)
    x = np.ones(1)
    gpucoll.all_reduce(x)  # the default group was not involved and still works
    assert x[0] == gpucoll.get_world_size()
    return errors


def test_cross_rank_mismatches_raise() -> None:
    assert run_spmd(mismatch_body, 2, timeout=90) == [["shape", "dtype", "op"]] * 2


def bad_input_body() -> str:
    import gpucoll

    r, n = gpucoll.get_rank(), gpucoll.get_world_size()  # n == 3
    x = np.ones(6, np.float32)

    def raises(exc: type[BaseException], match: str, fn: Any, *args: Any, **kwargs: Any) -> None:
        with pytest.raises(exc, match=match):
            fn(*args, **kwargs)

    raises(ValueError, r"src=3 is not a member", gpucoll.broadcast, x, src=3)
    raises(ValueError, r"group_src=-1 is out of range", gpucoll.broadcast, x, group_src=-1)
    raises(ValueError, r"src is required", gpucoll.broadcast, x)
    raises(ValueError, r"dst=7 is not a member", gpucoll.reduce, x, dst=7)
    raises(ValueError, r"group_dst=.* is this rank itself", gpucoll.send, x, dst=r)
    raises(ValueError, r"output_split_sizes must be 3 non-negative ints", gpucoll.all_to_all_single,
           np.empty(6, np.float32), x, output_split_sizes=[3, 3])
    raises(ValueError, r"input_split_sizes must be 3 non-negative ints", gpucoll.all_to_all_single,
           np.empty(6, np.float32), x, input_split_sizes=[7, -1, 0])
    raises(ValueError, r"input_split_sizes=\[1, 1, 1\] sums to 3 but input has 6 rows", gpucoll.all_to_all_single,
           np.empty(6, np.float32), x, input_split_sizes=[1, 1, 1])
    raises(ValueError, r"not divisible by the group size 3", gpucoll.all_to_all_single,
           np.empty(4, np.float32), np.ones(4, np.float32))
    raises(ValueError, r"tensor_list must have 3 arrays", gpucoll.all_gather, [np.empty(6, np.float32)] * 2, x)
    raises(ValueError, r"tensor_list\[1\] has shape \(5,\)", gpucoll.all_gather,
           [np.empty(6, np.float32), np.empty(5, np.float32), np.empty(6, np.float32)], x)
    raises(ValueError, r"tensor_list\[0\] has dtype float64", gpucoll.all_gather, [np.empty(6)] * 3, x)
    raises(ValueError, r"output_tensor .* must hold exactly group size x input_tensor = 3 x 6",
           gpucoll.all_gather_single, np.empty(12, np.float32), x)
    raises(ValueError, r"input .* must hold exactly group size x output", gpucoll.reduce_scatter_single,
           np.empty(2, np.float32), x[:5].copy())
    if r == 0:
        raises(ValueError, r"gather_list is required on the destination", gpucoll.gather, x, dst=0)
        raises(ValueError, r"scatter_list is required on the source", gpucoll.scatter, x, src=0)
    else:
        raises(ValueError, r"gather_list must not be given", gpucoll.gather, x, [x, x, x], dst=0)
    ro = np.ones(6, np.float32)
    ro.flags.writeable = False
    raises(ValueError, r"tensor is read-only.*functional", gpucoll.all_reduce, ro)
    raises(ValueError, r"C-contiguous", gpucoll.all_reduce, np.ones(12, np.float32)[::2])
    raises(TypeError, r"op=BAND needs integer or bool", gpucoll.all_reduce, x, op=gpucoll.ReduceOp.BAND)
    raises(TypeError, r"op=MAX is undefined for complex", gpucoll.all_reduce, np.ones(2, np.complex64),
           op=gpucoll.ReduceOp.MAX)
    raises(ValueError, r"PREMUL_SUM needs a factor", gpucoll.all_reduce, x, op=gpucoll.ReduceOp.PREMUL_SUM)
    raises(ValueError, r"op must be a ReduceOp", gpucoll.all_reduce, x, op="mean")
    raises(TypeError, r"tensor must be an array", gpucoll.all_reduce, [1.0, 2.0])
    raises(TypeError, r"group must be a ProcessGroup", gpucoll.all_reduce, x, group="world")
    raises(ValueError, r"op must be gpucoll.isend or gpucoll.irecv", gpucoll.P2POp, print, x, 0)
    raises(ValueError, r"non-empty list of P2POp", gpucoll.batch_isend_irecv, [])
    # none of that desynchronised the ranks
    gpucoll.all_reduce(x)
    assert (x == n).all()
    gpucoll.monitored_barrier(timeout=10)
    # rank 2 skips this one: the others learn who is missing
    if r == 2:
        time.sleep(2.5)
        return "skipped"
    try:
        gpucoll.monitored_barrier(timeout=1.0, wait_all_ranks=True)
    except gpucoll.DistBackendError as exc:
        return str(exc)
    return "no error"


def test_bad_input_raises_naming_the_argument() -> None:
    out = run_spmd(bad_input_body, 3, timeout=90)
    assert out[2] == "skipped"
    for msg in out[:2]:
        assert "monitored_barrier" in msg and "did not arrive" in msg and "[2]" in msg
