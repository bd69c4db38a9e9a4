"""Ungrouped sends and receives on the fake GPU held to NCCL's contract: ``ncclSend`` and
``ncclRecv`` are "blocking for the GPU", and sends and receives that must progress
together have to be one group (nccl.h). Every send here waits for its receive
(``eager_bytes=0``: NCCL promises no buffering).

The GPU run of 2026-11-27 saw two ranks each ``isend`` then ``irecv``, ungrouped, on a
scalable communicator, and the receive completed with its array unwritten. The cause:
gpucoll issued each as its own NCCL call, so both streams held send-then-receive, which
NCCL does not define (on the strict fake: both sends wait forever for their receives,
``test_fake_gpu.py``'s head-to-head rule). The backend now posts them and issues the ops
posted in a row as one group (``gpucoll._backends.nccl.posting``).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from gpucoll._env import NCCL_RANKS_PER_ROOT_ENV, NCCL_SCALABLE_INIT_ENV
from gpucoll.errors import DistBackendError

from _fake_gpu_world import FakeDeviceArray, dev, run_fake_gpu_worlds, run_world
from _nccl_fake import FakeRuntime
from test_nccl_scalable_init import SCALABLE

STRICT = {"eager_bytes": 0, "hang_limit": 6.0}


def _pair_body(w: Any, rt: FakeRuntime, rank: int) -> dict[str, Any]:
    """tests/gpu/test_nccl_gpu_p2p.py's body: the old scalable GPU body's exchange."""
    import gpucoll

    n = gpucoll.get_world_size()
    out: dict[str, Any] = {}
    for round_ in range(3):  # a few rounds: the same arrays again, as a loop would
        got = FakeDeviceArray(rt, np.zeros(5, np.float32))
        works = [gpucoll.isend(FakeDeviceArray(rt, np.full(5, rank + 10.0 + round_, np.float32)), (rank + 1) % n),
                 gpucoll.irecv(got, (rank - 1) % n)]
        for work in works:
            work.wait()
        out[f"round {round_}"] = (got.get().tolist(), [(rank - 1) % n + 10.0 + round_] * 5)
    # The other order on odd ranks, and a blocking pair, as torch scripts write them.
    got = FakeDeviceArray(rt, np.zeros(3, np.float32))
    mine = FakeDeviceArray(rt, np.full(3, 100.0 + rank, np.float32))
    if rank % 2:
        works = [gpucoll.irecv(got, (rank - 1) % n), gpucoll.isend(mine, (rank + 1) % n)]
    else:
        works = [gpucoll.isend(mine, (rank + 1) % n), gpucoll.irecv(got, (rank - 1) % n)]
    for work in works:
        assert work.is_completed() in (True, False)  # issues them; never blocks
    for work in works:
        work.wait()
    out["mixed order"] = (got.get().tolist(), [100.0 + (rank - 1) % n] * 3)
    return out


@pytest.mark.parametrize("scalable", [False, True], ids=["plain", "scalable"])
@pytest.mark.parametrize("size", [2, 3])
def test_an_ungrouped_isend_irecv_exchange_gets_the_peers_values(size: int, scalable: bool,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    kw: dict[str, Any] = {}
    if scalable:
        monkeypatch.setenv(NCCL_SCALABLE_INIT_ENV, "1")
        monkeypatch.setenv(NCCL_RANKS_PER_ROOT_ENV, "1")
        kw["features"] = SCALABLE
    results = run_fake_gpu_worlds(size, _pair_body, monkeypatch, fabric_kw=STRICT, **kw)
    for rank, cells in enumerate(results):
        for name, (got, want) in cells.items():
            assert got == want, f"rank {rank} {name}: got {got}, want {want}"


def test_each_send_issued_alone_is_the_deadlock_nccl_warns_of() -> None:
    """The old issue path, spelt out: each op its own NCCL call, both ranks sending first.
    On the strict fake the sends wait for receives queued behind them (reported as a
    hang); NCCL leaves it undefined. Never a silent result. (8 KiB: above the fake's
    default eager size, which run_world keeps.)"""
    def body(be: Any, rt: FakeRuntime, rank: int) -> bool:
        got = dev(rt, np.zeros(2048, np.float32))
        send = be.send(dev(rt, np.full(2048, 1.0 + rank, np.float32)), 1 - rank, 0)
        be.flush_p2p()
        recv = be.recv(got, 1 - rank, 0)
        be.flush_p2p()
        try:
            recv.synchronize(timeout=2.0)
            send.synchronize(timeout=2.0)
        except DistBackendError:
            return False
        return True
    with pytest.raises(AssertionError, match="rendezvous send"):
        run_world(2, body, hang=1.0, shutdown=False)


def test_a_posted_op_nobody_waits_for_is_issued_by_the_next_op_or_the_watchdog(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 posts a send and then does nothing with the group; rank 1's receive still
    gets the values (the watchdog's tick issues the send). A later op of the group issues
    what was posted before it, in order."""
    def body(w: Any, rt: FakeRuntime, rank: int) -> Any:
        import gpucoll

        x = FakeDeviceArray(rt, np.full(4, 7.0, np.float32))
        if rank == 0:
            work = gpucoll.isend(x, 1)
            time.sleep(1.5)  # several watchdog ticks (the group's 10 s timeout: 0.5 s)
            done = work.is_completed()
            y = FakeDeviceArray(rt, np.full(2, 3.0, np.float32))
            gpucoll.isend(y, 1)
            gpucoll.all_reduce(FakeDeviceArray(rt, np.ones(2, np.float32)))  # issues the posted send first
            return done
        got = FakeDeviceArray(rt, np.zeros(4, np.float32))
        gpucoll.irecv(got, 0).synchronize(timeout=5.0)
        got2 = FakeDeviceArray(rt, np.zeros(2, np.float32))
        work = gpucoll.irecv(got2, 0)
        z = FakeDeviceArray(rt, np.ones(2, np.float32))
        gpucoll.all_reduce(z)
        work.wait()
        return got.get().tolist(), got2.get().tolist(), z.get().tolist()
    done, (got, got2, z) = run_fake_gpu_worlds(2, body, monkeypatch, fabric_kw=STRICT)
    assert done is True and got == [7.0] * 4 and got2 == [3.0] * 2 and z == [2.0, 2.0]


def test_posted_ops_fail_with_the_abort_that_ends_the_backend() -> None:
    def body(be: Any, rt: FakeRuntime, rank: int) -> str:
        work = be.send(dev(rt, np.ones(4, np.float32)), 1 - rank, 0)
        be.abort("planted: a peer died")
        with pytest.raises(DistBackendError, match="planted: a peer died"):
            work.wait()
        return "ok"
    assert run_world(2, body, shutdown=False) == ["ok", "ok"]
