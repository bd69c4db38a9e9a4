"""Module-level collectives with torch.distributed's names and argument order.

Arrays are updated in place (``all_reduce(x)`` leaves the sum in ``x``); for
immutable arrays (JAX) use :mod:`gpucoll.functional`. ``src``/``dst``/``peer`` are
*global* ranks, as in torch; ``group_src``/``group_dst``/``group_peer`` give a
rank inside ``group`` instead. ``async_op=True`` returns a :class:`~gpucoll._work.Work`;
otherwise the call returns once the op is complete (host arrays) or ordered on the
caller's stream (device arrays).

As in torch, a rank that passes a group it is not a member of
(``GroupMember.NON_GROUP_MEMBER``) gets a warning naming the op and the call returns
None (``recv``: -1) without doing anything; ``GPUCOLL_NON_MEMBER=error`` (or
``GPUCOLL_DEBUG=DETAIL``) makes it a RuntimeError instead. The arrays of an output
list (``all_gather``, ``gather``, ``all_to_all``, ``all_gather_coalesced``) may be
non-contiguous views, as torch allows: the op fills contiguous stand-ins and copies
them into the views when it completes (for ``async_op=True``, before its Work is seen
complete).
"""

from __future__ import annotations

import contextlib
import operator
from datetime import timedelta
from typing import Any, Callable, Iterator, Sequence

from numpy import ndarray as _np_ndarray

from . import _world
from . import array as _array
from ._group import CoalescingManager, GroupMember, ProcessGroup
from ._group import coalescing as _coalescing
from ._reduce_op import ReduceOp, ReduceOpLike
from ._work import Work
from ._group.views import contiguous_input, with_views
from .array import ArrayLike, NotContiguousError

__all__ = [
    "all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather", "all_gather_single",
    "all_gather_into_tensor", "all_gather_coalesced", "gather", "scatter", "reduce_scatter",
    "reduce_scatter_single", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "send", "recv",
    "isend", "irecv", "P2POp", "batch_isend_irecv", "barrier", "monitored_barrier", "coalescing",
    "CoalescingManager",
]


_NON_MEMBER = GroupMember.NON_GROUP_MEMBER
_not_in_group = _world.not_in_group


def _pg(group: Any) -> ProcessGroup:
    if group is None:
        world = _world._WORLD
        if world is not None:
            return world.default
    return _world._resolve(group)


def _group_rank(pg: ProcessGroup, rank: int | None, group_rank: int | None, name: str,
                default: int | None = None) -> int:
    """The group rank named by ``name`` (a global rank) or ``group_<name>`` (a group rank);
    ``default`` (a group rank) when neither is given, else that is an error."""
    if group_rank is not None:
        if rank is not None:
            raise ValueError(f"pass either {name} (a global rank) or group_{name} (a group rank), not both; "
                             f"got {name}={rank}, group_{name}={group_rank}")
        return _int_rank(group_rank, f"group_{name}")
    if rank is None:
        if default is not None:
            return default
        raise ValueError(f"{name} is required (a global rank), or group_{name} (a rank in the group)")
    return pg.get_group_rank(_int_rank(rank, name), name)


def _int_rank(value: Any, name: str) -> int:
    # bool is an int subclass and 1.0 == 1 hashes like 1: both would pass a lookup silently.
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"{name} must be an int (a rank); got {type(value).__name__} {value!r}")


# ----- reductions -----

