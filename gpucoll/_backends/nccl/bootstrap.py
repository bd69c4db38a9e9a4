"""Whether NCCL can run here, the rendezvous that makes a communicator's unique id
known to every rank through the group's store, and a communicator made from it
(functions over explicit arguments; ``NCCLBackend`` takes the communicator)."""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping

from ..._env import NCCL_CALLER_STREAM_MAX_ENV, NCCL_RANKS_PER_ROOT_ENV, NCCL_SCALABLE_INIT_ENV
from ...errors import BackendUnavailableError, DistBackendError, DistStoreError
from ...store.base import Store
from . import lib as _nccl_lib
from .lib import Features
from .values import normalise_unique_id
from .protocols import Comm, Runtime
from .runtime import enter_device, leave_device

__all__ = ["nccl_unavailable_reason", "is_nccl_available", "nccl_version", "rendezvous", "create_comm",
           "refuse_nonblocking_env"]

_UID_KEY = "nccl/unique_id"
_ARRIVED_KEY = "nccl/arrived"
_ALL_ARRIVED_KEY = "nccl/all_arrived"


def nccl_unavailable_reason() -> str | None:
    """Why the NCCL backend cannot run in this process, or None if it can.

    Checks that CuPy imports, that it found an NCCL library, and that a CUDA device
    is visible (which initialises the CUDA driver: fork no workers afterwards).

    Example:
        >>> reason = nccl_unavailable_reason()
        >>> backend = "nccl" if reason is None else "cpu"
    """
    return _nccl_lib.unavailable_reason()


def is_nccl_available() -> bool:
    """True if the NCCL backend can run here (see :func:`nccl_unavailable_reason`)."""
    return nccl_unavailable_reason() is None


def nccl_version() -> tuple[int, int, int]:
    """The (major, minor, patch) of the NCCL library CuPy loads; needs no GPU.

    Raises:
        BackendUnavailableError: CuPy or NCCL is not installed.
    """
    return _nccl_lib.load().version


def refuse_nonblocking_env() -> None:
    """Refuse ``NCCL_COMM_BLOCKING=0``: NCCL applies it to every communicator, each call
    then returns ncclInProgress (7), which CuPy 14's NcclError cannot even name (KeyError: 7).

    Raises:
        BackendUnavailableError: the variable is set to 0.
    """
    if os.environ.get("NCCL_COMM_BLOCKING", "").strip() == "0":
        raise BackendUnavailableError(
            "NCCL_COMM_BLOCKING=0 is set: it makes every NCCL communicator non-blocking, and gpucoll "
            "drives its communicators in blocking mode through CuPy, whose error path cannot report "
            "ncclInProgress. Unset NCCL_COMM_BLOCKING (or set it to 1); gpucoll bounds NCCL's blocking "
            "calls with the group's timeout itself")


def rendezvous(store: Store, rank: int, size: int, *, timeout: float, group_name: str,
               make_uid: Callable[[], bytes]) -> bytes:
    """Agree on an NCCL unique id through ``store`` and wait until every rank has it.

    Rank 0 calls ``make_uid`` and publishes the id; the others wait for it. Then every
    rank counts itself in and waits for the last one: ``ncclCommInitRank`` blocks
    until all ranks join, and a missing rank is better reported here, as a timeout
    that says how many arrived, than as a hang inside NCCL.

    Args:
        store: the group's private store (keys ``nccl/...``; one communicator per store).
        rank, size: this rank and the group size.
        timeout: seconds to wait for rank 0's id and for all ranks to arrive.
        group_name: for errors.
        make_uid: makes a new unique id (``ncclGetUniqueId``); called on rank 0 only.

    Returns:
        The 128-byte unique id, the same on every rank.

    Raises:
        DistBackendError: the id or some ranks did not arrive within ``timeout``.
    """
    try:
        if rank == 0:
            uid = normalise_unique_id(make_uid())
            store.set(_UID_KEY, uid)
        else:
            uid = normalise_unique_id(store.get(_UID_KEY, timeout=timeout))
    except DistStoreError as exc:
        raise DistBackendError(
            f"group {group_name!r}: rank {rank} did not get the NCCL unique id from rank 0 through the "
            f"store within {timeout:.3g} s: {exc}") from exc
    arrived = _all_arrive(store, _ARRIVED_KEY, _ALL_ARRIVED_KEY, size, timeout)
    if arrived is not None:
        raise DistBackendError(f"group {group_name!r}: only {arrived} ranks reached NCCL communicator "
                               f"setup within {timeout:.3g} s")
    return uid


