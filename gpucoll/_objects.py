"""Collectives on Python objects and on raw bytes, always through the CPU backend.

The ``*_object*`` functions (torch's names) pickle objects. **Unpickling data from
another process can run arbitrary code**: use them only between processes you
trust as much as your own (the ranks of one job). Programs that will not
unpickle peer data use the ``*_bytes`` variants, which move ``bytes`` and never
unpickle anything; serialize with JSON, msgpack or NumPy's ``.tobytes()`` instead.

Every call is two CPU collectives (sizes, then data padded to the largest size)
or two messages (size, then data) for send/recv, except all-gather: one
all_gather_single of a fixed :data:`FIRST_BYTES` per rank, each rank's size
followed by the start of its payload, and a second one only for what did not fit
(the common small object moves in one op). Objects never go through a GPU, not
even in an NCCL group.

Size limit: a payload (pickled object list) larger than ``GPUCOLL_MAX_OBJECT_BYTES``
(default :data:`MAX_OBJECT_BYTES`, 2 GiB) is refused on every rank with the same
ValueError after the size exchange and before any data moves, so the group stays
usable. Bytes from peers arrive only over the group's authenticated transport
(docs/security.md); nothing else is ever unpickled.
"""

from __future__ import annotations

import functools
import os
import pickle
from typing import Any, Callable, Sequence, TypeVar

import numpy as np

from . import _world, array as _array
from ._env import MAX_OBJECT_BYTES_ENV
from ._group.options import DeviceLike
from ._group import GroupMember, ProcessGroup
from ._group.coalescing import refuse_inside
from ._backends.base import RunsNow
from .errors import DistError

_F = TypeVar("_F", bound=Callable[..., Any])


def _named(fn: _F) -> _F:
    """A DistError raised inside an object or bytes collective names the call the user
    made (``scatter_object_list``), not only the array collectives it is built from."""
    op = fn.__name__

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except DistError as exc:
            if str(exc).startswith(op):
                raise
            try:
                named = type(exc)(f"{op}: {exc}")
            except Exception:  # an error type that wants other arguments keeps its own text
                raise exc from None
            raise named from exc

    return wrapper  # type: ignore[return-value]

__all__ = [
    "all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list",
    "send_object_list", "recv_object_list",
    "all_gather_bytes", "gather_bytes", "broadcast_bytes", "scatter_bytes", "send_bytes", "recv_bytes",
]


MAX_OBJECT_BYTES = 2 << 30
"""Default limit on one rank's payload in the object and bytes collectives."""


def _limit() -> int:
    raw = os.environ.get(MAX_OBJECT_BYTES_ENV, "").strip()
    if not raw:
        return MAX_OBJECT_BYTES
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"GPUCOLL_MAX_OBJECT_BYTES must be a positive integer; got {raw!r}")
    return int(raw)


def _check_sizes(sizes: Any, what: str, ranks: Sequence[int] | None = None, limit: int | None = None) -> None:
    """Raise the same ValueError on every rank when a payload exceeds the limit.

    ``sizes`` are what every rank learned in the size exchange; a negative entry is a
    sender that found its own payload too large (and sent -size instead of data).
    ``limit``: :func:`_limit`'s value where the caller already read it.
    """
    if limit is None:
        limit = _limit()
    values = sizes.tolist() if isinstance(sizes, np.ndarray) else [int(v) for v in sizes]
    for i, n in enumerate(values):
        if n < 0 or n > limit:
            who = f"rank {ranks[i] if ranks is not None else i}"
            raise ValueError(f"{what}: {who}'s payload of {abs(n)} bytes exceeds the limit of {limit} bytes "
                             "(GPUCOLL_MAX_OBJECT_BYTES); nothing was sent and the group is still usable. "
                             "Send large data as arrays (broadcast, all_gather) instead of objects")


def _announced(payload: bytes, limit: int | None = None) -> int:
    """The size this rank announces: -len when over the limit (every rank then raises)."""
    n = len(payload)
    return -n if n > (_limit() if limit is None else limit) else n


def _pg(group: Any, what: str) -> ProcessGroup:
    pg = _world._resolve(group)
    pg._check_usable()
    refuse_inside(pg, what)
    return pg


