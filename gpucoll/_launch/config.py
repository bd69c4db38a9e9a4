"""What gpucoll-run was asked to do: the validated launch configuration, and GPU counting."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from typing import Mapping

from ..clusters.base import STORE_TOKEN_ENV

__all__ = ["LaunchConfig", "RELAY_MIN_RANKS_PER_NODE", "count_gpus", "resolve_nproc", "resolve_relay",
           "resolve_token"]

_PROC_GPUS = "/proc/driver/nvidia/gpus"


@dataclass(frozen=True)
class LaunchConfig:
    """A validated gpucoll-run invocation.

    Attributes:
        program: ``(script, *args)`` or ``("-m", module, *args)``.
        nproc_per_node: ranks started on this node.
        nnodes, node_rank: number of nodes and this node's index.
        master_addr, master_port: where node 0's launcher serves the job's store
            (port 0: bind any free port; only node 0 may use it).
        token: the store token handed to every rank.
        log_dir: directory for ``rank<N>.log`` files, or None.
        tee: with ``log_dir``, also show the ranks' output on the console.
        prefix: prefix console lines with ``[rank<N>]: ``.
        grace_period: seconds between SIGTERM and SIGKILL when stopping ranks.
        join_timeout: seconds to wait for node 0's store (other nodes) or, on node 0,
            for the other nodes to finish after the local ranks did.
        store_relay: run a store relay on this node (see :func:`resolve_relay`).
        bind_to: ``none`` or ``core``: bind each local rank to a core of its own
            (:mod:`gpucoll._launch.binding`).
    """

    program: tuple[str, ...]
    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    token: str = ""
    log_dir: str | None = None
    tee: bool = False
    prefix: bool = True
    grace_period: float = 5.0
    join_timeout: float = 300.0
    store_relay: bool = False
    bind_to: str = "none"

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def hosts_store(self) -> bool:
        """True on node 0, whose launcher serves the job's store."""
        return self.node_rank == 0

    @property
    def pipes_output(self) -> bool:
        """Whether ranks' output passes through the launcher (to prefix it or log it)."""
        return self.prefix or self.log_dir is not None


def resolve_nproc(value: str, environ: Mapping[str, str] | None = None) -> int:
    """Turn ``--nproc-per-node`` into a number of ranks.

    Args:
        value: a positive integer, ``gpu`` (one rank per visible GPU), ``cpu`` (one per
            usable CPU core) or ``auto`` (one per GPU if there are any, else 1).
        environ: environment for CUDA_VISIBLE_DEVICES; ``os.environ`` when None.

    Returns:
        The number of ranks, >= 1.

    Raises:
        ValueError: ``value`` is none of the above, or ``gpu`` finds no GPU.
    """
    text = value.strip().lower()
    if text.isdigit():
        n = int(text)
        if n < 1:
            raise ValueError(f"--nproc-per-node must be >= 1; got {value!r}")
        return n
    if text == "cpu":
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if text in ("gpu", "auto"):
        count, how = count_gpus(environ)
        if count > 0:
            return count
        if text == "auto":
            return 1
        raise ValueError(f"--nproc-per-node gpu: no GPU found ({how}); pass a number of ranks instead")
    raise ValueError(f"--nproc-per-node must be a positive integer, 'gpu', 'cpu' or 'auto'; got {value!r}")


def count_gpus(environ: Mapping[str, str] | None = None) -> tuple[int, str]:
    """Count the GPUs this node's ranks can use, without initialising CUDA.

    CuPy is not imported: CUDA would then be initialised in the launcher, and a
    driver problem would show up here rather than in the rank that needs the GPU.
    The sources, in order: CUDA_VISIBLE_DEVICES (counted as CUDA reads it: up to the
    first invalid entry), the driver's ``/proc/driver/nvidia/gpus``, ``nvidia-smi -L``.

    Args:
        environ: environment for CUDA_VISIBLE_DEVICES; ``os.environ`` when None.

    Returns:
        ``(count, how)``: the number of GPUs and where it was read.
    """
    environ = os.environ if environ is None else environ
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return _count_visible(visible), f"CUDA_VISIBLE_DEVICES={visible!r}"
    try:
        entries = os.listdir(_PROC_GPUS)
    except OSError:
        entries = []
    if entries:
        return len(entries), _PROC_GPUS
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0, f"CUDA_VISIBLE_DEVICES unset, no {_PROC_GPUS}, no nvidia-smi on PATH"
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        return 0, f"nvidia-smi -L failed: {err}"
    count = sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
    return count, "nvidia-smi -L"


def _count_visible(value: str) -> int:
    count = 0
    for item in value.split(","):
        item = item.strip()
        if item.isdigit() or item.startswith(("GPU-", "MIG-")):
            count += 1
        else:
            break  # CUDA ignores everything from the first invalid entry on ("-1" hides all)
    return count


def resolve_token(environ: Mapping[str, str], nnodes: int) -> str:
    """The job's store token: GPUCOLL_STORE_TOKEN if set, else a fresh one for one node.

    Args:
        environ: the launcher's environment.
        nnodes: number of nodes.

    Returns:
        The token.

    Raises:
        ValueError: several nodes and GPUCOLL_STORE_TOKEN is unset (every node's
            launcher must present the same secret, and printing one would leak it
            into logs).
    """
    token = environ.get(STORE_TOKEN_ENV, "")
    if token:
        return token
    if nnodes > 1:
        raise ValueError(f"--nnodes {nnodes}: set {STORE_TOKEN_ENV} to the same secret on every node, e.g. "
                         f"export {STORE_TOKEN_ENV}=$(python -c 'import secrets; print(secrets.token_hex(16))')")
    return secrets.token_hex(16)


RELAY_MIN_RANKS_PER_NODE = 32
"""``--store-relay auto`` turns relays on for jobs of several nodes with at least this many
ranks per node: the job's store then holds one connection per node instead of one per rank.
Below it (and on one node, where the store is in the same launcher) a relay's extra hop buys
nothing worth having."""


def resolve_relay(value: str, nnodes: int, nproc_per_node: int) -> bool:
    """Turn ``--store-relay`` (``auto``, ``on``, ``off``) into whether this node runs a relay.

    Raises:
        ValueError: another value.
    """
    if value == "on":
        return True
    if value == "off":
        return False
    if value == "auto":
        return nnodes > 1 and nproc_per_node >= RELAY_MIN_RANKS_PER_NODE
    raise ValueError(f"--store-relay must be auto, on or off; got {value!r}")
