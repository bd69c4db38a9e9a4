"""gpucoll: GPU-first collectives for Python without PyTorch.

torch.distributed's vocabulary (stores, process groups, async Work, object
collectives) over NCCL through CuPy on GPUs and a NumPy backend on CPUs.
``import gpucoll`` never imports CuPy; the NCCL backend loads it when a group
needs it.

The public surface is exactly what this module re-exports (see ``__all__``).
"""

from __future__ import annotations

from .errors import BackendUnavailableError as BackendUnavailableError
from .errors import DistBackendError as DistBackendError
from .errors import DistError as DistError
from .errors import DistNetworkError as DistNetworkError
from .errors import DistStoreError as DistStoreError
from .errors import DistStoreTimeoutError as DistStoreTimeoutError
from .reduce_op import ReduceOp as ReduceOp
from .reduce_op import make_premul_sum as make_premul_sum
from .work import Work as Work
from .work import WorkInfo as WorkInfo

# --- stores (store/) ---

# --- process groups, collectives, object collectives (world API) ---

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailableError", "DistBackendError", "DistError", "DistNetworkError",
    "DistStoreError", "DistStoreTimeoutError",
    "ReduceOp", "make_premul_sum", "Work", "WorkInfo",
    # stores
    # world API
]