def all_reduce(tensor: ArrayLike, op: ReduceOpLike = ReduceOp.SUM, group: ProcessGroup | None = None,
               async_op: bool = False) -> Work | None:
    """Reduce ``tensor`` over all ranks of ``group``; every rank gets the result in place.

    Args:
        tensor: the array to reduce (writable, C-contiguous).
        op: a :class:`ReduceOp` or :func:`make_premul_sum` (bitwise ops need int/bool).
        group: the group (default group when None).
        async_op: return a Work instead of waiting.

    Returns:
        A Work if ``async_op``, else None.

    Raises:
        ValueError/TypeError: bad array or op for the dtype.
        DistBackendError: the op failed or timed out (a peer died, ...).

    Example:
        >>> x = np.full(4, gpucoll.get_rank(), np.float32)
        >>> gpucoll.all_reduce(x, op=gpucoll.ReduceOp.MAX)   # x == world_size - 1
    """
    world = _world._WORLD  # the default group without a call: this is the hottest entry point
    if group is None and world is not None:
        pg = world.default
        if type(tensor) is _np_ndarray:
            if not async_op and type(op) is ReduceOp:
                # ProcessGroup.all_reduce's test of the NumPy kind it ran last (Issuer.host_last,
                # None while the general path is needed), made here to spare that frame.
                fast = (issuer := pg._issuer).host_last
                if fast is not None and fast.dtype is tensor.dtype and fast.op is op and fast.shape == tensor.shape \
                        and tensor.flags.carray:
                    return issuer.run_host(fast, tensor if fast.one_dim else tensor.reshape(-1), tensor)
        elif type(tensor) is _array._cupy_ndarray:
            # ProcessGroup.all_reduce's identity look-up of a CuPy array it ran before
            # (_group/device_run.py), made here to spare that frame: the same test on
            # the same dicts, empty while the general path is needed (ProcessGroup._restate).
            cp: Any = tensor
            seen = pg._device_seen.get(id(cp))
            if seen is not None and seen[0]() is cp and op is seen[1] and cp._c_contiguous:
                return pg._issuer.run_device(seen[2], cp, async_op)
        return pg.all_reduce(tensor, op, async_op)
    if group is _NON_MEMBER:
        return _not_in_group("all_reduce")
    return _pg(group).all_reduce(tensor, op, async_op)


def all_reduce_coalesced(tensors: Sequence[ArrayLike], op: ReduceOpLike = ReduceOp.SUM, group: ProcessGroup | None = None,
                         async_op: bool = False) -> Work | None:
    """All-reduce every array of ``tensors`` in one op (one Work)."""
    if group is _NON_MEMBER:
        return _not_in_group("all_reduce_coalesced")
    return _pg(group).all_reduce_coalesced(tensors, op, async_op)


def reduce(tensor: ArrayLike, dst: int | None = None, op: ReduceOpLike = ReduceOp.SUM, group: ProcessGroup | None = None,
           async_op: bool = False, group_dst: int | None = None) -> Work | None:
    """Reduce ``tensor`` over the group into rank ``dst``'s array (other ranks' arrays are
    left as the backend leaves them: unspecified, as in torch)."""
    if group is _NON_MEMBER:
        return _not_in_group("reduce")
    pg = _pg(group)
    return pg.reduce(tensor, _group_rank(pg, dst, group_dst, "dst"), op, async_op)


