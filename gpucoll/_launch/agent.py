"""gpucoll-run's agent: starts one node's ranks, supervises them, and stops them all.

Each rank runs in its own session (so its process group is its own: one
``killpg`` reaches the rank and every process it started) under the bootstrap
``python -m gpucoll._launch.worker``. One thread per rank waits for it to exit;
those threads, the signal handlers and the multi-node watchers all report to one
event queue, which the main thread reads. The first rank to fail (non-zero exit
or a signal) makes the agent send SIGTERM to every other rank's group, then
SIGKILL after the grace period; a signal to the launcher is forwarded the same
way. Whatever happens, every group is SIGKILLed before the agent returns.
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from .errorfile import ERROR_FILE_ENV, read_error
from .config import LaunchConfig
from .nodes import NodeLink
from .output import OutputPump
from .summary import (RankExit, describe_code, failure_report, failure_summary, launcher_exit_code,
                      report_key, root_cause)
from .worker import LAUNCHER_PID_ENV
from . import binding
from .._env import CPU_BIND_ENV, STORE_RELAY_ENV
from ..clusters.base import ClusterEnv
from ..clusters.env import SOURCE, rank_environment
from ..errors import DistError

__all__ = ["run_job"]

# The reaper: a tiny process in its own session that holds the read end of a pipe
# from the launcher. Each rank's process group id arrives as a line; "done" means
# the launcher cleaned up itself. End of file without "done" means the launcher
# died (even by SIGKILL): the reaper then kills every group, so the processes that
# ranks started do not outlive the job either. ``-S``: no site imports, fast start.
_REAPER = """
import os, shutil, signal, sys
groups = []
for line in sys.stdin:
    line = line.strip()
    if line == "done":
        sys.exit(0)
    if line.isdigit():
        groups.append(int(line))
for group in groups:
    try:
        os.killpg(group, signal.SIGKILL)
    except OSError:
        pass
shutil.rmtree(sys.argv[1], ignore_errors=True)
for name in os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else ():
    parts = name.split("-")
    if len(parts) == 3 and parts[0] == "gpucoll" and parts[1].isdigit() and int(parts[1]) in groups:
        try:
            os.unlink("/dev/shm/" + name)
        except OSError:
            pass
