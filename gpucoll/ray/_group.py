"""``gpucoll.ray.init_group``: the default process group in actors the user already has."""

from __future__ import annotations

from typing import Any, Sequence

from .._timeouts import to_seconds
from . import _actor, _ranks
from ._records import need_ray
from ._store import JobStore

__all__ = ["init_group", "RayGroup"]

_CALL_S = 300.0  # each step's bound beyond the group's own timeout


class RayGroup:
    """The default process group of a list of actors, made by :func:`init_group`.

    Attributes:
        actors: the actors, in rank order.
        world_size: how many.
    """

    def __init__(self, ray: Any, actors: Sequence[Any], store: JobStore, saved: list[dict[str, str | None]],
                 timeout: float) -> None:
        self._ray = ray
        self.actors = list(actors)
        self.world_size = len(self.actors)
        self._store = store
        self._saved = saved
        self._timeout = timeout
        self._destroyed = False

    def destroy(self) -> None:
        """Destroy the group in every actor (``destroy_process_group()``), restore the
        variables :func:`init_group` set there, and stop serving the group's store.
        A second call does nothing.

        Raises:
            ray.exceptions.RayError: an actor's destroy failed (the store is closed anyway).
        """
        if self._destroyed:
            return
        self._destroyed = True
        try:
            self._ray.get([a.__ray_call__.remote(_actor.leave_group, env) for a, env in zip(self.actors, self._saved)],
                          timeout=self._timeout + _CALL_S)
        finally:
            self._store.close()

    def __repr__(self) -> str:
        return f"<gpucoll.ray.RayGroup of {self.world_size} actors{' (destroyed)' if self._destroyed else ''}>"


def init_group(actors: Sequence[Any], *, backend: str | None = None, timeout: float | None = None) -> RayGroup:
    """Make the default process group in every actor of ``actors``, ranks in list order.

    Runs in each actor through ``actor.__ray_call__`` (the actor class needs no extra
    method): the actor gets the rank environment ``gpucoll-run`` gives and calls
    ``gpucoll.init_process_group(backend, timeout=timeout)``, so its methods call
    ``gpucoll.all_reduce(x)`` with no group argument. The store is served by this
    (the driver) process until :meth:`RayGroup.destroy`.

    Args:
        actors: Ray actor handles, each a different process; rank i is ``actors[i]``.
        backend: as for ``init_process_group``; None picks NCCL where the actor sees a
            usable GPU, else cpu.
        timeout: the group's timeout in seconds (``init_process_group``'s); default 300.

    Returns:
        A :class:`RayGroup`; call its ``destroy()`` to tear the group down everywhere.

    Raises:
        ValueError: ``actors`` is empty.
        ray.exceptions.RayError: ``init_process_group`` failed in an actor (the group is
            destroyed in the others).
        ImportError: Ray is not installed.

    Example:
        >>> group = gpucoll.ray.init_group(workers)
        >>> ray.get([w.step.remote() for w in workers])   # step() calls gpucoll.all_reduce
        >>> group.destroy()
    """
    ray = need_ray()
    actors = list(actors)
    if not actors:
        raise ValueError("init_group needs at least one actor; got an empty list")
    seconds = to_seconds(timeout, default=300.0, name="timeout")
    infos = ray.get([a.__ray_call__.remote(_actor.describe) for a in actors], timeout=_CALL_S)
    if len({(d["node_id"], d["pid"]) for d in infos}) != len(actors):
        raise ValueError("init_group: two of the actors are the same process; each rank needs its own actor")
    places = _ranks.order(infos, by_node=False)
    client = ray.util.client.ray.is_connected()
    here = None if client else ray.get_runtime_context().get_node_id()
    loopback = all(p.node_id == here for p in places)
    store = JobStore(ray, loopback=loopback)
    envs = _ranks.environments(places, store.addr, store.port, store.token, backend=backend, loopback=loopback,
                               records_deaths=False)
    for env in envs:
        env.pop("CUDA_VISIBLE_DEVICES", None)  # a running actor's devices are Ray's to set
    refs = [a.__ray_call__.remote(_actor.join_group, env, backend, seconds) for a, env in zip(actors, envs)]
    try:
        saved = ray.get(refs, timeout=seconds + _CALL_S)
    except BaseException:
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        for a, ref in zip(actors, refs):
            if ref in done:
                try:
                    ray.get(a.__ray_call__.remote(_actor.leave_group, ray.get(ref)), timeout=_CALL_S)
                except Exception:  # this actor's init failed: nothing to undo there
                    pass
        store.close()
        raise
    return RayGroup(ray, actors, store, saved, seconds)
