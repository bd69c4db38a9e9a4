"""CuPy and NCCL, loaded lazily: availability, version, unique ids, and a ctypes shim.

Nothing here imports CuPy at module import time; :func:`load` does, once per
process, and everything that needs CUDA goes through it.

``cupy.cuda.nccl`` binds communicators and the five classic collectives. What it
lacks (``ncclAlltoAll``/``ncclGather``/``ncclScatter`` from NCCL 2.28,
``ncclRedOpCreatePreMulSum``, ``ncclCommGetAsyncError``, ``ncclGetLastError``) is
called through :class:`NcclShim`, a ctypes view of *the same* ``libnccl`` that CuPy
loaded (found in ``/proc/self/maps``, so two copies of NCCL never meet in one
process). Each extra is used only where the loaded version has it
(:class:`Features`).
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from ...errors import BackendUnavailableError

__all__ = [
    "INSTALL_HINT", "NCCL_DTYPES", "MOVE_DTYPE", "OP_SUM", "OP_PROD", "OP_MAX", "OP_MIN", "OP_AVG",
    "Features", "NcclLib", "NcclShim", "version_tuple", "unavailable_reason", "load",
    "shim_of", "result_name", "UniqueId", "config_pointer",
    "same_library",
]

INSTALL_HINT = ('install CuPy and NCCL for your CUDA major version: pip install "gpucoll[cuda12]" '
                '(cupy-cuda12x + nvidia-nccl-cu12) or pip install "gpucoll[cuda13]"')

# ncclRedOp_t (nccl.h)
OP_SUM, OP_PROD, OP_MAX, OP_MIN, OP_AVG = 0, 1, 2, 3, 4

# ncclDataType_t (nccl.h): the types NCCL can reduce. Everything moves as bytes (MOVE_DTYPE).
NCCL_DTYPES: dict[str, int] = {
    "int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5,
    "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9,
    "float8_e4m3fn": 10, "float8_e5m2": 11,
}
MOVE_DTYPE = 1  # ncclUint8: data movement is bit-exact whatever the element type

_SCALAR_HOST_IMMEDIATE = 1  # ncclScalarHostImmediate: NCCL reads the factor before returning
_UNIQUE_ID_BYTES = 128

_RESULTS = {
    0: "ncclSuccess", 1: "ncclUnhandledCudaError", 2: "ncclSystemError", 3: "ncclInternalError",
    4: "ncclInvalidArgument", 5: "ncclInvalidUsage", 6: "ncclRemoteError", 7: "ncclInProgress",
    8: "ncclTimeout",
}


def result_name(code: int) -> str:
    """NCCL's name for an ``ncclResult_t`` value (``"ncclRemoteError"``...)."""
    return _RESULTS.get(code, f"ncclResult {code}")


def version_tuple(code: int) -> tuple[int, int, int]:
    """Decode ``ncclGetVersion``'s integer: 2.9 and later use major*10000+minor*100+patch,
    earlier releases major*1000+minor*100+patch."""
    if code >= 10000:
        return code // 10000, (code % 10000) // 100, code % 100
    return code // 1000, (code % 1000) // 100, code % 100


@dataclass(frozen=True)
class Features:
    """What the loaded NCCL (and CuPy's binding of it) can do; see docs/nccl-backend.md.

    Attributes:
        version: NCCL's (major, minor, patch).
        avg: ``ncclAvg`` (NCCL >= 2.10).
        premul_sum: ``ncclRedOpCreatePreMulSum`` through the shim (NCCL >= 2.11).
        fp8: float8 e4m3/e5m2 datatypes (NCCL >= 2.24; reductions also need sm_90).
        all_to_all, gather, scatter: NCCL's own calls (NCCL >= 2.28, through the shim).
        comm_split: ``ncclCommSplit`` through CuPy (NCCL >= 2.18).
        async_error: ``ncclCommGetAsyncError`` through the shim.
        comm_shrink: ``ncclCommShrink`` usable by the runtime's communicators (NCCL >=
            2.27). The shim binds it, but CuPy cannot adopt the raw communicator it
            returns, so the CuPy runtime leaves this False and shrink_group builds a
            fresh communicator through the store instead.
        init_scalable: ``ncclCommInitRankScalable`` (NCCL >= 2.23) and the raw collective
            calls a communicator it makes needs, through the shim (several roots' unique
            ids for one communicator: large jobs, see bootstrap.create_comm).
        register: ``ncclCommRegister``/``ncclCommDeregister`` and ``ncclMemAlloc``/
            ``ncclMemFree`` through the shim (NCCL >= 2.19).
        window: ``ncclCommWindowRegister``/``ncclCommWindowDeregister`` through the shim
            (NCCL >= 2.27): symmetric memory windows.
    """

    version: tuple[int, int, int]
    avg: bool = True
    premul_sum: bool = True
    fp8: bool = True
    all_to_all: bool = False
    gather: bool = False
    scatter: bool = False
    comm_split: bool = True
    async_error: bool = True
    comm_shrink: bool = False
    init_scalable: bool = False
    register: bool = False
    window: bool = False

    def describe(self) -> str:
        on = [name for name in ("avg", "premul_sum", "fp8", "all_to_all", "gather", "scatter",
                                "comm_split", "async_error", "comm_shrink", "init_scalable", "register", "window")
              if getattr(self, name)]
        return f"NCCL {'.'.join(map(str, self.version))} ({', '.join(on) or 'no extras'})"


