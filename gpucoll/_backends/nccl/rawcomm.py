"""A communicator CuPy did not make: :class:`RawComm` drives a raw ``ncclComm_t`` (one
from ``ncclCommInitRankScalable``, or split or shrunk from one) through the shim's
ctypes calls (:class:`~gpucoll._backends.nccl.lib.NcclShim`), which release the GIL as
CuPy's do."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from .lib import NcclCallError, NcclLib, shim_of

if TYPE_CHECKING:
    from .protocols import Comm

__all__ = ["RawComm"]


class RawComm:
    """:class:`Comm` over a raw ``ncclComm_t`` that CuPy did not make (one from
    ``ncclCommInitRankScalable``, or split or shrunk from one), driven through the shim's
    ctypes calls, which release the GIL as CuPy's do. The collectives take CuPy's
    argument order (buffers, count, datatype, [op], [root|peer], stream), as the plan
    steps give them."""

    def __init__(self, lib: NcclLib, handle: int, rank: int, size: int) -> None:
        shim = lib.shim
        assert shim is not None and handle
        self._lib, self._shim, self._handle = lib, shim, handle
        self.rank = rank
        self.size = size
        self.all_reduce = self._call("all_reduce", "ncclAllReduce")
        self.reduce = self._call("reduce", "ncclReduce")
        self.broadcast = self._call("broadcast", "ncclBroadcast")
        self.all_gather = self._call("all_gather", "ncclAllGather")
        self.reduce_scatter = self._call("reduce_scatter", "ncclReduceScatter")
        self.send = self._call("send", "ncclSend")
        self.recv = self._call("recv", "ncclRecv")

    @property
    def handle(self) -> int:
        """The raw ``ncclComm_t`` (0 once destroyed or aborted)."""
        return self._handle

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            shim = self._shim
            raise NcclCallError(what, code, (shim.last_error(self._handle) if self._handle else "")
                                or shim.error_string(code))

    def _call(self, name: str, what: str) -> Callable[..., None]:
        fn = self._shim.raw[name]

        def call(*args: Any) -> None:
            *head, stream = args
            self._check(fn(*head, self._handle, stream), what)
        return call

    def _shim_fn(self, fn: Any, what: str, *args: Any) -> None:
        if fn is None:
            raise NcclCallError(what, 5, f"not in NCCL {'.'.join(map(str, self._lib.version))}")
        self._check(fn(*args), what)

    def all_to_all(self, send: int, recv: int, count: int, dtype: int, stream: int) -> None:
        self._shim_fn(self._shim.all_to_all_fn, "ncclAlltoAll", send, recv, count, dtype, self._handle, stream)

    def gather(self, send: int, recv: int, count: int, dtype: int, root: int, stream: int) -> None:
        self._shim_fn(self._shim.gather_fn, "ncclGather", send, recv, count, dtype, root, self._handle, stream)

    def scatter(self, send: int, recv: int, count: int, dtype: int, root: int, stream: int) -> None:
        self._shim_fn(self._shim.scatter_fn, "ncclScatter", send, recv, count, dtype, root, self._handle, stream)

    def premul_sum(self, scalar: bytes, dtype: int) -> int:
        return self._shim.premul_sum(self._handle, scalar, dtype)

    def op_destroy(self, op: int) -> None:
        self._shim.op_destroy(self._handle, op)

    def async_error(self) -> int:
        return self._shim.async_error(self._handle) if self._handle else 0

    def last_error(self) -> str:
        return self._shim.last_error(self._handle)

    def _adopt(self, handle: Any) -> RawComm | None:
        import ctypes

        if not handle.value:
            return None
        rank, count = ctypes.c_int(), ctypes.c_int()
        self._check(self._shim.raw["user_rank"](handle, ctypes.byref(rank)), "ncclCommUserRank")
        self._check(self._shim.raw["count"](handle, ctypes.byref(count)), "ncclCommCount")
        return RawComm(self._lib, int(handle.value), rank.value, count.value)

    def split(self, color: int, key: int, config: Mapping[str, Any] | None = None) -> Comm | None:
        import ctypes

        from .lib import config_pointer

        new = ctypes.c_void_p()
        self._shim_fn(self._shim.comm_split_fn, "ncclCommSplit", self._handle, color, key, ctypes.byref(new),
                      config_pointer(dict(config) if config else None, self._lib.version))
        return self._adopt(new)

    def shrink(self, exclude: Sequence[int], flags: int, config: Mapping[str, Any] | None = None) -> Comm:
        import ctypes

        from .lib import config_pointer

        gone = (ctypes.c_int * len(exclude))(*exclude)
        new = ctypes.c_void_p()
        self._shim_fn(self._shim.comm_shrink_fn, "ncclCommShrink", self._handle, gone, len(exclude),
                      ctypes.byref(new), config_pointer(dict(config) if config else None, self._lib.version), flags)
        made = self._adopt(new)
        if made is None:
            raise NcclCallError("ncclCommShrink", 5, "it returned no communicator")
        return made

    # Buffer registration (the shim's calls on this communicator; see registration.py)
    def register(self, ptr: int, nbytes: int) -> int:
        return shim_of(self._lib, "ncclCommRegister").comm_register(self.handle, ptr, nbytes)

    def deregister(self, handle: int) -> None:
        shim_of(self._lib, "ncclCommDeregister").comm_deregister(self.handle, handle)

    def window_register(self, ptr: int, nbytes: int, flags: int) -> int:
        return shim_of(self._lib, "ncclCommWindowRegister").window_register(self.handle, ptr, nbytes, flags)

    def window_deregister(self, window: int) -> None:
        shim_of(self._lib, "ncclCommWindowDeregister").window_deregister(self.handle, window)

    def abort(self) -> None:
        handle, self._handle = self._handle, 0
        if handle:
            self._check(self._shim.raw["abort"](handle), "ncclCommAbort")

    def destroy(self) -> None:
        handle, self._handle = self._handle, 0
        if handle:
            self._check(self._shim.raw["destroy"](handle), "ncclCommDestroy")
