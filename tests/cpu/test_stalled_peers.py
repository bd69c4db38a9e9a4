"""A peer that stops (SIGSTOP) while the others wait on it: every waiting rank's timeout
names the stopped rank, whatever the op (point to point included) and however the
waiting rank waits (spinning, yielding or sleeping on the shared-memory flag)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import numpy as np

from gpucoll.testing import run_spmd

PG_TIMEOUT = 2.0
MiB = 1 << 20


def stopped_peer_body(victim: int) -> Any:
    import gpucoll

    r, n = gpucoll.get_rank(), gpucoll.get_world_size()
    pids: list[Any] = [None] * n
    gpucoll.all_gather_object(pids, os.getpid())
    ops = ("recv", "send", "all_reduce", "barrier", "all_gather_object")
    groups = {what: gpucoll.new_group(list(range(n)), timeout=PG_TIMEOUT) for what in ops}
    gpucoll.barrier()
    if r == victim:
        os.kill(os.getpid(), signal.SIGSTOP)
        return None  # resumed by rank 0 once every survivor is done; its groups are broken by then
    time.sleep(0.3)  # the victim is stopped
    msgs = []
    for what in ops:
        g = groups[what]
        t0 = time.monotonic()
        try:
            if what == "recv":
                gpucoll.recv(np.ones(1024), src=victim, group=g)
            elif what == "send":  # more than the socket buffers hold: the sender waits for the reader
                gpucoll.send(np.ones(16 * MiB // 8), dst=victim, group=g)
            elif what == "all_reduce":
                gpucoll.all_reduce(np.ones(8), group=g)
            elif what == "barrier":
                gpucoll.barrier(group=g)
            else:
                gpucoll.all_gather_object([None] * n, {"rank": r}, group=g)
        except gpucoll.DistError as exc:
            msgs.append((what, time.monotonic() - t0, str(exc)))
        else:
            msgs.append((what, time.monotonic() - t0, "returned"))
    if r == 0:
        time.sleep(0.5)
        os.kill(pids[victim], signal.SIGCONT)
    return msgs


def test_every_timeout_names_the_stopped_rank_and_its_own_op() -> None:
    """4 ranks on shared memory, rank 3 stopped: ranks 0-2 each time out in every op, and
    the group's message (the part before what the backend reported) names rank 3."""
    res = run_spmd(stopped_peer_body, 4, args=(3,), pg_timeout=PG_TIMEOUT, timeout=120)
    for r in range(3):
        seen = [m[0] for m in res[r]]
        assert seen == ["recv", "send", "all_reduce", "barrier", "all_gather_object"], (r, res[r])
        for what, elapsed, msg in res[r]:
            assert msg != "returned", (r, what)
            head = msg.split("The backend reported")[0]
            assert "rank 3" in head and "still waiting for" in head, (r, what, msg)
            assert f"rank {r} of 4" in head, (r, what, msg)
            assert elapsed < PG_TIMEOUT + 4.0, (r, what, elapsed)
