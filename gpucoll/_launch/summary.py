"""gpucoll-run's failure summary: which rank failed first, how, when, and its traceback's tail."""

from __future__ import annotations

import signal
import socket
import time
from dataclasses import dataclass

from .errorfile import ErrorRecord

__all__ = ["RankExit", "describe_code", "launcher_exit_code", "root_cause", "failure_report", "report_key",
           "failure_summary"]

_TRACEBACK_LINES = 20


@dataclass(frozen=True)
class RankExit:
    """How one local rank ended.

    Attributes:
        rank, local_rank: its global and local rank.
        pid: its process id.
        code: its exit status as ``subprocess`` reports it (negative: killed by signal).
        time: when the launcher saw it exit (seconds since the epoch).
        signalled_at: when gpucoll-run sent it a stop signal, or None.
        error: what it recorded in its error file, if anything.
        killed_at: when gpucoll-run sent it SIGKILL (after the grace period), or None.
    """

    rank: int
    local_rank: int
    pid: int
    code: int
    time: float
    signalled_at: float | None
    error: ErrorRecord | None
    killed_at: float | None = None

    @property
    def failed_by_itself(self) -> bool:
        """It failed on its own account, not (only) because gpucoll-run stopped it."""
        if self.code == 0:
            return False
        if self.signalled_at is None or self.time < self.signalled_at:
            return True
        # An exception recorded before the stop signal was the rank's own failure; one
        # recorded after it (a KeyboardInterrupt from a forwarded SIGINT) was not.
        if self.error is not None:
            return self.error.timestamp < self.signalled_at
        # Dead by a SIGKILL that gpucoll-run had not sent: someone else killed it (its
        # exit was only seen after the launcher had begun stopping the job).
        return self.code == -signal.SIGKILL and self.killed_at is None

    @property
    def secondary(self) -> bool:
        """Its recorded error is a DistError (or raised while handling one): most likely
        the consequence of another rank's failure rather than a failure of its own."""
        return self.error is not None and self.error.secondary

    @property
    def own_code(self) -> int:
        """The exit status the rank's own failure gave: a rank that had recorded an
        exception but was still exiting when the launcher's SIGTERM came counts as
        Python's status for an uncaught exception, 1."""
        if self.error is not None and self.signalled_at is not None and self.code < 0:
            return 1
        return self.code

    @property
    def failure_time(self) -> float:
        return self.error.timestamp if self.error is not None else self.time


def describe_code(code: int) -> str:
    """``"exit code 3"`` or ``"signal SIGKILL (9)"`` for a ``subprocess`` return code."""
    if code >= 0:
        return f"exit code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"signal {name} ({-code})"


def launcher_exit_code(code: int) -> int:
    """The launcher's own exit status for a rank's return code (a signal N gives 128 + N)."""
    return code if code >= 0 else 128 - code


def root_cause(exits: list[RankExit]) -> RankExit | None:
    """The rank whose failure came first, among those that failed on their own account.

    A rank whose error is a DistError (a peer closed its connection, a collective
    timed out) failed because of another rank's failure; it is the root cause only
    when no rank failed otherwise. Among the rest, the earliest failure wins: by the
    recorded exception's time, else by the exit the launcher saw.
    """
    failed = [e for e in exits if e.failed_by_itself]
    primary = [e for e in failed if not e.secondary]
    pool = primary or failed
    return min(pool, key=lambda e: (e.failure_time, e.rank)) if pool else None


def failure_report(root: RankExit, node_rank: int) -> dict[str, object]:
    """What one node's launcher tells the others about its root cause (JSON-able)."""
    what = f"{root.error.exc_type}: {root.error.message}" if root.error else ""
    return {"node": node_rank, "rank": root.rank, "code": root.own_code, "host": socket.gethostname(),
            "what": describe_code(root.own_code), "time": root.failure_time,
            "secondary": root.secondary, "error": _one_line(what), "pid": root.pid}


def report_key(report: dict[str, object]) -> tuple[bool, float, int]:
    """Order of precedence between nodes' reports: own failures before DistErrors, then time.

    Times come from different hosts' clocks; the first criterion does not depend on them.
    """
    return (bool(report.get("secondary")), float(str(report.get("time", 0.0))), int(str(report.get("rank", 0))))