# ----- the ctypes shim -----

class NcclCallError(RuntimeError):
    """An NCCL call made through the ctypes shim failed; ``code`` is its ncclResult_t."""

    def __init__(self, what: str, code: int, detail: str = "") -> None:
        super().__init__(f"{what} failed: {result_name(code)}" + (f": {detail}" if detail else ""))
        self.code = code



class UniqueId(ctypes.Structure):
    """``ncclUniqueId`` (passed by value to ncclCommInitRank*)."""

    _fields_ = [("internal", ctypes.c_char * _UNIQUE_ID_BYTES)]


def config_pointer(fields: dict[str, Any] | None, version: tuple[int, int, int]) -> Any:
    """The ``ncclConfig_t*`` argument for ``fields`` (gpucoll names): None (NULL) when
    nothing is set, else a reference to the struct that NCCL ``version`` (the loaded
    library's) declares, made as NCCL_CONFIG_INITIALIZER makes it
    (config.make_struct). Check the fields against the version first (config.check_config)."""
    if not fields:
        return None
    from .config import make_struct

    return ctypes.byref(make_struct(fields, version))


class NcclShim:
    """ctypes calls into the libnccl that CuPy loaded, for what CuPy does not bind.

    Every call releases the GIL (ctypes.CDLL does), so a hung NCCL never stalls
    other Python threads. Functions that the library lacks are None.

    Args:
        path: the library to open; normally :func:`loaded_library_path`'s answer.

    Raises:
        OSError: the library cannot be opened.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        lib = ctypes.CDLL(path)
        vp, c_int, c_size_t = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        self._get_version = self._bind(lib, "ncclGetVersion", [ctypes.POINTER(c_int)])
        self._async_error = self._bind(lib, "ncclCommGetAsyncError", [vp, ctypes.POINTER(c_int)])
        self._error_string = self._bind(lib, "ncclGetErrorString", [c_int], ctypes.c_char_p)
        self._last_error = self._bind(lib, "ncclGetLastError", [vp], ctypes.c_char_p)
        self._premul = self._bind(lib, "ncclRedOpCreatePreMulSum",
                                  [ctypes.POINTER(c_int), vp, c_int, c_int, vp])
        self._op_destroy = self._bind(lib, "ncclRedOpDestroy", [c_int, vp])
        self._group_start = self._bind(lib, "ncclGroupStart", [])
        self._group_end = self._bind(lib, "ncclGroupEnd", [])
        self.all_to_all_fn = self._bind(lib, "ncclAlltoAll", [vp, vp, c_size_t, c_int, vp, vp])
        self.gather_fn = self._bind(lib, "ncclGather", [vp, vp, c_size_t, c_int, c_int, vp, vp])
        self.scatter_fn = self._bind(lib, "ncclScatter", [vp, vp, c_size_t, c_int, c_int, vp, vp])
        # ncclResult_t ncclCommShrink(ncclComm_t comm, int* excludeRanksList, int excludeRanksCount,
        #                             ncclComm_t* newcomm, ncclConfig_t* config, int shrinkFlags)  (nccl.h, 2.27+)
        self.comm_shrink_fn = self._bind(lib, "ncclCommShrink",
                                         [vp, ctypes.POINTER(c_int), c_int, ctypes.POINTER(vp), vp, c_int])
        # The config-taking constructors (nccl.h); ``config`` is an ncclConfig_t* made by
        # config.make_struct (or NULL): see config_pointer.
        self.init_rank_config_fn = self._bind(lib, "ncclCommInitRankConfig",
                                              [ctypes.POINTER(vp), c_int, UniqueId, c_int, vp])
        self.comm_split_fn = self._bind(lib, "ncclCommSplit", [vp, c_int, c_int, ctypes.POINTER(vp), vp])
        # ncclResult_t ncclCommInitRankScalable(ncclComm_t* newcomm, int nranks, int myrank, int nId,
        #                                       ncclUniqueId* commIds, ncclConfig_t* config)  (nccl.h, 2.23+)
        self.init_rank_scalable_fn = self._bind(lib, "ncclCommInitRankScalable",
                                                [ctypes.POINTER(vp), c_int, c_int, c_int, ctypes.POINTER(UniqueId), vp])
        # Buffer registration and NCCL's allocator (nccl.h): ncclCommRegister(comm, buff, size,
        # void** handle), ncclCommDeregister(comm, handle) (2.19+); ncclCommWindowRegister(comm,
        # buff, size, ncclWindow_t* win, int winFlags), ncclCommWindowDeregister(comm, win) (2.27+);
        # ncclMemAlloc(void** ptr, size_t size), ncclMemFree(void* ptr) (2.19+).
        self.register_fn = self._bind(lib, "ncclCommRegister", [vp, vp, c_size_t, ctypes.POINTER(vp)])
        self.deregister_fn = self._bind(lib, "ncclCommDeregister", [vp, vp])
        self.window_register_fn = self._bind(lib, "ncclCommWindowRegister",
                                             [vp, vp, c_size_t, ctypes.POINTER(vp), c_int])
        self.window_deregister_fn = self._bind(lib, "ncclCommWindowDeregister", [vp, vp])
        self.mem_alloc_fn = self._bind(lib, "ncclMemAlloc", [ctypes.POINTER(vp), c_size_t])
        self.mem_free_fn = self._bind(lib, "ncclMemFree", [vp])
        # What a communicator CuPy did not make (RawComm) is driven with (nccl.h): buffers,
        # count, datatype, [op], [root|peer], comm, stream.
        self.raw = {
            "all_reduce": self._bind(lib, "ncclAllReduce", [vp, vp, c_size_t, c_int, c_int, vp, vp]),
            "reduce": self._bind(lib, "ncclReduce", [vp, vp, c_size_t, c_int, c_int, c_int, vp, vp]),
            "broadcast": self._bind(lib, "ncclBroadcast", [vp, vp, c_size_t, c_int, c_int, vp, vp]),
            "all_gather": self._bind(lib, "ncclAllGather", [vp, vp, c_size_t, c_int, vp, vp]),
            "reduce_scatter": self._bind(lib, "ncclReduceScatter", [vp, vp, c_size_t, c_int, c_int, vp, vp]),
            "send": self._bind(lib, "ncclSend", [vp, c_size_t, c_int, c_int, vp, vp]),
            "recv": self._bind(lib, "ncclRecv", [vp, c_size_t, c_int, c_int, vp, vp]),
            "abort": self._bind(lib, "ncclCommAbort", [vp]),
            "destroy": self._bind(lib, "ncclCommDestroy", [vp]),
            "user_rank": self._bind(lib, "ncclCommUserRank", [vp, ctypes.POINTER(c_int)]),
            "count": self._bind(lib, "ncclCommCount", [vp, ctypes.POINTER(c_int)]),
        }

    @property
    def has_premul_sum(self) -> bool:
        """ncclRedOpCreatePreMulSum and ncclRedOpDestroy were found."""
        return self._premul is not None and self._op_destroy is not None

    @property
    def has_async_error(self) -> bool:
        """ncclCommGetAsyncError was found."""
        return self._async_error is not None

    @property
    def has_group_calls(self) -> bool:
        """ncclGroupStart and ncclGroupEnd were found."""
        return self._group_start is not None and self._group_end is not None

    @staticmethod
    def _bind(lib: ctypes.CDLL, name: str, argtypes: list[Any], restype: Any = ctypes.c_int) -> Any:
        try:
            fn = getattr(lib, name)
        except AttributeError:
            return None
        fn.argtypes = argtypes
        fn.restype = restype
        return fn

    def version(self) -> int:
        """``ncclGetVersion`` of this library (the integer code)."""
        out = ctypes.c_int(0)
        self.check(self._get_version(ctypes.byref(out)), "ncclGetVersion")
        return int(out.value)

    def error_string(self, code: int) -> str:
        if self._error_string is None:
            return result_name(code)
        raw = self._error_string(code)
        return raw.decode(errors="replace") if raw else result_name(code)

    def last_error(self, comm: int) -> str:
        """NCCL's last error message for ``comm`` ('' when unknown or unsupported)."""
        if self._last_error is None:
            return ""
        raw = self._last_error(comm)
        return raw.decode(errors="replace") if raw else ""

    def check(self, code: int, what: str) -> None:
        """Raise RuntimeError naming ``what`` when ``code`` is not ncclSuccess."""
        if code != 0:
            raise RuntimeError(f"{what} failed: {result_name(code)}: {self.error_string(code)}")

    def async_error(self, comm: int) -> int:
        """``ncclCommGetAsyncError``: 0 while healthy, 7 (in progress) during nonblocking
        calls, anything else is a failure of the communicator."""
        if self._async_error is None or not comm:
            return 0
        out = ctypes.c_int(0)
        self.check(self._async_error(comm, ctypes.byref(out)), "ncclCommGetAsyncError")
        return int(out.value)

    def premul_sum(self, comm: int, scalar: bytes, dtype: int) -> int:
        """Create a PreMulSum op whose factor (``scalar``, encoded in ``dtype``) NCCL
        reads before returning; destroy it with :meth:`op_destroy`."""
        if self._premul is None:
            raise RuntimeError("this NCCL has no ncclRedOpCreatePreMulSum")
        op = ctypes.c_int(0)
        holder = ctypes.create_string_buffer(scalar, len(scalar))
        self.check(self._premul(ctypes.byref(op), ctypes.cast(holder, ctypes.c_void_p), dtype,
                                _SCALAR_HOST_IMMEDIATE, comm), "ncclRedOpCreatePreMulSum")
        return int(op.value)

    def group_start(self) -> None:
        self.check(self._group_start(), "ncclGroupStart")

    def group_end(self) -> None:
        """``ncclGroupEnd``, which can block until peers join (p2p connection setup):
        through ctypes the GIL is released meanwhile, so the watchdog keeps running."""
        self.check(self._group_end(), "ncclGroupEnd")

    def group_end_code(self) -> int:
        """``ncclGroupEnd``'s result code, not raised (:func:`same_library` asks it)."""
        return int(self._group_end())

    def op_destroy(self, comm: int, op: int) -> None:
        if self._op_destroy is not None:
            self.check(self._op_destroy(op, comm), "ncclRedOpDestroy")

    def _out_call(self, fn: Any, what: str, comm: int, *args: Any) -> int:
        """Call ``fn(*args, &out)`` (``comm``, when not 0, first); return ``out``.

        Raises:
            NcclCallError: the call failed, or this NCCL lacks it (ncclInvalidUsage).
        """
        if fn is None:
            raise NcclCallError(what, 5, "not in this NCCL")
        out = ctypes.c_void_p()
        lead = (comm,) if comm else ()
        code = fn(*lead, *args, ctypes.byref(out))
        if code != 0:
            raise NcclCallError(what, code, (self.last_error(comm) if comm else "") or self.error_string(code))
        return int(out.value or 0)

    def _plain_call(self, fn: Any, what: str, comm: int, *args: Any) -> None:
        if fn is None:
            raise NcclCallError(what, 5, "not in this NCCL")
        code = fn(*args)
        if code != 0:
            raise NcclCallError(what, code, (self.last_error(comm) if comm else "") or self.error_string(code))

    def comm_register(self, comm: int, ptr: int, nbytes: int) -> int:
        """``ncclCommRegister``: the registration handle (NULL, 0, when NCCL skips it)."""
        return self._out_call(self.register_fn, "ncclCommRegister", comm, ptr, nbytes)

    def comm_deregister(self, comm: int, handle: int) -> None:
        """``ncclCommDeregister``."""
        self._plain_call(self.deregister_fn, "ncclCommDeregister", comm, comm, handle)

    def window_register(self, comm: int, ptr: int, nbytes: int, flags: int) -> int:
        """``ncclCommWindowRegister`` (collective): the window (NULL, 0, when the communicator
        has no symmetric support, as NCCL returns it)."""
        if self.window_register_fn is None:
            raise NcclCallError("ncclCommWindowRegister", 5, "not in this NCCL")
        out = ctypes.c_void_p()
        code = self.window_register_fn(comm, ptr, nbytes, ctypes.byref(out), flags)
        if code != 0:
            raise NcclCallError("ncclCommWindowRegister", code, self.last_error(comm) or self.error_string(code))
        return int(out.value or 0)

    def window_deregister(self, comm: int, window: int) -> None:
        """``ncclCommWindowDeregister`` (collective)."""
        self._plain_call(self.window_deregister_fn, "ncclCommWindowDeregister", comm, comm, window)

    def mem_alloc(self, nbytes: int) -> int:
        """``ncclMemAlloc`` on the current device: cuMem memory NCCL can register and map."""
        if self.mem_alloc_fn is None:
            raise NcclCallError("ncclMemAlloc", 5, "not in this NCCL")
        out = ctypes.c_void_p()
        code = self.mem_alloc_fn(ctypes.byref(out), nbytes)  # the pointer comes first here
        if code != 0:
            raise NcclCallError("ncclMemAlloc", code, self.error_string(code))
        return int(out.value or 0)

    def mem_free(self, ptr: int) -> None:
        """``ncclMemFree``."""
        self._plain_call(self.mem_free_fn, "ncclMemFree", 0, ptr)


