"""The world API: the default process group and what is asked of a group.

torch.distributed's names and signatures: :func:`init_process_group`,
:func:`destroy_process_group`, :func:`get_rank`, ... (the groups made from the
default one: :mod:`gpucoll._new_groups`). The module's only mutable state is
the default-group slot, which holds the job's store, the default group and the
groups made since (so that ``destroy_process_group()`` can tear them all down).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ._env import BACKEND_ENV, DEBUG_ENV, NON_MEMBER_ENV
from ._timeouts import to_seconds
from ._group import Backend, GroupMember, ProcessGroup, nccl_usable, normalize_backend
from ._group.checks import _InitTwiceError, _RankError
from ._group.gpu_check import require_nccl
from ._group.join import await_all_joined, next_generation
from ._group.options import DeviceLike, PGOptionsLike, coerce_options, options_timeout
from ._rendezvous import rendezvous
from .store import HashStore, PrefixStore, Store

__all__ = [
    "init_process_group", "destroy_process_group", "is_initialized", "is_available", "is_nccl_available",
    "get_rank", "get_world_size", "get_backend", "get_process_group_ranks", "get_group_rank", "get_global_rank",
    "GroupMember", "default_group", "not_in_group",
]


@dataclass(eq=False)
class _World:
    store: Store  # this init's namespace of the job's store (groups live under it)
    owns_store: bool
    default: ProcessGroup
    backend: str
    timeout: float
    device_id: int | None
    groups: list[ProcessGroup] = field(default_factory=list)
    made: int = 0  # groups made by new_group so far: names them the same on every rank
    made_local: dict[tuple[int, ...], int] = field(default_factory=dict)  # per member set (local sync)
    spelling: str = ""  # the backend as init_process_group was asked for it ("gloo" stays "gloo")
    control_plane: Any = None  # this rank's control-plane server (GPUCOLL_CONTROL_PLANE), if any
    job_store: Store | None = None  # the store itself (closed on destroy when owned)
    # the members of the last group new_group made without this rank: what torch answers
    # for GroupMember.NON_GROUP_MEMBER in get_group_rank, get_global_rank, get_process_group_ranks
    non_member_ranks: list[int] | None = None


_WORLD: _World | None = None
"""The default-group slot (None until init_process_group)."""


def _world() -> _World:
    world = _WORLD
    if world is None:
        raise RuntimeError("the default process group is not initialized; call gpucoll.init_process_group() "
                           "first (or it was destroyed by destroy_process_group())")
    return world


def default_group() -> ProcessGroup:
    """The default process group.

    Raises:
        RuntimeError: :func:`init_process_group` has not been called (or was undone).
    """
    world = _WORLD
    if world is None:
        _world()
    assert world is not None
    return world.default


def not_in_group(op: str, stacklevel: int = 3) -> None:
    """What a call of ``op`` with ``group=GroupMember.NON_GROUP_MEMBER`` does before it
    returns without doing anything: warn, as torch's ``_warn_not_in_group`` (every rank may
    run the same line; the ranks a group leaves out skip it), or raise where the user
    asked for an error (``GPUCOLL_NON_MEMBER=error``, or ``GPUCOLL_DEBUG=DETAIL``): a
    skipped collective can hide a rank that took the wrong branch. ``stacklevel``: the
    warning's, counted from here (3: the caller of the function that called this).

    Raises:
        RuntimeError: errors were asked for.
        ValueError: ``GPUCOLL_NON_MEMBER`` holds neither ``warn`` nor ``error``.
    """
    from ._debug import DebugLevel, get_debug_level

    world = _WORLD
    me = -1 if world is None else world.default.rank()
    where = (f"global rank {me} which does not belong to the given group (GroupMember.NON_GROUP_MEMBER: "
             "new_group left this rank out)")
    mode = os.environ.get(NON_MEMBER_ENV, "").strip().lower() or "warn"
    if mode not in ("warn", "error"):
        raise ValueError(f"{NON_MEMBER_ENV} must be 'warn' or 'error'; got {os.environ.get(NON_MEMBER_ENV)!r}")
    if mode == "error" or get_debug_level() == DebugLevel.DETAIL:
        raise RuntimeError(f"{op} on {where}: this rank is not a member of the group; only members may use it "
                           f"(errors asked for by {NON_MEMBER_ENV}=error or {DEBUG_ENV}=DETAIL)")
    warnings.warn(f"Running {op} on {where}; the call does nothing and returns. Set {NON_MEMBER_ENV}=error "
                  "to make this an error", stacklevel=stacklevel)


def _resolve(group: Any) -> ProcessGroup:
    if group is None:
        return default_group()
    if isinstance(group, ProcessGroup):
        return group
    if group is GroupMember.NON_GROUP_MEMBER:
        raise RuntimeError("this rank is not a member of the group (new_group returned "
                           "GroupMember.NON_GROUP_MEMBER here); only members may use it")
    raise TypeError(f"group must be a ProcessGroup or None; got {type(group).__name__}")


# ----- init and teardown -----

def init_process_group(backend: str | None = None, init_method: str | None = None,
                       timeout: float | timedelta | None = None, world_size: int = -1, rank: int = -1,
                       store: Store | None = None, group_name: str = "", pg_options: PGOptionsLike = None,
                       device_id: DeviceLike = None) -> None:
    """Join the job: connect to the rendezvous store and create the default process group.

    Args:
        backend: ``"nccl"`` (device arrays through NCCL, host arrays/objects through the
            CPU backend), ``"cpu"`` (``"gloo"`` is an alias), or None: the launcher's choice
            (``GPUCOLL_BACKEND``) where it made one, else NCCL when a GPU and
            NCCL are usable, else CPU. ``"fake"``: no communication at all, every op
            completes at once after its argument checks (torch's FakeProcessGroup; one
            process plays any ``rank`` of any ``world_size``; ``store`` is optional).
        init_method: ``"env://"`` (default: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT or
            any launcher gpucoll detects: gpucoll-run, torchrun, Slurm, Open MPI, MPICH),
            ``"tcp://host:port"`` (rank 0 serves the store there; needs ``rank`` and
            ``world_size``) or ``"file:///path"`` (a FileStore on a shared filesystem).
        timeout: seconds (or timedelta) for rendezvous and for every op; default 300.
        world_size: number of processes; -1 reads it from the environment.
        rank: this process's rank; -1 reads it from the environment.
        store: an existing store to rendezvous through (then ``rank`` and ``world_size``
            are required and ``init_method`` must be None). It is not closed on destroy.
        group_name: the default group's name (default ``"default"``).
        pg_options: :class:`~gpucoll.NCCLOptions` for an NCCL group (its ncclConfig_t,
            stream priority, timeout; torch's ``ProcessGroupNCCL.Options`` shape is
            accepted too), :class:`~gpucoll.CPUOptions` for a CPU group (transport,
            timeout), or None. A timeout given here applies when ``timeout`` is None.
        device_id: for NCCL, the CUDA device to bind now (int, ``"cuda:N"``, or an
            object with ``.index``/``.id``); else the device of the first device array.

    With ``env://``: when ``GPUCOLL_STORE_HOSTED=1`` (gpucoll-run, gpucoll.testing) every
    rank is a client of the store at MASTER_ADDR:MASTER_PORT, presenting
    ``GPUCOLL_STORE_TOKEN``; otherwise rank 0 serves it there. ``MASTER_PORT=0`` only
    works when the store is hosted (ranks cannot otherwise learn the port rank 0 picks)
    or with one rank.

    Raises:
        RuntimeError: the default group already exists.
        ValueError: a bad argument or an incomplete environment (the message names it).
        DistStoreError, DistNetworkError: the rendezvous failed or timed out.
        BackendUnavailableError: ``backend="nccl"`` cannot run here.

    Example:
        >>> import gpucoll, numpy as np
        >>> gpucoll.init_process_group("cpu")          # under gpucoll-run / torchrun
        >>> x = np.ones(4, np.float32)
        >>> gpucoll.all_reduce(x)                        # x == world_size everywhere
        >>> gpucoll.destroy_process_group()
    """
    global _WORLD
    if _WORLD is not None:
        raise _InitTwiceError("trying to initialize the default process group twice! It is already "
                              "initialized; call destroy_process_group() before init_process_group() again")
    if backend is None:  # a launcher may choose it for its ranks (gpucoll.ray.run(backend=...))
        backend = os.environ.get(BACKEND_ENV, "").strip() or None
        try:
            name = normalize_backend(backend)
        except ValueError as exc:
            raise ValueError(f"{BACKEND_ENV}={backend!r} (the backend init_process_group() picks when given "
                             f"none): {exc}") from None
    else:
        name = normalize_backend(backend)
    options = coerce_options(pg_options, name)
    seconds = to_seconds(timeout if timeout is not None else options_timeout(options), name="timeout")
    if name == "nccl":
        require_nccl()  # at init, as documented: not at the first device op
    device = _device_index(device_id)
    if not isinstance(group_name, str):
        raise TypeError(f"group_name must be a str; got {type(group_name).__name__}")
    for arg, value in (("world_size", world_size), ("rank", rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{arg} must be an int; got {type(value).__name__} {value!r}")
    if store is None and name == "fake" and init_method is None:
        store = HashStore()  # the fake backend talks to no one; torch passes a FakeStore here
    if store is not None:
        if init_method is not None:
            raise ValueError(f"pass either init_method or store, not both; got init_method={init_method!r}")
        if world_size < 1 or rank < 0:
            raise ValueError(f"with store=, world_size and rank are required; got world_size={world_size}, "
                             f"rank={rank}")
        if not isinstance(store, Store):
            raise TypeError(f"store must be a gpucoll Store; got {type(store).__name__}")
        owns = False
    else:
        store, rank, world_size = rendezvous(init_method or "env://", rank, world_size, seconds)
        owns = True
    if not 0 <= rank < world_size:
        if owns:
            store.close()
        raise _RankError(f"Cannot init process group where rank {rank} >= world_size {world_size}: "
                         f"rank must be in [0, world_size={world_size}); got rank={rank}")
    if owns:
        try:  # every rank, not only the store's host, says how many processes joined
            await_all_joined(store, rank, world_size, seconds)
        except BaseException:
            store.close()
            raise
    pg_name = group_name or "default"
    try:
        # Each init of the default group gets its own namespace (generation) of the store:
        # after destroy_process_group, a new init must not read the previous group's keys.
        ns = PrefixStore(f"gpucoll/gen{next_generation(store, pg_name, world_size)}", store)
        pg = ProcessGroup(PrefixStore(f"pg/{pg_name}", ns), rank, world_size, group_name=pg_name,
                          global_ranks=range(world_size), timeout=seconds, backend=name, device_id=device,
                          group_desc="default_pg", pg_options=options)
    except BaseException:
        if owns:
            store.close()
        raise
    world = _World(ns, owns, _spelled(pg, backend), name, seconds, device, job_store=store,
                   spelling=str(backend or ""))
    from ._debug.control_plane import maybe_start  # opt-in debugging server (off unless GPUCOLL_CONTROL_PLANE is set)
    # Published at the root of the job's store, where gpucoll-debug status looks (the newest init wins).

    try:
        world.control_plane = maybe_start(store, rank, world_size, lambda: [world.default, *world.groups])
    except BaseException:
        pg._destroy()
        if owns:
            store.close()
        raise
    _WORLD = world
    GroupMember._world = pg


def _device_index(device_id: DeviceLike) -> int | None:
    if device_id is None:
        return None
    if isinstance(device_id, str):
        text = device_id.strip().lower()
        if text.startswith("cuda:") and text[5:].isdigit():
            return int(text[5:])
    elif isinstance(device_id, int) and not isinstance(device_id, bool):
        if device_id >= 0:
            return device_id
    else:
        for attr in ("index", "id"):  # torch.device, cupy.cuda.Device
            index = getattr(device_id, attr, None)
            if isinstance(index, int) and index >= 0:
                return index
    raise ValueError(f"device_id must be a CUDA device index >= 0, 'cuda:N' or a device object; got {device_id!r}")


def destroy_process_group(group: ProcessGroup | None = None) -> None:
    """Tear down ``group``, or with None every group and the default one (closing the store
    that :func:`init_process_group` opened).

    Later calls on a destroyed group raise RuntimeError.

    Raises:
        RuntimeError: ``group`` is None and nothing is initialized; or a completion hook
            of a destroyed group raised (the first such error, after teardown).
        DistBackendError: a backend failed to shut down (after everything else is torn down).
    """
    global _WORLD
    if group is GroupMember.NON_GROUP_MEMBER:
        return
    if group is not None:
        pg = _resolve(group)
        world = _WORLD
        if world is not None and pg is world.default:
            destroy_process_group(None)
            return
        if world is not None and pg in world.groups:
            world.groups.remove(pg)
        pg._destroy()
        return
    world = _world()
    _WORLD = None
    GroupMember._world = None
    first: BaseException | None = None
    if world.control_plane is not None:
        world.control_plane.close()
    for pg in [*reversed(world.groups), world.default]:
        try:
            pg._destroy()
        except BaseException as exc:
            first = first or exc
    if world.owns_store and world.job_store is not None:
        try:
            world.job_store.close()
        except Exception as exc:
            first = first or exc
    if first is not None:
        raise first


def is_initialized() -> bool:
    """True between :func:`init_process_group` and :func:`destroy_process_group`."""
    return _WORLD is not None


def is_available() -> bool:
    """True: gpucoll's CPU backend always works (torch's name, for porting)."""
    return True


def is_nccl_available() -> bool:
    """True when the NCCL backend can run here: CuPy, NCCL and a CUDA device (imports CuPy)."""
    return nccl_usable()


# ----- queries -----

def get_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (default group when None); -1 if not a member."""
    if group is GroupMember.NON_GROUP_MEMBER:
        return -1
    return _resolve(group).rank()


