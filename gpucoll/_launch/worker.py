"""The bootstrap gpucoll-run starts on every rank: ``python -m gpucoll._launch.worker``.

Usage: ``python -m gpucoll._launch.worker (script.py | -m module) [args...]``.

It runs the user's script or module as ``__main__`` (``sys.argv`` and ``sys.path``
as ``python script.py`` / ``python -m module`` would set them) after three
preparations:

- an uncaught exception (and a non-zero ``sys.exit``) is recorded in the rank's error file (GPUCOLL_ERROR_FILE)
  and then reported as Python would (``sys.excepthook``, exit status 1; a
  KeyboardInterrupt still ends the process by SIGINT);
- on Linux the process asks the kernel to SIGKILL it when the launcher dies, so
  that even a launcher killed by SIGKILL leaves no rank behind;
- stdout is line-buffered, so that ranks' lines reach the launcher's prefixing
  pump (and the log files) as they are printed, not when a buffer fills;
- with ``--bind-to core``, the process binds itself to the core its launcher planned
  for it (GPUCOLL_CPU_BIND) before the program starts any thread.
"""

from __future__ import annotations

import io
import os
import runpy
import signal
import sys
from types import TracebackType
from typing import Callable

from . import binding
from .errorfile import write_error

from .._env import CPU_BIND_ENV
from .._env import LAUNCHER_PID_ENV as LAUNCHER_PID_ENV

_PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> int:
    """Run the script or module named by ``argv``; return the exit status.

    Args:
        argv: ``[script, args...]`` or ``["-m", module, args...]``.

    Returns:
        0 when the program finished; a SystemExit raised by the program propagates.
    """
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        print("usage: python -m gpucoll._launch.worker (script.py | -m module) [args...]", file=sys.stderr)
        return 2
    _die_with_launcher()
    try:
        binding.apply_from_env()
    except (ValueError, OSError) as e:
        print(f"gpucoll-run worker: cannot bind to the CPUs its launcher planned ({CPU_BIND_ENV}): {e}",
              file=sys.stderr)
        return 1
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=True)
    run: Callable[[], object]
    if argv[0] == "-m":
        module = argv[1]
        sys.argv = [module, *argv[2:]]
        # ``python -m`` puts the working directory first on sys.path; so did our own -m.
        run = lambda: runpy.run_module(module, run_name="__main__", alter_sys=True)  # noqa: E731
    else:
        script = argv[0]
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        run = lambda: runpy.run_path(script, run_name="__main__")  # noqa: E731
    try:
        run()
    except SystemExit as exit_:
        if exit_.code not in (None, 0):
            # Recorded too: its time tells the launcher which rank failed first, which
            # the exit it sees later (after other ranks' errors) cannot.
            exit_.__traceback__ = _user_frames(exit_.__traceback__)
            try:
                write_error(exit_)
            except OSError:
                pass
        raise
    except BaseException as exc:
        _report(exc)
    return 0


def _report(exc: BaseException) -> None:
    """Record ``exc``, print it the way Python does, and end the process the way Python would."""
    exc.__traceback__ = _user_frames(exc.__traceback__)
    try:
        write_error(exc)
    except OSError as err:
        print(f"gpucoll: could not write the error file: {err}", file=sys.stderr)
    sys.excepthook(type(exc), exc, exc.__traceback__)
    sys.stderr.flush()
    if isinstance(exc, KeyboardInterrupt):
        # Python ends on an uncaught KeyboardInterrupt by SIGINT, so that callers
        # see "killed by SIGINT" and not a plain failure.
        sys.stdout.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    raise SystemExit(1)


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    """Drop the bootstrap's and runpy's frames from the top of a traceback."""
    own = {os.path.abspath(__file__), os.path.abspath(runpy.__file__ or ""), "<frozen runpy>"}
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if name not in own and os.path.abspath(name) not in own:
            break
        tb = tb.tb_next
    return tb


def _die_with_launcher() -> None:
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    # The launcher may have died between starting us and the prctl call: then our
    # parent is already someone else and no signal will come.
    expected = os.environ.get(LAUNCHER_PID_ENV, "")
    if expected.isdigit() and os.getppid() != int(expected):
        os._exit(1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
