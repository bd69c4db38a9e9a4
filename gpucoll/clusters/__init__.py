"""Where am I in the job? Rank, world size and the master's address, read from the environment.

``init_process_group()`` without a rank or world size calls :func:`detect`, which
asks each detector in :data:`DETECTORS` in turn and returns the first answer:

1. ``env``: gpucoll-run, torchrun, Kubernetes operators (RANK, WORLD_SIZE, ...).
   Explicit variables win over any scheduler, so ``srun gpucoll-run ...`` and
   ``mpirun torchrun ...`` work.
2. ``openmpi``: Open MPI's ``mpirun`` (OMPI_COMM_WORLD_*).
3. ``mpich``: MPICH Hydra, Intel MPI, Cray PALS (PMI_RANK, PMI_SIZE, ...).
4. ``slurm``: ``srun`` (SLURM_PROCID, SLURM_STEP_NODELIST, ...).

The MPI launchers come before Slurm because ``mpirun`` inside a Slurm allocation
starts its daemons with ``srun``: its processes carry the daemons' SLURM_PROCID
(one per node), and only the MPI variables describe the ranks.

Each detector is a pure function of an environment mapping, so every environment
can be tested with a dict.
"""

from __future__ import annotations

import os
from typing import Callable, Mapping

from . import env, mpich, openmpi, slurm
from .base import STORE_HOSTED_ENV as STORE_HOSTED_ENV
from .base import STORE_TOKEN_ENV as STORE_TOKEN_ENV
from .base import ClusterEnv as ClusterEnv

__all__ = ["ClusterEnv", "DETECTORS", "STORE_HOSTED_ENV", "STORE_TOKEN_ENV", "detect"]

Detector = Callable[[Mapping[str, str]], "ClusterEnv | None"]

DETECTORS: tuple[Detector, ...] = (
    env.detect,
    openmpi.detect,
    mpich.detect,
    slurm.detect,
)
"""The detectors, in the order they are asked."""


def detect(environ: Mapping[str, str] | None = None) -> ClusterEnv | None:
    """Return this process's place in the job, from the first detector that recognises it.

    Args:
        environ: the environment to read; ``os.environ`` when None.

    Returns:
        A ClusterEnv, or None when no launcher's variables are present (a plain
        ``python script.py``).

    Raises:
        ValueError: a launcher's variables are present but incomplete or malformed;
            the message names the variable to set.

    Example:
        >>> detect({"RANK": "0", "WORLD_SIZE": "1"}).source
        'gpucoll-run/torchrun'
        >>> detect({}) is None
        True
    """
    environ = os.environ if environ is None else environ
    for detector in DETECTORS:
        found = detector(environ)
        if found is not None:
            return found
    return None
