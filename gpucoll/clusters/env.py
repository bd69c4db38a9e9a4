"""gpucoll-run and torchrun-style variables: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.

Set by ``gpucoll-run``, by ``torchrun``, by Kubernetes training operators (one
process per pod: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT only) and by hand.

=====================  =========================================================
RANK, WORLD_SIZE       required together; their presence selects this detector
LOCAL_RANK             default 0
LOCAL_WORLD_SIZE       default 1 without LOCAL_RANK; with LOCAL_RANK but no
                       LOCAL_WORLD_SIZE (older launchers) WORLD_SIZE is assumed
GROUP_RANK             the node's index; default 0
MASTER_ADDR            required when WORLD_SIZE > 1; default 127.0.0.1
MASTER_PORT            required when WORLD_SIZE > 1; default 0 (bind any port)
GPUCOLL_STORE_HOSTED   "1": a launcher serves the store, every rank is a client
GPUCOLL_STORE_RELAY    HOST:PORT of the node's store relay (gpucoll-run --store-relay):
                       with GPUCOLL_STORE_HOSTED=1 the ranks reach the store through it
TORCHELASTIC_USE_AGENT_STORE  "True" (torchrun): the same, torchrun's agent serves it
=====================  =========================================================
"""

from __future__ import annotations

from typing import Mapping

from .base import STORE_HOSTED_ENV, STORE_TOKEN_ENV, ClusterEnv, read_int, read_master_port

__all__ = ["detect", "rank_environment", "SOURCE"]

SOURCE = "gpucoll-run/torchrun"


def detect(environ: Mapping[str, str]) -> ClusterEnv | None:
    """Read a torchrun-style environment.

    Args:
        environ: the environment mapping (``os.environ`` or a test's dict).

    Returns:
        A ClusterEnv, or None when neither RANK nor WORLD_SIZE is set (or both are empty).

    Raises:
        ValueError: one of RANK/WORLD_SIZE is set without the other, a value is not an
            integer or out of range, or MASTER_ADDR/MASTER_PORT is missing for a job
            of more than one rank. The message names the variable to set.

    Example:
        >>> detect({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "node7",
        ...         "MASTER_PORT": "29500"}).rank
        1
    """
    if not environ.get("RANK", "").strip() and not environ.get("WORLD_SIZE", "").strip():
        return None  # unset, or exported empty by a wrapper script: nothing to read
    for name in ("RANK", "WORLD_SIZE"):
        if environ.get(name, "").strip() == "":
            other = "WORLD_SIZE" if name == "RANK" else "RANK"
            raise ValueError(f"{other} is set but {name} is not ({SOURCE}); set both RANK and WORLD_SIZE")
    rank = read_int(environ, "RANK", source=SOURCE)
    world_size = read_int(environ, "WORLD_SIZE", minimum=1, source=SOURCE)
    if rank >= world_size:
        raise ValueError(f"RANK={rank} must be < WORLD_SIZE={world_size} ({SOURCE})")
    has_local_rank = environ.get("LOCAL_RANK", "").strip() != ""
    local_rank = read_int(environ, "LOCAL_RANK", default=0, source=SOURCE)
    local_world_size = read_int(environ, "LOCAL_WORLD_SIZE", minimum=1,
                                default=world_size if has_local_rank else 1, source=SOURCE)
    if local_rank >= local_world_size:
        raise ValueError(f"LOCAL_RANK={local_rank} must be < LOCAL_WORLD_SIZE={local_world_size} "
                         f"({SOURCE}); set LOCAL_WORLD_SIZE to the number of ranks on this node")
    master_addr = environ.get("MASTER_ADDR", "").strip()
    master_port = read_master_port(environ, source=SOURCE)
    if world_size > 1:
        if not master_addr:
            raise ValueError(f"RANK and WORLD_SIZE={world_size} are set but MASTER_ADDR is not "
                             f"({SOURCE}); set MASTER_ADDR to the host of rank 0's store")
        if master_port is None:
            raise ValueError(f"RANK and WORLD_SIZE={world_size} are set but MASTER_PORT is not "
                             f"({SOURCE}); set MASTER_PORT to the port of rank 0's store")
    return ClusterEnv(
        source=SOURCE,
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        master_addr=master_addr or "127.0.0.1",
        master_port=master_port or 0,
        # torchrun's agent serves a TCPStore on MASTER_PORT and says so to its workers.
        store_hosted=(environ.get(STORE_HOSTED_ENV, "").strip() == "1"
                      or environ.get("TORCHELASTIC_USE_AGENT_STORE", "") == "True"),
        node_rank=read_int(environ, "GROUP_RANK", default=0, source=SOURCE),
    )


def rank_environment(cluster: ClusterEnv, *, token: str | None = None) -> dict[str, str]:
    """The variables a launcher sets for one rank: the inverse of :func:`detect`.

    The rank-environment contract is written here once; ``gpucoll-run``,
    :func:`gpucoll.testing.run_spmd` and ``gpucoll-bench`` build their ranks'
    environments with it, and ``detect(rank_environment(c)) == c`` for every ``c``
    whose ``source`` is :data:`SOURCE` (tests/launch/test_clusters.py checks).

    Args:
        cluster: the rank's place in the job.
        token: the store's shared secret (``GPUCOLL_STORE_TOKEN``); not set when None.

    Returns:
        RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
        MASTER_PORT (empty for port 0) and GPUCOLL_STORE_HOSTED ("1" or "0"): each set
        either way, so that a value inherited from the launcher's own environment
        cannot leak through; GPUCOLL_STORE_TOKEN when ``token`` is given.

    Example:
        >>> env = rank_environment(ClusterEnv(SOURCE, 1, 2, 1, 2, "127.0.0.1", 29500, True), token="t")
        >>> env["RANK"], env["MASTER_PORT"], detect(env).store_hosted
        ('1', '29500', True)
    """
    env = {
        "RANK": str(cluster.rank),
        "WORLD_SIZE": str(cluster.world_size),
        "LOCAL_RANK": str(cluster.local_rank),
        "LOCAL_WORLD_SIZE": str(cluster.local_world_size),
        "GROUP_RANK": str(cluster.node_rank),
        "MASTER_ADDR": cluster.master_addr,
        # Port 0 ("bind any port") is how detect() reads an unset MASTER_PORT; set empty
        # rather than left out, so that a value inherited by the rank cannot leak through.
        "MASTER_PORT": str(cluster.master_port) if cluster.master_port else "",
        STORE_HOSTED_ENV: "1" if cluster.store_hosted else "0",
    }
    if token is not None:
        env[STORE_TOKEN_ENV] = token
    return env
