"""What a cluster detector returns: rank and rendezvous facts read from an environment.

Each detector (one module per environment, listed in ``gpucoll.clusters.DETECTORS``)
is a pure function ``detect(environ: Mapping[str, str]) -> ClusterEnv | None``:
None when its environment is not present, a ClusterEnv when it is, and a ValueError
naming the variable to set when the environment is present but incomplete.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Mapping

__all__ = ["ClusterEnv", "STORE_HOSTED_ENV", "STORE_TOKEN_ENV"]

from .._env import STORE_HOSTED_ENV as STORE_HOSTED_ENV
from .._env import STORE_TOKEN_ENV as STORE_TOKEN_ENV


@dataclass(frozen=True)
class ClusterEnv:
    """Rank and rendezvous facts of this process.

    Attributes:
        source: which environment was detected ("gpucoll-run/torchrun", "slurm",
            "openmpi", "mpich/pmi").
        rank, world_size, local_rank, local_world_size: this process's place in the job.
        master_addr: host of the job's TCPStore.
        master_port: its port; 0 means "rank 0 binds a free port and publishes it"
            (see the detector's docs for how peers learn it).
        store_hosted: True when a launcher already serves the store (all ranks are clients).
        node_rank: index of this node (GROUP_RANK / SLURM_NODEID), or 0 if unknown.
    """

    source: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    store_hosted: bool = False
    node_rank: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"{self.source}: rank must be in [0, world_size); "
                             f"got rank={self.rank}, world_size={self.world_size}")
        if not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(f"{self.source}: local_rank must be in [0, local_world_size); got "
                             f"local_rank={self.local_rank}, local_world_size={self.local_world_size}")
        if self.local_world_size > self.world_size:
            raise ValueError(f"{self.source}: local_world_size={self.local_world_size} exceeds "
                             f"world_size={self.world_size}")
        if not 0 <= self.master_port <= 65535:
            raise ValueError(f"{self.source}: master_port must be in 0..65535; got {self.master_port}")
        if not self.master_addr:
            raise ValueError(f"{self.source}: master_addr is empty")


# --- helpers shared by the detectors (not public API) ---

SCHEDULER_PORT_BASE = 61440
"""Ports derived from a scheduler's job id lie in 61440-65535: above Linux's default
ephemeral range (32768-60999), so no outgoing connection on the node holds one."""

SCHEDULER_PORT_SPAN = 4096


def read_int(environ: Mapping[str, str], name: str, *, minimum: int = 0,
             default: int | None = None, source: str = "") -> int:
    """Read an integer variable, or raise ValueError naming it and its value.

    Args:
        environ: the environment mapping.
        name: the variable.
        minimum: smallest allowed value.
        default: returned when the variable is unset; None makes it required.
        source: the environment being detected, for the message ("slurm", ...).

    Returns:
        The value as int.

    Raises:
        ValueError: the variable is unset (and has no default), not an integer,
            or below ``minimum``.
    """
    where = f" ({source})" if source else ""
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        if default is None:
            raise ValueError(f"environment variable {name} is not set{where}; set it to an integer >= {minimum}")
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r}{where} is not an integer") from None
    if value < minimum:
        raise ValueError(f"environment variable {name}={raw!r}{where} must be >= {minimum}")
    return value


def read_master_port(environ: Mapping[str, str], *, source: str) -> int | None:
    """MASTER_PORT as an int in 1..65535, or None when unset.

    Raises:
        ValueError: MASTER_PORT is set but not a port number.
    """
    if environ.get("MASTER_PORT", "").strip() == "":
        return None
    port = read_int(environ, "MASTER_PORT", minimum=1, source=source)
    if port > 65535:
        raise ValueError(f"environment variable MASTER_PORT={environ['MASTER_PORT']!r} ({source}) "
                         "must be a TCP port in 1..65535")
    return port


def scheduler_port(job_key: str) -> int:
    """A port derived deterministically from a scheduler's job id, the same on every node.

    Schedulers give ranks no channel to publish a port that rank 0 bound as 0 before
    the store exists, so every rank computes the same port from the job id instead.
    Numeric keys map consecutively (jobs started one after another get different
    ports); other keys are hashed with CRC-32 (stable across processes, unlike ``hash``).

    Args:
        job_key: the job id (digits) or any string that names the job.

    Returns:
        A port in ``[SCHEDULER_PORT_BASE, SCHEDULER_PORT_BASE + SCHEDULER_PORT_SPAN)``.
    """
    key = job_key.strip()
    number = int(key) if key.isascii() and key.isdigit() else zlib.crc32(key.encode("utf-8"))
    return SCHEDULER_PORT_BASE + number % SCHEDULER_PORT_SPAN
