"""The collectives gpucoll-bench measures: buffer layout, bus-bandwidth factor, and the call.

Each op follows its nccl-tests counterpart (``src/<op>.cu``):

- ``Layout`` is nccl-tests' ``getCollByteCount``: from the element count of the
  size on the command line it derives what each rank sends and receives, the
  ``count`` column (elements per rank for the gather/scatter family), and where
  the input and output sit inside one buffer for the in-place variant.
- the row's size is ``max(send, recv)`` bytes and ``algbw = size / time``, which is
  exactly nccl-tests' ``getBw`` for every op (all_gather: ``count*n*typesize``).
- ``busbw = algbw * factor(n)`` with the factors of nccl-tests' PERFORMANCE.md.

The calls go through gpucoll's public, torch.distributed-style API. Out-of-place
all_reduce goes through the path ``gpucoll.functional.all_reduce`` takes: NCCL
reduces from one buffer into another (as nccl-tests does); the CPU backend copies
the input into the output and reduces that in place. broadcast and reduce are
in-place only in gpucoll, and alltoall and sendrecv have no in-place form
(nccl-tests reports "N/A" for those too): those columns read N/A.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

# At the top, not in the call: a ``from`` import inside a function costs ~2 us a call.
from .._world import default_group

__all__ = ["Layout", "Call", "OpSpec", "OPS", "op_names", "get_op"]


@dataclass(frozen=True)
class Layout:
    """Element counts of one rank's buffers for one size.

    Attributes:
        send_count: elements of the rank's input.
        recv_count: elements of the rank's output.
        param_count: the table's ``count`` column (the count argument NCCL gets).
        send_inplace_offset: in-place input starts at ``send_inplace_offset * rank``
            elements into the shared buffer.
        recv_inplace_offset: in-place output starts at ``recv_inplace_offset * rank``.
    """

    send_count: int
    recv_count: int
    param_count: int
    send_inplace_offset: int = 0
    recv_inplace_offset: int = 0

    @property
    def size_count(self) -> int:
        """Elements of the larger of input and output: the table's size is this times the
        item size, and the in-place variant's one buffer holds this many."""
        return max(self.send_count, self.recv_count)


@dataclass(frozen=True)
class Call:
    """Arguments of one issued op on one rank.

    ``inp``/``out`` are arrays (NumPy on the CPU backend, CuPy on NCCL), views into the
    benchmark's buffers; for in-place variants they share memory as nccl-tests lays it out.
    """

    inp: Any
    out: Any
    redop: Any  # a gpucoll ReduceOp / PremulSum, or None for ops that do not reduce
    root: int
    rank: int
    size: int
    async_op: bool


Caller = Callable[[Call], "list[Any]"]


@dataclass(frozen=True)
class OpSpec:
    """One benchmarked collective.

    Attributes:
        name: the CLI name (nccl-tests' binary name without ``_perf``).
        layout: ``(count, nranks) -> Layout`` for the element count of one size.
        busbw_factor: ``nranks -> factor`` so that ``busbw = algbw * factor``.
        reduces: takes a reduction (``-o``); else the redop column reads "none".
        rooted: takes a root (``-r``); else the root column reads -1.
        out_of_place: issues the out-of-place variant, or None where gpucoll has none.
        in_place: issues the in-place variant, or None where gpucoll has none.
    """

    name: str
    layout: Callable[[int, int], Layout]
    busbw_factor: Callable[[int], float]
    reduces: bool
    rooted: bool
    out_of_place: Caller | None
    in_place: Caller | None

    def checked(self, rank: int, root: int) -> bool:
        """Whether this rank's output is defined (rooted reductions/gathers define it on the root only)."""
        return not (self.name in ("reduce", "gather") and rank != root)


# --- layouts (nccl-tests getCollByteCount) ---

def _same(count: int, n: int) -> Layout:
    return Layout(count, count, count)


def _gather_like(count: int, n: int) -> Layout:
    per = count // n
    return Layout(per, per * n, per, send_inplace_offset=per)


def _scatter_like(count: int, n: int) -> Layout:
    per = count // n
    return Layout(per * n, per, per, recv_inplace_offset=per)


def _alltoall(count: int, n: int) -> Layout:
    per = count // n
    return Layout(per * n, per * n, per)


# --- bus-bandwidth factors (nccl-tests doc/PERFORMANCE.md) ---

def _allreduce_factor(n: int) -> float:
    return 2.0 * (n - 1) / n


def _spread_factor(n: int) -> float:
    return (n - 1) / n


def _one(n: int) -> float:
    return 1.0


