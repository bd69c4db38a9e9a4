"""``gpucoll.ray.register``: gpucoll as the ``"GPUCOLL"`` backend of ``ray.util.collective``."""

from __future__ import annotations

__all__ = ["register", "BACKEND_NAME", "SETUP_HOOK"]

BACKEND_NAME = "GPUCOLL"
"""The name ``ray.util.collective`` knows gpucoll by (``backend="GPUCOLL"``)."""

SETUP_HOOK = "gpucoll.ray.register"
"""Ray's ``worker_process_setup_hook`` that registers the backend in every worker of a job
(``ray.init(runtime_env={"worker_process_setup_hook": SETUP_HOOK})``) or of one actor
(``.options(runtime_env=...)``)."""


def register() -> None:
    """Register gpucoll with ``ray.util.collective`` as the backend ``"GPUCOLL"`` in this
    process. Calling it again is harmless.

    Ray looks a backend up in the process that makes the group, so every actor that
    calls ``init_collective_group(..., backend="GPUCOLL")`` (or whose group
    ``create_collective_group`` declared) needs it registered too. Either call
    ``register()`` in the actor (e.g. in its ``__init__``) or let Ray do it in every
    worker: ``ray.init(runtime_env={"worker_process_setup_hook": "gpucoll.ray.register"})``
    (the whole job) or ``Actor.options(runtime_env={"worker_process_setup_hook":
    "gpucoll.ray.register"})`` (one actor class).

    Then ``allreduce``, ``broadcast``, ``allgather``, ``reducescatter``, ``reduce``,
    ``barrier``, ``send`` and ``recv`` of ``ray.util.collective`` work on NumPy arrays
    (gpucoll's CPU backend, no torch needed) and on CuPy arrays (NCCL).

    Raises:
        ImportError: Ray is not installed.
    """
    from ._records import need_ray

    need_ray()
    from ray.util.collective.backend_registry import BackendRegistry, register_collective_backend

    if BackendRegistry().is_registered(BACKEND_NAME):  # type: ignore[no-untyped-call, unused-ignore]  # untyped in Ray
        return
    from ._collective import GpucollGroup

    register_collective_backend(BACKEND_NAME, GpucollGroup)
