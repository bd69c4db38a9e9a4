"""What runs inside a rank's Ray actor: describing the process, taking the rank
environment, running ``fn`` and joining or leaving a group on a user's actor.

Nothing here imports Ray at module level except :func:`describe`'s lookups, which run in
an actor (where Ray is loaded already)."""

from __future__ import annotations

import os
import time
import traceback
from typing import Any, Callable, Mapping

__all__ = ["RankActor", "describe", "node_address", "set_env", "join_group", "leave_group"]


def node_address() -> str:
    """This node's address as Ray knows it."""
    import ray

    address: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call, unused-ignore]  # untyped in Ray
    return address


def describe(_instance: object = None) -> dict[str, Any]:
    """Where this process runs: node id and address, pid, host name, GPU ids (Ray's)."""
    import socket

    import ray

    return {"node_id": ray.get_runtime_context().get_node_id(), "node": node_address(),
            "pid": os.getpid(), "host": socket.gethostname(),
            "gpus": [str(g) for g in ray.get_gpu_ids()], "nice": os.getpriority(os.PRIO_PROCESS, 0)}


def set_env(env: Mapping[str, str | None]) -> dict[str, str | None]:
    """Set (or, for None, remove) variables; return what they were before."""
    before = {k: os.environ.get(k) for k in env}
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    return before


class RankActor:
    """One rank of a :func:`gpucoll.ray.run` job (made into a Ray actor by the driver)."""

    def info(self) -> dict[str, Any]:
        """:func:`describe` of this actor's process."""
        return describe()

    def setup(self, env: Mapping[str, str | None]) -> None:
        """Take the rank environment (what gpucoll-run gives a rank)."""
        set_env(env)

    def call(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, Any]:
        """Run ``fn``: ``("ok", value)`` or ``("err", traceback)``; a default group ``fn``
        left initialized is destroyed (as a process that exits would release it)."""
        try:
            value = fn(*args, **kwargs)
        except BaseException:  # noqa: BLE001 - reported to the driver, which stops the job
            return "err", traceback.format_exc()
        finally:
            _release()
        return "ok", value

    def now(self) -> float:
        """This process's clock (time.time()), for tests and the bench."""
        return time.time()


def _release() -> None:
    import gpucoll

    if gpucoll.is_initialized():
        try:
            gpucoll.destroy_process_group()
        except Exception:  # the group failed already: the error fn saw says why
            pass


def join_group(_instance: object, env: Mapping[str, str | None], backend: str | None,
               timeout: float | None) -> dict[str, str | None]:
    """On a user's actor (through ``__ray_call__``): take the rank environment and make the
    default group; returns the variables as they were, for :func:`leave_group`."""
    import gpucoll

    before = set_env(env)
    try:
        gpucoll.init_process_group(backend, timeout=timeout)
    except BaseException:
        set_env(before)
        raise
    return before


def leave_group(_instance: object, before: Mapping[str, str | None]) -> None:
    """On a user's actor: destroy the default group and restore the environment."""
    import gpucoll

    try:
        if gpucoll.is_initialized():
            gpucoll.destroy_process_group()
    finally:
        set_env(before)
