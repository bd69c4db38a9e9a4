"""The compiled handler of small collectives inside ``jax.jit`` (``native.c``), and each
group's in-jit channel.

``native.c`` is built on first use with the machine's C compiler (``cc``, or ``$CC``),
against the ``c_api.h`` that ``jax.ffi.include_dir()`` ships, into a per-user cache
(``$GPUCOLL_CACHE_DIR``, else ``$XDG_CACHE_HOME/gpucoll``, else ``~/.cache/gpucoll``),
keyed by the source's and the header's digest. Nothing is compiled at install.
Without a compiler (or with ``GPUCOLL_JAX_NATIVE=0``) every op runs through the
Python handler as before; ``GPUCOLL_JAX_NATIVE=1`` makes a failed build an error.

A group's channel is set up at its first collective inside jit, on every rank alike
(all ranks reach that op, in program order): the ranks say over the group's store
whether each can use it (the library loaded, every rank on one host, no DETAIL debug
level); if all can, they map a shared segment. From then on every in-jit collective
of the group takes one numbered step on the channel (see ``native.c``): the kinds in
:data:`KINDS` whose input is at most :data:`SLOT_BYTES` bytes run there, without
Python; every other collective takes the step for its signature check, then runs in
Python.
If some rank cannot, no rank uses the channel. p2p ops never use it.
"""

from __future__ import annotations

import ctypes as C
import math
import mmap
import os
import threading
import time
import warnings
from typing import Any, NamedTuple

from .._backends.cpu.backend import CPUBackend
from .._backends.cpu.reduce import make_reducer
from .._backends.cpu.shm import ShmUnavailable, get_while_alive, map_segment
from .._backends.cpu.signatures import Signatures
from .._backends.mismatch import SignatureMismatch
from .._buffer import DTYPES
from .._debug import DebugLevel, get_debug_level
from .._env import JAX_NATIVE_ENV, cbuild
from .._group import ProcessGroup
from .._reduce_op import ReduceOp
from ..errors import DistBackendError
from ..store.prefix import PrefixStore

ENV = JAX_NATIVE_ENV

SLOT_BYTES = 64 << 10
"""The largest op (bytes) the compiled handler runs; larger ones run in Python."""

KINDS = {"all_reduce": 0, "broadcast": 1, "barrier": 2, "reduce": 3, "all_gather": 4, "reduce_scatter": 5,
         "gather": 6, "scatter": 7}  # the kinds the compiled handler runs (native.c's K_*)
_REDUCING = frozenset({"all_reduce", "reduce", "reduce_scatter"})
P2P = frozenset({"send", "recv"})
_REDUCE_OPS: tuple[ReduceOp, ...] = tuple(ReduceOp)  # an op attribute's index (handler.OPS)
_OPS = {ReduceOp.SUM: 0, ReduceOp.PRODUCT: 1, ReduceOp.MIN: 2, ReduceOp.MAX: 3, ReduceOp.BAND: 4,
        ReduceOp.BOR: 5, ReduceOp.BXOR: 6, ReduceOp.AVG: 7}
_DTYPES = {"bool": 0, "int8": 1, "uint8": 2, "int16": 3, "uint16": 4, "int32": 5, "uint32": 6, "int64": 7,
           "uint64": 8, "float16": 9, "bfloat16": 10, "float32": 11, "float64": 12}
_CTL = 4096          # native.c's CTL_OFF: the abort word's page
_REC = 256           # native.c's REC_BYTES
_STRIDE = (16 + SLOT_BYTES + 63) // 64 * 64  # native.c's slot_stride: HDR_BYTES, the data, to 64 bytes
# native.c's error codes, as errors name them
_E_MISMATCH, _E_TIMEOUT, _E_DEAD, _E_ABORTED, _E_CLOSED, _E_BROKEN, _E_CONCURRENT = range(1, 8)

Explain = C.CFUNCTYPE(C.c_int, C.c_int64, C.c_int, C.c_int, C.c_uint64, C.c_uint64, C.c_int64, C.c_void_p,
                      C.c_int64)

_lock = threading.RLock()
_lib: Any = None
_tried = False
_why_not = ""


def _build() -> str:
    """The path of the built library (built now if the cache does not hold it)."""
    import jax

    include = jax.ffi.include_dir()
    with open(os.path.join(include, "xla", "ffi", "api", "c_api.h"), "rb") as f:
        header = f.read()
    return cbuild.build("jaxffi", os.path.join(os.path.dirname(os.path.abspath(__file__)), "native.c"),
                        [include], header)