def shim_of(lib: NcclLib, what: str) -> NcclShim:
    """``lib``'s shim, for ``what`` (an NCCL call CuPy does not bind).

    Raises:
        NcclCallError: there is no shim (ncclInvalidUsage, with why).
    """
    if lib.shim is None:
        raise NcclCallError(what, 5, lib.shim_error or "the NCCL shim is not loaded")
    return lib.shim


def loaded_library_path(fragment: str = "libnccl.so") -> str | None:
    """The path of the already-loaded library whose file name contains ``fragment``.

    Reads ``/proc/self/maps`` so that the answer is the very file the dynamic
    linker mapped for CuPy; None where that file does not exist (not Linux) or the
    library is not loaded.
    """
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6:
                    path = parts[5].strip()
                    if fragment in os.path.basename(path):
                        return path
    except OSError:
        return None
    return None


def _find_library_path() -> str | None:
    found = loaded_library_path()
    if found is not None:
        return found
    try:
        from cuda import pathfinder  # type: ignore[import-not-found,unused-ignore]

        return str(pathfinder.load_nvidia_dynamic_lib("nccl").abs_path)
    except Exception:
        return None


def same_library(nccl: Any, shim: NcclShim) -> bool:
    """Whether ``shim`` calls the very library CuPy's binding ``nccl`` calls, not another
    copy of the same release (two files can be mapped at once: a wheel's and one on
    ``LD_LIBRARY_PATH``). NCCL's group depth is the library's own state: a group opened
    through CuPy is closed by the shim's ``ncclGroupEnd`` only in the same library (in
    another it is ncclInvalidUsage, and CuPy's group is closed by CuPy). An empty group:
    nothing is issued. Needs no GPU."""
    if not shim.has_group_calls:
        return True  # nothing to compare; nothing of the shim's groups is used either
    nccl.groupStart()
    try:
        code = shim.group_end_code()
    except Exception:  # noqa: BLE001  (treated as another library)
        code = -1
    if code != 0:
        nccl.groupEnd()
        return False
    return True


