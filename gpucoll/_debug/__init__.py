"""Debug levels: OFF, INFO, DETAIL (torch's ``DebugLevel``), from ``GPUCOLL_DEBUG``.

- ``OFF`` (default): nothing extra.
- ``INFO``: every op's call site (``file:line`` of the caller, outside gpucoll) is kept
  in the flight recorder, so ``gpucoll-debug trace`` shows where each rank issued
  the op it is stuck in.
- ``DETAIL``: INFO, and before every collective on every backend the ranks of the
  group compare what they are about to issue (op, sequence number, dtype, shape,
  root, reduction); if they differ, every rank raises an error naming the field and
  each rank's value instead of hanging or computing garbage. It costs one small
  all-gather per collective.

The level comes from ``GPUCOLL_DEBUG``, read whenever a group is created; when it
is unset, torch's ``TORCH_DISTRIBUTED_DEBUG`` is read instead, so a job configured
for torch gets the same level. :func:`set_debug_level` overrides the environment
for groups created afterwards (a group keeps the level it was created with, as
torch's process groups do).
"""

from __future__ import annotations

import enum
import os

__all__ = ["DebugLevel", "get_debug_level", "set_debug_level", "set_debug_level_from_env", "DEBUG_ENV",
           "TORCH_DEBUG_ENV"]

from .._env import DEBUG_ENV as DEBUG_ENV

TORCH_DEBUG_ENV = "TORCH_DISTRIBUTED_DEBUG"


class DebugLevel(enum.IntEnum):
    """How much checking and recording groups do (torch's ``DebugLevel``)."""

    OFF = 0
    INFO = 1
    DETAIL = 2

    def __str__(self) -> str:
        # torch's str(): "DebugLevel.DETAIL" (an IntEnum's str is its number since Python 3.11)
        return f"DebugLevel.{self.name}"


def _from_env() -> DebugLevel:
    for var in (DEBUG_ENV, TORCH_DEBUG_ENV):
        raw = os.environ.get(var, "").strip()
        if raw:
            try:
                return DebugLevel[raw.upper()]
            except KeyError:
                raise ValueError(f"The value of {var} must be OFF, INFO, or DETAIL; got {raw!r}") from None
    return DebugLevel.OFF


class _Level:
    """The process's debug level: one slot, like the default group's (read per group creation)."""

    value: DebugLevel | None = None


def get_debug_level() -> DebugLevel:
    """The current debug level: the one :func:`set_debug_level` set, else the environment's.

    Raises:
        ValueError: ``GPUCOLL_DEBUG`` (or ``TORCH_DISTRIBUTED_DEBUG``) holds another value.
    """
    return _from_env() if _Level.value is None else _Level.value


def set_debug_level(level: DebugLevel | str | None) -> None:
    """Set the debug level for groups created from now on.

    Args:
        level: a :class:`DebugLevel` or its name (``"OFF"``, ``"INFO"``, ``"DETAIL"``);
            None goes back to reading the environment.

    Raises:
        ValueError: an unknown level.
    """
    if level is None or isinstance(level, DebugLevel):
        _Level.value = level
        return
    if isinstance(level, str) and level.strip().upper() in DebugLevel.__members__:
        _Level.value = DebugLevel[level.strip().upper()]
        return
    raise ValueError(f"level must be a DebugLevel or one of 'OFF', 'INFO', 'DETAIL'; got {level!r}")


def set_debug_level_from_env() -> None:
    """Read the level from ``GPUCOLL_DEBUG`` (else ``TORCH_DISTRIBUTED_DEBUG``) again.

    Raises:
        ValueError: the variable holds another value.
    """
    _Level.value = _from_env()


def package_dir() -> str:
    """The directory of this gpucoll package, with a trailing separator.

    A frame is the library's own when its file lies under this directory: decided by the
    package's real location, never by a name in the path (a user's script may well live in a
    folder called ``gpucoll``, as a clone of the repository does).
    """
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def call_site() -> str:
    """``file:line (function)`` of the innermost caller outside gpucoll (for the flight recorder)."""
    import sys

    frame = sys._getframe(1)
    package = package_dir()
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return ""
    return f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"


def thread_stacks() -> dict[str, str]:
    """Every thread's current Python stack, by ``"<name> (<ident>)"``, innermost call last."""
    import sys
    import threading
    import traceback

    names = {t.ident: t.name for t in threading.enumerate()}
    return {f"{names.get(ident, '?')} ({ident})": "".join(traceback.format_stack(frame))
            for ident, frame in sys._current_frames().items()}
