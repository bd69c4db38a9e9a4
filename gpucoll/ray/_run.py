"""``gpucoll.ray.run``: one SPMD job over Ray actors, in one call from the driver.

The job: a placement group (one bundle per rank), one :class:`~._actor.RankActor` per
bundle, the ranks ordered by node and GPU, each given gpucoll-run's rank environment,
the store served by the driver. The driver then watches the ranks through their one
long-running call (``ray.wait``): a result, a raised exception, or Ray's word that the
actor died. A death is written into the job's store at once, where the survivors'
CPU backends read it (their pending or next collective fails naming it). At the end
every actor is killed, the placement group removed, and the shared-memory segments of
the job's processes on this node unlinked.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Mapping, Sequence

from . import _actor, _ranks
from ._records import RankDied, RankFailure, RayJobError, need_ray
from ._store import JobStore

__all__ = ["run"]

_START_S = 120.0  # placing the ranks and starting their actors, when run has no timeout
_GATHER_S = 0.5  # after a first failure, how long other failures are gathered for the message


def run(fn: Callable[..., Any], world_size: int, *, args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None, resources_per_rank: Mapping[str, float] | None = None,
        strategy: str = "PACK", backend: str | None = None, timeout: float | None = None,
        on_failure: str = "raise") -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks, each a Ray actor; return the
    results in rank order.

    Each rank gets the environment ``gpucoll-run`` gives (RANK, LOCAL_RANK, WORLD_SIZE,
    LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT, the store token), so that
    ``gpucoll.init_process_group()`` with no arguments works inside ``fn`` and the same
    code runs under ``gpucoll-run``. The store is served by this (the driver) process.

    Args:
        fn: the rank's program; it and its arguments must pickle (cloudpickle), and its
            return value too.
        world_size: number of ranks, >= 1.
        args, kwargs: passed to ``fn`` on every rank.
        resources_per_rank: Ray resources of each rank's bundle; default one GPU where
            the cluster has GPUs, else one CPU.
        strategy: the placement group's strategy: "PACK", "SPREAD", "STRICT_PACK" or
            "STRICT_SPREAD".
        backend: what ``init_process_group()`` without arguments picks inside ``fn``
            ("cpu", "nccl"); None: its own default (NCCL where GPUs are usable).
        timeout: seconds for the whole job; past it every rank is stopped and
            :class:`RayJobError` raised. None: no bound (placing the ranks still has one of
            120 s).
        on_failure: ``"raise"``: a rank that dies stops the job with RayJobError.
            ``"shrink"``: the job goes on; the survivors' collectives fail naming the
            dead rank, ``shrink_group()`` leaves it out at once, and its entry in the
            result is a :class:`RankDied`.

    Returns:
        ``[result of rank 0, rank 1, ...]`` (with ``on_failure="shrink"``, a RankDied for
        each rank that died).

    Raises:
        RayJobError: a rank raised (its traceback is in the message and in
            ``failures``), died (with ``on_failure="raise"``), the job timed out, or the
            ranks could not be placed in time. The other ranks are stopped first.
        ValueError: an argument is out of range.
        ImportError: Ray is not installed.

    Example:
        >>> def body():
        ...     import gpucoll, numpy as np
        ...     gpucoll.init_process_group()
        ...     x = np.ones(4) * gpucoll.get_rank()
        ...     gpucoll.all_reduce(x)
        ...     return x.tolist()
        >>> gpucoll.ray.run(body, 2)
        [[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]]
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1; got {world_size!r}")
    if on_failure not in ("raise", "shrink"):
        raise ValueError(f"on_failure must be 'raise' or 'shrink'; got {on_failure!r}")
    if strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
        raise ValueError(f"strategy must be PACK, SPREAD, STRICT_PACK or STRICT_SPREAD; got {strategy!r}")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds or None; got {timeout!r}")
    ray = need_ray()
    if not ray.is_initialized():
        ray.init()
    job = _Job(ray, world_size, resources_per_rank, strategy, timeout)
    try:
        job.start(backend)
        return job.watch(fn, tuple(args), dict(kwargs or {}), on_failure)
    finally:
        job.close()


def default_resources(ray: Any) -> dict[str, float]:
    """One GPU where the cluster has GPUs, else one CPU."""
    return {"GPU": 1.0} if ray.cluster_resources().get("GPU", 0) > 0 else {"CPU": 1.0}


class _Job:
    def __init__(self, ray: Any, world_size: int, resources: Mapping[str, float] | None, strategy: str,
                 timeout: float | None) -> None:
        self.ray = ray
        self.n = world_size
        self.resources = dict(resources) if resources is not None else default_resources(ray)
        for key, value in self.resources.items():
            if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or value < 0:
                raise ValueError(f"resources_per_rank must map resource names to amounts >= 0; "
                                 f"got {key!r}: {value!r}")
        self.strategy = strategy
        self.timeout = timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.pg: Any = None
        self.actors: list[Any] = []  # in rank order once started
        self.places: list[_ranks.Placement] = []
        self.store: JobStore | None = None

    def _left(self, cap: float) -> float:
        return cap if self.deadline is None else max(0.0, min(cap, self.deadline - time.monotonic()))

    def start(self, backend: str | None) -> None:
        ray = self.ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.pg = placement_group([dict(self.resources) for _ in range(self.n)], strategy=self.strategy)
        wait = self._left(_START_S)
        ready, _ = ray.wait([self.pg.ready()], timeout=wait)
        if not ready:
            raise RayJobError(f"gpucoll.ray.run: the cluster did not place {self.n} ranks of {self.resources} "
                              f"each (strategy {self.strategy}) within {wait:.0f} s; it has "
                              f"{ray.available_resources()} available of {ray.cluster_resources()}")
        res = dict(self.resources)
        options = {"num_cpus": res.pop("CPU", 0), "num_gpus": res.pop("GPU", 0), "resources": res,
                   "max_restarts": 0}  # fn runs on the worker's main thread, as a script's code would
        cls = ray.remote(_actor.RankActor)
        made = [cls.options(**options, scheduling_strategy=PlacementGroupSchedulingStrategy(
            self.pg, placement_group_bundle_index=i)).remote() for i in range(self.n)]
        self.actors = made
        infos = self._get([a.info.remote() for a in made], "report where they run")
        self.places = _ranks.order(infos)
        self.actors = [made[p.index] for p in self.places]
        here = ray.get_runtime_context().get_node_id()
        loopback = all(p.node_id == here for p in self.places) and not ray.util.client.ray.is_connected()
        self.store = JobStore(ray, loopback=loopback)
        envs = _ranks.environments(self.places, self.store.addr, self.store.port, self.store.token,
                                   backend=backend, loopback=loopback)
        self._get([a.setup.remote(env) for a, env in zip(self.actors, envs)], "take their environment")

    def _get(self, refs: list[Any], what: str) -> list[Any]:
        wait = self._left(_START_S)
        try:
            return list(self.ray.get(refs, timeout=wait))
        except self.ray.exceptions.GetTimeoutError:
            raise RayJobError(f"gpucoll.ray.run: the {self.n} rank actors did not {what} within {wait:.0f} s") \
                from None

    def watch(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
              on_failure: str) -> list[Any]:
        ray = self.ray
        refs = {a.call.remote(fn, args, kwargs): rank for rank, a in enumerate(self.actors)}
        pending = list(refs)
        results: dict[int, Any] = {}
        failures: list[RankFailure] = []
        first_failure = 0.0
        while pending:
            if failures and time.monotonic() - first_failure > _GATHER_S:
                break
            if self.deadline is not None and time.monotonic() >= self.deadline:
                late = sorted(refs[r] for r in pending)
                raise RayJobError(f"gpucoll.ray.run: the job of {self.n} ranks timed out after {self.timeout:g} s; "
                                  f"ranks {late} had not finished (every rank was stopped)", failures)
            ready, pending = ray.wait(pending, num_returns=1, timeout=self._left(_GATHER_S if failures else 1.0))
            for ref in ready:
                rank = refs[ref]
                try:
                    status, payload = ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    died = self._died(rank, exc)
                    if on_failure == "shrink":
                        results[rank] = died
                        continue
                    failures.append(RankFailure(rank, died=died))
                except ray.exceptions.RayError as exc:  # fn's result could not come back
                    failures.append(RankFailure(rank, traceback=f"{type(exc).__name__}: {exc}"))
                else:
                    if status == "ok":
                        results[rank] = payload
                        continue
                    failures.append(RankFailure(rank, traceback=str(payload)))
                if len(failures) == 1:
                    first_failure = time.monotonic()
        if failures:
            # Deaths first: a survivor's error is the consequence of a death, not its cause.
            failures.sort(key=lambda f: (f.died is None, ))
            raise RayJobError(_failure_message(failures, self.n), failures)
        return [results[r] for r in range(self.n)]

    def _died(self, rank: int, exc: BaseException) -> RankDied:
        p = self.places[rank]
        reason = " ".join(str(exc).split())
        # Ray appends a list of common causes of a worker's death: what it saw comes first.
        reason = reason.split(" Some common causes include", 1)[0]
        died = RankDied(rank, p.node, p.node_id, p.pid, reason)
        assert self.store is not None
        try:
            self.store.record({"rank": rank, "node": p.node, "node_id": p.node_id, "pid": p.pid, "reason": reason})
        except Exception:  # noqa: BLE001 - the survivors' errors then lack the record, nothing worse
            pass
        return died

    def close(self) -> None:
        ray = self.ray
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # already dead
                pass
        if self.pg is not None:
            try:
                ray.util.remove_placement_group(self.pg)
            except Exception:  # the cluster is going down
                pass
        if self.store is not None:
            self.store.close()
        here = ray.get_runtime_context().get_node_id() if not ray.util.client.ray.is_connected() else None
        local = [p.pid for p in self.places if p.node_id == here]
        _reap(local)


def _reap(pids: list[int], wait: float = 10.0) -> None:
    """Wait (bounded) for this node's rank processes to exit, then unlink the
    shared-memory segments they made and left."""
    deadline = time.monotonic() + wait
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _exists(p)]
        if alive:
            time.sleep(0.02)
    from .._backends.cpu.segments import remove_segments_of

    remove_segments_of(pids)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie has exited: it is only waiting for its parent (the raylet) to reap it
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _failure_message(failures: list[RankFailure], n: int) -> str:
    parts = []
    for f in failures:
        if f.died is not None:
            parts.append(f"{f.died.describe()}")
        else:
            parts.append(f"rank {f.rank} raised:\n{f.traceback.rstrip()}")
    ranks = sorted({f.rank for f in failures})
    return (f"gpucoll.ray.run: rank {failures[0].rank} of {n} failed (failed ranks: {ranks}; every rank was "
            "stopped)\n" + "\n".join(parts))
