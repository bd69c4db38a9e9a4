"""What a cluster detector returns: rank and rendezvous facts read from an environment.

Each detector (one module per environment, listed in ``gpucoll.clusters.DETECTORS``)
is a pure function ``detect(environ: Mapping[str, str]) -> ClusterEnv | None``:
None when its environment is not present, a ClusterEnv when it is, and a ValueError
naming the variable to set when the environment is present but incomplete.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ClusterEnv", "STORE_HOSTED_ENV", "STORE_TOKEN_ENV"]

STORE_HOSTED_ENV = "GPUCOLL_STORE_HOSTED"
"""Set to "1" by a launcher (gpucoll-run, gpucoll.testing) that already runs the job's
TCPStore server at MASTER_ADDR:MASTER_PORT: then every rank, rank 0 included,
connects as a client instead of rank 0 hosting the server."""

STORE_TOKEN_ENV = "GPUCOLL_STORE_TOKEN"
"""The shared secret a TCPStore client presents before any other request."""


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
