"""Test bodies that run both on a real GPU (tests/gpu, CuPy arrays in spawned ranks)
and on the fake GPU in CI (tests/nccl, fake device arrays on rank threads), with their
checks, so that a test only a GPU runs cannot drift from what the library says.

A body takes ``make(values) -> device array`` and ``read(array) -> list`` and uses the
module-level API (``gpucoll.all_reduce``) on the default group, which the caller has
made (GPUCOLL_DEBUG=DETAIL where the body needs it)."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

__all__ = ["debug_detail_body", "check_debug_detail", "scalable_ops_body", "check_scalable_ops"]


def debug_detail_body(rank: int, make: Callable[[np.ndarray], Any], read: Callable[[Any], list[float]]) -> dict[str, Any]:
    """GPUCOLL_DEBUG=DETAIL: an all_reduce whose shapes differ (4 and 8 elements on
    ranks 0 and 1) is refused on every rank before NCCL sees it; the group works after."""
    import gpucoll

    out: dict[str, Any] = {}
    x = make(np.ones(4 * (rank + 1), np.float32))
    try:
        gpucoll.all_reduce(x)  # different sizes: without the check NCCL would misbehave
        out["mismatch"] = "not caught"
    except gpucoll.DistBackendError as exc:
        out["mismatch"] = str(exc)
    y = make(np.full(3, rank + 1, np.float32))
    gpucoll.all_reduce(y)
    out["after"] = read(y)
    return out


def check_debug_detail(out: dict[str, Any]) -> None:
    """The DETAIL message as docs/process-groups.md shows it (the fields of every rank,
    worded by gpucoll._backends.mismatch for every backend), on two ranks."""
    msg = out["mismatch"]
    assert "GPUCOLL_DEBUG=DETAIL" in msg and "group 'default' (default_pg)" in msg, out
    assert "they differ in shape (rank 0: (4,), rank 1: (8,))" in msg, out
    assert "rank 0: op=all_reduce seq=1 dtype=float32 shape=(4,) reduce op=SUM" in msg, out
    assert "rank 1: op=all_reduce seq=1 dtype=float32 shape=(8,) reduce op=SUM" in msg, out
    assert out["after"] == [3.0] * 3, out


def scalable_ops_body(rank: int, size: int, make: Callable[[np.ndarray], Any],
                      read: Callable[[Any], list[Any]]) -> dict[str, Any]:
    """Each kind of op the plan steps issue, on the default group (made from several
    roots by the caller: GPUCOLL_NCCL_SCALABLE_INIT=1, GPUCOLL_NCCL_RANKS_PER_ROOT=1):
    {name: (got, want)}."""
    import gpucoll

    r, n = rank, size
    out: dict[str, Any] = {}
    x = make(np.arange(6, dtype=np.float32) + r)
    gpucoll.all_reduce(x)
    out["all_reduce"] = (read(x), (np.arange(6) * n + sum(range(n))).tolist())
    y = make(np.full(4, r + 1, dtype=np.int32))
    gpucoll.broadcast(y, src=n - 1)
    out["broadcast"] = (read(y), [n] * 4)
    outs = [make(np.zeros(3, dtype=np.float64)) for _ in range(n)]
    gpucoll.all_gather(outs, make(np.full(3, float(r), dtype=np.float64)))
    out["all_gather"] = ([read(o) for o in outs], [[float(i)] * 3 for i in range(n)])
    z = make(np.full(2, r + 1.0, dtype=np.float32))
    gpucoll.reduce(z, dst=0)
    if r == 0:
        out["reduce"] = (read(z), [float(sum(range(1, n + 1)))] * 2)
    if n > 1:
        # One group (batch_isend_irecv): each rank's receive needs its peer's send, and
        # NCCL's ncclSend/ncclRecv "is blocking for the GPU. If multiple ncclSend() and
        # ncclRecv() operations need to progress concurrently to complete, they must be
        # fused within a ncclGroupStart()/ncclGroupEnd() section" (nccl.h's docs): an
        # isend then an irecv on every rank may wait forever.
        got = make(np.zeros(5, dtype=np.float32))
        works = gpucoll.batch_isend_irecv([
            gpucoll.P2POp(gpucoll.isend, make(np.full(5, r + 10.0, dtype=np.float32)), (r + 1) % n),
            gpucoll.P2POp(gpucoll.irecv, got, (r - 1) % n)])
        for w in works:
            w.wait()
        out["send_recv"] = (read(got), [(r - 1) % n + 10.0] * 5)
    return out


def check_scalable_ops(results: list[dict[str, Any]]) -> None:
    for rank, cells in enumerate(results):
        assert cells.pop("comm") == "RawComm", f"rank {rank} did not take the scalable path"
        for name, (got, want) in cells.items():
            assert got == want, f"rank {rank} {name}: got {got}, want {want}"
