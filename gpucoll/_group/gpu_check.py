"""Whether this machine can run device work, asked once where the user asked for it.

``init_process_group("nccl")`` on a machine without a GPU raises at init (not at
the first device op), and the reason names what is missing: no ``/dev/nvidia*``
device node at all, before any CUDA driver error that would suggest a driver or
CuPy upgrade.
"""

from __future__ import annotations

from .._env.devices import no_gpu_reason
from ..errors import BackendUnavailableError

__all__ = ["require_nccl"]


def require_nccl() -> None:
    """Raise unless the NCCL backend can run here.

    A backend substituted in ``gpucoll._group.registry.BACKENDS`` (a test's stand-in) is taken
    as it is.

    Raises:
        BackendUnavailableError: with the reason and what to use instead.
    """
    from . import registry
    from .._backends.nccl.backend import nccl_unavailable_reason

    if registry.BACKENDS.get("nccl") is not registry._make_nccl:
        return
    reason = no_gpu_reason() or nccl_unavailable_reason()
    if reason is not None:
        raise BackendUnavailableError(
            f"backend='nccl' cannot run here: {reason}. Use backend='cpu' (NumPy and other host "
            "arrays), or backend=None to pick nccl only where a GPU is usable")
