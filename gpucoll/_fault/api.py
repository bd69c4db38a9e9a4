"""The world-level fault-tolerance API: shrink a group, grow it, join it.

See docs/fault-tolerance.md for the guarantees and a complete training loop.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Sequence

from .. import _world
from .._backends.base import Backend
from .._group import ProcessGroup, normalize_backend
from .._group.grow import offer_seats, take_seat
from .._group.options import DeviceLike, PGOptionsLike, coerce_options, options_timeout
from .._group.shrink import check_exclusions, shrink
from .._rendezvous import rendezvous
from .._timeouts import to_seconds
from ..store import PrefixStore, Store

__all__ = ["shrink_group", "grow_group", "join_process_group"]


def shrink_group(ranks_to_exclude: Sequence[int] | None = None, group: ProcessGroup | None = None, *,
                 timeout: float | timedelta | None = None, pg_options: PGOptionsLike = None) -> ProcessGroup:
    """Abort ``group`` and return a new group of its remaining ranks, renumbered in order.

    Every remaining rank of the group calls it (typically after a collective raised
    :class:`~gpucoll.DistError` because a peer died). torch 2.13's name; torch needs
    the list and supports NCCL only, gpucoll finds the failed ranks itself and
    shrinks CPU and NCCL groups.

    Args:
        ranks_to_exclude: ranks *of group* known to be gone. None: the ranks find out
            themselves: every live rank checks in through the store and the ranks that
            have not checked in ``timeout`` seconds after the first arrival are left out.
            The decision is written once, so every survivor gets the same group.
        group: the group to shrink; the default group when None. Shrinking the default
            group makes the result the new default group (global ranks renumbered:
            ``get_rank()`` returns the new rank).
        timeout: seconds each agreement step waits for ranks that have not arrived;
            the group's timeout when None. Recovery takes about this long when a
            rank is missing, and no longer than the build when none is.
        pg_options: the new group's :class:`~gpucoll.NCCLOptions` (its config reaches
            ncclCommShrink, or the fresh communicator's ncclCommInitRankConfig) or
            :class:`~gpucoll.CPUOptions`; None keeps the group's own. A timeout there
            becomes the new group's (else it keeps the old one's).

    Returns:
        The new group. The old one is destroyed (its pending Work failed with
        DistBackendError, its sockets and shared memory released).

    Raises:
        DistError: this rank arrived after the others had agreed without it (it was
            excluded), or further failures kept the new group from being built.
        ValueError: ``ranks_to_exclude`` holds a rank outside the group, this rank, or
            every rank.

    Example:
        >>> try:
        ...     gpucoll.all_reduce(grads)
        ... except gpucoll.DistError:
        ...     gpucoll.shrink_group()          # the default group, without the dead
        ...     gpucoll.all_reduce(grads)       # retry the step among the survivors
    """
    world = _world._world()
    pg = _world._resolve(group)
    pg._check_usable()
    options = pg.pg_options if pg_options is None else coerce_options(pg_options, pg.backend_name)
    new_timeout = pg.timeout if pg_options is None else (options_timeout(options) or pg.timeout)
    exclude = check_exclusions(ranks_to_exclude, pg)
    seconds = pg.timeout if timeout is None else to_seconds(timeout, name="timeout")
    is_default = pg is world.default

    def make(name: str, rank: int, members: list[int], device: Backend | None) -> ProcessGroup:
        global_ranks = list(range(len(members))) if is_default else [pg.global_ranks[r] for r in members]
        return ProcessGroup(PrefixStore(f"pg/{name}", world.store), rank, len(members), group_name=name,
                            global_ranks=global_ranks, timeout=new_timeout, backend=pg.backend_name,
                            device_id=pg._device_id if pg._bound else None, device_backend=device,
                            group_desc=pg.group_desc, pg_options=options)

    if pg in world.groups:
        world.groups.remove(pg)
    new = shrink(pg, exclude, seconds, make, world.store, options)
    if is_default:
        world.default = new
        _world.GroupMember._world = new
    else:
        world.groups.append(new)
    return new


def grow_group(num_new_ranks: int = 1, *, timeout: float | timedelta | None = None) -> ProcessGroup:
    """Grow the default group by ``num_new_ranks`` processes that call
    :func:`join_process_group`; every rank of the default group calls it.

    The members keep their ranks; the new processes get the next ones, in the order
    they joined. The result becomes the default group (the old one is destroyed). Its
    name, and so its store namespace, is new: nothing written under the old one is read.

    Args:
        num_new_ranks: how many processes to take in (>= 1).
        timeout: seconds to wait for them; the default group's timeout when None.

    Raises:
        DistError: fewer processes joined in time (on every member; the default group
            is unchanged and usable).
        ValueError: ``num_new_ranks`` < 1.
    """
    world = _world._world()
    if isinstance(num_new_ranks, bool) or not isinstance(num_new_ranks, int) or num_new_ranks < 1:
        raise ValueError(f"num_new_ranks must be an int >= 1; got {num_new_ranks!r}")
    pg = world.default
    pg._check_usable()
    seconds = pg.timeout if timeout is None else to_seconds(timeout, name="timeout")
    # Tickets and seats live at the root of the job's store, where a new process looks;
    # the groups live in this init's namespace of it (its generation), which the seat names.
    root = world.job_store if world.job_store is not None else world.store
    namespace = world.store.prefix if isinstance(world.store, PrefixStore) and root is not world.store else ""
    info = {"backend": world.backend, "timeout": pg.timeout, "made": world.made, "desc": pg.group_desc,
            "bound": pg._bound, "namespace": namespace}
    plan = offer_seats(pg, root, num_new_ranks, seconds, info)
    new = ProcessGroup(PrefixStore(f"pg/{plan['name']}", world.store), pg.rank(), plan["size"],
                       group_name=plan["name"], global_ranks=range(plan["size"]), timeout=pg.timeout,
                       backend=pg.backend_name, device_id=pg._device_id if pg._bound else None,
                       group_desc=pg.group_desc)
    world.default = new
    _world.GroupMember._world = new
    pg._destroy()
    return new


def join_process_group(init_method: str | None = None, *, store: Store | None = None,
                       timeout: float | timedelta | None = None, device_id: DeviceLike = None) -> None:
    """Join a running job as a new member: wait until its ranks call :func:`grow_group`,
    then become a rank of the grown default group (instead of ``init_process_group``).

    Args:
        init_method: how to reach the job's store (see ``init_process_group``); with
            ``env://`` (the default) the store must be hosted apart from the ranks
            (``GPUCOLL_STORE_HOSTED=1``: gpucoll-run, gpucoll.testing), since the rank
            that served it may be the one that died. RANK and WORLD_SIZE are read but
            not used for the new rank.
        store: the job's store, instead of ``init_method`` (not closed on destroy).
        timeout: seconds to wait for a ``grow_group`` call; default 300.
        device_id: for NCCL jobs, the CUDA device to use.

    Raises:
        RuntimeError: this process already has a default group.
        DistError: no grow_group took this process in time.
    """
    if _world._WORLD is not None:
        raise RuntimeError("join_process_group: this process already has a default group; "
                           "call destroy_process_group() first")
    seconds = to_seconds(timeout, name="timeout")
    owns = store is None
    if store is None:
        store, _, _ = rendezvous(init_method or "env://", -1, -1, seconds)
    elif init_method is not None:
        raise ValueError(f"pass either init_method or store, not both; got init_method={init_method!r}")
    try:
        seat = take_seat(store, seconds)
        backend = normalize_backend(seat["backend"])
        device = _world._device_index(device_id)
        if seat.get("bound") and device is None:
            raise ValueError("join_process_group: the job's NCCL group is bound to a device on every rank; "
                             "pass device_id= (the CUDA device this process uses)")
        ns: Store = PrefixStore(seat["namespace"], store) if seat.get("namespace") else store
        pg = ProcessGroup(PrefixStore(f"pg/{seat['name']}", ns), seat["rank"], seat["size"],
                          group_name=seat["name"], global_ranks=range(seat["size"]), timeout=seat["timeout"],
                          backend=backend, device_id=device, group_desc=seat.get("desc", ""))
    except BaseException:
        if owns:
            store.close()
        raise
    world = _world._World(ns, owns, pg, backend, float(seat["timeout"]), device, job_store=store)
    world.made = int(seat["made"])
    _world._WORLD = world
    _world.GroupMember._world = pg