# ----- loading -----

@dataclass(frozen=True)
class NcclLib:
    """CuPy, its NCCL binding, and facts about the loaded NCCL.

    Attributes:
        cupy: the ``cupy`` module.
        nccl: ``cupy.cuda.nccl``.
        version_code: ``ncclGetVersion``'s integer.
        shim: ctypes view of the same library, or None if it could not be opened.
        shim_error: why ``shim`` is None ('' otherwise).
        features: what the loaded NCCL can do.
    """

    cupy: Any
    nccl: Any
    version_code: int
    shim: NcclShim | None
    shim_error: str
    features: Features

    @property
    def version(self) -> tuple[int, int, int]:
        return version_tuple(self.version_code)

    @property
    def library_path(self) -> str | None:
        return self.shim.path if self.shim is not None else None


def _import_cupy_nccl() -> tuple[ModuleType, ModuleType]:
    try:
        import cupy
    except ImportError as exc:
        raise BackendUnavailableError(
            f"the NCCL backend needs CuPy, which is not installed ({exc}); {INSTALL_HINT}") from exc
    except Exception as exc:  # a broken CUDA install can fail CuPy's import in many ways
        raise BackendUnavailableError(
            f"CuPy failed to import ({type(exc).__name__}: {exc}); {INSTALL_HINT}") from exc
    try:
        from cupy.cuda import nccl
    except Exception as exc:
        raise BackendUnavailableError(
            f"CuPy {cupy.__version__} cannot import its NCCL binding ({type(exc).__name__}: {exc}); "
            f"{INSTALL_HINT}") from exc
    if not getattr(nccl, "available", False) or not hasattr(nccl, "NcclCommunicator"):
        raise BackendUnavailableError(
            f"CuPy {cupy.__version__} found no NCCL library (libnccl.so.2); {INSTALL_HINT}")
    return cupy, nccl


