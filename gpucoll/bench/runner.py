"""The measurement loop that runs on every rank of an initialised process group.

Each sweep first runs ``warmup_iters`` ops at its largest and smallest size (as
nccl-tests' ``TimeTest``). Then, per size and variant (out-of-place, in-place), as
nccl-tests' ``BenchTime``: ``warmup_iters`` untimed ops (nccl-tests runs one), a
barrier, then ``iters`` ops issued back to back and one wait at the end (``-z 1``:
a wait after each op instead; ``-m M``: each iteration is M ops inside one
``gpucoll.coalescing()`` block, one group call, and the time is over ``iters * M`` ops; ``-G N``: the ``iters`` ops captured into a CUDA graph,
launched N times after a barrier, timed over ``iters * N`` ops; the check runs
uncaptured). Time per op is the elapsed time over ``iters``; the
reported time is its maximum over ranks (``-a`` picks rank 0's, the mean or the
minimum instead; ``-C 1`` stops the clock when the last op is issued). Then ``check`` runs on fresh
deterministic inputs count the wrong elements on every rank (summed over ranks)
against the exact expected output.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from . import check as _check
from .arrays import ArrayKit, make_kit
from .ops import Call, Caller, Layout, OpSpec, get_op
from .. import _world
from .options import DATATYPES, PREMUL_FACTOR, REDOPS, BenchConfig, redop_defined

__all__ = ["Measurement", "Row", "RankInfo", "check_config", "run_rank", "rank_info", "AGGREGATED_OPS"]

AGGREGATED_OPS = ("all_reduce", "all_gather", "reduce_scatter")
"""The ops ``-m`` aggregates: those ``gpucoll.coalescing()`` batches into one group call."""


@dataclass(frozen=True)
class Measurement:
    """One variant (out-of-place or in-place) of one row.

    Attributes:
        time_us: microseconds per op, the maximum over ranks.
        algbw: algorithm bandwidth, GB/s (size / time, 1 GB = 1e9 bytes).
        busbw: bus bandwidth, GB/s (algbw times the op's factor).
        wrong: wrong elements summed over ranks; None when not checked (``-c 0``).
    """

    time_us: float
    algbw: float
    busbw: float
    wrong: int | None


@dataclass(frozen=True)
class Row:
    """One line of the table: one op, size, datatype, reduction and root."""

    op: str
    size: int
    count: int
    datatype: str
    redop: str
    root: int
    out_of_place: Measurement | None
    in_place: Measurement | None


@dataclass(frozen=True)
class RankInfo:
    """Where one rank ran (the header's "Using devices" lines).

    Attributes:
        rank, pid, hostname: the rank, its process and host.
        device: the device in words (``cuda:3 (NVIDIA H200)``, ``cpu (...)``).
        cuda_device: the CUDA device index; -1 on the CPU backend.
        pci: the GPU's PCI address as nccl-tests prints it (``0000:19:00``); "" on the CPU.
        gpu_name: the GPU's name (``NVIDIA H200``); "" on the CPU.
    """

    rank: int
    pid: int
    hostname: str
    device: str
    cuda_device: int = -1
    pci: str = ""
    gpu_name: str = ""


def rank_info(kit: ArrayKit) -> RankInfo:
    """This rank's :class:`RankInfo`."""
    import gpucoll

    index, pci, name = kit.device_identity()
    return RankInfo(gpucoll.get_rank(), os.getpid(), socket.gethostname(), kit.device_name(), index, pci, name)


def _redop_object(name: str) -> Any:
    from .._reduce_op import ReduceOp, make_premul_sum

    if name == "premulsum":
        return make_premul_sum(PREMUL_FACTOR)
    return ReduceOp[REDOPS[name]]


def _allreduce_scalar(value: float, op: str) -> float:
    import gpucoll

    buf = np.array([value], dtype=np.float64)
    gpucoll.all_reduce(buf, op=gpucoll.ReduceOp[op])
    return float(buf[0])


def _over_ranks(seconds: float, average: int, rank: int, size: int) -> float:
    """Combine one time over the ranks as nccl-tests' ``-a``: 0 rank 0's, 1 mean, 2 min, 3 max."""
    if average == 0:
        return _allreduce_scalar(seconds if rank == 0 else 0.0, "SUM")
    if average == 1:
        return _allreduce_scalar(seconds, "SUM") / size
    return _allreduce_scalar(seconds, "MIN" if average == 2 else "MAX")


class _Variant:
    """The views of one variant of one size: input and output inside the run's buffers."""

    def __init__(self, inp: Any, out: Any, zero_first: Any) -> None:
        self.inp = inp
        self.out = out
        self.zero_first = zero_first  # what to clear before writing check inputs


def _views(send: Any, recv: Any, lay: Layout, rank: int, in_place: bool) -> _Variant:
    if not in_place:
        return _Variant(send[:lay.send_count], recv[:lay.recv_count], recv[:lay.recv_count])
    base = recv[:lay.size_count]
    s0, r0 = lay.send_inplace_offset * rank, lay.recv_inplace_offset * rank
    return _Variant(base[s0:s0 + lay.send_count], base[r0:r0 + lay.recv_count], base)


class _Case:
    """Everything fixed for one sweep: op, datatype, reduction, root."""

    def __init__(self, cfg: BenchConfig, spec: OpSpec, kit: ArrayKit, datatype: str, redop: str | None,
                 root: int, rank: int, size: int) -> None:
        self.cfg, self.spec, self.kit = cfg, spec, kit
        self.datatype, self.dtype = datatype, DATATYPES[datatype]
        self.redop, self.redop_obj = redop, (_redop_object(redop) if redop else None)
        self.root, self.rank, self.size = root, rank, size

    def _call(self, v: _Variant, async_op: bool) -> Call:
        return Call(v.inp, v.out, self.redop_obj, self.root, self.rank, self.size, async_op)

    def _issue(self, caller: Caller, v: _Variant, async_op: bool) -> list[Any]:
        return caller(self._call(v, async_op))

    def _aggregated(self, caller: Caller, call: Call) -> list[Any]:
        """One timed iteration: ``-m M`` ops in one coalescing block (one group call on
        NCCL, one coalesced op on the CPU backend), or the one op."""
        if self.cfg.agg_iters == 1:
            return caller(call)
        import gpucoll

        with gpucoll.coalescing(async_ops=True) as cm:
            for _ in range(self.cfg.agg_iters):
                caller(call)
        return list(cm.works)

    def _loop(self, caller: Caller, v: _Variant, iters: int) -> float:
        """Run ``iters`` ops; return the host time when the last one was issued. The op's
        arguments are made once (as nccl-tests fills its arguments once per size): the
        loop times the library's calls, not the benchmark's own objects."""
        if self.cfg.blocking:
            call = self._call(v, False)
            for _ in range(iters):
                issued = time.perf_counter()
                for w in self._aggregated(caller, call):
                    w.wait()
                self.kit.synchronize()
            return issued if iters else time.perf_counter()
        call = self._call(v, True)
        pending: list[Any] = []
        extend = pending.extend
        if self.cfg.agg_iters == 1:
            for _ in range(iters):
                extend(caller(call))
        else:
            for _ in range(iters):
                extend(self._aggregated(caller, call))
        issued = time.perf_counter()
        for w in pending:
            w.wait()
        self.kit.synchronize()
        return issued

    def warm(self, caller: Caller, v: _Variant) -> None:
        self._loop(caller, v, self.cfg.warmup_iters)

    def _graph_loop(self, caller: Caller, v: _Variant, iters: int,
                    barrier: Callable[[], object]) -> tuple[float, float, float]:
        """nccl-tests' ``-G N``: capture ``iters`` ops into a CUDA graph (untimed), then,
        after a barrier, launch it N times and wait. Returns (start, last launch issued,
        end); the time per op is over ``iters * N`` ops. gpucoll runs no Python per
        replayed op (tests/nccl/test_nccl_capture.py)."""
        kit: Any = self.kit

        def issue() -> None:
            for _ in range(iters):
                self._issue(caller, v, False)
        graph = kit.capture(issue)
        barrier()
        t0 = time.perf_counter()
        kit.launch(graph, self.cfg.cudagraph)
        issued = time.perf_counter()
        kit.synchronize()
        return t0, issued, time.perf_counter()

    def measure(self, caller: Caller, v: _Variant, lay: Layout, nbytes: int) -> Measurement:
        import gpucoll

        self._loop(caller, v, self.cfg.warmup_iters)  # uncaptured: connected, kernels loaded
        # Two barriers: a rank that waited long in the first may have slept in it and
        # leaves it a wake-up later than its peers; both enter the second at once and
        # leave it within a spin of each other, so the timed loop starts together (a
        # late start would be timed as the first op's wait, over only 20 ops).
        gpucoll.barrier()
        gpucoll.barrier()
        ops = self.cfg.iters * self.cfg.agg_iters  # nccl-tests divides by iters * agg_iters
        if self.cfg.cudagraph:
            t0, issued, end = self._graph_loop(caller, v, self.cfg.iters, gpucoll.barrier)
            ops *= self.cfg.cudagraph
        else:
            t0 = time.perf_counter()
            issued = self._loop(caller, v, self.cfg.iters)
            end = time.perf_counter()
        end = issued if self.cfg.report_cputime else end
        seconds = _over_ranks((end - t0) / ops, self.cfg.average, self.rank, self.size)
        algbw = nbytes / seconds / 1e9 if seconds > 0 else 0.0
        busbw = algbw * self.spec.busbw_factor(self.size)
        wrong = self.check(caller, v, lay) if self.cfg.check else None
        return Measurement(seconds * 1e6, algbw, busbw, wrong)

    def check(self, caller: Caller, v: _Variant, lay: Layout) -> int:
        spec, kit, n = self.spec, self.kit, self.size
        mine = spec.checked(self.rank, self.root)
        itemsize = np.dtype(_check.np_dtype(self.dtype)).itemsize
        wrong = 0
        for rep in range(1, self.cfg.check + 1):
            kit.zero(v.zero_first)
            kit.write(v.inp, _check.make_input(spec, self.dtype, self.redop, self.rank, n, lay, rep))
            for w in self._issue(caller, v, False):
                w.wait()
            kit.synchronize()
            local = 0
            if mine and lay.recv_count:
                if self.cfg.corrupt:
                    kit.corrupt(v.out, itemsize)
                expected = _check.make_expected(spec, self.dtype, self.redop, self.rank, n, self.root, lay, rep)
                local = _check.count_wrong(kit.to_host(v.out), expected)
            wrong = int(_allreduce_scalar(float(local), "SUM"))
            if wrong:
                break
        # Timed loops run on zeros: repeated prod/sum of check data would overflow (and warn).
        kit.zero(v.zero_first)
        kit.zero(v.inp)
        return wrong


def _skip(spec: OpSpec, datatype: str, redop: str | None) -> bool:
    return spec.reduces and redop is not None and not redop_defined(redop, datatype)


def check_config(cfg: BenchConfig, world_size: int) -> None:
    """Reject what cannot run on ``world_size`` ranks, before anything starts.

    Raises:
        ValueError: sendrecv on one rank, a root outside the world, or no reduction
            of ``cfg.redops`` defined on any datatype of ``cfg.datatypes``.
    """
    spec = get_op(cfg.op)
    if spec.name == "sendrecv" and world_size < 2:
        raise ValueError("sendrecv needs a world of at least 2 ranks (gpucoll has no send to self); "
                         f"got {world_size}")
    if spec.reduces and not any(redop_defined(r, d) for r in cfg.redops for d in cfg.datatypes):
        raise ValueError(f"reduction {'/'.join(cfg.redops)} is not defined on {'/'.join(cfg.datatypes)} "
                         "(bitwise reductions need integer types, premulsum float types)")
    if cfg.agg_iters > 1 and spec.name not in AGGREGATED_OPS:
        raise ValueError(f"-m/--agg_iters {cfg.agg_iters}: {spec.name} cannot be aggregated; gpucoll.coalescing() "
                         f"takes {', '.join(AGGREGATED_OPS)}. Use -m 1")
    if cfg.agg_iters > 1 and cfg.cudagraph:
        raise ValueError(f"-m/--agg_iters {cfg.agg_iters} with -G/--cudagraph {cfg.cudagraph}: aggregated ops "
                         "are not captured into graphs; use one of them")
    if spec.rooted and cfg.root >= world_size:
        raise ValueError(f"root must be -1 or a rank below the world size {world_size}; got {cfg.root}")


def run_rank(cfg: BenchConfig, *, on_row: Callable[[Row], None] | None = None,
             on_progress: Callable[[str], None] | None = None, kit: ArrayKit | None = None) -> list[Row]:
    """Run the whole sweep on this rank; every rank of the default group must call it.

    Args:
        cfg: what to measure.
        on_row: called with each finished row (the same rows on every rank).
        on_progress: called with a short description before each measurement.
        kit: the buffers' kit; by default NumPy for cpu, CuPy for nccl.

    Returns:
        The rows, in the order measured.

    Raises:
        ValueError: see :func:`check_config`.
    """
    import gpucoll

    spec = get_op(cfg.op)
    rank, n = gpucoll.get_rank(), gpucoll.get_world_size()
    check_config(cfg, n)
    kit = kit if kit is not None else make_kit(cfg.backend, int(os.environ.get("LOCAL_RANK", rank)))
    roots = (list(range(n)) if cfg.root == -1 else [cfg.root]) if spec.rooted else [-1]
    redops: list[str | None] = list(cfg.redops) if spec.reduces else [None]
    rows: list[Row] = []
    for _cycle in range(cfg.run_cycles):
        rows += _sweep(cfg, spec, kit, rank, n, roots, redops, on_row, on_progress)
    return rows


def _sweep(cfg: BenchConfig, spec: OpSpec, kit: ArrayKit, rank: int, n: int, roots: list[int],
           redops: list[str | None], on_row: Callable[[Row], None] | None,
           on_progress: Callable[[str], None] | None) -> list[Row]:
    rows: list[Row] = []
    for datatype in cfg.datatypes:
        dtype = DATATYPES[datatype]
        itemsize = np.dtype(_check.np_dtype(dtype)).itemsize
        top = spec.layout(max(cfg.sizes) // itemsize, n)
        make = kit.pooled_zeros if cfg.local_register else kit.zeros
        send, recv = make(top.send_count, dtype), make(top.size_count, dtype)
        regs = _register(cfg, (send, recv))
        try:
            rows += _sweep_type(cfg, spec, kit, rank, n, roots, redops, on_row, on_progress, datatype, itemsize,
                                send, recv)
        finally:
            _deregister(regs)
        del send, recv
    return rows


def _register(cfg: BenchConfig, bufs: tuple[Any, ...]) -> list[Any]:
    """``-R 1``/``-R 2``: register the run's buffers with the default group (locally, or as
    symmetric windows: collective, every rank in the same order), as nccl-tests does."""
    if not cfg.local_register:
        return []
    group = _world.default_group()
    return [group.register_buffer(b, symmetric=cfg.local_register == 2) for b in bufs if len(b)]


def _deregister(regs: list[Any]) -> None:
    group = _world.default_group() if regs else None
    for reg in regs:
        assert group is not None
        group.deregister_buffer(reg)


def _sweep_type(cfg: BenchConfig, spec: OpSpec, kit: ArrayKit, rank: int, n: int, roots: list[int],
                redops: list[str | None], on_row: Callable[[Row], None] | None,
                on_progress: Callable[[str], None] | None, datatype: str, itemsize: int, send: Any,
                recv: Any) -> list[Row]:
    rows: list[Row] = []
    for redop in redops:
        if _skip(spec, datatype, redop):
            continue
        for root in roots:
            case = _Case(cfg, spec, kit, datatype, redop, max(root, 0), rank, n)
            # nccl-tests warms each sweep up at its largest and smallest size first.
            first = spec.out_of_place or spec.in_place
            assert first is not None
            for size in (max(cfg.sizes), min(cfg.sizes)):
                lay = spec.layout(size // itemsize, n)
                if lay.param_count:
                    case.warm(first, _views(send, recv, lay, rank, first is spec.in_place))
            # Then one whole measurement at the smallest size, not reported: on the CPU
            # backend the first measurement of a process was the slow one whichever
            # call it timed (1.5-5x the next; docs/cpu-backend.md, "Async ops").
            if lay.param_count and not cfg.cudagraph:
                case.measure(first, _views(send, recv, lay, rank, first is spec.in_place), lay,
                             lay.size_count * itemsize)
            for size in cfg.sizes:
                lay = spec.layout(size // itemsize, n)
                if lay.param_count == 0:
                    continue  # less than one element per rank: nothing to move
                nbytes = lay.size_count * itemsize
                results: list[Measurement | None] = []
                for in_place, caller in ((False, spec.out_of_place), (True, spec.in_place)):
                    if caller is None:
                        results.append(None)
                        continue
                    if on_progress is not None:
                        where = "in-place" if in_place else "out-of-place"
                        on_progress(f"{spec.name} {datatype} {redop or ''} {nbytes} B {where}")
                    v = _views(send, recv, lay, rank, in_place)
                    results.append(case.measure(caller, v, lay, nbytes))
                row = Row(spec.name, nbytes, lay.param_count, datatype, redop or "none", root,
                          results[0], results[1])
                rows.append(row)
                if on_row is not None:
                    on_row(row)
    return rows
