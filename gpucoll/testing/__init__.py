"""Run an SPMD function on N local ranks: the multi-process test harness.

Public so that users can test their own SPMD code the way gpucoll tests itself::

    from gpucoll.testing import run_spmd

    def body(scale):
        import numpy as np, gpucoll
        x = np.full(4, gpucoll.get_rank() * scale, dtype=np.float32)
        gpucoll.all_reduce(x)
        return x.tolist()

    def test_sum():
        results = run_spmd(body, world_size=3, args=(2.0,))
        assert results[0] == [6.0] * 4

The harness hosts the job's TCPStore in the calling process (port 0, a fresh token),
starts ``world_size`` processes, optionally calls ``init_process_group`` in each,
runs ``fn(*args, **kwargs)`` and returns the per-rank return values (which must
pickle). On the first rank that raises or dies, every other rank is killed and
:class:`SPMDError` is raised with that rank's traceback and log tail. If the job
does not finish within ``timeout`` seconds, each rank dumps its Python stacks
(faulthandler) into its log, all are killed, and SPMDError says where they were.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import secrets
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Mapping, Sequence

from .._env import CPU_BIND_ENV

__all__ = ["run_spmd", "SPMDError", "RankFailure"]

_STACK_SIGNAL = signal.SIGUSR1


@dataclass(frozen=True)
class RankFailure:
    """Why one rank failed: its exit code, traceback (if it raised) and log tail."""

    rank: int
    exitcode: int | None
    traceback: str
    log_tail: str


class SPMDError(AssertionError):
    """An SPMD job failed or timed out. ``failures`` lists what each failed rank reported.

    Subclasses AssertionError so pytest shows it as a test failure, not an error.
    """

    def __init__(self, message: str, failures: Sequence[RankFailure]) -> None:
        super().__init__(message)
        self.failures = list(failures)


def run_spmd(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = 120.0,
    backend: str | None = "cpu",
    init: bool = True,
    pg_timeout: float = 30.0,
    env: Mapping[str, str] | None = None,
    start_method: str = "forkserver",
    bind_to: str = "none",
) -> list[Any]:
    """Run ``fn`` on ``world_size`` ranks and return each rank's result, in rank order.

    Args:
        fn: a picklable (module-level) function; runs once on every rank.
        world_size: number of ranks, >= 1.
        args, kwargs: passed to ``fn`` on every rank.
        timeout: seconds for the whole job (start, fn, teardown) before it is killed.
        backend: backend for ``init_process_group`` (ignored if ``init`` is False).
        init: call ``gpucoll.init_process_group`` before ``fn`` and
            ``destroy_process_group`` after it. With False, the ranks still get
            RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, the store token
            and ``GPUCOLL_STORE_HOSTED=1`` in their environment.
        pg_timeout: the process group's timeout in seconds (how soon a dead peer surfaces).
        env: extra environment variables for every rank.
        start_method: multiprocessing start method ("forkserver" or "spawn").
        bind_to: ``"core"`` binds rank i to core i (all its hardware threads), as
            ``gpucoll-run --bind-to core`` does; ``"none"`` (default) binds nothing. With
            more ranks than cores nothing is bound.

    Returns:
        ``[fn result of rank 0, rank 1, ...]``.

    Raises:
        SPMDError: a rank raised, died, or the job exceeded ``timeout``.
        ValueError: ``world_size`` < 1, or ``bind_to`` is not "none" or "core".
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1; got {world_size!r}")
    from .._launch import binding

    cpus = binding.plan(bind_to, world_size)
    _check_not_importing_main()
    from ..clusters.base import ClusterEnv
    from ..clusters.env import SOURCE, rank_environment
    from ..store import TCPStore

    token = secrets.token_hex(16)
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=timeout, token=token)
    ctx: Any = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(["numpy", "gpucoll"])
    logdir = tempfile.mkdtemp(prefix="gpucoll-spmd-")
    procs: list[Any] = []
    readers: dict[Any, int] = {}
    try:
        for rank in range(world_size):
            rank_env = dict(env or {})
            # Set either way: a rank never binds by a value its parent's launcher set.
            rank_env[CPU_BIND_ENV] = binding.env_value(cpus[rank]) if cpus is not None else ""
            rank_env.update(rank_environment(
                ClusterEnv(SOURCE, rank, world_size, rank, world_size, "127.0.0.1", server.port, store_hosted=True),
                token=token))
            r, w = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_rank_main,
                args=(fn, tuple(args), dict(kwargs or {}), rank, rank_env, init, backend, pg_timeout,
                      os.path.join(logdir, f"rank{rank}.log"), w),
                name=f"gpucoll-spmd-rank{rank}", daemon=True,
            )
            p.start()
            w.close()
            procs.append(p)
            readers[r] = rank
        return _collect(procs, readers, world_size, timeout, logdir)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5)
        server.close()
        _rmtree(logdir)