@functools.lru_cache(maxsize=None)
def load() -> NcclLib:
    """Import CuPy and its NCCL binding, open the shim, and work out :class:`Features`.

    Cached: the library is loaded once per process. Needs no GPU.

    Raises:
        BackendUnavailableError: CuPy is missing or broken, or it found no NCCL.
    """
    cupy, nccl = _import_cupy_nccl()
    try:
        code = int(nccl.get_version())
    except Exception as exc:
        raise BackendUnavailableError(f"ncclGetVersion failed ({exc}); {INSTALL_HINT}") from exc
    shim: NcclShim | None = None
    shim_error = ""
    path = _find_library_path()
    if path is None:
        shim_error = "could not locate the libnccl that CuPy loaded"
    else:
        try:
            shim = NcclShim(path)
            if shim.version() != code:
                shim_error = (f"{path} reports NCCL {shim.version()}, CuPy's NCCL reports {code}; "
                              "not mixing two NCCL libraries")
                shim = None
            elif not same_library(nccl, shim):
                shim_error = (f"{path} is another copy of NCCL {'.'.join(map(str, version_tuple(code)))} than "
                              "the one CuPy calls (a group opened through CuPy is not open there); "
                              "not mixing two NCCL libraries")
                shim = None
        except (OSError, RuntimeError) as exc:
            shim, shim_error = None, f"cannot open {path}: {exc}"
    return NcclLib(cupy, nccl, code, shim, shim_error, features_of(code, shim, nccl))