def failure_summary(exits: list[RankExit], *, start: float, node_rank: int, reason: str = "",
                    remote: dict[str, object] | None = None, tracebacks_on_console: bool = False) -> str:
    """The text gpucoll-run prints when a job fails.

    Args:
        exits: every local rank's exit.
        start: when the job started (seconds since the epoch).
        node_rank: this node's index.
        reason: why the launcher stopped the ranks when no local rank failed by itself
            (a signal to the launcher, another node's failure).
        remote: another node's report (see :func:`failure_report`) when it, not a
            local rank, is the job's root cause.
        tracebacks_on_console: the ranks' stderr reaches the console, so the root cause's
            traceback is already there; the summary then points to it instead of
            repeating it (with ``--log-dir`` and no ``--tee`` it shows the last lines).

    Returns:
        A multi-line summary.
    """
    root = root_cause(exits) if remote is None else None
    bar = "=" * 72
    lines = [bar, "gpucoll-run: job failed" if root or remote or not reason else f"gpucoll-run: {reason}"]
    if remote is not None:
        lines += [
            f"root cause: rank {remote.get('rank')} on node {remote.get('node')} (host {remote.get('host')}, "
            f"pid {remote.get('pid')}; reported by that node's launcher)",
            f"  {remote.get('what')}",
        ]
        if remote.get("error"):
            lines.append(f"  error: {remote.get('error')}")
    if root is not None:
        lines += [
            f"root cause: rank {root.rank} (local rank {root.local_rank} on node {node_rank}, "
            f"host {socket.gethostname()}, pid {root.pid})",
            f"  {describe_code(root.own_code)}" + (
                f" (then {describe_code(root.code)} from gpucoll-run while exiting)"
                if root.own_code != root.code else ""),
            f"  time: {_clock(root.failure_time)} ({root.failure_time - start:.2f} s after start)",
        ]
        if root.error is not None:
            lines.append(f"  error: {root.error.exc_type}: {root.error.message}")
            if tracebacks_on_console and root.error.exc_type != "SystemExit":  # Python prints none for it
                # The rank's own stderr already put its traceback on the console: say where,
                # rather than print it a second time.
                lines.append(f"  where (the whole traceback is above, in rank {root.rank}'s output):")
                lines += [f"    {line}" for line in _user_frames_of(root.error.traceback)]
            else:
                tb = root.error.traceback.rstrip("\n").splitlines()
                shown = tb[-_TRACEBACK_LINES:]
                lines.append("  traceback" + (" (last lines)" if len(tb) > len(shown) else "") + ":")
                lines += [f"    {line}" for line in shown]
        else:
            lines.append("  (no Python exception was recorded: the process exited or was killed)")
        if reason:
            lines.append(f"  then: {reason}")
    others = [e for e in exits if e.failed_by_itself and e is not root]
    if remote is not None and others:
        lines.append("on this node:")
    for e in sorted(others, key=lambda e: e.rank):
        what = f"{e.error.exc_type}: {e.error.message}" if e.error else "no exception recorded"
        lines.append(f"also failed: rank {e.rank} ({describe_code(e.own_code)}; {_one_line(what)})")
    stopped = sorted(e.rank for e in exits if e.signalled_at is not None and not e.failed_by_itself)
    if stopped:
        lines.append(f"stopped by gpucoll-run: rank{'s' if len(stopped) > 1 else ''} "
                     f"{', '.join(map(str, stopped))}")
    lines.append(bar)
    return "\n".join(lines)


def _user_frames_of(traceback: str, frames: int = 2) -> list[str]:
    """The innermost ``frames`` frames of a formatted traceback that lie outside gpucoll,
    without Python's ``^^^`` markers: where the user's code was when it failed."""
    from .._debug import package_dir

    found: list[list[str]] = []
    for line in traceback.splitlines():
        stripped = line.strip()
        if line.startswith("  File "):
            found.append([line.rstrip()])
        elif found and line.startswith("    ") and stripped and set(stripped) - set("^~"):
            found[-1].append(line.rstrip())
        elif not line.startswith(" "):
            found.append([])  # the exception line, or a chained traceback's header: ends a frame
    library = package_dir()
    mine = [f for f in found if f and library not in f[0]]
    return [line.strip() if i == 0 else "  " + line.strip()
            for f in mine[-frames:] for i, line in enumerate(f)]


def _clock(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 1000):03d}"


def _one_line(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
