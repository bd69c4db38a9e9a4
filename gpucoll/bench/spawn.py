"""``--nproc N``: run the benchmark as a local job of N processes.

The parent hosts the job's TCPStore (port 0, published through MASTER_PORT, with
a fresh token), starts N copies of ``python -m gpucoll.bench`` with the
torchrun-style variables that ``init_process_group`` reads, and waits. Rank 0
writes to this process's stdout, so the table appears line by line as sizes
finish; every rank's stderr is this process's stderr.

When a rank other than 0 fails, the others are killed at once (a peer of a dead
rank would otherwise sit in a collective until its timeout), as mpi4py's
``run`` aborts the whole job. Rank 0 exits last by design (it writes the
report), so its exit ends the job after a short grace period for the others.
"""

from __future__ import annotations

import os
import secrets
import shlex
import subprocess
import sys
import time
from typing import Sequence

__all__ = ["run_local", "GRACE_SECONDS", "COMMAND_ENV"]

GRACE_SECONDS = 10.0
"""How long the other ranks may take to exit after rank 0 has."""


from .._env import BENCH_COMMAND_ENV as COMMAND_ENV
from .._env import CPU_BIND_ENV


def run_local(nproc: int, argv: Sequence[str], *, timeout: float, poll: float = 0.05,
              typed: Sequence[str] | None = None, bind_to: str = "none", quiet_unbound: bool = False) -> int:
    """Run ``python -m gpucoll.bench *argv`` on ``nproc`` local ranks; return the job's exit code.

    Args:
        nproc: number of ranks, >= 1.
        argv: the benchmark's command line for every rank.
        timeout: seconds the store waits for a rank's request (the process group's timeout).
        poll: seconds between checks of the children.
        typed: the arguments the user typed (``argv`` may add resolved ones); recorded
            as the report's ``command``.
        bind_to: ``"core"``: rank i binds itself to core i (``GPUCOLL_CPU_BIND``, as
            ``gpucoll-run --bind-to core``); with more ranks than cores none is bound, said
            on stderr unless ``quiet_unbound``. ``"none"``: no binding.

    Returns:
        0 when every rank exited 0; else the exit code of the first rank that failed
        (rank 0's code when it reported wrong results).

    Raises:
        ValueError: ``nproc`` < 1.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1; got {nproc}")
    from .._launch import binding
    from ..clusters.base import ClusterEnv
    from ..clusters.env import SOURCE, rank_environment
    from ..store import TCPStore

    cpus = binding.plan(bind_to, nproc)
    if cpus is None and bind_to != "none" and not quiet_unbound:
        print(f"gpucoll-bench: --bind-to {bind_to}: {nproc} ranks but {len(binding.cores())} cores "
              "to run on; no rank is bound", file=sys.stderr, flush=True)

    token = secrets.token_hex(16)
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout, token=token)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(nproc):
            env = dict(os.environ)
            env.update(rank_environment(
                ClusterEnv(SOURCE, rank, nproc, rank, nproc, "127.0.0.1", server.port, store_hosted=True),
                token=token))
            env[COMMAND_ENV] = shlex.join(["gpucoll-bench", *(argv if typed is None else typed)])
            # Set either way: a rank never binds by a value this process's own launcher set.
            env[CPU_BIND_ENV] = binding.env_value(cpus[rank]) if cpus is not None else ""
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "gpucoll.bench", *argv], env=env,
                stdout=None if rank == 0 else subprocess.DEVNULL))
        return _wait(procs, poll)
    except KeyboardInterrupt:
        return 130
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass
        server.close()


def _wait(procs: list[subprocess.Popen[bytes]], poll: float) -> int:
    first_failure = 0
    rank0_done_at: float | None = None
    while True:
        codes = [p.poll() for p in procs]
        for rank, code in enumerate(codes):
            if code and rank != 0:
                return code  # a peer died: the caller kills the rest now
            if code and not first_failure:
                first_failure = code
        if all(c is not None for c in codes):
            return first_failure
        if codes[0] is not None:
            rank0_done_at = rank0_done_at or time.monotonic()
            if time.monotonic() - rank0_done_at > GRACE_SECONDS:
                return first_failure or 1
        time.sleep(poll)
