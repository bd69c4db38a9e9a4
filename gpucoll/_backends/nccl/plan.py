"""How each op becomes NCCL calls, kernel launches and copies: pure Python, no CUDA.

A *plan* is a list of phases; a phase is ``(pre, calls, post)``: local steps, then
the NCCL calls (issued as one ``ncclGroupStart/End`` group when there are several),
then local steps. Everything runs in order on the group's communication stream.
Plans of several ops merge phase by phase into one plan (coalescing), which is why
an op that needs two rounds of communication (the kernel-reduction path) is two
phases rather than one.

Steps are tuples, cheap to build on the hot path:

NCCL calls (``op`` is an ``ncclRedOp_t`` or a :class:`Premul` created per call)::

    ("all_reduce", send, recv, count, dtype, op)
    ("reduce", send, recv, count, dtype, op, root)
    ("broadcast", send, recv, count, dtype, root)
    ("all_gather", send, recv, count, dtype)
    ("reduce_scatter", send, recv, count, dtype, op)
    ("all_to_all", send, recv, count, dtype)
    ("gather", send, recv, count, dtype, root)
    ("scatter", send, recv, count, dtype, root)
    ("send", ptr, count, dtype, peer)
    ("recv", ptr, count, dtype, peer)

Local steps::

    ("copy", dst, src, nbytes)
    ("kernel", name, n, args)        # args per gpucoll._backends.nccl.kernel_loader.SIGNATURES

Every rank must issue the same collectives in the same order, so a choice between
two NCCL strategies may depend only on facts that every rank shares (shapes, op,
dtype, the NCCL version), never on a rank's own memory layout: that only decides
whether a temporary buffer and copies are needed around the same calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence, Union

from ..._buffer import Buffer, DType
from ..._reduce_op import PremulSum, ReduceOp, ReduceOpLike
from .lib import MOVE_DTYPE, NCCL_DTYPES, OP_AVG, OP_MAX, OP_MIN, OP_PROD, OP_SUM, Features
from .values import encode_scalar

__all__ = ["Premul", "Reduction", "Planner", "Phase", "Plan", "merge", "calls_only", "KTYPES", "kernel_name"]

Step = tuple[Any, ...]
Phase = tuple[list[Step], list[Step], list[Step]]
Plan = list[Phase]


@dataclass(frozen=True)
class Premul:
    """A PreMulSum operator to create for one call: ``scalar`` encoded in ``dtype``."""

    scalar: bytes
    dtype: int


NcclOp = Union[int, Premul]

# Kernel type suffixes (kernels/reduce.cu); bool travels as uint8 0/1.
KTYPES: dict[str, str] = {
    "bool": "u8", "int8": "i8", "uint8": "u8", "int16": "i16", "uint16": "u16",
    "int32": "i32", "uint32": "u32", "int64": "i64", "uint64": "u64",
    "float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64",
    "float8_e4m3fn": "f8e4m3", "float8_e5m2": "f8e5m2",
}

_NATIVE_OPS = {ReduceOp.SUM: OP_SUM, ReduceOp.PRODUCT: OP_PROD, ReduceOp.MIN: OP_MIN, ReduceOp.MAX: OP_MAX}
_KERNEL_OPS = {ReduceOp.SUM: "sum", ReduceOp.PRODUCT: "prod", ReduceOp.MIN: "min", ReduceOp.MAX: "max",
               ReduceOp.BAND: "band", ReduceOp.BOR: "bor", ReduceOp.BXOR: "bxor", ReduceOp.AVG: "sum",
               ReduceOp.PREMUL_SUM: "sum"}
_BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)
_FP8 = ("float8_e4m3fn", "float8_e5m2")


def kernel_name(family: str, ktype: str, op: str = "") -> str:
    """The extern "C" name of a kernel in kernels/reduce.cu."""
    return f"gpucoll_{family}_{op}_{ktype}" if op else f"gpucoll_{family}_{ktype}"


@dataclass(frozen=True)
class Reduction:
    """How one (dtype, op) pair reduces on this NCCL.

    Attributes:
        dtype: NCCL datatype of the native call (the component type for complex).
        mult: NCCL elements per array element (2 for complex, else 1).
        itemsize: bytes per array element.
        op: the native NCCL op, or None for the kernel path (exchange chunks with
            send/recv or ncclAlltoAll, fold them with a kernel, all-gather the result).
        kop: the kernel path's fold ("sum", "band", ...).
        ktype: kernel type suffix for fold/divide/scale kernels ('' if none needed).
        scale: multiply each rank's input by this before reducing (PREMUL_SUM without
            NCCL's PreMulSum), or None.
        divide: truncating division of the sum by the group size (AVG on integers).
    """

    dtype: int
    mult: int
    itemsize: int
    op: NcclOp | None
    kop: str = ""
    ktype: str = ""
    scale: float | None = None
    divide: bool = False


def _refuse(dtype: DType, op: ReduceOpLike, why: str) -> TypeError:
    name = "PREMUL_SUM" if isinstance(op, PremulSum) else op.name
    return TypeError(f"op={name} on dtype {dtype.name} is not supported by the NCCL backend: {why}")


def resolve_reduction(dtype: DType, op: ReduceOpLike, size: int, features: Features,
                      fp8_reductions: bool) -> Reduction:
    """Decide how ``op`` reduces ``dtype`` arrays (see docs/nccl-backend.md, "Reductions").

    Args:
        dtype: the arrays' element type.
        op: a validated ReduceOp or PremulSum.
        size: the group size (AVG).
        features: the loaded NCCL's features.
        fp8_reductions: NCCL can reduce float8 on this device (NCCL >= 2.24 and sm_90+).

    Raises:
        TypeError: the combination is undefined (bitwise on floats, MIN on complex,
            AVG on bool) or this NCCL/GPU cannot do it (float8 reductions before sm_90).
    """
    base = op.op if isinstance(op, PremulSum) else op
    factor = op.factor if isinstance(op, PremulSum) else None
    name, kind, isz = dtype.name, dtype.kind, dtype.itemsize
    if base in _BITWISE:
        if kind not in "biu":
            raise _refuse(dtype, op, "bitwise ops need an integer or bool array")
        if kind == "b" and base is not ReduceOp.BXOR:
            # On 0/1 bytes, and = min and or = max: NCCL does those natively.
            return Reduction(MOVE_DTYPE, 1, 1, OP_MIN if base is ReduceOp.BAND else OP_MAX)
        return Reduction(MOVE_DTYPE, 1, isz, None, _KERNEL_OPS[base], KTYPES[name])
    if kind == "b":
        if base in (ReduceOp.AVG, ReduceOp.PREMUL_SUM):
            raise _refuse(dtype, op, "use SUM (logical or) or a numeric dtype")
        # NumPy's bool semantics: SUM/MAX are or, PRODUCT/MIN are and.
        return Reduction(MOVE_DTYPE, 1, 1, OP_MAX if base in (ReduceOp.SUM, ReduceOp.MAX) else OP_MIN)
    if kind == "c":
        comp = "float32" if name == "complex64" else "float64"
        if base not in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PREMUL_SUM):
            raise _refuse(dtype, op, "complex arrays reduce with SUM, AVG or PREMUL_SUM only")
        return _float_reduction(dtype, comp, 2, base, factor, size, features, op)
    if name in _FP8:
        if not fp8_reductions:
            raise _refuse(dtype, op, "float8 reductions need NCCL >= 2.24 on a GPU of compute capability "
                          f">= 9.0 (this is NCCL {'.'.join(map(str, features.version))}); "
                          "data movement of float8 works everywhere")
        if base is ReduceOp.PREMUL_SUM and not features.premul_sum:
            raise _refuse(dtype, op, "needs NCCL's PreMulSum (NCCL >= 2.11 and its library found)")
        return _float_reduction(dtype, name, 1, base, factor, size, features, op)
    if kind == "f":
        return _float_reduction(dtype, name, 1, base, factor, size, features, op)
    # integers
    native = name in NCCL_DTYPES  # NCCL has no 16-bit integers
    nccl_dtype = NCCL_DTYPES[name] if native else MOVE_DTYPE
    scale: float | None = None
    if base is ReduceOp.PREMUL_SUM:
        assert factor is not None
        if not float(factor).is_integer():
            raise _refuse(dtype, op, f"integer arrays need an integral factor; got {factor!r}")
        scale = float(factor)
    if native and base is ReduceOp.AVG and features.avg:
        # ncclAvg on integers (FuncSumPostDiv in NCCL's reduce_kernel.h): the sum wraps
        # in the type, then |sum| / n is negated back, truncating toward zero: exactly
        # what the avg_trunc kernel below computes for NCCL < 2.10 and 16-bit integers.
        return Reduction(nccl_dtype, 1, isz, OP_AVG)
    if native:
        nop = _NATIVE_OPS.get(base, OP_SUM)
        return Reduction(nccl_dtype, 1, isz, nop, "", KTYPES[name], scale, base is ReduceOp.AVG)
    return Reduction(nccl_dtype, 1, isz, None, _KERNEL_OPS[base], KTYPES[name], scale,
                     base is ReduceOp.AVG)


def _float_reduction(dtype: DType, comp: str, mult: int, base: ReduceOp, factor: float | None,
                     size: int, features: Features, op: ReduceOpLike) -> Reduction:
    nccl_dtype = NCCL_DTYPES[comp]
    isz = dtype.itemsize
    if base in _NATIVE_OPS:
        return Reduction(nccl_dtype, mult, isz, _NATIVE_OPS[base])
    if size == 1 and comp in KTYPES:
        # NCCL's one-rank path (ncclLaunchOneRank, src/device/onerank.cu) runs a PreMulSum
        # (float AVG is one, by 1/n) through its own kernel, which gpucoll does not use: on
        # an H200 it refused float8 (its fp8 cases are compiled out of the host pass) and,
        # in NCCL 2.28.9, left the last element of 4,099 float64 (and complex64) unscaled.
        # On one rank AVG is the input itself and PREMUL_SUM a scale: NCCL's SUM (a copy)
        # and gpucoll's scale kernel, which rounds the factor to the type as NCCL does.
        return Reduction(nccl_dtype, mult, isz, OP_SUM, "", KTYPES[comp],
                         None if base is ReduceOp.AVG else factor)
    if base is ReduceOp.AVG:
        if features.avg:
            return Reduction(nccl_dtype, mult, isz, OP_AVG)
        factor = 1.0 / size  # before ncclAvg: scale by 1/n, then sum
    assert factor is not None
    from ..._buffer import dtype_by_name

    if features.premul_sum:
        return Reduction(nccl_dtype, mult, isz, Premul(encode_scalar(factor, dtype_by_name(comp)), nccl_dtype))
    if comp not in KTYPES:
        raise _refuse(dtype, op, "needs NCCL's PreMulSum (NCCL >= 2.11 and its library found)")
    return Reduction(nccl_dtype, mult, isz, OP_SUM, "", KTYPES[comp], factor)


def adjacent(bufs: Sequence[Buffer], nbytes: int) -> bool:
    """True when ``bufs`` lie back to back in memory, each ``nbytes`` long."""
    if not bufs:
        return False
    base = bufs[0].ptr
    return all(b.ptr == base + i * nbytes and b.nbytes == nbytes for i, b in enumerate(bufs))


def merge(plans: Sequence[Plan]) -> Plan:
    """One plan that runs ``plans`` together: phase k of each joins one NCCL group."""
    if len(plans) == 1:
        return plans[0]
    out: Plan = []
    for k in range(max((len(p) for p in plans), default=0)):
        pre: list[Step] = []
        calls: list[Step] = []
        post: list[Step] = []
        for p in plans:
            if k < len(p):
                pre += p[k][0]
                calls += p[k][1]
                post += p[k][2]
        out.append((pre, calls, post))
    return out


class Planner:
    """Builds plans for one communicator.

    Args:
        rank, size: this rank and the communicator's size.
        features: the loaded NCCL's features.
        fp8_reductions: NCCL can reduce float8 on this device.
        alloc: ``alloc(nbytes) -> device pointer`` of a temporary kept alive until the
            op completes (the caller ties its lifetime to the Work).
    """

    def __init__(self, rank: int, size: int, features: Features, fp8_reductions: bool,
                 alloc: Callable[[int], int]) -> None:
        self.rank = rank
        self.size = size
        self.features = features
        self.fp8_reductions = fp8_reductions
        self.alloc = alloc
        self._cache: dict[tuple[str, ReduceOp], Reduction] = {}

    def reduction(self, dtype: DType, op: ReduceOpLike) -> Reduction:
        if type(op) is ReduceOp:  # a PremulSum is an instance too (torch), with its own factor
            key = (dtype.name, op)
            red = self._cache.get(key)
            if red is None:
                red = self._cache[key] = resolve_reduction(dtype, op, self.size, self.features,
                                                           self.fp8_reductions)
            return red
        return resolve_reduction(dtype, op, self.size, self.features, self.fp8_reductions)

    # ----- local steps -----

    @staticmethod
    def _scale(red: Reduction, ptr: int, n: int) -> Step:
        assert red.scale is not None
        return ("kernel", kernel_name("scale", red.ktype), n * red.mult, (ptr, n * red.mult, red.scale))

    def _divide(self, red: Reduction, ptr: int, n: int) -> Step:
        return ("kernel", kernel_name("avg_trunc", red.ktype), n, (ptr, n, self.size))

    @staticmethod
    def _fold(red: Reduction, rows: int, out: int, n: int, nrows: int, stride: int) -> Step:
        return ("kernel", kernel_name("reduce", red.ktype, red.kop), n, (rows, out, n, nrows, stride))

    def _scaled_copy(self, red: Reduction, src: int, n: int, pre: list[Step]) -> int:
        tmp = self.alloc(n * red.itemsize)
        pre.append(("copy", tmp, src, n * red.itemsize))
        pre.append(self._scale(red, tmp, n))
        return tmp

    # ----- reductions -----

    def all_reduce(self, buf: Buffer, op: ReduceOpLike, src: Buffer | None = None) -> Plan:
        """``buf`` = the reduction of every rank's ``buf`` (in place) or, with ``src``
        (same dtype and size), of every rank's ``src`` (out of place; ``src`` is left
        alone)."""
        red = self.reduction(buf.dtype, op)
        n, p = buf.numel, buf.ptr
        if n == 0:
            return []
        s = p if src is None else src.ptr
        pre: list[Step] = []
        if s != p and (red.scale is not None or red.op is None):
            # The fallbacks below work in place: start from a copy of the input.
            pre.append(("copy", p, s, buf.nbytes))
            s = p
        # all_reduce overwrites buf anyway, so PREMUL_SUM's fallback scales it in place.
        if red.scale is not None:
            pre.append(self._scale(red, p, n))
        if red.op is None:
            return self._kernel_all_reduce(red, p, n, pre)
        post = [self._divide(red, p, n)] if red.divide else []
        return [(pre, [("all_reduce", s, p, n * red.mult, red.dtype, red.op)], post)]

    def _exchange(self, red: Reduction, srcs: Sequence[int], counts: Sequence[int], chunk: int,
                  base: int | None) -> tuple[int, list[Step], list[Step]]:
        """Send chunk j of the input (at ``srcs[j]``, ``counts[j]`` elements) to rank j;
        receive every rank's chunk ``rank`` into row i of a temporary ``size x chunk``
        array. Returns (temporary, pre steps, calls)."""
        isz, r = red.itemsize, self.rank
        rows = self.alloc(self.size * chunk * isz)
        if base is not None and self.features.all_to_all and all(c == chunk for c in counts):
            return rows, [], [("all_to_all", base, rows, chunk * isz, MOVE_DTYPE)]
        pre: list[Step] = []
        calls: list[Step] = []
        mine = counts[r]
        for j in range(self.size):
            if j == r:
                if mine:
                    pre.append(("copy", rows + r * chunk * isz, srcs[r], mine * isz))
                continue
            if counts[j]:
                calls.append(("send", srcs[j], counts[j] * isz, MOVE_DTYPE, j))
            if mine:
                calls.append(("recv", rows + j * chunk * isz, mine * isz, MOVE_DTYPE, j))
        return rows, pre, calls

    def _chunks(self, count: int) -> tuple[int, list[int]]:
        chunk = -(-count // self.size)
        return chunk, [max(0, min(chunk, count - j * chunk)) for j in range(self.size)]

    def _kernel_all_reduce(self, red: Reduction, p: int, count: int, pre: list[Step]) -> Plan:
        # Reduce-scatter by exchange + fold, then all-gather: bandwidth like NCCL's ring,
        # temporary memory about the size of the array.
        isz, r = red.itemsize, self.rank
        chunk, counts = self._chunks(count)
        even = count % self.size == 0
        srcs = [p + j * chunk * isz for j in range(self.size)]
        rows, pre1, calls = self._exchange(red, srcs, counts, chunk, p if even else None)
        mine = counts[r]
        out = p + r * chunk * isz if even else rows + r * chunk * isz
        post: list[Step] = []
        if mine:
            post.append(self._fold(red, rows, out, mine, self.size, chunk))
            if red.divide:
                post.append(self._divide(red, out, mine))
        if even:
            gather: Phase = ([], [("all_gather", out, p, chunk * isz, MOVE_DTYPE)], [])
        else:
            gather = ([], [("all_gather", out, rows, chunk * isz, MOVE_DTYPE)],
                      [("copy", p, rows, count * isz)])
        return [(pre + pre1, calls, post), gather]

    def reduce(self, buf: Buffer, dst: int, op: ReduceOpLike) -> Plan:
        red = self.reduction(buf.dtype, op)
        n, p, r = buf.numel, buf.ptr, self.rank
        if n == 0:
            return []
        pre: list[Step] = []
        src = p
        if red.scale is not None:
            # Only dst's buffer may change: scale a copy.
            src = self._scaled_copy(red, p, n, pre)
        if red.op is not None:
            post = [self._divide(red, p, n)] if red.divide and r == dst else []
            return [(pre, [("reduce", src, p, n * red.mult, red.dtype, red.op, dst)], post)]
        isz = red.itemsize
        chunk, counts = self._chunks(n)
        srcs = [src + j * chunk * isz for j in range(self.size)]
        rows, pre1, calls = self._exchange(red, srcs, counts, chunk, src if n % self.size == 0 else None)
        mine = counts[r]
        out = rows + r * chunk * isz
        post1: list[Step] = []
        if mine:
            post1.append(self._fold(red, rows, out, mine, self.size, chunk))
            if red.divide:
                post1.append(self._divide(red, out, mine))
        calls2: list[Step] = []
        post2: list[Step] = []
        if r == dst:
            for j in range(self.size):
                if j != r and counts[j]:
                    calls2.append(("recv", p + j * chunk * isz, counts[j] * isz, MOVE_DTYPE, j))
            if mine:
                post2.append(("copy", p + r * chunk * isz, out, mine * isz))
        elif mine:
            calls2.append(("send", out, mine * isz, MOVE_DTYPE, dst))
        return [(pre + pre1, calls, post1), ([], calls2, post2)]

    def reduce_scatter(self, out: Buffer, inputs: Sequence[Buffer], op: ReduceOpLike) -> Plan:
        nb = out.nbytes
        if any(b.nbytes != nb for b in inputs):
            return self._reduce_scatter_uneven(out, inputs, op)
        base = inputs[0].ptr if adjacent(inputs, nb) else None
        return self._reduce_scatter(out, [b.ptr for b in inputs], base, op)

    def _reduce_scatter_uneven(self, out: Buffer, inputs: Sequence[Buffer], op: ReduceOpLike) -> Plan:
        """torch's list reduce_scatter with chunk j of rank j's own size: one grouped
        ncclReduce per rank (root j gets chunk j). Only where NCCL reduces natively with no
        pre-scaling (SUM, PRODUCT, MIN, MAX, AVG; not emulated or PREMUL_SUM ops)."""
        red = self.reduction(out.dtype, op)
        if red.op is None or red.scale is not None:
            raise ValueError(f"reduce_scatter with input_list chunks of different sizes needs a reduction NCCL "
                             f"runs natively (SUM, PRODUCT, MIN, MAX, AVG) for dtype {out.dtype.name}; got "
                             f"{getattr(op, 'name', op)}: pass chunks of equal size")
        r = self.rank
        calls: list[Step] = []
        for j, b in enumerate(inputs):
            if b.numel:
                calls.append(("reduce", b.ptr, out.ptr if j == r else b.ptr, b.numel * red.mult, red.dtype,
                              red.op, j))
        post = [self._divide(red, out.ptr, out.numel)] if red.divide and out.numel else []
        return [([], calls, post)] if calls else []

    def reduce_scatter_single(self, out: Buffer, inp: Buffer, op: ReduceOpLike) -> Plan:
        nb = out.nbytes
        return self._reduce_scatter(out, [inp.ptr + j * nb for j in range(self.size)], inp.ptr, op)

    def _reduce_scatter(self, out: Buffer, chunks: list[int], base: int | None, op: ReduceOpLike) -> Plan:
        red = self.reduction(out.dtype, op)
        c = out.numel
        if c == 0:
            return []
        nb = c * red.itemsize
        pre: list[Step] = []
        if base is None or red.scale is not None:
            packed = self.alloc(self.size * nb)
            pre += [("copy", packed + j * nb, ptr, nb) for j, ptr in enumerate(chunks)]
            if red.scale is not None:
                pre.append(self._scale(red, packed, self.size * c))
            base = packed
            chunks = [packed + j * nb for j in range(self.size)]
        if red.op is not None:
            post = [self._divide(red, out.ptr, c)] if red.divide else []
            return [(pre, [("reduce_scatter", base, out.ptr, c * red.mult, red.dtype, red.op)], post)]
        rows, pre1, calls = self._exchange(red, chunks, [c] * self.size, c, base)
        post1 = [self._fold(red, rows, out.ptr, c, self.size, c)]
        if red.divide:
            post1.append(self._divide(red, out.ptr, c))
        return [(pre + pre1, calls, post1)]

    # ----- data movement -----

    def broadcast(self, buf: Buffer, src: int) -> Plan:
        if not buf.nbytes:
            return []
        return [([], [("broadcast", buf.ptr, buf.ptr, buf.nbytes, MOVE_DTYPE, src)], [])]

    def all_gather_single(self, out: Buffer, inp: Buffer) -> Plan:
        if not inp.nbytes:
            return []
        return [([], [("all_gather", inp.ptr, out.ptr, inp.nbytes, MOVE_DTYPE)], [])]

    def all_gather(self, outs: Sequence[Buffer], inp: Buffer) -> Plan:
        nb = inp.nbytes
        if not nb:
            return []
        if adjacent(outs, nb):
            return [([], [("all_gather", inp.ptr, outs[0].ptr, nb, MOVE_DTYPE)], [])]
        tmp = self.alloc(self.size * nb)
        post: list[Step] = [("copy", o.ptr, tmp + j * nb, nb) for j, o in enumerate(outs)]
        return [([], [("all_gather", inp.ptr, tmp, nb, MOVE_DTYPE)], post)]

    def gather(self, outs: Sequence[Buffer] | None, inp: Buffer, dst: int) -> Plan:
        nb, r = inp.nbytes, self.rank
        if not nb:
            return []
        if r == dst and outs is None:
            raise ValueError(f"gather: outs must be given on the destination rank {dst}")
        if self.features.gather:
            recv, post = inp.ptr, []
            if r == dst:
                assert outs is not None
                if adjacent(outs, nb):
                    recv = outs[0].ptr
                else:
                    recv = self.alloc(self.size * nb)
                    post = [("copy", o.ptr, recv + j * nb, nb) for j, o in enumerate(outs)]
            return [([], [("gather", inp.ptr, recv, nb, MOVE_DTYPE, dst)], post)]
        if r != dst:
            return [([], [("send", inp.ptr, nb, MOVE_DTYPE, dst)], [])]
        assert outs is not None
        pre = [("copy", outs[r].ptr, inp.ptr, nb)] if outs[r].ptr != inp.ptr else []
        calls: list[Step] = [("recv", outs[j].ptr, nb, MOVE_DTYPE, j) for j in range(self.size) if j != r]
        return [(pre, calls, [])]

    def scatter(self, out: Buffer, inputs: Sequence[Buffer] | None, src: int) -> Plan:
        nb, r = out.nbytes, self.rank
        if not nb:
            return []
        if r == src and inputs is None:
            raise ValueError(f"scatter: inputs must be given on the source rank {src}")
        if self.features.scatter:
            send, pre = out.ptr, []
            if r == src:
                assert inputs is not None
                if adjacent(inputs, nb):
                    send = inputs[0].ptr
                else:
                    send = self.alloc(self.size * nb)
                    pre = [("copy", send + j * nb, b.ptr, nb) for j, b in enumerate(inputs)]
            return [(pre, [("scatter", send, out.ptr, nb, MOVE_DTYPE, src)], [])]
        if r != src:
            return [([], [("recv", out.ptr, nb, MOVE_DTYPE, src)], [])]
        assert inputs is not None
        pre = [("copy", out.ptr, inputs[r].ptr, nb)] if inputs[r].ptr != out.ptr else []
        calls: list[Step] = [("send", inputs[j].ptr, nb, MOVE_DTYPE, j) for j in range(self.size) if j != r]
        return [(pre, calls, [])]

    def all_to_all(self, outs: Sequence[Buffer], inputs: Sequence[Buffer]) -> Plan:
        # Always send/recv: a rank cannot know whether its peers' lists are uniform,
        # and ncclAlltoAll would have to be chosen by every rank alike.
        r = self.rank
        pre: list[Step] = []
        calls: list[Step] = []
        for j in range(self.size):
            if j == r:
                if outs[r].nbytes and outs[r].ptr != inputs[r].ptr:
                    pre.append(("copy", outs[r].ptr, inputs[r].ptr, outs[r].nbytes))
                continue
            if inputs[j].nbytes:
                calls.append(("send", inputs[j].ptr, inputs[j].nbytes, MOVE_DTYPE, j))
            if outs[j].nbytes:
                calls.append(("recv", outs[j].ptr, outs[j].nbytes, MOVE_DTYPE, j))
        return [(pre, calls, [])]

    def all_to_all_single(self, out: Buffer, inp: Buffer, out_counts: Sequence[int],
                          in_counts: Sequence[int]) -> Plan:
        r, isz = self.rank, inp.dtype.itemsize
        if out_counts[r] != in_counts[r]:
            raise ValueError(f"all_to_all_single: rank {r} sends itself {in_counts[r]} elements but "
                             f"expects {out_counts[r]}; out_counts[{r}] must equal in_counts[{r}]")
        pre: list[Step] = []
        calls: list[Step] = []
        in_off = out_off = 0
        for j in range(self.size):
            ci, co = in_counts[j], out_counts[j]
            if j == r:
                if ci and out.ptr + out_off != inp.ptr + in_off:
                    pre.append(("copy", out.ptr + out_off, inp.ptr + in_off, ci * isz))
            else:
                if ci:
                    calls.append(("send", inp.ptr + in_off, ci * isz, MOVE_DTYPE, j))
                if co:
                    calls.append(("recv", out.ptr + out_off, co * isz, MOVE_DTYPE, j))
            in_off += ci * isz
            out_off += co * isz
        return [(pre, calls, [])]

    # ----- point to point -----

    @staticmethod
    def p2p(ops: Sequence[tuple[str, Buffer, int]]) -> Plan:
        calls: list[Step] = []
        for kind, buf, peer in ops:
            if kind not in ("send", "recv"):
                raise ValueError(f"a point-to-point op must be 'send' or 'recv'; got {kind!r}")
            if buf.nbytes:
                calls.append((kind, buf.ptr, buf.nbytes, MOVE_DTYPE, peer))
        return [([], calls, [])]


def calls_only(plan: Plan) -> bool:
    """True for a plan of NCCL calls alone: no local copy or kernel, no PreMul operator
    made per call, so it can be issued again for the same key as it is."""
    return all(not pre and not post and not any(isinstance(x, Premul) for step in calls for x in step)
               for pre, calls, post in plan)
