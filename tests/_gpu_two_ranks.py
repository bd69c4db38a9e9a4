"""Whether two ranks may share the one GPU of the GPU machine: NCCL >= 2.30 with
NCCL_MULTI_RANK_GPU_ENABLE=1 (older NCCL refuses "Duplicate GPU"). The GPU tests of
world size 2 skip with this reason, decided once in the parent process."""

from __future__ import annotations

__all__ = ["why_not_two_ranks_on_one_gpu", "TWO_RANKS_ENV"]

TWO_RANKS_ENV = {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_NVLS_ENABLE": "0"}
"""What two ranks on one GPU need in their environment (NVLS is disabled there anyway)."""


def why_not_two_ranks_on_one_gpu() -> str | None:
    """None when the loaded NCCL lets two ranks share one GPU, else why not."""
    try:
        from gpucoll._backends.nccl.backend import nccl_version

        version = nccl_version()
    except Exception as exc:
        return f"NCCL not loadable: {exc}"
    return None if version >= (2, 30, 0) else "two ranks on one GPU need NCCL >= 2.30"
