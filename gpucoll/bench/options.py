"""What one benchmark run measures: sizes, datatypes, reductions and loop counts.

Names and defaults follow nccl-tests (``src/common.cu``) so that a command line
written for ``all_reduce_perf`` means the same thing here. This module imports
nothing heavy: the CLI parses and validates arguments before NumPy or CuPy load.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass

__all__ = [
    "DATATYPES", "DATATYPE_ALIASES", "ALL_DATATYPES", "REDOPS", "REDOP_ALIASES", "ALL_REDOPS",
    "BITWISE_REDOPS", "PREMUL_FACTOR", "BenchConfig", "parse_size", "size_sweep",
    "resolve_datatypes", "resolve_redops", "is_integer_type", "redop_defined",
]

DATATYPES: dict[str, str] = {
    "int8": "int8", "uint8": "uint8", "int32": "int32", "uint32": "uint32",
    "int64": "int64", "uint64": "uint64", "half": "float16", "float": "float32",
    "double": "float64", "bfloat16": "bfloat16", "f8e4m3": "float8_e4m3fn", "f8e5m2": "float8_e5m2",
}
"""nccl-tests datatype name -> gpucoll DType name, in nccl-tests' order (``-d all`` runs them all)."""

DATATYPE_ALIASES: dict[str, str] = {
    "char": "int8", "int": "int32", "float16": "half", "fp16": "half", "float32": "float",
    "fp32": "float", "float64": "double", "fp64": "double", "bf16": "bfloat16",
    "float8_e4m3fn": "f8e4m3", "fp8_e4m3": "f8e4m3", "float8_e5m2": "f8e5m2", "fp8_e5m2": "f8e5m2",
}

ALL_DATATYPES: tuple[str, ...] = tuple(DATATYPES)

REDOPS: dict[str, str] = {
    "sum": "SUM", "prod": "PRODUCT", "max": "MAX", "min": "MIN", "avg": "AVG",
    "premulsum": "PREMUL_SUM", "band": "BAND", "bor": "BOR", "bxor": "BXOR",
}
"""nccl-tests reduction name (plus gpucoll's bitwise ops) -> ``ReduceOp`` member name."""

REDOP_ALIASES: dict[str, str] = {"mulsum": "premulsum", "product": "prod", "premul_sum": "premulsum"}

ALL_REDOPS: tuple[str, ...] = tuple(REDOPS)
BITWISE_REDOPS: frozenset[str] = frozenset({"band", "bor", "bxor"})