def library() -> Any:
    """The loaded compiled handler, or None (no compiler, or turned off)."""
    global _lib, _tried, _why_not
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        mode = cbuild.mode(ENV)
        if mode == "0":
            _why_not = f"{ENV}=0"
        else:
            try:
                _lib = _load(_build())
            except Exception as exc:  # no compiler, a failed build: the Python handler serves
                _why_not = f"{type(exc).__name__}: {exc}"
                if mode == "1":
                    _tried = True
                    raise DistBackendError(f"{ENV}=1 but gpucoll's compiled jit handler could not be built: "
                                           f"{_why_not}") from exc
                warnings.warn(f"gpucoll: collectives inside jax.jit run through Python (slower): the compiled "
                              f"handler could not be built ({_why_not}); set {ENV}=0 to silence this",
                              RuntimeWarning, stacklevel=2)
        _tried = True
    return _lib


def why_not() -> str:
    """Why :func:`library` returned None ("" if it did not)."""
    return _why_not


_TAG_BITS = [0, 0]  # the handler's plan-number tag and index bits (configure)


def configure(tag: int, index_bits: int) -> None:
    """How plan numbers are made (handler.py): a per-process tag above ``index_bits``."""
    _TAG_BITS[:] = [tag, index_bits]


def _load(path: str) -> Any:
    lib = C.CDLL(path)
    for kind in KINDS:
        getattr(lib, f"gcj_{kind}").restype = C.c_void_p
    lib.gcj_init.argtypes = [Explain, C.c_uint64, C.c_int]
    lib.gcj_fallback.argtypes = [C.c_int, C.c_void_p]
    lib.gcj_channel.restype = C.c_void_p
    lib.gcj_channel.argtypes = [C.c_void_p, C.c_int, C.c_int, C.c_int64, C.c_int64, C.c_double, C.c_double, C.c_int]
    lib.gcj_close.argtypes = [C.c_void_p]
    lib.gcj_plan.argtypes = [C.c_int64, C.c_void_p, C.c_int, C.c_int, C.c_int, C.c_int, C.c_int, C.c_int64,
                             C.c_int64, C.c_int64, C.c_uint64]
    lib.gcj_round.argtypes = [C.c_int64]
    lib.gcj_run.restype = C.c_void_p
    lib.gcj_run.argtypes = [C.c_void_p, C.c_int64]
    lib.gcj_native_ops.restype = C.c_int64
    lib.gcj_init(_EXPLAIN, *_TAG_BITS)
    return lib


def native_ops() -> int:
    """Ops the compiled handler has run in this process (0 without it)."""
    return int(_lib.gcj_native_ops()) if _lib is not None else 0


# ----- channels -----
class Channel:
    """One group's in-jit channel on this rank (see the module docstring).

    ``ptr`` is native.c's channel, or None when the group's in-jit ops run in Python
    only. ``mm`` keeps the mapping alive for the process's life: another thread may
    still be reading it when the group goes."""

    __slots__ = ("closed_why", "first_error", "mm", "pg", "ptr", "sigs", "why")

    def __init__(self, pg: ProcessGroup, ptr: int | None, mm: Any, sigs: Signatures | None, why: str) -> None:
        self.pg = pg
        self.ptr = ptr
        self.mm = mm
        self.sigs = sigs
        self.first_error = ""
        self.closed_why = ""  # the CPU backend's reason when it aborted or shut down
        self.why = why  # why the group's in-jit ops run in Python ("" when they do not)


_CHANNELS: dict[int, Channel] = {}  # by group handle (handler.group_handle)


def channel_for(pg: ProcessGroup) -> Channel:
    """The group's channel, set up now if this is its first collective inside jit (a
    collective call: every rank of the group makes it at the same op)."""
    ch = _CHANNELS.get(id(pg))
    if ch is None:
        with _lock:
            ch = _CHANNELS.get(id(pg))
            if ch is None:
                try:
                    ch = _setup(pg)
                except BaseException as exc:
                    # set up once: later in-jit ops of the group run in Python (whose own
                    # checks then fail them if the group is broken)
                    _CHANNELS[id(pg)] = Channel(pg, None, None, None, f"setting the channel up failed: {exc}")
                    raise
                _CHANNELS[id(pg)] = ch
    return ch


def _can(pg: ProcessGroup, lib: Any) -> str:
    """Why this rank cannot use a channel for ``pg`` ("" if it can)."""
    if lib is None:
        return f"the compiled handler is not loaded ({_why_not})"
    cpu = pg._cpu
    if not isinstance(cpu, CPUBackend):
        return f"the group's host backend is {type(cpu).__name__}, not the CPU backend"
    if cpu.transport not in ("shm", "local"):
        return f"the group's CPU transport is {cpu.transport}, not shared memory (ranks on several hosts?)"
    if get_debug_level() >= DebugLevel.DETAIL:
        return "the debug level is DETAIL (every op takes the Python path and its checks)"
    return ""


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return "?"


