"""Worker identity, message types (torch's names) and the RPC errors."""

from __future__ import annotations

import enum
import re
from typing import Any

from ..errors import DistError, DistNetworkError

__all__ = ["WorkerInfo", "MessageType", "RpcTimeoutError", "PeerLostError", "UnknownWorkerError",
           "AgentShutDownError", "DuplicateNameError", "InvalidWorkerNameError", "AsyncReturnTypeError", "FunctionNotFoundError", "IntentionalFailureError",
           "check_name", "detached"]

_NAME = re.compile(r"^[A-Za-z0-9\-_:]*$")


def check_name(name: Any) -> str:
    """A worker name as torch allows it: ``^[A-Za-z0-9-_:]*$``, under 128 characters."""
    if not isinstance(name, str):
        raise TypeError(f"a worker name must be a str; got {type(name).__name__}: {name!r}")
    if not name:
        raise InvalidWorkerNameError("Worker name must be non-empty")
    if not _NAME.match(name):
        raise InvalidWorkerNameError(f"Worker name must match ^[A-Za-z0-9-_:]*$; got {name!r}")
    if len(name) >= 128:
        raise InvalidWorkerNameError(f"Worker name must be shorter than 128 chars; got {len(name)} characters: "
                                     f"{name[:20]!r}...")
    return name


def detached(error: BaseException) -> BaseException:
    """``error`` without the frames it was raised through (its own and its causes').

    An error kept in a future (a failed send, a remote call's outcome) must not keep the
    frames it passed: they hold the call's arguments, RRefs among them, and the future
    itself is often one of their locals, so the error, its traceback and the future form a
    cycle that only the garbage collector frees. An RRef held that way is not deleted when
    its call ends, and an owner that waits for its forks to go (``shutdown``, or
    ``_delete_all_user_and_unforked_owner_rrefs``) waits for a deletion that never comes.
    The error's message already names what failed.
    """
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        e.__traceback__ = None
        e = e.__cause__ or e.__context__
    return error


class WorkerInfo:
    """A worker's name and id (its rank): picklable, hashable, compared by both."""

    __slots__ = ("name", "id")

    def __init__(self, name: str, id: int) -> None:  # noqa: A002 -- torch's field name
        self.name = check_name(name)
        self.id = id

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WorkerInfo) and (self.name, self.id) == (other.name, other.id)

    def __hash__(self) -> int:
        return hash((self.name, self.id))

    def __repr__(self) -> str:
        return f"WorkerInfo(id={self.id}, name={self.name})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (WorkerInfo, (self.name, self.id))


class MessageType(enum.IntEnum):
    """Message kinds on the wire, by torch's names (the faulty agent selects by these)."""

    SCRIPT_CALL = 0
    SCRIPT_RET = 1
    PYTHON_CALL = 2
    PYTHON_RET = 3
    SCRIPT_REMOTE_CALL = 4
    PYTHON_REMOTE_CALL = 5
    REMOTE_RET = 6
    SCRIPT_RREF_FETCH_CALL = 7
    PYTHON_RREF_FETCH_CALL = 8
    SCRIPT_RREF_FETCH_RET = 9
    PYTHON_RREF_FETCH_RET = 10
    RREF_USER_DELETE = 11
    RREF_FORK_REQUEST = 12
    RREF_CHILD_ACCEPT = 13
    RREF_ACK = 14
    CLEANUP_AUTOGRAD_CONTEXT_REQ = 15
    EXCEPTION = 16
    REPLY_NOW = 100  # gpucoll's own: write the reply to a call at once (gpucoll.rpc._hurry)


class RpcTimeoutError(DistError, TimeoutError):
    """A call did not complete within its timeout (torch: "RPC ran for more than set timeout")."""


class IntentionalFailureError(DistError):
    """A send the faulty test backend was told to fail ("Send attempt failed intentionally")."""


class PeerLostError(DistNetworkError):
    """The worker a call went to exited, was killed, or its connection broke."""


class UnknownWorkerError(DistError, ValueError):
    """No worker of that name or id is in the group."""


class DuplicateNameError(DistError, ValueError):
    """Two workers of one group asked for the same name."""


class InvalidWorkerNameError(ValueError, RuntimeError):
    """A worker name torch would refuse (a ValueError; a RuntimeError too, as torch raises)."""


class FunctionNotFoundError(AttributeError, RuntimeError):
    """The callee cannot import the function a call names (an AttributeError, and a
    RuntimeError as torch raises)."""


class AsyncReturnTypeError(TypeError, RuntimeError):
    """A function marked @async_execution returned something other than a Future."""


class AgentShutDownError(DistError):
    """RPC was shut down (or never initialized) while a call was pending or being made."""
