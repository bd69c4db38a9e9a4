"""Groups made from the default group: :func:`new_group`, :func:`split_group`,
:func:`new_subgroups` and :func:`new_subgroups_by_enumeration` (torch's names and
signatures). The world slot they add to lives in :mod:`gpucoll._world`; they reach it
through that module (``_w._world()``), so a test that swaps the slot swaps it here too.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Sequence

from . import _world as _w
from ._timeouts import to_seconds
from ._group import GroupMember, ProcessGroup, normalize_backend
from ._group.dispatch import split_device_backend_of
from ._group.checks import _check_desc, _check_ranks, _ranks_label
from ._group.options import PGOptions, PGOptionsLike, coerce_options, options_timeout
from .store import PrefixStore

__all__ = ["new_group", "split_group", "new_subgroups", "new_subgroups_by_enumeration"]

def _group_options(pg_options: Any, backend: str, timeout: float | timedelta | None,
                   default: float) -> tuple[PGOptions | None, float]:
    """``pg_options`` coerced for a ``backend`` group, and the group's timeout: ``timeout``,
    else the options', else ``default``."""
    options = coerce_options(pg_options, backend)
    if timeout is None:
        timeout = options_timeout(options)
    return options, default if timeout is None else to_seconds(timeout, name="timeout")


def _make_group(world: _w._World, name: str, global_ranks: list[int] | None, my_global: int,
                timeout: float | timedelta | None, backend: str | None, *,
                parent: ProcessGroup | None = None, parent_ranks: list[int] | None = None,
                color: int = 0, group_desc: str | None = None,
                pg_options: PGOptions | None = None) -> ProcessGroup | None:
    """Make group ``name`` on its members (``global_ranks``; None on a rank that joins
    none) and return it; None on non-members.

    With ``parent`` (whose ranks must all call, members or not) an NCCL group's
    communicator is split from the parent's (``ncclCommSplit``) where that is possible;
    ``parent_ranks`` are the members as parent ranks and ``color`` tells apart the
    groups of one split_group call; ``pg_options`` are already coerced."""
    seconds = world.timeout if timeout is None else to_seconds(timeout, name="timeout")
    kind = world.backend if backend is None else normalize_backend(backend)
    store = PrefixStore(f"pg/{name}", world.store)
    device_backend = None
    if parent is not None and kind == "nccl":
        device_backend = split_device_backend_of(parent, parent_ranks, color, store=store, group_name=name,
                                                         timeout=seconds, pg_options=pg_options)
    if global_ranks is None:
        return None
    try:
        pg = ProcessGroup(store, global_ranks.index(my_global), len(global_ranks), group_name=name,
                          global_ranks=global_ranks, timeout=seconds, backend=kind, device_id=world.device_id,
                          device_backend=device_backend, group_desc=_check_desc(group_desc),
                          pg_options=pg_options)
    except BaseException:
        if device_backend is not None:
            device_backend.shutdown()
        raise
    world.groups.append(pg)
    return _w._spelled(pg, world.spelling if backend is None or backend == world.backend else backend)