PREMUL_FACTOR = 2.0
"""The factor of ``premulsum``: a power of two, so that the expected result is exact in every dtype."""

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kKmMgGtT]?)(?:i?[bB])?\s*$")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Parse a byte count as nccl-tests does: ``8``, ``512K``, ``32M``, ``1G`` (binary units).

    A trailing ``B``/``iB`` is accepted (``64MB``, ``64MiB``), and fractions (``0.5M``).

    Raises:
        ValueError: ``text`` is not a size.
    """
    m = _SIZE_RE.match(text)
    if m is None:
        raise ValueError(f"invalid size {text!r}: expected a byte count like 8, 512K, 32M or 1G")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def size_sweep(minbytes: int, maxbytes: int, stepbytes: int, stepfactor: int,
               limit: int = 100_000) -> list[int]:
    """The sizes nccl-tests visits: ``minbytes`` up to ``maxbytes``, times ``stepfactor``
    when it is > 1, else plus ``stepbytes``.

    Raises:
        ValueError: an argument is out of range, or the sweep has more than ``limit`` sizes.
    """
    if minbytes < 0:
        raise ValueError(f"minbytes must be >= 0; got {minbytes}")
    if maxbytes < minbytes:
        raise ValueError(f"invalid sizes for minbytes and maxbytes: {minbytes} > {maxbytes}")
    if stepfactor < 1:
        raise ValueError(f"stepfactor must be >= 1; got {stepfactor}")
    if stepfactor == 1 and stepbytes <= 0 and maxbytes > minbytes:
        raise ValueError(f"stepbytes must be > 0 when stepfactor is 1; got {stepbytes}")
    if stepfactor > 1 and minbytes == 0 and maxbytes > 0:
        raise ValueError("minbytes must be > 0 when stepfactor > 1 (0 times a factor stays 0)")
    sizes: list[int] = []
    size = minbytes
    while size <= maxbytes:
        sizes.append(size)
        if len(sizes) > limit:
            raise ValueError(f"the size sweep {minbytes}..{maxbytes} has more than {limit} sizes; "
                             "raise -i/--stepbytes or use -f/--stepfactor")
        if minbytes == maxbytes:
            break
        size = size * stepfactor if stepfactor > 1 else size + stepbytes
    return sizes


def _resolve(name: str, what: str, aliases: Mapping[str, str], known: Collection[str],
             every: tuple[str, ...]) -> tuple[str, ...]:
    key = name.strip().lower()
    if key == "all":
        return every
    key = aliases.get(key, key)
    if key not in known:
        raise ValueError(f"unknown {what} {name!r}; expected one of {', '.join(every)} or all")
    return (key,)


def resolve_datatypes(name: str) -> tuple[str, ...]:
    """``-d`` value -> nccl-tests datatype names (``all`` gives every one).

    Raises:
        ValueError: unknown name.
    """
    return _resolve(name, "datatype", DATATYPE_ALIASES, DATATYPES, ALL_DATATYPES)


def resolve_redops(name: str) -> tuple[str, ...]:
    """``-o`` value -> reduction names (``all`` gives every one).

    Raises:
        ValueError: unknown name.
    """
    return _resolve(name, "reduction", REDOP_ALIASES, REDOPS, ALL_REDOPS)


def is_integer_type(datatype: str) -> bool:
    """True for the integer datatypes (the only ones bitwise reductions accept)."""
    return DATATYPES[datatype].startswith(("int", "uint"))


def redop_defined(redop: str, datatype: str) -> bool:
    """Whether gpucoll defines ``redop`` on ``datatype``: bitwise reductions need integers,
    premulsum needs floats. ``-o all`` runs each datatype with the reductions defined on it."""
    if redop in BITWISE_REDOPS:
        return is_integer_type(datatype)
    if redop == "premulsum":
        return not is_integer_type(datatype)
    return True


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run, as the CLI parsed it.

    Attributes:
        op: the collective (see ``gpucoll.bench.ops.OPS``).
        sizes: the byte sizes to measure (from :func:`size_sweep`).
        minbytes, maxbytes, stepbytes, stepfactor: the sweep as given (for the header).
        iters: timed iterations per size.
        warmup_iters: untimed iterations per size before the timed ones.
        check: number of checked runs per size (0 turns the check off, as ``-c 0``).
        datatypes: nccl-tests datatype names.
        redops: reduction names (ignored by ops that do not reduce).
        root: root rank of rooted ops; -1 runs every root in turn.
        blocking: wait for each op before issuing the next (``-z 1``).
        cudagraph: number of CUDA graph launches (``-G``); 0 runs without graphs.
        backend: "cpu" or "nccl" (already resolved from "auto").
        timeout: process-group timeout in seconds.
        corrupt: test hook: perturb each checked output so the check must report wrong
            elements (set by the ``GPUCOLL_BENCH_CORRUPT=1`` environment variable).
        average: how a time is combined over ranks (``-a``): 0 rank 0's, 1 the mean,
            2 the minimum, 3 the maximum.
        run_cycles: how many times the whole sweep runs (``-N``).
        report_cputime: time only the issuing of the ops, not their completion (``-C 1``).
        nthreads, ngpus: nccl-tests' ``-t`` and ``-g`` as given (the local job ran
            ``nthreads * ngpus`` ranks, one process and one GPU each); the header shows them.
        agg_iters: ops issued inside one group call per timed iteration (``-m``), through
            ``gpucoll.coalescing()``; the time per op is divided by it.
        local_register: ``-R``: 0 plain buffers; 1 buffers from the NCCL memory pool,
            registered with the communicator (``ncclCommRegister``); 2 registered as
            symmetric windows (``ncclCommWindowRegister``, NCCL >= 2.27).
    """

    op: str
    sizes: tuple[int, ...]
    minbytes: int = 32 << 20
    maxbytes: int = 32 << 20
    stepbytes: int = 1 << 20
    stepfactor: int = 1
    iters: int = 20
    warmup_iters: int = 5
    check: int = 1
    datatypes: tuple[str, ...] = ("float",)
    redops: tuple[str, ...] = ("sum",)
    root: int = 0
    blocking: bool = False
    cudagraph: int = 0
    backend: str = "cpu"
    timeout: float = 300.0
    corrupt: bool = False
    average: int = 3
    run_cycles: int = 1
    report_cputime: bool = False
    nthreads: int = 1
    ngpus: int = 1
    agg_iters: int = 1
    local_register: int = 0

    def __post_init__(self) -> None:
        if self.iters < 1:
            raise ValueError(f"iters must be >= 1; got {self.iters}")
        if self.warmup_iters < 0:
            raise ValueError(f"warmup_iters must be >= 0; got {self.warmup_iters}")
        if self.check < 0:
            raise ValueError(f"check must be >= 0; got {self.check}")
        if self.cudagraph < 0:
            raise ValueError(f"cudagraph must be >= 0; got {self.cudagraph}")
        if self.root < -1:
            raise ValueError(f"root must be a rank or -1 (every root); got {self.root}")
        if self.average not in (0, 1, 2, 3):
            raise ValueError(f"average must be 0 (rank 0), 1 (mean), 2 (min) or 3 (max); got {self.average}")
        if self.run_cycles < 1:
            raise ValueError(f"run_cycles must be >= 1; got {self.run_cycles}")
        if self.nthreads < 1 or self.ngpus < 1:
            raise ValueError(f"nthreads and ngpus must be >= 1; got {self.nthreads} and {self.ngpus}")
        if self.agg_iters < 1:
            raise ValueError(f"agg_iters must be >= 1; got {self.agg_iters}")
        if self.local_register not in (0, 1, 2):
            raise ValueError(f"local_register must be 0 (off), 1 (local) or 2 (symmetric); got {self.local_register}")
        if self.backend not in ("cpu", "nccl"):
            raise ValueError(f"backend must be 'cpu' or 'nccl'; got {self.backend!r}")
        for d in self.datatypes:
            if d not in DATATYPES:
                raise ValueError(f"unknown datatype {d!r}; expected one of {', '.join(ALL_DATATYPES)}")
        for r in self.redops:
            if r not in REDOPS:
                raise ValueError(f"unknown reduction {r!r}; expected one of {', '.join(ALL_REDOPS)}")