def _setup(pg: ProcessGroup) -> Channel:
    lib = library()
    rank, size = pg.rank(), pg.size()
    why = _can(pg, lib)
    store = PrefixStore("jit", pg.store)
    ns = _pid_namespace()
    same_ns = True
    if size > 1:
        store.set(f"can/{rank}", f"{ns}\n{why}".encode())
        deadline = time.monotonic() + pg.timeout
        gone = pg._cpu.gone if isinstance(pg._cpu, CPUBackend) else (lambda r: None)
        for r in range(size):  # each rank's word, failing at once when a rank is known gone
            their_ns, _, their_why = get_while_alive(store, f"can/{r}", deadline, r, gone).partition("\n")
            same_ns = same_ns and their_ns == ns
            if their_why and not why:
                why = f"rank {r}: {their_why}"
    if why:
        return Channel(pg, None, None, None, why)
    cpu = pg._cpu
    assert isinstance(cpu, CPUBackend)  # (_can)
    data_off = _CTL + _round(size * _REC)
    total = data_off + 2 * size * _STRIDE
    if size == 1:
        mm: Any = mmap.mmap(-1, total)
    else:
        try:
            mm = map_segment(PrefixStore("seg/", store), rank, size, total, pg.timeout, cpu.gone)[0]
        except ShmUnavailable as exc:  # some rank could not map it: raised on every rank alike
            return Channel(pg, None, None, None, f"no shared segment: {exc}")
    base = C.addressof(C.c_char.from_buffer(mm))
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    spin = 200e-6 if size <= cores else 20e-6  # the CPU transport's spin (shm_algos.py)
    ptr = lib.gcj_channel(base, rank, size, SLOT_BYTES, data_off, float(pg.timeout), spin, int(same_ns))
    if not ptr:
        raise MemoryError("gpucoll: could not allocate a jit channel")
    ch = Channel(pg, ptr, mm, Signatures(store, rank, size, pg.timeout), "")

    def close(reason: str) -> None:
        ch.closed_why = ch.closed_why or reason
        lib.gcj_close(ptr)

    cpu.closers.append(close)
    return ch


def _round(n: int, to: int = 4096) -> int:
    return (n + to - 1) // to * to


# ----- plans -----
class _Told(NamedTuple):
    """A plan native.c knows: whether it runs there, its signature, the handler's Plan."""

    native: bool
    sig: int
    plan: Any


_TOLD: dict[int, _Told] = {}  # by plan index


def register(index: int, plan: Any, ch: Channel) -> bool:
    """Tell native.c about a plan of a channel group (its first call); True when it
    runs there without Python."""
    told = _TOLD.get(index)
    if told is None:
        with _lock:  # native.c's plan table grows here (and a plan is told once)
            told = _TOLD.get(index) or _register(index, plan, ch)
    return told.native


def _register(index: int, plan: Any, ch: Channel) -> _Told:
    kind, attrs = plan.kind, plan.attrs
    fields: dict[str, object] = {}
    if plan.ins and kind != "barrier":
        shape, dtype = plan.ins[0]
        fields["dtype"] = str(dtype)
        if not (kind == "all_to_all_single" and (attrs.get("in_splits") or attrs.get("out_splits"))):
            fields["shape"] = tuple(shape)
    op = None
    if "op" in attrs:
        op = _REDUCE_OPS[attrs["op"]]
        fields["reduce op"] = op.name
    if "root" in attrs:
        fields["root"] = attrs["root"]
    assert ch.sigs is not None
    sig = ch.sigs.of(kind, fields)
    native = False
    nbytes = count = piece = 0
    dcode = ocode = 0
    if kind in KINDS and plan.ins:
        shape, dtype = plan.ins[0]
        n = ch.pg.size()
        nbytes = math.prod(shape) * dtype.itemsize  # what a rank writes into its slot
        # one rank's part: the chunk of a stacked input (scatters), else the whole input
        piece = nbytes // n if kind in ("reduce_scatter", "scatter") else nbytes
        count = piece // dtype.itemsize if dtype.itemsize else 0
        dcode = _DTYPES.get(dtype.name, -1)
        # a barrier moves no data (its value passes through); the others move bytes
        native = kind == "barrier" or nbytes <= SLOT_BYTES
        if kind in _REDUCING:
            ocode = _OPS.get(op, -1) if op is not None else -1
            native = native and dcode >= 0 and ocode >= 0 and _defined(op, dtype.name, n)
    root = int(attrs.get("root", 0))
    if _lib.gcj_plan(index, ch.ptr, int(native), KINDS.get(kind, 0), dcode, ocode, root, count, nbytes, piece,
                     sig) != 0:
        raise MemoryError("gpucoll: could not record a jit plan")
    told = _TOLD[index] = _Told(native, sig, plan)
    return told


