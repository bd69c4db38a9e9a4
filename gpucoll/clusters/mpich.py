"""MPICH's Hydra (``mpiexec``), Intel MPI, Cray PALS and other PMI launchers.

=================================  ==============================================
PMI_RANK, PMI_SIZE                 rank and world size; PMI_RANK selects this
                                   detector
MPI_LOCALRANKID, MPI_LOCALNRANKS   local rank and size (Hydra, Intel MPI)
PMI_LOCAL_RANK, PMI_LOCAL_SIZE     the same under Cray PALS
PMIX_NAMESPACE, PALS_APID,         a job id the master port is derived from
PMI_JOBID, PMI_KVSNAME
MASTER_ADDR, MASTER_PORT           override the derived master address and port
=================================  ==============================================

When every rank is on one node the master is 127.0.0.1; across nodes PMI does not
say where rank 0 runs, so set MASTER_ADDR (``mpiexec -genv MASTER_ADDR <host>``).
Hydra exports no job id, so its jobs need MASTER_PORT too.

``srun --mpi=pmi2`` also sets PMI_RANK and PMI_SIZE; when they agree with
SLURM_PROCID and the step's task count this detector steps aside so that the
Slurm detector, which knows the node list, reads the job.
"""

from __future__ import annotations

from typing import Mapping

from .base import ClusterEnv, read_int, read_master_port, scheduler_port

__all__ = ["detect", "SOURCE"]

SOURCE = "mpich/pmi"

_JOB_ID_VARS = ("PMIX_NAMESPACE", "PALS_APID", "PMI_JOBID", "PMI_KVSNAME")
_LOCAL_VARS = (("MPI_LOCALRANKID", "MPI_LOCALNRANKS"), ("PMI_LOCAL_RANK", "PMI_LOCAL_SIZE"))


def detect(environ: Mapping[str, str]) -> ClusterEnv | None:
    """Read a PMI environment (MPICH Hydra, Intel MPI, Cray PALS).

    Args:
        environ: the environment mapping.

    Returns:
        A ClusterEnv, or None when PMI_RANK is unset or the job was started by
        ``srun`` directly.

    Raises:
        ValueError: a variable is missing or malformed, or the master address or port
            cannot be derived; the message names the variable to set.

    Example:
        >>> env = detect({"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0",
        ...               "MPI_LOCALNRANKS": "2", "MASTER_PORT": "29500"})
        >>> env.master_addr, env.master_port
        ('127.0.0.1', 29500)
    """
    if "PMI_RANK" not in environ:
        return None
    rank = read_int(environ, "PMI_RANK", source=SOURCE)
    world_size = read_int(environ, "PMI_SIZE", minimum=1, source=SOURCE)
    if _started_by_srun(environ, rank, world_size):
        return None
    local = next(((r, s) for r, s in _LOCAL_VARS if r in environ), None)
    if local is not None:
        local_rank = read_int(environ, local[0], source=SOURCE)
        local_world_size = read_int(environ, local[1], minimum=1, source=SOURCE)
    elif world_size == 1:
        local_rank, local_world_size = 0, 1
    else:
        raise ValueError("PMI_RANK and PMI_SIZE are set but not the local rank (mpich/pmi); "
                         "set MPI_LOCALRANKID and MPI_LOCALNRANKS")

    master_addr = environ.get("MASTER_ADDR", "").strip()
    if not master_addr:
        if local_world_size != world_size:
            raise ValueError(f"cannot derive the master address of a multi-node PMI job (mpich/pmi: "
                             f"{local_world_size} of {world_size} ranks on this node); set MASTER_ADDR to "
                             "the host of rank 0, e.g. mpiexec -genv MASTER_ADDR <host> ...")
        master_addr = "127.0.0.1"
    master_port = read_master_port(environ, source=SOURCE)
    if master_port is None:
        job = next((environ[v] for v in _JOB_ID_VARS if environ.get(v, "").strip()), None)
        if job is None:
            raise ValueError(f"cannot derive the master port (mpich/pmi: none of {', '.join(_JOB_ID_VARS)} "
                             "is set, as under Hydra); set MASTER_PORT, e.g. mpiexec -genv MASTER_PORT "
                             "29500 ...")
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
        node_rank=0,  # PMI does not export a node index
    )


def _started_by_srun(environ: Mapping[str, str], rank: int, world_size: int) -> bool:
    if "SLURM_STEP_ID" not in environ:
        return False
    ntasks = environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS") or ""
    return environ.get("SLURM_PROCID", "").strip() == str(rank) and ntasks.strip() == str(world_size)