_UNGUARDED = ('put the code that calls run_spmd under `if __name__ == "__main__":` in your script: '
              "run_spmd starts its ranks with multiprocessing's forkserver (or spawn) method, which imports the "
              "script's main module again in a helper process, and that import must not start ranks itself")


def _check_not_importing_main() -> None:
    """Refuse a nested start while multiprocessing imports the main module in a child."""
    if getattr(mp.current_process(), "_inheriting", False):
        raise RuntimeError("gpucoll.testing.run_spmd was called while a helper process was importing your "
                           "script; " + _UNGUARDED)


def _collect(procs: list[Any], readers: dict[Any, int], world_size: int, timeout: float,
             logdir: str) -> list[Any]:
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    pending = dict(readers)
    sentinels = {p.sentinel: rank for rank, p in enumerate(procs)}
    while len(results) < world_size:
        left = deadline - time.monotonic()
        if left <= 0:
            _dump_stacks(procs)
            tails = [RankFailure(rk, procs[rk].exitcode, "", _tail(logdir, rk))
                     for rk in range(world_size) if rk not in results]
            where = "\n".join(f"--- rank {f.rank} (no result) ---\n{f.log_tail}" for f in tails)
            raise SPMDError(f"SPMD job of {world_size} ranks timed out after {timeout:.0f} s; "
                            f"ranks {[f.rank for f in tails]} did not finish. Their stacks:\n{where}", tails)
        ready: list[Any] = wait(list(pending) + list(sentinels), timeout=min(left, 1.0))
        for obj in ready:
            if obj in pending:
                rank = pending.pop(obj)
                try:
                    status, payload = obj.recv()
                except (EOFError, OSError):
                    status, payload = "died", ""
                if status == "ok":
                    results[rank] = pickle.loads(payload)
                else:
                    _fail(procs, rank, payload if status == "err" else "", logdir, world_size)
            elif obj in sentinels:
                rank = sentinels.pop(obj)
                if rank in results:
                    continue
                conn = next((c for c, rk in pending.items() if rk == rank), None)
                if conn is not None and conn.poll(1.0):
                    continue  # its result or traceback is still in the pipe: read it next round
                _fail(procs, rank, "", logdir, world_size)
    return [results[r] for r in range(world_size)]


def _fail(procs: list[Any], rank: int, tb: str, logdir: str, world_size: int) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(5)
    code = procs[rank].exitcode
    how = f"raised:\n{tb}" if tb else f"died with exit code {code}" + (
        f" (signal {signal.Signals(-code).name})" if code is not None and code < 0 else "")
    fail = RankFailure(rank, code, tb, _tail(logdir, rank))
    log = f"\n--- rank {rank} log tail ---\n{fail.log_tail}" if fail.log_tail.strip() else (
        "\nIt wrote nothing to its log: it died before running fn, and its own error (if any) is on "
        "this process's stderr above. If the script calls run_spmd at module level, "
        + _UNGUARDED)
    raise SPMDError(f"rank {rank} of {world_size} {how}{log}", [fail])


def _dump_stacks(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive() and p.pid:
            try:
                os.kill(p.pid, _STACK_SIGNAL)
            except OSError:
                pass
    time.sleep(1.0)


def _tail(logdir: str, rank: int, limit: int = 6000) -> str:
    try:
        with open(os.path.join(logdir, f"rank{rank}.log"), "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - limit))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _rmtree(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def _rank_main(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], rank: int,
               env: dict[str, str], init: bool, backend: str | None, pg_timeout: float,
               logpath: str, conn: Connection) -> None:
    log = open(logpath, "ab", buffering=0)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.register(_STACK_SIGNAL, file=sys.stderr, all_threads=True)
    os.environ.update(env)
    try:
        from .._launch.binding import apply_from_env

        apply_from_env()
        import gpucoll

        if init:
            gpucoll.init_process_group(backend=backend, timeout=pg_timeout)
        try:
            result = fn(*args, **kwargs)
        finally:
            if init and gpucoll.is_initialized():
                gpucoll.destroy_process_group()
        conn.send(("ok", pickle.dumps(result)))
    except BaseException:
        tb = traceback.format_exc()
        sys.stderr.write(tb)
        try:
            conn.send(("err", tb))
        except OSError:
            pass
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    conn.close()
    os._exit(0)