def new_group(ranks: Sequence[int] | None = None, timeout: float | timedelta | None = None,
              backend: str | None = None, pg_options: PGOptionsLike = None, use_local_synchronization: bool = False,
              group_desc: str | None = None, sort_ranks: bool = True) -> Any:
    """Create a group of some ranks of the default group. Every rank of the default group
    must call it, in the same order (that is how groups get the same name everywhere).

    Args:
        ranks: global ranks of the members (sorted, as torch does); None = all.
        timeout: the group's timeout; the default group's when None.
        backend: ``"cpu"``/``"nccl"``; the default group's when None.
        pg_options: :class:`~gpucoll.NCCLOptions` (NCCL groups: passed to the new
            communicator's ncclCommSplit / ncclCommInitRankConfig) or
            :class:`~gpucoll.CPUOptions` (CPU groups); a timeout there applies when
            ``timeout`` is None.
        use_local_synchronization: only the members call (torch's meaning): the group is
            named from its sorted member ranks and a count of such groups over the same
            ranks, so disjoint groups created at once on different ranks never share a
            name or a store namespace; an NCCL group then makes its own communicator
            (no split of the default group's, which would need every rank).
        group_desc: a description kept by the group: shown in its repr, its errors and
            its flight-recorder dumps.
        sort_ranks: False keeps ``ranks`` in the order given: member ``ranks[i]`` is
            group rank ``i`` (torch's ``sort_ranks``).

    Returns:
        The group on members; elsewhere ``GroupMember.NON_GROUP_MEMBER`` (also with
        ``use_local_synchronization=True``, where torch 2.13 returns None).

    Raises:
        ValueError: ranks out of range, duplicated or empty.

    Example:
        >>> evens = gpucoll.new_group([r for r in range(gpucoll.get_world_size()) if r % 2 == 0])
        >>> if evens is not gpucoll.GroupMember.NON_GROUP_MEMBER:
        ...     gpucoll.all_reduce(x, group=evens)
    """
    world = _w._world()
    _check_desc(group_desc)
    size = world.default.size()
    members = _check_ranks(range(size) if ranks is None else ranks, size, "ranks")
    if sort_ranks:
        members = sorted(members)
    # Checked on every rank, members or not, so that all raise alike.
    backend = world.backend if backend is None else normalize_backend(backend)
    options, timeout = _group_options(pg_options, backend, timeout, world.timeout)
    me = world.default.rank()
    mine = members if me in members else None
    if use_local_synchronization:
        if mine is None:
            # Non-members need not call (nothing to count). torch 2.13 returns None here, which
            # every later call reads as "the default group"; the sentinel keeps them off it.
            return GroupMember.NON_GROUP_MEMBER
        key = tuple(members)
        world.made_local[key] = n = world.made_local.get(key, 0) + 1
        pg = _make_group(world, f"local.{_ranks_label(members)}.{n}", mine, me, timeout, backend,
                         group_desc=group_desc, pg_options=options)
    else:
        world.made += 1
        # Every rank takes part: an NCCL group's communicator is split from the default
        # group's where NCCL can (ncclCommSplit is a collective of the parent).
        pg = _make_group(world, f"group{world.made}", mine, me, timeout, backend, parent=world.default,
                         parent_ranks=mine, group_desc=group_desc, pg_options=options)
        if pg is None:
            world.non_member_ranks = members  # torch: NON_GROUP_MEMBER now maps to these ranks
    return GroupMember.NON_GROUP_MEMBER if pg is None else pg


def split_group(parent_pg: ProcessGroup | None = None, split_ranks: Sequence[Sequence[int]] | None = None,
                timeout: float | timedelta | None = None, pg_options: PGOptionsLike = None,
                group_desc: str | None = None) -> ProcessGroup | None:
    """Split ``parent_pg`` into disjoint groups; every rank of the parent must call it.

    Args:
        parent_pg: the group to split (default group when None).
        split_ranks: lists of *parent-group* ranks, disjoint; a rank in none of them
            gets None.
        timeout: the new group's timeout (the parent's when None).
        pg_options: the new groups' options (see :func:`new_group`); None: the
            parent's options, as torch does.
        group_desc: a description kept by the new groups (repr, errors, flight recorder).

    Returns:
        The group this rank belongs to, or None.

    Raises:
        ValueError: ``split_ranks`` missing, out of range, or overlapping.
    """
    world = _w._world()
    _check_desc(group_desc)
    parent = _w._resolve(parent_pg)
    parent._check_usable()
    options, seconds = _group_options(parent.pg_options if pg_options is None else pg_options,
                                      parent.backend_name, timeout, parent.timeout)
    if not split_ranks:
        raise ValueError("split_ranks is required: a list of lists of ranks of the parent group")
    seen: set[int] = set()
    splits = []
    for i, ranks in enumerate(split_ranks):
        checked = sorted(_check_ranks(ranks, parent.size(), f"split_ranks[{i}]"))
        if seen & set(checked):
            raise ValueError(f"split_ranks overlap: rank(s) {sorted(seen & set(checked))} appear in more than one split")
        seen |= set(checked)
        splits.append(checked)
    parent._split_count += 1
    me = parent.rank()
    for i, ranks in enumerate(splits):
        if me in ranks:
            name = f"{parent.group_name}.split{parent._split_count}.{i}"
            global_ranks = [parent.global_ranks[r] for r in ranks]
            return _make_group(world, name, global_ranks, parent.global_ranks[me], seconds, parent.backend_name,
                               parent=parent, parent_ranks=ranks, color=i, group_desc=group_desc,
                               pg_options=options)
    # In no split: still part of the parent's ncclCommSplit (as NCCL_SPLIT_NOCOLOR).
    name = f"{parent.group_name}.split{parent._split_count}.none"
    return _make_group(world, name, None, parent.global_ranks[me], seconds, parent.backend_name, parent=parent,
                       pg_options=options)