def _all_arrive(store: Store, counter: str, flag: str, size: int, timeout: float) -> str | None:
    """Count this rank in at ``counter`` and wait until all ``size`` ranks are: None once
    they are, else how many arrived ("k of n") when ``timeout`` seconds ran out."""
    try:
        if store.add(counter, 1) == size:
            store.set(flag, b"1")
        store.wait([flag], timeout)
        return None
    except DistStoreError:
        try:
            return f"{store.add(counter, 0)} of {size}"
        except DistStoreError:
            return f"not all {size}"


DEFAULT_SCALABLE_FROM = 1024
"""Ranks from which a communicator is made from several roots (GPUCOLL_NCCL_SCALABLE_INIT)."""
DEFAULT_RANKS_PER_ROOT = 256
"""Ranks per root on that path (GPUCOLL_NCCL_RANKS_PER_ROOT)."""


DEFAULT_CALLER_STREAM_MAX = 0
"""Bytes up to which an async op runs on the caller's stream (GPUCOLL_NCCL_CALLER_STREAM_MAX).
None by default: ``async_op=True`` overlaps the op with the caller's later work, as in torch."""


def caller_stream_max() -> int:
    """``GPUCOLL_NCCL_CALLER_STREAM_MAX``: an async op of up to this many bytes (a
    repeated one, untimed) is issued on the caller's current stream rather than on the
    communication stream: two CUDA calls fewer to issue and none to wait on that stream,
    at the price of later work on that stream running after the op rather than beside
    it. 0, the default, puts every async op on the communication stream (torch's
    scheduling: the op overlaps the caller's later work on its stream).

    Raises:
        ValueError: the variable is not a whole number of bytes >= 0.
    """
    name = NCCL_CALLER_STREAM_MAX_ENV
    text = os.environ.get(name, "").strip()
    if not text:
        return DEFAULT_CALLER_STREAM_MAX
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{name} must be a number of bytes >= 0; got {text!r}")
    return value


def _positive_env(name: str, default: int, *, off: bool = False) -> int | None:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    if off and text.lower() in ("off", "0", "no", "false"):
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name} must be a positive number of ranks{' or off' if off else ''}; got {text!r}")
    return value