def _group_rank(pg: ProcessGroup, rank: int | None, group_rank: int | None, name: str,
                default_global: int | None = None) -> int:
    """The group rank named by ``rank`` (global) or ``group_rank``; with neither given,
    ``default_global`` (a global rank: torch's object collectives default to global rank 0)."""
    from ._collectives import _group_rank as translate

    if rank is None and group_rank is None and default_global is not None:
        rank = default_global
    return translate(pg, rank, group_rank, name)


def _as_bytes(data: Any, name: str) -> bytes:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    raise TypeError(f"{name} must be bytes, bytearray or memoryview; got {type(data).__name__}")


def _padded(data: bytes | memoryview, cap: int) -> np.ndarray:
    out = np.zeros(cap, np.uint8)
    out[:len(data)] = np.frombuffer(data, np.uint8)
    return out


# ----- bytes -----

FIRST_BYTES = 4096
"""Bytes per rank in all-gather's first exchange: an int64 size, then the payload's start."""


def _gather_single(pg: ProcessGroup, out: np.ndarray, inp: np.ndarray) -> None:
    """``pg.all_gather_single(out, inp)`` on host arrays made here, through the CPU backend's
    Work-less path when nothing needs a Work (as a repeated all_reduce)."""
    cpu, issuer = pg._cpu, pg._issuer
    now = getattr(cpu, "all_gather_single_now", None)
    if now is None or pg._coalescing is not None or issuer.hooks or issuer.debug_detail:
        pg.all_gather_single(out, inp)
        return
    o, i = _array.as_buffer(out, writable=True), _array.as_buffer(inp)
    issuer.run_now(cpu, now, cpu.all_gather_single, (o, i), i, "all_gather_single", [out])


class _FirstExchange:
    """One group's arrays for all-gather's first exchange (a row of ``FIRST_BYTES`` out,
    every rank's row in), kept from call to call with the CPU backend's op bound to them
    (their views and the op's signature made once): a repeated small all_gather_object
    allocates nothing and describes nothing again. One call holds them at a time."""

    __slots__ = ("row", "rows", "run", "start", "buffer")

    def __init__(self, pg: ProcessGroup, cpu: RunsNow) -> None:
        self.row = np.zeros(FIRST_BYTES, np.uint8)
        self.rows = np.empty(pg.size() * FIRST_BYTES, np.uint8)
        self.run = cpu.all_gather_runner(self.rows, self.row)
        self.buffer = _array.as_buffer(self.row)
        # The Work path, when the backend cannot run it now (ops queued ahead).
        self.start = functools.partial(pg._cpu.all_gather_single, _array.as_buffer(self.rows, writable=True),
                                       self.buffer)


def _fill(row: np.ndarray, announced: int, payload: bytes, k: int) -> None:
    """Write a first row: the announced size, then ``k`` bytes of the payload (the bytes
    past them may be stale: the sizes delimit every row)."""
    row[:8].view(np.int64)[0] = announced
    if k > 0:
        row[8:8 + k] = np.frombuffer(payload, np.uint8, count=k)


def _first_exchange(pg: ProcessGroup, announced: int, payload: bytes, k: int) -> tuple[list[int], list[bytes]]:
    """All-gather this rank's first row (its announced size, then ``k`` bytes of its
    payload); returns every rank's announced size and the payload bytes its row holds."""
    cpu, issuer = pg._cpu, pg._issuer
    pool = pg._object_scratch
    if pool is None:  # first call: arrays only where the backend has the Work-less path
        pool = pg._object_scratch = [_FirstExchange(pg, cpu)] if isinstance(cpu, RunsNow) else []
    scratch = None
    if pool and pg._coalescing is None and not issuer.hooks and not issuer.debug_detail:
        try:
            scratch = pool.pop()  # atomic: a concurrent call finds the pool empty
        except IndexError:
            scratch = None
    if scratch is None:  # the Work path, or another thread holds the arrays: arrays of this call's own
        first = np.zeros(FIRST_BYTES, np.uint8)
        _fill(first, announced, payload, k)
        out = np.empty(pg.size() * FIRST_BYTES, np.uint8)
        _gather_single(pg, out, first)
        return _rows(out)
    try:
        _fill(scratch.row, announced, payload, k)
        issuer.run_now(cpu, scratch.run, scratch.start, (), scratch.buffer, "all_gather_single", [scratch.rows])
        return _rows(scratch.rows)  # copied out before another call may reuse the arrays
    finally:
        pool.append(scratch)