def _defined(op: Any, dtype: str, size: int) -> bool:
    """Whether the CPU backend defines ``op`` on ``dtype`` (else Python runs it, and says why not)."""
    try:
        make_reducer(op, DTYPES[dtype], size)
    except (TypeError, ValueError):
        return False
    return True


def round_(index: int) -> None:
    """The channel step of a collective that runs in Python (its signature check).

    Raises:
        DistBackendError: a peer's op differs, a peer is gone or late, the group is closed.
    """
    rc = _lib.gcj_round(index)
    if rc:
        raise DistBackendError(getattr(_last, "text", "") if rc > 0 else
                               f"gpucoll: jit plan {index} is unknown to the compiled handler")


def run(frame: int, index: int) -> int:
    """Run a native plan from Python (its first call); the FFI error, or 0."""
    return int(_lib.gcj_run(frame, index) or 0)


# ----- errors, worded in Python -----
_last = threading.local()  # the text of this thread's last error (round_ raises it)


def _explain(index: int, code: int, peer: int, theirs: int, opno: int, pid: int, buf: int, cap: int) -> int:
    """native.c's callback: word a failure into ``buf`` (the FFI error's message)."""
    kind = "op"
    try:
        kind = _TOLD[index].plan.kind
        text = _text(index, code, peer, theirs, opno, pid)
    except BaseException as exc:  # never raise into C
        text = f"an op inside jax.jit failed (code {code}, peer {peer}); wording it failed: {exc!r}"
    _last.text = text
    full = f"gpucoll.functional.{kind} inside jax.jit failed: DistBackendError: {text}"
    data = full.encode(errors="replace")[:max(0, cap - 1)]
    C.memmove(buf, data, len(data))
    C.memset(buf + len(data), 0, 1)
    return len(data)


def _text(index: int, code: int, peer: int, theirs: int, opno: int, pid: int) -> str:
    """What failed: ``peer`` is the rank waited on; for a mismatch ``theirs`` is its
    signature; for an abort ``pid`` is the rank that aborted and ``theirs`` packs the
    rank it failed on (plus one) and its code; otherwise ``pid`` is ``peer``'s pid."""
    plan = _TOLD[index].plan
    ch = _CHANNELS[id(plan.pg)]
    what = f"group {plan.pg.group_name!r}, op #{opno} inside jit"
    if code == _E_MISMATCH:
        assert ch.sigs is not None
        text = str(ch.sigs.reworded(SignatureMismatch("", peer, theirs, _TOLD[index].sig)))
    elif code == _E_TIMEOUT:
        text = (f"{what}: timed out after {plan.pg.timeout:g} s waiting for rank {peer}"
                f"{f' (pid {pid})' if pid else ''}")
    elif code == _E_DEAD:
        text = f"{what}: rank {peer} (pid {pid}) exited"
    elif code == _E_ABORTED:
        culprit, why = (theirs & 0xFFFFFFFF) - 1, theirs >> 32
        said = {_E_MISMATCH: f"found that rank {culprit} issued a different collective",
                _E_TIMEOUT: f"timed out waiting for rank {culprit}", _E_DEAD: f"found that rank {culprit} exited",
                _E_CLOSED: "destroyed or aborted the group"}.get(why, f"failed (code {why})")
        text = f"{what}: rank {pid} {said}, which ends the group's in-jit ops (this rank waited for rank {peer})"
        if ch.closed_why:
            text += f"; this rank's group: {ch.closed_why}"
    elif code == _E_CLOSED:
        text = f"{what}: the group was aborted or destroyed: {ch.closed_why or 'on another thread'}"
    elif code == _E_BROKEN:
        text = f"{what}: an earlier op of this group inside jit failed: {ch.first_error}"
    else:
        text = (f"{what}: two gpucoll calls of this group ran at once from jitted programs on different "
                "threads; a group's in-jit collectives must run one at a time")
    if code not in (_E_BROKEN, _E_CLOSED, _E_CONCURRENT) and not ch.first_error:
        ch.first_error = text
    return text


_EXPLAIN = Explain(_explain)