def scalable_roots(size: int) -> list[int] | None:
    """The ranks that each make one unique id for ``ncclCommInitRankScalable`` in a group
    of ``size`` ranks, or None below GPUCOLL_NCCL_SCALABLE_INIT ranks (one root).

    ceil(size / GPUCOLL_NCCL_RANKS_PER_ROOT) roots; root i is the first rank NCCL's
    bootstrap assigns to id i (``firstRankFromRoot`` in src/bootstrap.cc: size // n
    ranks per id, the first size % n ids one more), so that each id's bootstrap root
    thread runs in a process that talks to it anyway.

    Raises:
        ValueError: either variable is set to something other than a positive count
            (or "off" for the threshold).
    """
    start = _positive_env(NCCL_SCALABLE_INIT_ENV, DEFAULT_SCALABLE_FROM, off=True)
    per_root = _positive_env(NCCL_RANKS_PER_ROOT_ENV, DEFAULT_RANKS_PER_ROOT)
    assert per_root is not None
    if start is None or size < start:
        return None
    n = -(-size // per_root)
    return [i * (size // n) + min(i, size % n) for i in range(n)]


def scalable_rendezvous(store: Store, rank: int, size: int, roots: list[int], *, timeout: float,
                        group_name: str, make_uid: Callable[[], bytes]) -> list[bytes]:
    """Every root's unique id, in root order, on every rank: each root makes one and
    publishes it through ``store``; every rank reads them all in one request, then counts
    itself in as :func:`rendezvous` does.

    Raises:
        DistBackendError: an id or some ranks did not arrive within ``timeout``.
    """
    keys = [f"{_UID_KEY}/{i}" for i in range(len(roots))]
    try:
        if rank in roots:
            store.set(keys[roots.index(rank)], normalise_unique_id(make_uid()))
        store.wait(keys, timeout)
        uids = [normalise_unique_id(v) for v in store.multi_get(keys)]
    except DistStoreError as exc:
        raise DistBackendError(
            f"group {group_name!r}: rank {rank} did not get the NCCL unique ids of the {len(roots)} roots "
            f"(ranks {roots[:8]}{' ...' if len(roots) > 8 else ''}) through the store within {timeout:.3g} s: "
            f"{exc}") from exc
    arrived = _all_arrive(store, _ARRIVED_KEY, _ALL_ARRIVED_KEY, size, timeout)
    if arrived is not None:
        raise DistBackendError(f"group {group_name!r}: only {arrived} ranks reached NCCL communicator "
                               f"setup within {timeout:.3g} s")
    return uids


def _short(ranks: list[int]) -> str:
    return str(ranks) if len(ranks) <= 8 else f"[{', '.join(map(str, ranks[:8]))}, ... ({len(ranks)} in all)]"


def _check_scalable_ids(uids: list[bytes], size: int) -> None:
    """What ncclCommInitRankScalable asks of its ids (ncclCommInitRankDev, src/init.cc:
    1 <= nId <= nranks; each a distinct 128-byte ncclUniqueId), checked before NCCL's
    bootstrap would hang on them."""
    if not 1 <= len(uids) <= size:
        raise ValueError(f"nId={len(uids)} ids for nranks={size}; NCCL needs 1 <= nId <= nranks")
    if len(set(uids)) != len(uids) or any(len(u) != 128 for u in uids):
        raise ValueError("the roots' ids are not distinct 128-byte ncclUniqueIds")


def create_comm(rt: Runtime, features: Features, store: Store, rank: int, size: int, *, timeout: float,
                group_name: str, config: Mapping[str, Any] | None, device: int) -> Comm:
    """A communicator for rank ``rank`` of ``size`` of group ``group_name`` on ``device``:
    its unique id through the group's ``store`` (:func:`rendezvous`), then
    ncclCommInitRank(Config) with ``config`` (None: NCCL's defaults); from
    GPUCOLL_NCCL_SCALABLE_INIT ranks, where the loaded NCCL has it, several roots' ids
    (:func:`scalable_rendezvous`) and ncclCommInitRankScalable instead.

    Raises:
        DistBackendError: the rendezvous timed out or NCCL failed.
    """
    roots = scalable_roots(size) if features.init_scalable else None
    prev = enter_device(rt, device)
    try:
        if roots is None:
            uid = rendezvous(store, rank, size, timeout=timeout, group_name=group_name, make_uid=rt.unique_id)
        else:
            uids = scalable_rendezvous(store, rank, size, roots, timeout=timeout, group_name=group_name,
                                       make_uid=rt.unique_id)
        try:
            if roots is None:
                return rt.new_comm(size, uid, rank, config)
            _check_scalable_ids(uids, size)
            return rt.new_comm_scalable(size, uids, rank, config)
        except Exception as exc:
            how = "ncclCommInitRank" if roots is None else (
                f"ncclCommInitRankScalable with nranks={size}, nId={len(uids)}, the ids made by ranks "
                f"{_short(roots)} and taken in that order")
            raise DistBackendError(
                f"creating the NCCL communicator of group {group_name!r} (rank {rank} of "
                f"{size}, cuda:{device}, {how}) failed: {type(exc).__name__}: {exc}. With several ranks "
                "on one GPU, NCCL >= 2.30 and NCCL_MULTI_RANK_GPU_ENABLE=1 are needed") from exc
    finally:
        leave_device(rt, prev)