# --- calls through the public API ---

def _works(result: Any) -> list[Any]:
    """Normalise what a gpucoll call returned (None, a Work, or a list of Works)."""
    if result is None:
        return []
    if isinstance(result, (list, tuple)):
        return [w for w in result if w is not None]
    return [result]


def _chunks(buf: Any, n: int, per: int) -> list[Any]:
    return [buf[i * per:(i + 1) * per] for i in range(n)]


def _all_reduce(c: Call) -> list[Any]:
    import gpucoll

    return _works(gpucoll.all_reduce(c.out, op=c.redop, async_op=c.async_op))


def _all_reduce_out_of_place(c: Call) -> list[Any]:
    return _works(default_group()._all_reduce_into(c.out, c.inp, c.redop, async_op=c.async_op))


def _all_gather(c: Call) -> list[Any]:
    import gpucoll

    return _works(gpucoll.all_gather_single(c.out, c.inp, async_op=c.async_op))


def _reduce_scatter(c: Call) -> list[Any]:
    import gpucoll

    return _works(gpucoll.reduce_scatter_single(c.out, c.inp, op=c.redop, async_op=c.async_op))


def _broadcast(c: Call) -> list[Any]:
    import gpucoll

    return _works(gpucoll.broadcast(c.out, c.root, async_op=c.async_op))


def _reduce(c: Call) -> list[Any]:
    import gpucoll

    return _works(gpucoll.reduce(c.out, c.root, op=c.redop, async_op=c.async_op))


def _alltoall_call(c: Call) -> list[Any]:
    import gpucoll

    return _works(gpucoll.all_to_all_single(c.out, c.inp, async_op=c.async_op))


def _gather(c: Call) -> list[Any]:
    import gpucoll

    per = len(c.inp)
    outs = _chunks(c.out, c.size, per) if c.rank == c.root else None
    return _works(gpucoll.gather(c.inp, outs, c.root, async_op=c.async_op))


def _scatter(c: Call) -> list[Any]:
    import gpucoll

    per = len(c.out)
    ins = _chunks(c.inp, c.size, per) if c.rank == c.root else None
    return _works(gpucoll.scatter(c.out, ins, c.root, async_op=c.async_op))


def _sendrecv(c: Call) -> list[Any]:
    import gpucoll

    # Posted together so that neither side waits for the other's receive (a ring of
    # blocking sends would deadlock); one Work per direction, as torch returns them.
    nxt, prv = (c.rank + 1) % c.size, (c.rank - 1) % c.size
    works = _works(gpucoll.batch_isend_irecv([
        gpucoll.P2POp(gpucoll.isend, c.inp, nxt),
        gpucoll.P2POp(gpucoll.irecv, c.out, prv),
    ]))
    if not c.async_op:
        for w in works:
            w.wait()
        return []
    return works


OPS: dict[str, OpSpec] = {
    s.name: s
    for s in (
        OpSpec("all_reduce", _same, _allreduce_factor, True, False, _all_reduce_out_of_place, _all_reduce),
        OpSpec("all_gather", _gather_like, _spread_factor, False, False, _all_gather, _all_gather),
        OpSpec("reduce_scatter", _scatter_like, _spread_factor, True, False, _reduce_scatter,
               _reduce_scatter),
        OpSpec("broadcast", _same, _one, False, True, None, _broadcast),
        OpSpec("reduce", _same, _one, True, True, None, _reduce),
        OpSpec("alltoall", _alltoall, _spread_factor, False, False, _alltoall_call, None),
        OpSpec("sendrecv", _same, _one, False, False, _sendrecv, None),
        OpSpec("gather", _gather_like, _spread_factor, False, True, _gather, _gather),
        OpSpec("scatter", _scatter_like, _spread_factor, False, True, _scatter, _scatter),
    )
}
"""Every benchmarked op by CLI name, in nccl-tests' order of binaries."""


def op_names() -> Sequence[str]:
    """The CLI names of the benchmarked ops."""
    return tuple(OPS)


def get_op(name: str) -> OpSpec:
    """Look up an op by CLI name (``alltoall`` also as ``all_to_all``).

    Raises:
        ValueError: unknown op.
    """
    key = {"all_to_all": "alltoall", "allreduce": "all_reduce", "allgather": "all_gather",
           "reducescatter": "reduce_scatter", "send_recv": "sendrecv"}.get(name, name)
    try:
        return OPS[key]
    except KeyError:
        raise ValueError(f"unknown op {name!r}; expected one of {', '.join(OPS)}") from None