def new_subgroups(group_size: int | None = None, group: ProcessGroup | None = None,
                  timeout: float | timedelta | None = None, backend: str | None = None,
                  pg_options: PGOptionsLike = None, group_desc: str | None = None) -> tuple[Any, list[Any]]:
    """Cut the default group (or ``group``) into consecutive subgroups of ``group_size`` ranks.

    Args:
        group_size: ranks per subgroup; default LOCAL_WORLD_SIZE (ranks per node).
        group: the group to cut (default group when None); all its ranks must call.

    Returns:
        ``(this rank's subgroup, all subgroups)`` (non-members' entries are
        ``GroupMember.NON_GROUP_MEMBER``, as with new_group).

    Raises:
        ValueError: ``group_size`` missing, not positive, or not dividing the group size.

    Example:
        >>> node_group, _ = gpucoll.new_subgroups()   # one group per node
    """
    parent = _w._resolve(group)
    if group_size is None:
        raw = os.environ.get("LOCAL_WORLD_SIZE", "")
        if not raw.isdigit():
            raise ValueError("group_size is required when LOCAL_WORLD_SIZE is not set")
        group_size = int(raw)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"The arg 'group_size' ({group_size!r}) must be positive: an int >= 1")
    if parent.size() < group_size:
        raise ValueError(f"The arg 'group_size' ({group_size}) must not exceed the world size ({parent.size()})")
    if parent.size() % group_size:
        raise ValueError(f"The world size ({parent.size()}) must be divisible by '{group_size=}': "
                         f"group_size must divide the size of group {parent.group_name!r}")
    ranks = list(parent.global_ranks)
    chunks = [ranks[i:i + group_size] for i in range(0, len(ranks), group_size)]
    return new_subgroups_by_enumeration(chunks, timeout=timeout, backend=backend, pg_options=pg_options,
                                        group_desc=group_desc)


def new_subgroups_by_enumeration(ranks_per_subgroup_list: Sequence[Sequence[int]],
                                 timeout: float | timedelta | None = None, backend: str | None = None,
                                 pg_options: PGOptionsLike = None, group_desc: str | None = None) -> tuple[Any, list[Any]]:
    """Create one subgroup per list of global ranks; every rank of the default group must call.

    Returns:
        ``(this rank's subgroup or None, all subgroups)``.

    Raises:
        ValueError: empty input, ranks out of range, or a rank in two subgroups.
    """
    world = _w._world()
    coerce_options(pg_options, world.backend if backend is None else normalize_backend(backend))
    if not ranks_per_subgroup_list:
        raise ValueError("The arg 'ranks_per_subgroup_list' cannot be empty: pass one list of ranks per subgroup")
    size = world.default.size()
    owner: dict[int, list[int]] = {}
    for i, ranks in enumerate(ranks_per_subgroup_list):
        checked = _check_ranks(ranks, size, f"ranks_per_subgroup_list[{i}]")
        for r in checked:
            if r in owner:
                raise ValueError(f"Rank {r} has appeared in both subgroup {owner[r]} and {checked}: a rank may "
                                 "not appear in more than one subgroup")
            owner[r] = checked
    mine: Any = None
    subgroups = []
    for ranks in ranks_per_subgroup_list:
        pg = new_group(ranks, timeout=timeout, backend=backend, pg_options=pg_options, group_desc=group_desc)
        subgroups.append(pg)
        if isinstance(pg, ProcessGroup):
            mine = pg
    return mine, subgroups
