"""Point-to-point messages of the CPU backend: a batch of sends and receives over the TCP mesh."""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol, Sequence

from ..._buffer import Buffer
from ...errors import DistBackendError, DistError
from ..._work import Work
from .reduce import as_bytes
from .tcp import KIND_P2P, Recv, TcpMesh

__all__ = ["P2PIssuer", "run_batch"]


class P2PIssuer(Protocol):
    """What a batch needs of the backend that issues it (the CPU backend, which imports
    this module): its rank and group, a numbered Work, and whether it may run ops."""

    rank: int
    group_name: str
    _error: DistBackendError | None  # set once the backend is aborted
    _closed: bool  # set once it is shut down

    def _work(self, op_type: str, keep: Sequence[Any], *, p2p: bool = False) -> Work: ...


def run_batch(be: P2PIssuer, mesh: TcpMesh, ops: Sequence[tuple[str, Buffer, Any, int]], op_type: str) -> Work:
    """``be.batch_p2p``: post every receive, then send everything; one Work completes when
    all are done (or fails with the first error)."""
    for kind, _, peer, _ in ops:
        if kind not in ("send", "recv"):
            raise ValueError(f"p2p op kind must be 'send' or 'recv'; got {kind!r}")
        if peer == be.rank:
            raise ValueError(f"cannot {kind} to/from this rank itself (rank {be.rank})")
    work = be._work(op_type, [b for _, b, _, _ in ops], p2p=True)
    name = f"{op_type} (p2p seq {work.seq}) on group {be.group_name!r}"
    recvs = [(b, peer, tag) for kind, b, peer, tag in ops if kind == "recv"]
    pending = [len(recvs) + 1]  # +1: the sends
    lock = threading.Lock()
    t0 = time.perf_counter()
    source: list[int | None] = [None]

    def one_done(err: BaseException | None, src: int | None) -> None:
        with lock:
            if src is not None:
                source[0] = src
            pending[0] -= 1
            last = pending[0] == 0
        if err is not None:
            work._set_exception(DistBackendError(f"{name} failed: {err}"))
        elif last:
            work._set_result(active_duration=time.perf_counter() - t0, source_rank=source[0])

    if be._error is not None or be._closed:
        one_done(be._error or DistBackendError("the CPU backend was shut down"), None)
        return work
    for b, peer, tag in recvs:
        mesh.post(Recv(peer, KIND_P2P, tag, as_bytes(b), None,
                        on_done=lambda r: one_done(r.error, r.source)))
    err: BaseException | None = None
    try:
        for kind, b, peer, tag in ops:
            if kind == "send":
                mesh.send(peer, KIND_P2P, tag, as_bytes(b))
    except DistError as exc:
        err = exc
    one_done(err, None)
    return work