def _rows(out: np.ndarray) -> tuple[list[int], list[bytes]]:
    """Each rank's announced size, and the payload bytes its first row holds."""
    head = FIRST_BYTES - 8
    sizes: list[int] = out.view(np.int64)[::FIRST_BYTES // 8].tolist()
    return sizes, [out[i * FIRST_BYTES + 8:i * FIRST_BYTES + 8 + max(0, min(n, head))].tobytes()
                   for i, n in enumerate(sizes)]


@_named
def all_gather_bytes(data: bytes, group: ProcessGroup | None = None) -> list[bytes]:
    """Every rank gets every rank's ``data``, in rank order.

    Example:
        >>> gpucoll.all_gather_bytes(f"host {socket.gethostname()}".encode())
        [b'host a', b'host b']
    """
    pg = _pg(group, "all_gather_bytes")
    payload = _as_bytes(data, "data")
    n = pg.size()
    limit = _limit()  # read once per call
    announced = _announced(payload, limit)
    head = FIRST_BYTES - 8  # payload bytes that ride with the size
    k = min(announced, head)  # nothing of a payload over the limit (announced < 0)
    sizes, heads = _first_exchange(pg, announced, payload, k)
    _check_sizes(sizes, "all_gather", pg.global_ranks, limit)
    cap = max(sizes) - head
    if cap <= 0:
        return heads
    rest = np.empty(n * cap, np.uint8)
    _gather_single(pg, rest, _padded(memoryview(payload)[head:], cap))
    return [heads[i] + rest[i * cap:i * cap + max(0, sizes[i] - head)].tobytes() for i in range(n)]


@_named
def gather_bytes(data: bytes, dst: int | None = None, group: ProcessGroup | None = None,
                 group_dst: int | None = None) -> list[bytes] | None:
    """Rank ``dst`` gets every rank's ``data`` (rank order); other ranks get None."""
    pg = _pg(group, "gather_bytes")
    root = _group_rank(pg, dst, group_dst, "dst")
    pg._check_rank(root, "dst")
    payload = _as_bytes(data, "data")
    n = pg.size()
    sizes = np.empty(n, np.int64)
    limit = _limit()  # read once per call
    pg.all_gather_single(sizes, np.array([_announced(payload, limit)], np.int64))  # every rank needs the padding size
    _check_sizes(sizes, "gather", pg.global_ranks, limit)
    cap = int(sizes.max())
    if cap == 0:
        return [b""] * n if pg.rank() == root else None
    outs = [np.empty(cap, np.uint8) for _ in range(n)] if pg.rank() == root else None
    pg.gather(_padded(payload, cap), outs, root)
    if outs is None:
        return None
    return [o[:int(sizes[i])].tobytes() for i, o in enumerate(outs)]


@_named
def broadcast_bytes(data: bytes | None, src: int | None = None, group: ProcessGroup | None = None,
                    group_src: int | None = None) -> bytes:
    """Every rank gets rank ``src``'s ``data`` (ignored, may be None, elsewhere)."""
    pg = _pg(group, "broadcast_bytes")
    root = _group_rank(pg, src, group_src, "src")
    pg._check_rank(root, "src")
    payload = _as_bytes(data, "data") if pg.rank() == root else b""
    size = np.array([_announced(payload)], np.int64)
    pg.broadcast(size, root)
    _check_sizes(size, "broadcast", [pg.global_ranks[root]])
    buf = _padded(payload, int(size[0])) if pg.rank() == root else np.empty(int(size[0]), np.uint8)
    if buf.size:
        pg.broadcast(buf, root)
    return payload if pg.rank() == root else buf.tobytes()


@_named
def scatter_bytes(data_list: Sequence[bytes] | None, src: int | None = None, group: ProcessGroup | None = None,
                  group_src: int | None = None) -> bytes:
    """Rank i gets ``data_list[i]`` of rank ``src`` (``data_list`` is given on ``src`` only)."""
    pg = _pg(group, "scatter_bytes")
    root = _group_rank(pg, src, group_src, "src")
    pg._check_rank(root, "src")
    n = pg.size()
    sizes = np.empty(n, np.int64)
    payloads: list[bytes] = []
    if pg.rank() == root:
        if data_list is None or len(data_list) != n:
            raise ValueError(f"data_list must hold {n} bytes objects on the source rank; got "
                             f"{None if data_list is None else len(data_list)}")
        payloads = [_as_bytes(d, f"data_list[{i}]") for i, d in enumerate(data_list)]
        sizes[:] = [_announced(p) for p in payloads]
    pg.broadcast(sizes, root)
    _check_sizes(sizes, f"scatter from rank {pg.global_ranks[root]}")
    cap = int(sizes.max())
    if cap == 0:
        return b""
    out = np.empty(cap, np.uint8)
    ins = [_padded(p, cap) for p in payloads] if pg.rank() == root else None
    pg.scatter(out, ins, root)
    return out[:int(sizes[pg.rank()])].tobytes()


@_named
def send_bytes(data: bytes, dst: int | None = None, group: ProcessGroup | None = None, tag: int = 0,
               group_dst: int | None = None) -> None:
    """Send ``data`` to rank ``dst`` (two messages: its length, then the bytes)."""
    pg = _pg(group, "send_bytes")
    peer = _group_rank(pg, dst, group_dst, "dst")
    payload = _as_bytes(data, "data")
    pg.send(np.array([_announced(payload)], np.int64), peer, tag, async_op=False)
    _check_sizes([_announced(payload)], "send", [pg.global_ranks[pg.rank()]])
    if payload:
        pg.send(np.frombuffer(payload, np.uint8), peer, tag, async_op=False)


@_named
def recv_bytes(src: int | None = None, group: ProcessGroup | None = None, tag: int = 0,
               group_src: int | None = None) -> tuple[bytes, int]:
    """Receive bytes sent by :func:`send_bytes` from rank ``src`` (None: any rank).

    Returns:
        ``(data, sender's global rank)``, or its group rank when ``group_src`` was used.
    """
    pg = _pg(group, "recv_bytes")
    peer = None if src is None and group_src is None else _group_rank(pg, src, group_src, "src")
    size = np.empty(1, np.int64)
    work = pg.recv(size, peer, tag, async_op=False)
    source = work._source_rank if peer is None else peer
    _check_sizes(size, "recv", [pg.global_ranks[source]])
    data = np.empty(int(size[0]), np.uint8)
    if data.size:
        pg.recv(data, source, tag, async_op=False)
    return data.tobytes(), (source if group_src is not None else pg.global_ranks[source])


# ----- pickled objects (trusted peers only) -----

def _dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _check_list(object_list: Any, name: str, length: int | None = None) -> None:
    if not isinstance(object_list, list):
        raise TypeError(f"{name} must be a list; got {type(object_list).__name__}")
    if length is not None and len(object_list) != length:
        raise ValueError(f"{name} must have {length} entries (one per rank); got {len(object_list)}")


@_named
def all_gather_object(object_list: list[Any], obj: object, group: ProcessGroup | None = None) -> None:
    """Fill ``object_list`` (length = group size) with every rank's ``obj``. Pickles; see the
    module docstring's security note.

    Example:
        >>> out = [None] * gpucoll.get_world_size()
        >>> gpucoll.all_gather_object(out, {"rank": gpucoll.get_rank()})
    """
    if group is GroupMember.NON_GROUP_MEMBER:
        _world.not_in_group("all_gather_object", stacklevel=4)
        return
    pg = _world._resolve(group)
    _check_list(object_list, "object_list", pg.size())
    for i, data in enumerate(all_gather_bytes(_dumps(obj), group=pg)):
        object_list[i] = pickle.loads(data)


@_named
def gather_object(obj: object, object_gather_list: list[Any] | None = None, dst: int | None = None,
                  group: ProcessGroup | None = None, group_dst: int | None = None) -> None:
    """Rank ``dst`` (default: global rank 0, as torch) fills ``object_gather_list``
    (length = group size) with every rank's ``obj``."""
    if group is GroupMember.NON_GROUP_MEMBER:
        _world.not_in_group("gather_object", stacklevel=4)
        return
    pg = _world._resolve(group)
    root = _group_rank(pg, dst, group_dst, "dst", default_global=0)
    if pg.rank() == root:
        _check_list(object_gather_list, "object_gather_list", pg.size())
    datas = gather_bytes(_dumps(obj), group=pg, group_dst=root)
    if datas is not None and object_gather_list is not None:
        for i, data in enumerate(datas):
            object_gather_list[i] = pickle.loads(data)


@_named
def broadcast_object_list(object_list: list[Any], src: int | None = None, group: ProcessGroup | None = None,
                          device: DeviceLike = None, group_src: int | None = None) -> None:
    """Every rank's ``object_list`` gets rank ``src``'s entries (lists must be equally long);
    ``src`` defaults to global rank 0, as in torch.

    ``device`` is accepted for torch compatibility and ignored: objects never use a GPU.
    """
    if group is GroupMember.NON_GROUP_MEMBER:
        _world.not_in_group("broadcast_object_list", stacklevel=4)
        return
    pg = _world._resolve(group)
    _check_list(object_list, "object_list")
    root = _group_rank(pg, src, group_src, "src", default_global=0)
    data = broadcast_bytes(_dumps(list(object_list)) if pg.rank() == root else None, group=pg, group_src=root)
    if pg.rank() != root:
        received = pickle.loads(data)
        if len(received) != len(object_list):
            raise ValueError(f"object_list has {len(object_list)} entries here but {len(received)} on the "
                             f"source rank; they must match")
        object_list[:] = received


@_named
def scatter_object_list(scatter_object_output_list: list[Any], scatter_object_input_list: list[Any] | None = None,
                        src: int | None = None, group: ProcessGroup | None = None,
                        group_src: int | None = None) -> None:
    """Rank i gets ``scatter_object_input_list[i]`` of rank ``src`` (default: global rank 0,
    as torch) in ``scatter_object_output_list[0]``.

    Raises:
        ValueError: ``scatter_object_output_list`` is not a list of at least one entry
            (torch's message), or the input list does not hold one object per rank.
    """
    if group is GroupMember.NON_GROUP_MEMBER:
        _world.not_in_group("scatter_object_list", stacklevel=4)
        return
    pg = _world._resolve(group)
    if not isinstance(scatter_object_output_list, list) or not scatter_object_output_list:
        raise ValueError("Expected argument scatter_object_output_list to be a list of size at least 1; got "
                         f"{scatter_object_output_list!r} (it receives this rank's object in entry 0)")
    root = _group_rank(pg, src, group_src, "src", default_global=0)
    datas = None
    if pg.rank() == root:
        _check_list(scatter_object_input_list, "scatter_object_input_list", pg.size())
        assert scatter_object_input_list is not None
        datas = [_dumps(o) for o in scatter_object_input_list]
    scatter_object_output_list[0] = pickle.loads(scatter_bytes(datas, group=pg, group_src=root))


@_named
def send_object_list(object_list: list[Any], dst: int | None = None, group: ProcessGroup | None = None,
                     device: DeviceLike = None, group_dst: int | None = None) -> None:
    """Send the objects of ``object_list`` to rank ``dst`` (which calls :func:`recv_object_list`)."""
    if group is GroupMember.NON_GROUP_MEMBER:
        _world.not_in_group("send_object_list", stacklevel=4)
        return
    pg = _world._resolve(group)
    _check_list(object_list, "object_list")
    send_bytes(_dumps(list(object_list)), group=pg, group_dst=_group_rank(pg, dst, group_dst, "dst"))


@_named
def recv_object_list(object_list: list[Any], src: int | None = None, group: ProcessGroup | None = None,
                     device: DeviceLike = None, group_src: int | None = None) -> int:
    """Fill ``object_list`` with the objects rank ``src`` (None: any rank) sent.

    Returns:
        The sender's global rank (its group rank when ``group_src`` was used); -1 on a rank
        that is not a member of ``group`` (as torch).

    Raises:
        ValueError: the sender sent a different number of objects than ``object_list`` holds.
    """
    if group is GroupMember.NON_GROUP_MEMBER:
        _world.not_in_group("recv_object_list", stacklevel=4)
        return -1
    pg = _world._resolve(group)
    _check_list(object_list, "object_list")
    peer = None if src is None and group_src is None else _group_rank(pg, src, group_src, "src")
    if peer is None:
        data, source = recv_bytes(group=pg)
    else:
        data, _ = recv_bytes(group=pg, group_src=peer)
        source = peer if group_src is not None else pg.global_ranks[peer]
    received = pickle.loads(data)
    if len(received) != len(object_list):
        raise ValueError(f"object_list has {len(object_list)} entries but the sender sent {len(received)}")
    object_list[:] = received
    return source