"""

# The scratch folder (error files) is named after the launcher's pid and pid namespace,
# so that the next launch can tell a folder whose launcher is dead (and whose reaper
# could not remove it) from a running job's.
_SCRATCH_PREFIX = "gpucoll-run-"

_SETTLE = 2.0  # seconds a launcher waits for other nodes' failure reports

_FORWARDED = {signal.SIGINT: signal.SIGINT, signal.SIGTERM: signal.SIGTERM, signal.SIGHUP: signal.SIGTERM}

Event = tuple[Any, ...]


@dataclass
class _Rank:
    rank: int
    local_rank: int
    proc: subprocess.Popen[bytes]
    error_file: str
    code: int | None = None
    exit_time: float = 0.0
    signalled_at: float | None = None
    killed_at: float | None = None
    waiter: threading.Thread | None = field(default=None, repr=False)


def run_job(config: LaunchConfig, *, stdout: BinaryIO | None = None, stderr: BinaryIO | None = None) -> int:
    """Run one node's share of the job described by ``config``; return the launcher's exit status.

    Args:
        config: the validated launch configuration.
        stdout, stderr: the console's binary streams (default: this process's).

    Returns:
        0 when every rank succeeded; else the first failed rank's exit code (128 + N
        for a signal N), 128 + N when the launcher was stopped by signal N, or 1 when
        the job's store could not be reached.
    """
    return _Agent(config, stdout or sys.stdout.buffer, stderr or sys.stderr.buffer).run()


class _Agent:
    def __init__(self, config: LaunchConfig, stdout: BinaryIO, stderr: BinaryIO) -> None:
        self.config = config
        self.stdout = stdout
        self.stderr = stderr
        self.events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self.ranks: list[_Rank] = []
        self.start = time.time()
        self.stop_reason = ""      # set once: why the agent is stopping the ranks
        self.local_failure = False  # ... and whether that was one of its own ranks failing
        self.exit_code: int | None = None
        self.kill_deadline: float | None = None
        self.link: NodeLink | None = None
        self.server: Any = None
        self.relay: Any = None     # this node's store relay (--store-relay), or None
        self.port = config.master_port
        self.reaper: subprocess.Popen[bytes] | None = None
        self.interrupted: int | None = None   # the signal that stopped the launcher, if any
        self.reported: tuple[int, int] | None = None  # (rank, code) last reported to the other nodes

    # -- the job ----------------------------------------------------------------------

    def run(self) -> int:
        # Before any rank exists, signals keep their default effect: Ctrl-C while a
        # node waits for node 0's store must end the launcher at once.
        try:
            if not self._open_store():
                return 1
        except KeyboardInterrupt:
            self._close_store()
            self._say("interrupted while connecting to the job's store")
            return 128 + signal.SIGINT
        _remove_stale_scratch()
        scratch = tempfile.mkdtemp(prefix=f"{_SCRATCH_PREFIX}{_pid_namespace()}-{os.getpid()}-")
        old_handlers = self._install_signal_handlers()
        try:
            return self._run(scratch, old_handlers)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def _run(self, scratch: str, old_handlers: dict[int, Any]) -> int:
        cfg = self.config
        pump: OutputPump | None = None
        try:
            if cfg.log_dir is not None:
                os.makedirs(cfg.log_dir, exist_ok=True)
            pump = OutputPump(self.stdout, self.stderr, prefix=cfg.prefix, log_dir=cfg.log_dir,
                              console=cfg.log_dir is None or cfg.tee) if cfg.pipes_output else None
            self.reaper = subprocess.Popen([sys.executable, "-S", "-c", _REAPER, scratch], stdin=subprocess.PIPE,
                                           start_new_session=True, close_fds=True, bufsize=0)
            self._spawn(scratch, pump)
            if pump is not None:
                pump.start()
            if self.link is not None:
                self.link.watch()
            self._supervise()
        finally:
            self._kill_all(signal.SIGKILL)
            for r in self.ranks:
                if r.waiter is not None:
                    r.waiter.join(5.0)
            if pump is not None:
                pump.join(5.0)
            _remove_rank_segments([r.proc.pid for r in self.ranks])
            code, remote = self._decide()
            self._close_store()
            self._dismiss_reaper()
            self._restore_signal_handlers(old_handlers)
        return self._finish(code, remote)

    def _open_store(self) -> bool:
        """Node 0 serves the job's store; every node connects its NodeLink to it."""
        cfg = self.config
        try:
            if cfg.hosts_store:
                from ..store import TCPStore

                # One node: loopback (or the given address) only. Several: every interface,
                # since the name other nodes use may not be an address of this host.
                bind = cfg.master_addr if cfg.nnodes == 1 else ("::" if ":" in cfg.master_addr else "")
                # Its clients: every node's link and every rank, or, through relays, one
                # connection per node: the server raises the open-file limit for them, sizes
                # its accept queues, and refuses at once (naming the limit) if they cannot fit.
                clients = cfg.nnodes + (cfg.nnodes if cfg.store_relay else cfg.world_size)
                self.server = TCPStore(bind, cfg.master_port, clients, is_master=True,
                                       wait_for_workers=False, timeout=cfg.join_timeout, token=cfg.token)
                self.port = int(self.server.port)
                if cfg.nnodes > 1 and cfg.master_port == 0:
                    self._say(f"the job's store listens on {cfg.master_addr}:{self.port}; start the other "
                              f"nodes with --master-addr {cfg.master_addr} --master-port {self.port}")
            # Node 0 reaches its own server over loopback: --master-addr is the name
            # other nodes use, which need not resolve here to an address of this host.
            addr = cfg.master_addr if not cfg.hosts_store else ("::1" if ":" in cfg.master_addr
                                                                else "127.0.0.1")
            link_addr, link_port = addr, self.port
            if cfg.store_relay:
                # The node's ranks, and this agent's link, reach the store through one
                # connection: the store holds one per node (docs/scaling.md).
                from ..store._relay import StoreRelay

                self.relay = StoreRelay(addr, self.port, token=cfg.token, timeout=cfg.join_timeout)
                link_addr, link_port = self.relay.host, self.relay.port
            if cfg.nnodes > 1:
                self.link = NodeLink(link_addr, link_port, cfg.token, cfg.join_timeout,
                                     cfg.nnodes, cfg.node_rank, self.events)
        except (DistError, OSError) as err:
            what = "serve" if cfg.hosts_store and self.server is None else "reach"
            self._say(f"cannot {what} the job's store at {cfg.master_addr}:{self.port}: {err}")
            return False
        return True

    def _close_store(self) -> None:
        if self.link is not None:
            self.link.close()
        if self.relay is not None:
            self.relay.close()
        if self.server is not None:
            self.server.close()

    def _spawn(self, scratch: str, pump: OutputPump | None) -> None:
        cfg = self.config
        base = dict(os.environ)
        base[LAUNCHER_PID_ENV] = str(os.getpid())
        base.pop(STORE_RELAY_ENV, None)  # an outer job's relay is not this one's
        if self.relay is not None:
            base[STORE_RELAY_ENV] = self.relay.address
        if cfg.nproc_per_node > 1 and "OMP_NUM_THREADS" not in base:
            # As torchrun does: N ranks each starting one OpenMP thread per core would
            # oversubscribe the node N times.
            base["OMP_NUM_THREADS"] = "1"
        base.pop(CPU_BIND_ENV, None)  # nor is an outer job's binding
        cpus = binding.plan(cfg.bind_to, cfg.nproc_per_node)
        if cfg.bind_to != "none" and cpus is None:
            print(f"gpucoll-run: --bind-to {cfg.bind_to}: {cfg.nproc_per_node} local ranks but "
                  f"{len(binding.cores())} cores to run on; no rank is bound", file=sys.stderr, flush=True)
        cmd = [sys.executable, "-m", "gpucoll._launch.worker", *cfg.program]
        error_dir = cfg.log_dir or scratch
        for local_rank in range(cfg.nproc_per_node):
            if self.stop_reason or not self._drain_nonblocking():
                break
            rank = cfg.node_rank * cfg.nproc_per_node + local_rank
            error_file = os.path.join(error_dir, f"error-rank{rank}.json")
            try:
                os.unlink(error_file)
            except FileNotFoundError:
                pass
            env = dict(base, **rank_environment(
                ClusterEnv(SOURCE, rank, cfg.world_size, local_rank, cfg.nproc_per_node, cfg.master_addr,
                           self.port, store_hosted=True, node_rank=cfg.node_rank), token=cfg.token))
            env[ERROR_FILE_ENV] = error_file
            if cpus is not None:
                env[CPU_BIND_ENV] = binding.env_value(cpus[local_rank])
            pipe = subprocess.PIPE if pump is not None else None
            proc = subprocess.Popen(
                cmd, env=env, start_new_session=True, close_fds=True,
                # Like mpirun: the console's input goes to the first rank only.
                stdin=None if local_rank == 0 else subprocess.DEVNULL,
                stdout=pipe, stderr=pipe, bufsize=0,
            )
            r = _Rank(rank, local_rank, proc, error_file)
            self.ranks.append(r)
            self._tell_reaper(f"{proc.pid}\n")
            if pump is not None:
                assert proc.stdout is not None and proc.stderr is not None
                pump.add(rank, proc.stdout, proc.stderr)
            index = len(self.ranks) - 1
            r.waiter = threading.Thread(target=self._wait_rank, args=(index,), daemon=True,
                                        name=f"gpucoll-run-wait-rank{rank}")
            r.waiter.start()

    def _tell_reaper(self, line: str) -> None:
        if self.reaper is not None and self.reaper.stdin is not None:
            try:
                self.reaper.stdin.write(line.encode("ascii"))
            except OSError:
                pass  # the reaper is gone: PR_SET_PDEATHSIG still covers the ranks

    def _dismiss_reaper(self) -> None:
        if self.reaper is None:
            return
        self._tell_reaper("done\n")
        if self.reaper.stdin is not None:
            self.reaper.stdin.close()
        try:
            self.reaper.wait(5.0)
        except subprocess.TimeoutExpired:
            self.reaper.kill()
            self.reaper.wait()

    def _wait_rank(self, index: int) -> None:
        code = self.ranks[index].proc.wait()
        # The time is taken here, not when the main thread gets to the event: which rank
        # failed first is decided by comparing it with other ranks' error times.
        self.events.put(("exit", index, code, time.time()))

    def _drain_nonblocking(self) -> bool:
        """Handle events that arrived while starting ranks; False once stopping."""
        while True:
            try:
                self._handle(self.events.get_nowait())
            except queue.Empty:
                return not self.stop_reason

    # -- supervision ------------------------------------------------------------------

    def _supervise(self) -> None:
        local_done = False
        while True:
            running = [r for r in self.ranks if r.code is None]
            if not running and not local_done:
                local_done = True
                if not self._after_local_ranks():
                    return
            if local_done and self.exit_code is not None:
                return
            wait = 1.0
            if self.kill_deadline is not None:
                wait = max(0.0, min(wait, self.kill_deadline - time.monotonic()))
            try:
                self._handle(self.events.get(timeout=wait))
            except queue.Empty:
                pass
            if self.kill_deadline is not None and time.monotonic() >= self.kill_deadline:
                self._kill_all(signal.SIGKILL)
                self.kill_deadline = None

    def _after_local_ranks(self) -> bool:
        """Every local rank has exited. Return True to keep waiting (for other nodes)."""
        cfg = self.config
        if self.stop_reason or self.exit_code is not None:
            if self.exit_code is None:
                self.exit_code = self._local_failure_code()
            return False
        if self.link is None:
            self.exit_code = 0
            return False
        self.link.report_done()
        if not cfg.hosts_store:
            self.exit_code = 0
            return False
        self.link.wait_all_done()
        return True

    def _handle(self, event: Event) -> None:
        kind = event[0]
        if kind == "exit":
            r = self.ranks[event[1]]
            r.code, r.exit_time = int(event[2]), float(event[3])
            if r.code == 0:
                return
            root = root_cause(self._exits(exited_only=True))
            if root is not None and not self.stop_reason:
                self.stop_reason = f"rank {r.rank} failed ({describe_code(r.code)})"
                self.local_failure = True
                self._stop(signal.SIGTERM)
            if root is not None:
                self._report_local_root(root)
        elif kind == "signal":
            signum = int(event[1])
            if self.stop_reason:
                self._kill_all(signal.SIGKILL)  # a second Ctrl-C does not wait
            else:
                self.stop_reason = f"interrupted by {signal.Signals(signum).name}"
                self.exit_code = 128 + signum
                self.interrupted = signum
                self._stop(_FORWARDED.get(signal.Signals(signum), signal.SIGTERM))
        elif kind in ("remote", "store_lost", "done_timeout"):
            if kind == "remote":
                info = event[1]
                reason = (f"rank {info.get('rank')} on node {info.get('node')} ({info.get('host')}) "
                          f"failed ({info.get('what')})")
                code = launcher_exit_code(int(info.get("code", 1))) or 1
            else:
                reason, code = str(event[1]), 1
            if not self.stop_reason and self.exit_code is None:
                self.stop_reason = reason
                self.exit_code = code
                self._stop(signal.SIGTERM)
        elif kind == "all_done":
            if self.exit_code is None:
                self.exit_code = 0

    def _stop(self, sig: signal.Signals) -> None:
        now = time.time()
        for r in self.ranks:
            if r.code is None:
                r.signalled_at = now
                _killpg(r.proc.pid, sig)
        self.kill_deadline = time.monotonic() + self.config.grace_period

    def _kill_all(self, sig: signal.Signals) -> None:
        # Exited ranks too: processes they started may still be running in their group.
        now = time.time()
        for r in self.ranks:
            if r.code is None and sig == signal.SIGKILL and r.killed_at is None:
                r.killed_at = now
            _killpg(r.proc.pid, sig)

    # -- results ----------------------------------------------------------------------

    def _exits(self, *, exited_only: bool = False) -> list[RankExit]:
        now = time.time()
        # A rank not reaped by now was SIGKILLed by the launcher's cleanup.
        return [RankExit(r.rank, r.local_rank, r.proc.pid, r.code if r.code is not None else -9,
                         r.exit_time if r.code is not None else now, r.signalled_at, read_error(r.error_file),
                         r.killed_at if r.code is not None else (r.killed_at or now))
                for r in self.ranks if r.code is not None or not exited_only]

    def _report_local_root(self, root: RankExit) -> None:
        """After a local rank's failure (and after stopping the others): tell the other
        nodes this node's root cause, when it changed (a rank killed outright may be
        seen after one that its death made fail)."""
        if self.link is not None and self.reported != (root.rank, root.own_code):
            self.reported = (root.rank, root.own_code)
            self.link.report_failure(failure_report(root, self.config.node_rank))

    def _local_failure_code(self) -> int:
        root = root_cause(self._exits())
        return launcher_exit_code(root.own_code) if root is not None else 1

    def _decide(self) -> tuple[int, dict[str, Any] | None]:
        """The launcher's exit code and, when another node's rank is the job's root
        cause, that node's report. Called once every local rank has exited."""
        code = self.exit_code if self.exit_code is not None else 1
        if code == 0 or self.interrupted is not None:
            if self.link is not None and code != 0:
                self.link.report_exited()
            return code, None
        remote: dict[str, Any] | None = None
        if self.link is not None:
            root = root_cause(self._exits())
            mine = failure_report(root, self.config.node_rank) if root is not None else None
            # A local DistError, or no local failure at all, waits a moment for the node
            # where the failure began to report it; a rank's own failure needs no wait.
            settle = 0.0 if mine is not None and not mine["secondary"] else _SETTLE
            reports = self.link.failures(settle)
            if mine is not None:
                reports.append(mine)
            if reports:
                best = min(reports, key=report_key)
                if int(best["node"]) != self.config.node_rank:
                    remote = best
                code = launcher_exit_code(int(best["code"])) or 1
            self.link.report_exited()
            if self.config.hosts_store:
                # Other launchers read the reports from this node's store: keep it up
                # until they have (bounded, in case one of them is gone).
                self.link.wait_exited(self.config.grace_period + _SETTLE + 3.0)
        elif self.local_failure:
            code = self._local_failure_code()
        return code, remote

    def _finish(self, code: int, remote: dict[str, Any] | None) -> int:
        if code != 0 and self.ranks:
            exits = self._exits()
            reason = "" if self.local_failure else self.stop_reason
            self._say(failure_summary(exits, start=self.start, node_rank=self.config.node_rank,
                                      reason=reason, remote=remote,
                                      tracebacks_on_console=self.config.log_dir is None or self.config.tee),
                      prefix=False)
        elif code != 0 and self.stop_reason:
            self._say(self.stop_reason)
        return code

    def _say(self, text: str, *, prefix: bool = True) -> None:
        lines = text if not prefix else "\n".join(f"gpucoll-run: {line}" for line in text.splitlines())
        try:
            self.stderr.write(lines.encode("utf-8", "replace") + b"\n")
            self.stderr.flush()
        except (OSError, ValueError):
            pass

    # -- signals ----------------------------------------------------------------------

    def _install_signal_handlers(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        old: dict[int, Any] = {}
        for sig in _FORWARDED:
            old[sig] = signal.signal(sig, self._on_signal)
        return old

    def _on_signal(self, signum: int, frame: object) -> None:
        # SimpleQueue.put is safe in a signal handler; a Queue could deadlock here.
        self.events.put(("signal", signum))

    @staticmethod
    def _restore_signal_handlers(old: dict[int, Any]) -> None:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _pid_namespace() -> str:
    try:
        return format(os.stat("/proc/self/ns/pid").st_ino, "x")
    except OSError:
        return "0"


def _remove_stale_scratch() -> None:
    """Remove scratch folders left by launchers of this pid namespace that are dead
    (a launcher killed by SIGKILL whose reaper was killed too)."""
    base = tempfile.gettempdir()
    mine = f"{_SCRATCH_PREFIX}{_pid_namespace()}-"
    try:
        names = [n for n in os.listdir(base) if n.startswith(mine)]
    except OSError:
        return
    for name in names:
        pid_text = name[len(mine):].split("-", 1)[0]
        path = os.path.join(base, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not pid_text.isdigit() or st.st_uid != os.getuid() or not os.path.isdir(path) or os.path.islink(path):
            continue
        try:
            os.kill(int(pid_text), 0)
            continue  # its launcher is alive (or the pid was reused: left for later)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:
            continue


def _remove_rank_segments(pids: list[int]) -> None:
    """Unlink the CPU backend's shared-memory segments the (exited) ranks created: a
    rank killed before every peer mapped its segment leaves it in /dev/shm."""
    from .._backends.cpu.segments import remove_segments_of

    remove_segments_of(pids)


def _killpg(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