def reduce_scatter(output: ArrayLike, input_list: Sequence[ArrayLike], op: ReduceOpLike = ReduceOp.SUM,
                   group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Rank i receives the reduction over ranks of their ``input_list[i]`` in ``output``."""
    if group is _NON_MEMBER:
        return _not_in_group("reduce_scatter")
    pg = _pg(group)
    return with_views(lambda _, ins: pg.reduce_scatter(output, ins, op, async_op), None, input_list, "", async_op)


def reduce_scatter_single(output: ArrayLike, input: ArrayLike, op: ReduceOpLike = ReduceOp.SUM, group: ProcessGroup | None = None,
                          async_op: bool = False) -> Work | None:
    """``input`` holds ``size`` equal consecutive chunks; rank i gets chunk i reduced over ranks.

    ``output`` must have exactly ``input.size // group size`` elements (any shape).
    """
    if group is _NON_MEMBER:
        return _not_in_group("reduce_scatter_single")
    return _pg(group).reduce_scatter_single(output, input, op, async_op)


reduce_scatter_tensor = reduce_scatter_single
"""torch's older name for :func:`reduce_scatter_single`."""


# ----- data movement -----

def broadcast(tensor: ArrayLike, src: int | None = None, group: ProcessGroup | None = None, async_op: bool = False,
              group_src: int | None = None) -> Work | None:
    """Copy rank ``src``'s ``tensor`` into every other rank's ``tensor``."""
    if group is _NON_MEMBER:
        return _not_in_group("broadcast")
    pg = _pg(group)
    return pg.broadcast(tensor, _group_rank(pg, src, group_src, "src"), async_op)


def all_gather(tensor_list: Sequence[ArrayLike], tensor: ArrayLike, group: ProcessGroup | None = None,
               async_op: bool = False) -> Work | None:
    """``tensor_list[i]`` receives rank i's ``tensor`` on every rank (same shape and dtype).
    ``tensor`` and the arrays of ``tensor_list`` may be non-contiguous, as in torch."""
    if group is _NON_MEMBER:
        return _not_in_group("all_gather")
    pg, inp = _pg(group), contiguous_input(tensor)
    return with_views(lambda outs, _: pg.all_gather(outs, inp, async_op), tensor_list, None, "tensor_list", async_op)


def all_gather_single(output_tensor: ArrayLike, input_tensor: ArrayLike, group: ProcessGroup | None = None,
                      async_op: bool = False) -> Work | None:
    """Gather every rank's ``input_tensor`` into ``output_tensor`` as ``size`` consecutive chunks.

    ``output_tensor`` must hold exactly ``size * input_tensor.size`` elements, e.g. shape
    ``(size * n, ...)`` or ``(size, n, ...)``.

    Example:
        >>> out = np.empty(world * 4, np.float32)
        >>> gpucoll.all_gather_single(out, np.full(4, rank, np.float32))
    """
    if group is _NON_MEMBER:
        return _not_in_group("all_gather_single")
    return _pg(group).all_gather_single(output_tensor, input_tensor, async_op)


all_gather_into_tensor = all_gather_single
"""torch's older name for :func:`all_gather_single`."""


def all_gather_coalesced(output_tensor_lists: Sequence[Sequence[ArrayLike]], input_tensor_list: Sequence[ArrayLike],
                         group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Several all_gathers in one op: ``output_tensor_lists[r][k]`` gets rank r's ``input_tensor_list[k]``
    (torch's layout: one list per rank, each with one array per input; shapes may differ per input)."""
    if group is _NON_MEMBER:
        return _not_in_group("all_gather_coalesced")
    pg = _pg(group)
    return with_views(lambda outs, ins: pg.all_gather_coalesced(outs, ins, async_op), output_tensor_lists,
                       input_tensor_list, "output_tensor_lists", async_op, rows=True)


def gather(tensor: ArrayLike, gather_list: Sequence[ArrayLike] | None = None, dst: int | None = None,
           group: ProcessGroup | None = None, async_op: bool = False,
           group_dst: int | None = None) -> Work | None:
    """Rank ``dst`` (default: the group's rank 0, as torch) receives every rank's ``tensor`` in
    ``gather_list`` (given on ``dst`` only). ``tensor`` and the arrays of ``gather_list`` may
    be non-contiguous, as in torch."""
    if group is _NON_MEMBER:
        return _not_in_group("gather")
    pg = _pg(group)
    root = _group_rank(pg, dst, group_dst, "dst", default=0)
    inp = contiguous_input(tensor)
    return with_views(lambda outs, _: pg.gather(inp, outs, root, async_op), gather_list, None, "gather_list", async_op)


def scatter(tensor: ArrayLike, scatter_list: Sequence[ArrayLike] | None = None, src: int | None = None,
            group: ProcessGroup | None = None, async_op: bool = False,
            group_src: int | None = None) -> Work | None:
    """Rank i receives ``scatter_list[i]`` of rank ``src`` (default: the group's rank 0, as torch;
    ``scatter_list`` given on ``src`` only) in ``tensor``."""
    if group is _NON_MEMBER:
        return _not_in_group("scatter")
    pg = _pg(group)
    root = _group_rank(pg, src, group_src, "src", default=0)
    return with_views(lambda _, ins: pg.scatter(tensor, ins, root, async_op), None, scatter_list, "", async_op)


def all_to_all(output_tensor_list: Sequence[ArrayLike], input_tensor_list: Sequence[ArrayLike],
               group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Rank i's ``input_tensor_list[j]`` lands in rank j's ``output_tensor_list[i]`` (the
    arrays of both lists may be non-contiguous, as in torch)."""
    if group is _NON_MEMBER:
        return _not_in_group("all_to_all")
    pg = _pg(group)
    return with_views(lambda outs, ins: pg.all_to_all(outs, ins, async_op), output_tensor_list, input_tensor_list,
                       "output_tensor_list", async_op)


def all_to_all_single(output: ArrayLike, input: ArrayLike, output_split_sizes: Sequence[int] | None = None,
                      input_split_sizes: Sequence[int] | None = None, group: ProcessGroup | None = None,
                      async_op: bool = False) -> Work | None:
    """Split ``input`` along dim 0 and send piece j to rank j; ``output`` concatenates what
    arrives, in rank order.

    Args:
        output_split_sizes: rows received from each rank (default: equal split).
        input_split_sizes: rows sent to each rank (default: equal split).

    Raises:
        ValueError: split sizes of the wrong length, negative, or not summing to dim 0;
            a non-contiguous ``input`` or ``output`` ("Tensors must be contiguous", as gloo).
    """
    if group is _NON_MEMBER:
        return _not_in_group("all_to_all_single")
    try:
        return _pg(group).all_to_all_single(output, input, output_split_sizes, input_split_sizes, async_op)
    except NotContiguousError as exc:
        raise NotContiguousError(f"Tensors must be contiguous: {exc}") from None


# ----- point to point -----

def send(tensor: ArrayLike, dst: int | None = None, group: ProcessGroup | None = None, tag: int = 0,
         group_dst: int | None = None) -> None:
    """Send ``tensor`` to rank ``dst`` and wait until it is sent."""
    if group is _NON_MEMBER:
        return _not_in_group("send")
    pg = _pg(group)
    pg.send(tensor, _group_rank(pg, dst, group_dst, "dst"), tag, async_op=False)


def recv(tensor: ArrayLike, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0,
         group_src: int | None = None) -> int:
    """Receive into ``tensor`` from rank ``src`` (None: from any rank).

    Returns:
        The sender's global rank (as torch), or its group rank when ``group_src`` was used;
        -1 on a rank that is not a member of ``group`` (as torch).
    """
    if group is _NON_MEMBER:
        _not_in_group("recv")
        return -1
    pg = _pg(group)
    peer = None if src is None and group_src is None else _group_rank(pg, src, group_src, "src")
    work = pg.recv(tensor, peer, tag, async_op=False)
    source = work._source_rank if peer is None else peer
    return source if group_src is not None else pg.global_ranks[source]


def isend(tensor: ArrayLike, dst: int | None = None, group: ProcessGroup | None = None, tag: int = 0,
          group_dst: int | None = None) -> Work | None:
    """Start sending ``tensor`` to rank ``dst``; do not touch ``tensor`` until the Work completes."""
    if group is _NON_MEMBER:
        return _not_in_group("isend")
    pg = _pg(group)
    return pg.send(tensor, _group_rank(pg, dst, group_dst, "dst"), tag)


def irecv(tensor: ArrayLike, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0,
          group_src: int | None = None) -> Work | None:
    """Start receiving into ``tensor`` from rank ``src`` (None: any rank; then
    ``work.source_rank()`` gives the sender's group rank)."""
    if group is _NON_MEMBER:
        return _not_in_group("irecv")
    pg = _pg(group)
    peer = None if src is None and group_src is None else _group_rank(pg, src, group_src, "src")
    return pg.recv(tensor, peer, tag)


class P2POp:
    """One send or receive for :func:`batch_isend_irecv`.

    Args:
        op: :func:`isend` or :func:`irecv` (or the strings ``"isend"``/``"irecv"``).
        tensor: the array to send or receive into.
        peer: the other side's global rank (or ``group_peer``).
        group: the group (default group when None).
        tag: message tag.
        group_peer: the other side's rank in ``group``.
    """

    def __init__(self, op: Callable[..., Any] | str, tensor: ArrayLike, peer: int | None = None,
                 group: ProcessGroup | None = None, tag: int = 0, group_peer: int | None = None) -> None:
        kinds = {isend: "send", irecv: "recv", "isend": "send", "irecv": "recv", send: "send", recv: "recv"}
        try:
            self.kind = kinds[op]
        except (KeyError, TypeError):
            raise ValueError(f"op must be gpucoll.isend or gpucoll.irecv; got {op!r}") from None
        self.op = op
        self.tensor = tensor
        self.group = _pg(group)
        self.tag = tag
        self.group_peer = _group_rank(self.group, peer, group_peer, "peer")
        self.peer = self.group.get_global_rank(self.group_peer, "group_peer")

    def __repr__(self) -> str:
        return f"P2POp({self.kind}, peer={self.peer}, tag={self.tag}, group={self.group.group_name!r})"


def batch_isend_irecv(p2p_op_list: Sequence[P2POp]) -> list[Work]:
    """Post all sends and receives together (one NCCL group call on devices).

    All ops must use the same group. Returns one Work per op; they are the same
    batch Work, which completes when every op has.

    Example:
        >>> right, left = (rank + 1) % world, (rank - 1) % world
        >>> works = gpucoll.batch_isend_irecv([gpucoll.P2POp(gpucoll.isend, x, right),
        ...                                    gpucoll.P2POp(gpucoll.irecv, y, left)])
        >>> for w in works: w.wait()
    """
    if not p2p_op_list or not all(isinstance(p, P2POp) for p in p2p_op_list):
        raise ValueError("p2p_op_list must be a non-empty list of P2POp")
    pg = p2p_op_list[0].group
    if any(p.group is not pg for p in p2p_op_list):
        raise ValueError("every P2POp of one batch_isend_irecv must use the same group")
    work = pg.batch_p2p([(p.kind, p.tensor, p.group_peer, p.tag) for p in p2p_op_list])
    return [work] * len(p2p_op_list)


# ----- control -----

def barrier(group: ProcessGroup | None = None, async_op: bool = False,
            device_ids: Sequence[int] | None = None) -> Work | None:
    """Wait until every rank of the group has reached the barrier.

    Host-side: it does not wait for device work still queued on streams (call
    ``work.synchronize()`` or synchronize the stream first). ``device_ids`` is
    accepted for torch compatibility and ignored.
    """
    if group is _NON_MEMBER:
        return _not_in_group("barrier")
    return _pg(group).barrier(async_op)


def monitored_barrier(group: ProcessGroup | None = None, timeout: float | timedelta | None = None,
                      wait_all_ranks: bool = False) -> None:
    """A barrier that says which ranks did not arrive within ``timeout``.

    Runs through the store, so it works even when a backend is stuck. Rank 0 collects
    the arrivals and releases the others.

    Args:
        timeout: seconds or ``timedelta`` (default: the group's timeout); 0 does not wait:
            it fails at once unless every rank has already arrived.
        wait_all_ranks: report every missing rank, not just the first.

    Raises:
        DistBackendError: ranks did not arrive; the message lists them.
    """
    from ._timeouts import to_seconds

    if group is _NON_MEMBER:
        return _not_in_group("monitored_barrier")
    pg = _pg(group)
    pg.monitored_barrier(to_seconds(timeout, default=pg.timeout, allow_zero=True), wait_all_ranks)


@contextlib.contextmanager
def coalescing(group: ProcessGroup | None = None, async_ops: bool = False) -> Iterator[CoalescingManager]:
    """Batch the ops issued on ``group`` inside the block into one op.

    Supported inside: ``all_reduce`` (all with the same op: one
    ``all_reduce_coalesced``), ``all_gather_single`` (one ``all_gather_coalesced``),
    ``reduce_scatter_single``, and ``isend``/``irecv`` (one batch). One kind per block.
    The arrays' results are there when the block ends (or, with ``async_ops=True``,
    after ``cm.wait()``); ops called with ``async_op=True`` inside return Works that
    complete with the batch.

    Example:
        >>> with gpucoll.coalescing() as cm:
        ...     for g in grads:
        ...         gpucoll.all_reduce(g)
    """
    with _coalescing.block(_pg(group), async_ops) as cm:
        yield cm
