"""Test bodies that run both on a real GPU (tests/gpu, CuPy arrays in spawned ranks)
and on the fake GPU in CI (tests/nccl, fake device arrays on rank threads), with their
checks, so that a test only a GPU runs cannot drift from what the library says.

A body takes ``make(values) -> device array`` and ``read(array) -> list`` and uses the
module-level API (``gpucoll.all_reduce``) on the default group, which the caller has
made (GPUCOLL_DEBUG=DETAIL where the body needs it)."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

__all__ = ["debug_detail_body", "check_debug_detail"]


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
