"""ProcessGroup: a set of ranks that run collectives together.

A group owns its store namespace, its backends, its watchdog and its flight
recorder. Each call is dispatched by where its arrays live: host memory goes to
the group's CPU backend, device memory to its NCCL backend (created on first
device op unless ``device_id`` was given). Object collectives and barriers always
use the CPU backend, so a group made for NCCL still has one (DESIGN.md,
Multi-backend groups).

Methods here take *group* ranks; the module-level functions in
:mod:`gpucoll._collectives` take torch's global ``src``/``dst`` and translate.
Every check that can be made locally (ranks in range, shapes and dtypes of
outputs, split sizes, writability, op valid for the dtype) is made before the
backend sees the call, with the same rules on every rank.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Sequence, Union

from .. import array as _array
from ..array import ArrayLike
from .._buffer import Buffer
from .._reduce_op import ReduceOp, ReduceOpLike
from .._timeouts import to_seconds
from .._work import Work
from .barrier import monitored_barrier
from .checks import _DTYPES_DIFFER, _check_op, _coalesced_dtypes, _list_dtypes, _real_view, _row_elems, _size_error, _splits
from .core import GroupCore

__all__ = ["ProcessGroup", "TAG_MAX"]

TAG_MAX = 2**31 - 1
"""The largest point-to-point tag (torch's tags are C ints; negative ones are refused)."""

ArrayOrBuffer = Union[ArrayLike, Buffer]
"""What a ProcessGroup method takes: an :data:`~gpucoll.array.ArrayLike`, or a Buffer the
library made already (functional passes those)."""


class ProcessGroup(GroupCore):
    """The ranks of one communicator, with torch's ``rank()``/``size()`` accessors.

    Made by :func:`gpucoll.init_process_group`, :func:`gpucoll.new_group` and
    friends; not meant to be constructed directly. Its constructor, identity,
    dispatch and issue path are :class:`~gpucoll._group.core.GroupCore`'s; the
    collectives are here, one thin method each.
    """
    # ----- reductions -----
    def all_reduce(self, tensor: ArrayOrBuffer, op: ReduceOpLike = ReduceOp.SUM, async_op: bool = False) -> Work | None:
        """Reduce ``tensor`` across the group, in place on every rank."""
        self._check_usable()
        buf = _array.as_buffer(tensor, name="tensor", writable=True)
        red = _check_op(op, buf.dtype)
        if self._coalescing is not None:
            return self._coalescing._defer(self, "all_reduce", red, ("tensor", buf, tensor), async_op)
        backend = self._backend_for(buf, "tensor")
        work = self._issue(backend, lambda: backend.all_reduce(buf, red), buf, [tensor], op="all_reduce", red=red)
        return self._finish(backend, work, async_op)

    def _all_reduce_into(self, output: Any, input: Any, op: Any = ReduceOp.SUM,
                         async_op: bool = False) -> Work | None:
        """``output`` = the reduction of every rank's ``input`` (the functional API's
        all_reduce, gpucoll-bench's out-of-place all_reduce; ``input`` is left alone).
        A device backend that reduces out of place (NCCL) does it in one op; otherwise
        ``input`` is copied into ``output``, which is then reduced in place."""
        self._check_usable()
        out = _array.as_buffer(output, name="output", writable=True)
        inp = _array.as_buffer(input, name="input")
        if out.dtype != inp.dtype or out.numel != inp.numel:  # ValueError for both, as torch
            raise ValueError(f"output ({out.dtype.name} x {out.numel}) must match input "
                             f"({inp.dtype.name} x {inp.numel})")
        red = _check_op(op, out.dtype)
        into = None
        if self._coalescing is None:
            backend = self._backend_for_all([out, inp], ["output", "input"])
            into = getattr(backend, "all_reduce_into", None)
        if into is None:
            _array.copy_buffer(out, inp)
            return self.all_reduce(out, op, async_op)
        work = self._issue(backend, lambda: into(out, inp, red), out, [output], op="all_reduce", red=red)
        return self._finish(backend, work, async_op)

    def all_reduce_coalesced(self, tensors: Sequence[ArrayOrBuffer], op: ReduceOpLike = ReduceOp.SUM,
                             async_op: bool = False) -> Work | None:
        """All-reduce several arrays as one op."""
        self._check_usable()
        if self._coalescing is not None:
            self._not_coalescable("all_reduce_coalesced")
        names = [f"tensors[{i}]" for i in range(len(tensors))]
        if not names:
            raise ValueError("tensors must contain at least one array")
        bufs = [_array.as_buffer(t, name=n, writable=True) for t, n in zip(tensors, names)]
        reds = [_check_op(op, b.dtype) for b in bufs]
        backend = self._backend_for_all(bufs, names)
        work = self._issue(backend, lambda: backend.all_reduce_coalesced(bufs, reds[0]), bufs[0], list(tensors),
                           op="all_reduce_coalesced", red=reds[0])
        work._wait_gives_result = True
        return self._finish(backend, work, async_op)

    def reduce(self, tensor: ArrayOrBuffer, dst: int, op: ReduceOpLike = ReduceOp.SUM, async_op: bool = False) -> Work | None:
        """Reduce ``tensor`` into rank ``dst``'s (group rank) copy."""
        self._check_usable()
        if self._coalescing is not None:
            self._not_coalescable("reduce")
        self._check_rank(dst, "group_dst")
        buf = _array.as_buffer(tensor, name="tensor", writable=True)
        red = _check_op(op, buf.dtype)
        backend = self._backend_for(buf, "tensor")
        work = self._issue(backend, lambda: backend.reduce(buf, dst, red), buf, [tensor], dst, op="reduce", red=red)
        return self._finish(backend, work, async_op)

    def reduce_scatter(self, output: ArrayOrBuffer, input_list: Sequence[ArrayOrBuffer], op: ReduceOpLike = ReduceOp.SUM,
                       async_op: bool = False) -> Work | None:
        """Reduce ``input_list[i]`` over ranks into rank i's ``output``.

        As torch's: ``input_list[i]`` may have rank i's own size (uneven chunks), the
        same on every rank; ``input_list[rank]`` must be laid out like ``output``."""
        self._check_usable()
        if self._coalescing is not None:
            self._not_coalescable("reduce_scatter")
        out = _array.as_buffer(output, name="output", writable=True)
        ins = self._uneven_list(input_list, "input_list", out, "output")
        red = _check_op(op, out.dtype)
        backend = self._backend_for_all([out, *ins], ["output"] + [f"input_list[{i}]" for i in range(len(ins))])
        work = self._issue(backend, lambda: backend.reduce_scatter(out, ins, red), out, [output], op="reduce_scatter",
                           red=red)
        return self._finish(backend, work, async_op)

    def reduce_scatter_single(self, output: ArrayOrBuffer, input: ArrayOrBuffer, op: ReduceOpLike = ReduceOp.SUM,
                              async_op: bool = False) -> Work | None:
        """Reduce ``input`` (``size`` consecutive chunks) over ranks; rank i gets chunk i in ``output``."""
        self._check_usable()
        out = _array.as_buffer(output, name="output", writable=True)
        inp = _array.as_buffer(input, name="input")
        self._check_chunked(inp, out, "input", "output")
        red = _check_op(op, out.dtype)
        if self._coalescing is not None:
            return self._coalescing._defer(self, "reduce_scatter_single", red,
                                           ("output", out, output, inp), async_op)
        backend = self._backend_for_all([out, inp], ["output", "input"])
        work = self._issue(backend, lambda: backend.reduce_scatter_single(out, inp, red), out, [output],
                           op="reduce_scatter_single", red=red)
        return self._finish(backend, work, async_op)

    # ----- data movement -----
    def broadcast(self, tensor: ArrayOrBuffer, src: int, async_op: bool = False) -> Work | None:
        """Copy ``tensor`` from group rank ``src`` to every rank."""
        self._check_usable()
        if self._coalescing is not None:
            self._not_coalescable("broadcast")
        self._check_rank(src, "group_src")
        buf = _array.as_buffer(tensor, name="tensor", writable=True)
        backend = self._backend_for(buf, "tensor")
        work = self._issue(backend, lambda: backend.broadcast(buf, src), buf, [tensor], src, op="broadcast")
        return self._finish(backend, work, async_op)

    def all_gather(self, tensor_list: Sequence[ArrayOrBuffer], tensor: ArrayOrBuffer, async_op: bool = False) -> Work | None:
        """Gather every rank's ``tensor`` into ``tensor_list`` (one array per rank) on every rank."""
        self._check_usable()
        if self._coalescing is not None:
            self._not_coalescable("all_gather")
        inp = _array.as_buffer(tensor, name="tensor")
        outs = self._list_like(tensor_list, "tensor_list", inp, "tensor", writable=True, views=True)
        inp = _real_view(inp)
        backend = self._backend_for_all([inp, *outs], ["tensor"] + [f"tensor_list[{i}]" for i in range(len(outs))])
        work = self._issue(backend, lambda: backend.all_gather(outs, inp), inp, list(tensor_list), op="all_gather")
        return self._finish(backend, work, async_op)

    def all_gather_single(self, output: ArrayOrBuffer, input: ArrayOrBuffer, async_op: bool = False) -> Work | None:
        """Gather every rank's ``input`` into ``output`` (``size`` consecutive chunks, rank order)."""
        self._check_usable()
        out = _array.as_buffer(output, name="output_tensor", writable=True)
        inp = _array.as_buffer(input, name="input_tensor")
        self._check_chunked(out, inp, "output_tensor", "input_tensor")
        if self._coalescing is not None:
            return self._coalescing._defer(self, "all_gather_single", None,
                                           ("output_tensor", out, output, inp), async_op)
        backend = self._backend_for_all([out, inp], ["output_tensor", "input_tensor"])
        work = self._issue(backend, lambda: backend.all_gather_single(out, inp), inp, [output], op="all_gather_single")
        return self._finish(backend, work, async_op)

    def all_gather_coalesced(self, output_lists: Sequence[Sequence[Any]], input_list: Sequence[ArrayOrBuffer],
                             async_op: bool = False) -> Work | None:
        """Several all_gathers as one op: ``output_lists[r][k]`` gets rank r's ``input_list[k]``
        (torch's layout: one list per rank, each with one array per input)."""
        self._check_usable()
        if self._coalescing is not None:
            self._not_coalescable("all_gather_coalesced")
        if isinstance(input_list, (str, bytes)) or not hasattr(input_list, "__len__") or not input_list:
            raise ValueError("input_tensor_list must be a non-empty list of arrays")
        _coalesced_dtypes(output_lists, input_list)
        if isinstance(output_lists, (str, bytes)) or not hasattr(output_lists, "__len__") \
                or len(output_lists) != self._size:
            got = len(output_lists) if hasattr(output_lists, "__len__") else type(output_lists).__name__
            raise ValueError(f"output_tensor_lists must have {self._size} lists (one per rank of group "
                             f"{self.group_name!r}), each with one array per input; got {got}")
        ins = [_array.as_buffer(t, name=f"input_tensor_list[{k}]") for k, t in enumerate(input_list)]
        for r, row in enumerate(output_lists):
            if isinstance(row, (str, bytes)) or not hasattr(row, "__len__") or len(row) != len(ins):
                got = len(row) if hasattr(row, "__len__") else type(row).__name__
                raise _size_error("output_tensor_lists",
                                  f"output_tensor_lists[{r}] must have {len(ins)} arrays (one per input); got {got}")
        # The backends take the outputs per input (outs[k][r]): the transpose of torch's layout.
        outs = [self._list_like([output_lists[r][k] for r in range(self._size)],
                                f"output_tensor_lists[*][{k}]", ins[k], f"input_tensor_list[{k}]",
                                writable=True, views=True) for k in range(len(ins))]
        ins = [_real_view(b) for b in ins]
        flat = ins + [b for row in outs for b in row]
        names = [f"input_tensor_list[{k}]" for k in range(len(ins))] + \
            [f"output_tensor_lists[{r}][{k}]" for k in range(len(outs)) for r in range(self._size)]
        backend = self._backend_for_all(flat, names)
        work = self._issue(backend, lambda: backend.all_gather_coalesced(outs, ins), ins[0],
                           [list(row) for row in output_lists], op="all_gather_coalesced")
        return self._finish(backend, work, async_op)

    def gather(self, tensor: ArrayOrBuffer, gather_list: Sequence[ArrayOrBuffer] | None, dst: int,
               async_op: bool = False) -> Work | None:
        """Gather every rank's ``tensor`` into ``gather_list`` on group rank ``dst``."""
        self._check_usable()
        if self._coalescing is not None:
            self._not_coalescable("gather")
        self._check_rank(dst, "group_dst")
        inp = _array.as_buffer(tensor, name="tensor")
        _list_dtypes(gather_list, inp, "gather_list", "tensor")
        outs: list[Buffer] | None = None
        if self._rank == dst:
            if not gather_list:
                raise ValueError(f"gather_list is required on the destination rank {dst} "
                                 f"({self._size} arrays shaped like tensor)")
            outs = self._list_like(gather_list, "gather_list", inp, "tensor", writable=True, views=True)
        elif gather_list:
            raise ValueError(f"gather_list must not be given on a non-destination rank (this is rank "
                             f"{self._rank}, dst is {dst})")
        inp = _real_view(inp)
        backend = self._backend_for_all([inp, *(outs or ())], ["tensor"] + ["gather_list"] * len(outs or ()))
        work = self._issue(backend, lambda: backend.gather(outs, inp, dst), inp,
                           list(gather_list) if gather_list else [], dst, op="gather")
        return self._finish(backend, work, async_op)

    def scatter(self, tensor: ArrayOrBuffer, scatter_list: Sequence[ArrayOrBuffer] | None, src: int,
                async_op: bool = False) -> Work | None:
        """Send ``scatter_list[i]`` from group rank ``src`` into rank i's ``tensor``."""
        self._check_usable()
        if self._coalescing is not None:
            self._not_coalescable("scatter")
        self._check_rank(src, "group_src")
        out = _array.as_buffer(tensor, name="tensor", writable=True)
        _list_dtypes(scatter_list, out, "scatter_list", "tensor")
        ins: list[Buffer] | None = None
        if self._rank == src:
            if not scatter_list:
                raise ValueError(f"scatter_list is required on the source rank {src} "
                                 f"({self._size} arrays shaped like tensor)")
            ins = self._list_like(scatter_list, "scatter_list", out, "tensor", writable=False, views=True)
        elif scatter_list:
            raise ValueError(f"scatter_list must not be given on a non-source rank (this is rank "
                             f"{self._rank}, src is {src})")
        out = _real_view(out)
        backend = self._backend_for_all([out, *(ins or ())], ["tensor"] + ["scatter_list"] * len(ins or ()))
        work = self._issue(backend, lambda: backend.scatter(out, ins, src), out, [tensor], src, op="scatter")
        return self._finish(backend, work, async_op)

    def all_to_all(self, output_list: Sequence[Any], input_list: Sequence[ArrayOrBuffer],
                   async_op: bool = False) -> Work | None:
        """Rank i sends ``input_list[j]`` to rank j, which receives it in ``output_list[i]``."""
        self._check_usable()
        if self._coalescing is not None:
            self._not_coalescable("all_to_all")
        for lst, name in ((output_list, "output_tensor_list"), (input_list, "input_tensor_list")):
            if len(lst) != self._size:
                raise _size_error(name, f"{name} must have {self._size} arrays (one per rank); got {len(lst)}")
        outs = [_array.as_buffer(t, name=f"output_tensor_list[{i}]", writable=True) for i, t in enumerate(output_list)]
        ins = [_array.as_buffer(t, name=f"input_tensor_list[{i}]") for i, t in enumerate(input_list)]
        for i, b in enumerate(outs + ins):
            if b.dtype != ins[0].dtype:
                raise ValueError(f"{_DTYPES_DIFFER}: all arrays of all_to_all must share one dtype; got "
                                 f"{b.dtype.name} and {ins[0].dtype.name}")
        names = [f"output_tensor_list[{i}]" for i in range(len(outs))] + \
                [f"input_tensor_list[{i}]" for i in range(len(ins))]
        backend = self._backend_for_all(outs + ins, names)
        work = self._issue(backend, lambda: backend.all_to_all(outs, ins), ins[0], list(output_list),
                           op="all_to_all")
        return self._finish(backend, work, async_op)

    def all_to_all_single(self, output: ArrayOrBuffer, input: ArrayOrBuffer, output_split_sizes: Sequence[int] | None = None,
                          input_split_sizes: Sequence[int] | None = None,
                          async_op: bool = False) -> Work | None:
        """Split ``input`` along dim 0 (``input_split_sizes`` rows to each rank), exchange, and
        concatenate what arrives in ``output`` (``output_split_sizes`` rows from each rank)."""
        self._check_usable()
        if self._coalescing is not None:
            self._not_coalescable("all_to_all_single")
        out = _array.as_buffer(output, name="output", writable=True)
        inp = _array.as_buffer(input, name="input")
        if out.dtype != inp.dtype:
            raise ValueError(f"{_DTYPES_DIFFER}: output has dtype {out.dtype.name} but input has {inp.dtype.name}; "
                             "they must match")
        row_out, row_in = _row_elems(out, "output"), _row_elems(inp, "input")
        if row_out != row_in:
            raise ValueError(f"output rows (shape {out.shape}) and input rows (shape {inp.shape}) must have "
                             "the same number of elements")
        out_rows = _splits(output_split_sizes, out.shape[0], self._size, "output_split_sizes", "output")
        in_rows = _splits(input_split_sizes, inp.shape[0], self._size, "input_split_sizes", "input")
        out_counts = [r * row_out for r in out_rows]
        in_counts = [r * row_in for r in in_rows]
        backend = self._backend_for_all([out, inp], ["output", "input"])
        work = self._issue(backend, lambda: backend.all_to_all_single(out, inp, out_counts, in_counts), inp,
                           [output], op="all_to_all_single")
        return self._finish(backend, work, async_op)

    # ----- point to point -----
    def send(self, tensor: ArrayOrBuffer, dst: int, tag: int = 0, async_op: bool = True) -> Work:
        """Send ``tensor`` to group rank ``dst``; returns its Work (completed unless ``async_op``)."""
        self._check_usable()
        buf = self._p2p_check(tensor, dst, tag, "group_dst", writable=False)
        if self._coalescing is not None:
            return self._coalescing._defer_p2p(self, ("send", buf, tensor, dst, tag))
        backend = self._backend_for(buf, "tensor")
        work = self._issue(backend, lambda: backend.send(buf, dst, tag), buf, [], dst)
        self._finish(backend, work, async_op)
        return work

    def recv(self, tensor: ArrayOrBuffer, src: int | None, tag: int = 0, async_op: bool = True) -> Work:
        """Receive into ``tensor`` from group rank ``src`` (None: any rank); returns its Work
        (completed unless ``async_op``; ``work.source_rank()`` names the sender)."""
        self._check_usable()
        buf = self._p2p_check(tensor, src, tag, "group_src", writable=True)
        if self._coalescing is not None:
            if src is None:
                raise ValueError("recv from any source (src=None) cannot run inside gpucoll.coalescing()")
            return self._coalescing._defer_p2p(self, ("recv", buf, tensor, src, tag))
        backend = self._backend_for(buf, "tensor")
        work = self._issue(backend, lambda: backend.recv(buf, src, tag), buf, [tensor],
                           -1 if src is None else src)
        self._finish(backend, work, async_op)
        return work

    def batch_p2p(self, ops: Sequence[tuple[str, Any, int, int]]) -> Work:
        """Post ``(kind, array, group peer, tag)`` sends/receives together; one Work for all."""
        self._check_usable()
        if self._coalescing is not None:
            self._not_coalescable("batch_isend_irecv")
        if not ops:
            raise ValueError("p2p_op_list must not be empty")
        bufs = [self._p2p_check(t, peer, tag, "peer", writable=(kind == "recv")) for kind, t, peer, tag in ops]
        backend = self._backend_for_all(bufs, [f"p2p_op_list[{i}].tensor" for i in range(len(bufs))])
        batch = [(kind, b, peer, tag) for (kind, _, peer, tag), b in zip(ops, bufs)]
        outputs = [t for kind, t, _, _ in ops if kind == "recv"]
        work = self._issue(backend, lambda: backend.batch_p2p(batch), bufs[0], outputs)
        self._finish(backend, work, True)
        return work

    def _p2p_check(self, tensor: Any, peer: int | None, tag: int, name: str, writable: bool) -> Buffer:
        if peer is not None:
            self._check_rank(peer, name)
            if peer == self._rank:
                raise ValueError(f"{name}={peer} is this rank itself; send/recv need another rank")
        if isinstance(tag, bool) or not isinstance(tag, int):
            raise TypeError(f"tag must be an int; got {type(tag).__name__} {tag!r}")
        if not 0 <= tag <= TAG_MAX:
            raise ValueError(f"tag={tag} is out of range: a tag must be in [0, {TAG_MAX}] (a C int, as torch's)")
        return _array.as_buffer(tensor, name="tensor", writable=writable)

    # ----- control -----
    def barrier(self, async_op: bool = False) -> Work | None:
        """Block until every rank of the group has called barrier (host-side; CPU backend)."""
        self._check_usable()
        if self._coalescing is not None:
            self._not_coalescable("barrier")
        backend = self._cpu
        work = self._issue(backend, backend.barrier, None, [])
        return self._finish(backend, work, async_op)

    def monitored_barrier(self, timeout: float | timedelta | None = None, wait_all_ranks: bool = False) -> None:
        """A barrier through the store that names the ranks that did not arrive.

        Rank 0 waits up to ``timeout`` (seconds or ``timedelta``; default the group's
        timeout; 0: no waiting) for every rank's arrival key, then releases the others
        with "ok" or with the list of missing ranks (so every rank that is still alive
        raises the same error). Monitored barriers are numbered by a counter of their
        own, so other ops (point-to-point ones included) may differ between ranks.

        Raises:
            DistBackendError: some ranks did not arrive in time (named in the message).
        """
        self._check_usable()
        if self._coalescing is not None:
            self._not_coalescable("monitored_barrier")
        seconds = to_seconds(timeout, default=self.timeout, allow_zero=True)
        self._seq += 1
        self._monitored_seq += 1
        if self.backend_name == "fake":
            return  # no other rank exists to wait for
        self._last_release = monitored_barrier(self._store, self._rank, self._size, self._monitored_seq,
                                               self.group_name, seconds, wait_all_ranks, self._last_release,
                                               getattr(self._cpu, "peer_gone", lambda peer: None))
