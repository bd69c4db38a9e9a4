"""Open MPI: processes started by ``mpirun``/``mpiexec`` (Open MPI 4 and 5).

===============================  ================================================
OMPI_COMM_WORLD_RANK, _SIZE      rank and world size; RANK selects this detector
OMPI_COMM_WORLD_LOCAL_RANK       local rank
OMPI_COMM_WORLD_LOCAL_SIZE       ranks on this node
OMPI_MCA_orte_hnp_uri            Open MPI 4: the host mpirun runs on (the master
                                 of a multi-node job) and the job id
OMPI_MCA_ess_base_jobid,         the job id the master port is derived from
PMIX_NAMESPACE
MASTER_ADDR, MASTER_PORT         override the derived master address and port
===============================  ================================================

When every rank is on one node the master is 127.0.0.1. Across nodes it is the
host that runs ``mpirun`` (rank 0 runs there with the default mapping of a batch
job); Open MPI 5 does not publish that host, so set MASTER_ADDR there
(``mpirun -x MASTER_ADDR=$(hostname) ...``).
"""

from __future__ import annotations

from typing import Mapping

from .base import ClusterEnv, read_int, read_master_port, scheduler_port

__all__ = ["detect", "SOURCE"]

SOURCE = "openmpi"

_JOB_ID_VARS = ("OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE")


def detect(environ: Mapping[str, str]) -> ClusterEnv | None:
    """Read the environment Open MPI's launcher gives each process.

    Args:
        environ: the environment mapping.

    Returns:
        A ClusterEnv, or None when OMPI_COMM_WORLD_RANK is unset (not started by
        Open MPI's mpirun; ``srun`` direct launch is the Slurm detector's).

    Raises:
        ValueError: a variable is missing or malformed, or the master address or port
            cannot be derived; the message names the variable to set.

    Example:
        >>> env = detect({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
        ...               "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        ...               "OMPI_MCA_ess_base_jobid": "1975844865"})
        >>> env.master_addr, env.rank
        ('127.0.0.1', 1)
    """
    if "OMPI_COMM_WORLD_RANK" not in environ:
        return None
    rank = read_int(environ, "OMPI_COMM_WORLD_RANK", source=SOURCE)
    world_size = read_int(environ, "OMPI_COMM_WORLD_SIZE", minimum=1, source=SOURCE)
    local_rank = read_int(environ, "OMPI_COMM_WORLD_LOCAL_RANK", source=SOURCE)
    local_world_size = read_int(environ, "OMPI_COMM_WORLD_LOCAL_SIZE", minimum=1, source=SOURCE)
    hnp_uri = environ.get("OMPI_MCA_orte_hnp_uri", "")

    master_addr = environ.get("MASTER_ADDR", "").strip()
    if not master_addr:
        if local_world_size == world_size:
            master_addr = "127.0.0.1"
        else:
            master_addr = _hnp_host(hnp_uri) or ""
            if not master_addr:
                raise ValueError("cannot derive the master address of a multi-node Open MPI job "
                                 "(OMPI_MCA_orte_hnp_uri is not set, as under Open MPI 5); set MASTER_ADDR "
                                 "to the host of rank 0, e.g. mpirun -x MASTER_ADDR=$(hostname) ...")
    master_port = read_master_port(environ, source=SOURCE)
    if master_port is None:
        job = next((environ[v] for v in _JOB_ID_VARS if environ.get(v, "").strip()), "")
        if not job and hnp_uri:
            job = hnp_uri.split(";", 1)[0]
        if not job:
            raise ValueError("cannot derive the master port of this Open MPI job (no "
                             f"{' or '.join(_JOB_ID_VARS)} in the environment); set MASTER_PORT, "
                             "e.g. mpirun -x MASTER_PORT=29500 ...")
        master_port = scheduler_port(job)
    return ClusterEnv(
        source=SOURCE,
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        master_addr=master_addr,
        master_port=master_port,
        store_hosted=False,
        node_rank=0,  # Open MPI does not export a node index
    )


def _hnp_host(uri: str) -> str | None:
    """First IPv4 address of mpirun's own URI: ``"<jobid>.0;tcp://10.0.0.1,10.1.0.1:41123;..."``."""
    for part in uri.split(";")[1:]:
        if part.startswith("tcp://"):
            addrs = part[len("tcp://"):].rsplit(":", 1)[0]
            first = addrs.split(",")[0].strip()
            if first:
                return first
    return None