def features_of(code: int, shim: NcclShim | None, nccl: Any) -> Features:
    """Work out :class:`Features` from a version code, the shim and CuPy's binding."""
    v = version_tuple(code)
    return Features(
        version=v,
        avg=v >= (2, 10, 0),
        premul_sum=v >= (2, 11, 0) and shim is not None and shim.has_premul_sum,
        fp8=v >= (2, 24, 0),
        all_to_all=v >= (2, 28, 0) and shim is not None and shim.all_to_all_fn is not None,
        gather=v >= (2, 28, 0) and shim is not None and shim.gather_fn is not None,
        scatter=v >= (2, 28, 0) and shim is not None and shim.scatter_fn is not None,
        comm_split=v >= (2, 18, 0) and hasattr(getattr(nccl, "NcclCommunicator", None), "commSplit"),
        async_error=shim is not None and shim.has_async_error,
        init_scalable=v >= (2, 23, 0) and shim is not None and shim.init_rank_scalable_fn is not None
        and all(fn is not None for fn in shim.raw.values()),
        register=v >= (2, 19, 0) and shim is not None and None not in (
            shim.register_fn, shim.deregister_fn, shim.mem_alloc_fn, shim.mem_free_fn),
        window=v >= (2, 27, 0) and shim is not None and None not in (
            shim.window_register_fn, shim.window_deregister_fn, shim.mem_alloc_fn),
    )


def unavailable_reason(*, need_device: bool = True) -> str | None:
    """Why the NCCL backend cannot run here, or None when it can.

    Checks, in order: CuPy imports; CuPy found NCCL; (``need_device``) the CUDA
    driver answers and shows at least one device. The device check initialises
    the CUDA driver in this process: fork no workers after calling it.
    """
    try:
        lib = load()
    except BackendUnavailableError as exc:
        return str(exc)
    if not need_device:
        return None
    try:
        count = int(lib.cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:
        return (f"no usable CUDA device ({type(exc).__name__}: {exc}): the NCCL backend needs an NVIDIA "
                f"GPU with a driver recent enough for CuPy {lib.cupy.__version__}'s CUDA; with an older "
                'driver, install the CuPy build of its CUDA major version (pip install "gpucoll[cuda12]" '
                'or "gpucoll[cuda13]"). Host arrays work with backend="cpu"')
    if count < 1:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        return f"no CUDA device is visible{where}"
    return None
