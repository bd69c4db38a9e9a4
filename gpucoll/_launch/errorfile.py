"""Per-rank error files: how a worker tells its launcher why it died.

``gpucoll-run`` names a file per rank in GPUCOLL_ERROR_FILE; the worker bootstrap
writes the uncaught exception there (type, message, traceback, time) before the
process exits, and the launcher puts it in its failure summary. The output stream
is not enough: it may be redirected, interleaved with other ranks, or cut off by a
kill, and it does not say which error came first.
"""

from __future__ import annotations

import json
import os
import socket
import time
import traceback
from dataclasses import asdict, dataclass

from ..errors import DistError

__all__ = ["ERROR_FILE_ENV", "ErrorRecord", "write_error", "read_error"]

from .._env import ERROR_FILE_ENV as ERROR_FILE_ENV


@dataclass(frozen=True)
class ErrorRecord:
    """An uncaught exception of one worker.

    Attributes:
        exc_type: qualified name of the exception's class ("ValueError", "mod.MyError").
        message: ``str(exception)``.
        traceback: the formatted traceback, chained causes included.
        timestamp: when it was recorded (seconds since the epoch).
        pid: the worker's process id.
        hostname: the worker's host.
        rank: the worker's RANK, or -1 when unknown.
        secondary: the exception is a :class:`gpucoll.errors.DistError` or was raised
            while handling one (its ``__cause__``/``__context__`` chain holds one): the
            rank most likely failed because a peer did, not on its own account.
    """

    exc_type: str
    message: str
    traceback: str
    timestamp: float
    pid: int
    hostname: str
    rank: int
    secondary: bool = False


def _chain_has_dist_error(exc: BaseException) -> bool:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, DistError):
            return True
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return False


def write_error(exc: BaseException, path: str | None = None) -> str | None:
    """Record ``exc`` in the error file.

    The file is written to a temporary name and renamed, so a reader never sees half
    a record even if the worker is killed while writing.

    Args:
        exc: the exception (its ``__traceback__`` is used).
        path: where to write; defaults to the GPUCOLL_ERROR_FILE variable.

    Returns:
        The path written, or None when no path was given or set.

    Raises:
        OSError: the file cannot be written.
    """
    path = path or os.environ.get(ERROR_FILE_ENV) or None
    if path is None:
        return None
    cls = type(exc)
    name = cls.__qualname__ if cls.__module__ in ("builtins", "__main__") else f"{cls.__module__}.{cls.__qualname__}"
    rank_raw = os.environ.get("RANK", "")
    record = ErrorRecord(
        exc_type=name,
        message=str(exc),
        traceback="".join(traceback.format_exception(cls, exc, exc.__traceback__)),
        timestamp=time.time(),
        pid=os.getpid(),
        hostname=socket.gethostname(),
        rank=int(rank_raw) if rank_raw.isdigit() else -1,
        secondary=_chain_has_dist_error(exc),
    )
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(asdict(record), f)
    os.replace(tmp, path)
    return path


def read_error(path: str) -> ErrorRecord | None:
    """Read an error file written by :func:`write_error`.

    Args:
        path: the file.

    Returns:
        The record, or None when the file does not exist or does not hold a record
        (a worker killed before it could write one leaves none).
    """
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return ErrorRecord(
            exc_type=str(data["exc_type"]),
            message=str(data["message"]),
            traceback=str(data["traceback"]),
            timestamp=float(data["timestamp"]),
            pid=int(data["pid"]),
            hostname=str(data["hostname"]),
            rank=int(data["rank"]),
            secondary=bool(data.get("secondary", False)),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
