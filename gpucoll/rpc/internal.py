"""torch.distributed.rpc.internal's public names: the RPC pickler's ``serialize`` and
``deserialize``, ``RPCExecMode``, ``RemoteException``."""

from __future__ import annotations

import collections
import enum
from typing import Any

from . import _wire
from ._rref import RRef

__all__ = ["RPCExecMode", "serialize", "deserialize", "RemoteException"]


class RPCExecMode(enum.Enum):
    """How a call was made (torch's values)."""

    SYNC = "sync"
    ASYNC = "async"
    ASYNC_JIT = "async_jit"
    REMOTE = "remote"


RemoteException = collections.namedtuple("RemoteException", ["msg", "exception_type"])
"""An exception raised by a remote function, as torch carries it: its text and type."""


def _hook(obj: Any) -> Any:
    if type(obj) is RRef:
        return (tuple, (obj._serialize(),))
    return NotImplemented


def serialize(obj: Any) -> tuple[bytes, list[Any]]:
    """Pickle ``obj`` as RPC does: the pickle (protocol 5) and its out-of-band buffers.

    An RRef is written as its fork data without forking it (and refused, as torch does,
    when it was deleted or its creation timed out).
    """
    data, bufs = _wire.dumps(obj, _hook)
    return bytes(data), bufs


def deserialize(binary_data: bytes, tensor_table: list[Any]) -> Any:
    """Unpickle what :func:`serialize` wrote."""
    return _wire.loads(binary_data, [bytearray(memoryview(b).cast("B")) if not isinstance(b, bytearray) else b
                                     for b in tensor_table])