def get_world_size(group: ProcessGroup | None = None) -> int:
    """Number of ranks in ``group`` (default group when None); -1 if not a member."""
    if group is GroupMember.NON_GROUP_MEMBER:
        return -1
    return _resolve(group).size()


def get_backend(group: ProcessGroup | None = None) -> Backend:
    """The group's backend, a :class:`Backend` (a str): ``"cpu"``, ``"nccl"``, or ``"gloo"``
    for a CPU group created with that spelling (torch's name, which ported scripts compare with).

    Raises:
        ValueError: this rank is not a member of ``group`` (torch's type and words).
    """
    if group is GroupMember.NON_GROUP_MEMBER:
        raise ValueError("Invalid process group specified: this rank is not a member of the group "
                         "(new_group returned GroupMember.NON_GROUP_MEMBER here)")
    return Backend(_resolve(group)._backend_spelling)


def _spelled(pg: ProcessGroup, asked: Any) -> ProcessGroup:
    if isinstance(asked, str) and asked.strip().lower() == "gloo" and pg.backend_name == "cpu":
        pg._backend_spelling = "gloo"
    return pg


def _int_rank(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int; got {type(value).__name__}")
    return value


def _ranks_of(group: ProcessGroup | None) -> tuple[list[int], str]:
    """``group``'s global ranks in group-rank order, and its name for messages. For
    ``GroupMember.NON_GROUP_MEMBER`` (what :func:`new_group` returned on a rank it left
    out), the members of the last such group, as torch answers there."""
    if group is GroupMember.NON_GROUP_MEMBER:
        ranks = _world().non_member_ranks
        if ranks is None:
            raise ValueError("Group GroupMember.NON_GROUP_MEMBER is not registered, please create group with "
                             "new_group: no group has left this rank out yet")
        return list(ranks), repr(group)
    pg = _resolve(group)
    return list(pg.global_ranks), repr(pg.group_name)


def get_process_group_ranks(group: ProcessGroup | None) -> list[int]:
    """The global ranks of ``group``'s members, in group-rank order.

    On a rank that :func:`new_group` left out, ``GroupMember.NON_GROUP_MEMBER`` stands for
    the last group made without this rank (torch's answer there), here and in
    :func:`get_group_rank` and :func:`get_global_rank`.

    Raises:
        ValueError: ``group`` is ``GroupMember.NON_GROUP_MEMBER`` and no group has left
            this rank out (torch's "not registered").
    """
    return _ranks_of(group)[0]


def get_group_rank(group: ProcessGroup | None, global_rank: int) -> int:
    """Translate a global rank to ``group``'s rank.

    Raises:
        ValueError: ``global_rank`` is not in ``group`` (torch's "... is not part of group").
    """
    ranks, name = _ranks_of(group)
    if isinstance(global_rank, int) and not isinstance(global_rank, bool) and global_rank not in ranks:
        raise ValueError(f"Global rank {global_rank} is not part of group {name}: "
                         f"global_rank={global_rank} is not a member (its global ranks: {ranks})")
    if group is GroupMember.NON_GROUP_MEMBER:
        return ranks.index(_int_rank(global_rank, "global_rank"))
    return _resolve(group).get_group_rank(global_rank)


def get_global_rank(group: ProcessGroup | None, group_rank: int) -> int:
    """Translate ``group``'s rank to a global rank.

    Raises:
        ValueError: ``group_rank`` is out of range (torch's "... is not part of group").
    """
    ranks, name = _ranks_of(group)
    if isinstance(group_rank, int) and not isinstance(group_rank, bool) and not 0 <= group_rank < len(ranks):
        raise ValueError(f"Group rank {group_rank} is not part of group {name}: "
                         f"group_rank={group_rank} is out of range for a group of size {len(ranks)}")
    if group is GroupMember.NON_GROUP_MEMBER:
        return ranks[_int_rank(group_rank, "group_rank")]
    return _resolve(group).get_global_rank(group_rank)
