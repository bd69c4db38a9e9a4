"""The fake backend: every op completes at once, without communicating (torch's FakeProcessGroup).

``init_process_group("fake", rank=r, world_size=n)`` in ONE process gives a group
that believes it has ``n`` ranks, so code written for 1,024 ranks runs on a laptop:
every argument check a real group makes (shapes, dtypes, ranks, split sizes, op for
the dtype) is made by the ProcessGroup before the backend sees the call, then the
op returns a completed Work. Outputs are filled as torch 2.13's fake group fills
them, as if every rank held this rank's data (so code reads no uninitialised
memory and "does every rank agree?" checks pass): all-gather and gather slots get
the input; reduce-scatter and scatter give this rank's own chunk; all-to-all
copies input to output. Reductions and broadcasts leave the data alone.

Host arrays and device arrays both come here; no NCCL or peer is touched. Ops
that fill device outputs copy on the device through CuPy (so need a GPU); the
others (reductions, broadcast, barrier, p2p) need none.

With ``FakeOptions(error_on_collective=True)`` every op raises instead (torch's
option of that name: a check that a code path issues no collective).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from .._buffer import Buffer, copy_buffer, split_buffer
from .._reduce_op import ReduceOpLike
from ..store import Store
from .._work import Work

__all__ = ["FakeBackend"]


class _EmptyInputError(ValueError, RuntimeError):
    """A bad argument (ValueError) that torch's fake group reports as RuntimeError."""


class FakeBackend:
    """A Backend whose ops complete immediately; see the module docstring."""

    name = "fake"

    def __init__(self, store: Store, rank: int, size: int, *, timeout: float = 300.0,
                 group_name: str = "", error_on_collective: bool = False) -> None:
        self.rank = rank
        self.size = size
        self.group_name = group_name
        self.error_on_collective = error_on_collective
        self._aborted: str | None = None

    def _refuse(self, op: str) -> None:
        if self.error_on_collective:
            from ..errors import DistBackendError

            raise DistBackendError(f"FakeProcessGroup collective operation error: {op} on fake group "
                                   f"{self.group_name!r}, made with FakeOptions(error_on_collective=True)")

    def _done(self, op: str) -> Work:
        self._refuse(op)
        work = Work(op)
        if self._aborted is not None:
            from ..errors import DistBackendError

            work._set_exception(DistBackendError(f"{op} on group {self.group_name!r}: {self._aborted}"))
        else:
            work._set_result()
        return work

    @staticmethod
    def _fill(outs: Sequence[Buffer], inp: Buffer) -> None:
        for out in outs:
            if out.ptr != inp.ptr:
                copy_buffer(out, inp)

    @staticmethod
    def _piece(buf: Buffer, start: int, count: int) -> Buffer:
        """``count`` elements of ``buf`` from element ``start`` (a view)."""
        size = buf.dtype.itemsize
        return dataclasses.replace(buf, ptr=buf.ptr + start * size, nbytes=count * size, shape=(count,))

    # --- reductions: data untouched ---
    def all_reduce(self, buf: Buffer, op: ReduceOpLike) -> Work:
        return self._done("all_reduce")

    def all_reduce_into(self, out: Buffer, inp: Buffer, op: ReduceOpLike) -> Work:
        return self._done("all_reduce")

    def all_reduce_coalesced(self, bufs: Sequence[Buffer], op: ReduceOpLike) -> Work:
        return self._done("all_reduce_coalesced")

    def reduce(self, buf: Buffer, dst: int, op: ReduceOpLike) -> Work:
        return self._done("reduce")

    def reduce_scatter(self, out: Buffer, inputs: Sequence[Buffer], op: ReduceOpLike) -> Work:
        self._refuse("reduce_scatter")
        self._fill([out], inputs[self.rank])
        return self._done("reduce_scatter")

    def reduce_scatter_single(self, out: Buffer, inp: Buffer, op: ReduceOpLike) -> Work:
        self._refuse("reduce_scatter_single")
        self._fill([out], split_buffer(inp, self.size)[self.rank])
        return self._done("reduce_scatter_single")

    # --- data movement: all-gathers replicate this rank's input, the rest untouched ---
    def broadcast(self, buf: Buffer, src: int) -> Work:
        return self._done("broadcast")

    def all_gather(self, outs: Sequence[Buffer], inp: Buffer) -> Work:
        self._refuse("all_gather")
        self._fill(outs, inp)
        return self._done("all_gather")

    def all_gather_single(self, out: Buffer, inp: Buffer) -> Work:
        self._refuse("all_gather_single")
        self._fill(split_buffer(out, self.size), inp)
        return self._done("all_gather_single")

    def all_gather_coalesced(self, outs: Sequence[Sequence[Buffer]], inps: Sequence[Buffer]) -> Work:
        self._refuse("all_gather_coalesced")
        for row, inp in zip(outs, inps):
            self._fill(row, inp)
        return self._done("all_gather_coalesced")

    def gather(self, outs: Sequence[Buffer] | None, inp: Buffer, dst: int) -> Work:
        self._refuse("gather")
        if outs is not None:
            self._fill(outs, inp)
        return self._done("gather")

    def scatter(self, out: Buffer, inputs: Sequence[Buffer] | None, src: int) -> Work:
        self._refuse("scatter")
        if inputs is not None:
            self._fill([out], inputs[self.rank])
        return self._done("scatter")

    def all_to_all(self, outs: Sequence[Buffer], inputs: Sequence[Buffer]) -> Work:
        self._refuse("all_to_all")
        for out, inp in zip(outs, inputs):
            self._fill([out], inp)
        return self._done("all_to_all")

    def all_to_all_single(self, out: Buffer, inp: Buffer, out_counts: Sequence[int],
                          in_counts: Sequence[int]) -> Work:
        self._refuse("all_to_all_single")
        if inp.numel == 0 and out.numel > 0:
            raise _EmptyInputError("inputBuffer is empty: the fake group fills each rank's part of the output from "
                             f"this rank's input, which holds no elements (output {out.shape})")
        if list(out_counts) == list(in_counts) and len(set(out_counts)) <= 1:
            self._fill([out], inp)  # even splits: torch copies input to output whole
        else:
            # Uneven: each rank's region of the output is filled from the start of the
            # input, repeated as needed (torch's fake alltoall_base).
            offset = 0
            for count in out_counts:
                done = 0
                while done < count:
                    step = min(count - done, inp.numel)
                    if step == 0:
                        break
                    self._fill([self._piece(out, offset + done, step)], self._piece(inp, 0, step))
                    done += step
                offset += count
        return self._done("all_to_all_single")

    # --- point to point ---
    def send(self, buf: Buffer, dst: int, tag: int) -> Work:
        return self._done("send")

    def recv(self, buf: Buffer, src: int | None, tag: int) -> Work:
        self._refuse("recv")
        work = Work("recv")
        work._set_result(source_rank=src if src is not None else (self.rank + 1) % self.size)
        return work

    def batch_p2p(self, ops: Sequence[tuple[str, Buffer, int, int]]) -> Work:
        return self._done("batch_p2p")

    # --- control ---
    def barrier(self) -> Work:
        return self._done("barrier")

    def abort(self, reason: str) -> None:
        self._aborted = reason

    def shutdown(self) -> None:
        self._aborted = self._aborted or "the group was shut down"
