"""Shrinking a group after a rank failure: agreement, abort, rebuild.

:func:`shrink` is the engine behind ``gpucoll.shrink_group``. It runs in rounds,
each in the old group's store namespace under ``shrink/<round>/``:

1. **Who is in.** Every live rank checks in (``in/<rank>``, and a counter). The
   set of members is written *once* to ``members`` with ``compare_set``: by the
   rank whose check-in completes the count (nobody missing), or by the first rank
   whose deadline (its own entry plus the timeout) passes, from the check-ins it
   sees then. Everyone reads that one value, so two survivors never end up in
   different groups; a rank that checks in after it was written and is not in it
   gets a DistError saying it was excluded. With an explicit ``ranks_to_exclude``
   the first round skips this step.
2. **Build.** The members build the new group (its own store namespace, a fresh
   name ``<old>.shrink<round>``, so no stale key is read) and each reports
   ``built/<rank>`` = 1 or 0.
3. **Outcome.** ``outcome`` is written once: ``ok`` when every member reported 1,
   ``retry`` as soon as one reported 0 or when a deadline passes with reports
   missing (a member died during the rebuild). On ``retry`` every member drops
   what it built and the next round starts among the members of this one.

The old group is aborted before round 1 (its pending Work fails, its sockets and
shared memory are released); on NCCL its communicator is kept until the new one
has been carved out of it with ``ncclCommShrink`` where the backend can.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

from .._backends import deaths
from .._backends.base import Backend, KnowsDeadPeers, ShrinksCommunicator
from ..errors import DistError, DistStoreError
from ..store import PrefixStore, Store
from .group import ProcessGroup
from .options import PGOptions
from .registry import _BACKEND_GRACE_S, backend_kwargs

__all__ = ["shrink", "abort_group", "check_exclusions", "MAX_ROUNDS"]

MAX_ROUNDS = 8
"""Rebuild attempts before shrink gives up (each one follows a further failure)."""

_POLL_S = 0.25  # longest single store wait, so that a deadline is seen promptly


def check_exclusions(ranks_to_exclude: object, pg: ProcessGroup) -> list[int] | None:
    """Validate ``ranks_to_exclude`` (group ranks of ``pg``); None means "find them"."""
    if ranks_to_exclude is None:
        return None
    if isinstance(ranks_to_exclude, (str, bytes)) or not hasattr(ranks_to_exclude, "__iter__"):
        raise TypeError(f"ranks_to_exclude must be a list of ints or None; got {type(ranks_to_exclude).__name__}")
    out = list(ranks_to_exclude)
    for r in out:
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < pg.size():
            raise ValueError(f"ranks_to_exclude holds {r!r}, which is not a rank of group {pg.group_name!r} "
                             f"(ranks 0..{pg.size() - 1})")
    if len(set(out)) != len(out):
        raise ValueError(f"ranks_to_exclude holds duplicate ranks: {out}")
    if pg.rank() in out:
        raise ValueError(f"ranks_to_exclude holds this rank ({pg.rank()}) of group {pg.group_name!r}: only the "
                         "ranks that stay call shrink_group")
    if len(out) >= pg.size():
        raise ValueError(f"ranks_to_exclude would exclude every rank of group {pg.group_name!r}")
    return sorted(out)


def abort_group(pg: ProcessGroup, reason: str, *, keep_device: bool = False) -> None:
    """Abort ``pg`` at once (torch's SHRINK_ABORT): every pending and later op fails with
    ``reason``; its CPU transport (sockets, shared memory) is released. With
    ``keep_device`` the device backend is left running for ``ncclCommShrink`` (the
    caller shuts it down after). Never raises; bounded by the backends' own unwinding."""
    with pg._issuer.abort_lock:
        if pg._issuer.abort_reason is None:
            pg._issuer.abort_reason = reason
    backends = [pg._cpu] if keep_device else [pg._nccl, pg._cpu]
    for backend in backends:
        if backend is not None:
            try:
                backend.abort(reason)
            except Exception:  # an abort that fails leaves nothing more to stop
                pass
    if keep_device:
        pg._nccl = None  # handed to the caller: _destroy must not shut it down
        pg._nccl_into = None
    try:
        pg._destroy()
    except Exception:  # a hook error or a failed shutdown: the group is gone either way
        pass


def _decide(store: Store, key: str, value: bytes) -> bytes:
    """Write ``value`` to ``key`` unless something is there; the value that stands."""
    store.compare_set(key, b"", value)
    return store.get(key)


def _await_decision(store: Store, key: str, deadline: float, on_deadline: Callable[[], bytes],
                    early: Callable[[], bytes | None] | None = None) -> bytes:
    """The value of ``key``: wait until ``deadline``, then decide with ``on_deadline()``.
    ``early()`` may return a value to decide before the deadline (or None)."""
    while True:
        if store.check([key]):
            return store.get(key)
        if early is not None:
            value = early()
            if value is not None:
                return _decide(store, key, value)
        left = deadline - time.monotonic()
        if left <= 0:
            return _decide(store, key, on_deadline())
        try:
            store.wait([key], timeout=min(left, _POLL_S))
        except DistStoreError:
            continue


def _encode(ranks: Sequence[int]) -> bytes:
    return ",".join(str(r) for r in ranks).encode() or b"-"


def _decode(value: bytes) -> list[int]:
    text = value.decode()
    return [] if text == "-" else [int(r) for r in text.split(",")]


def _agree_members(store: Store, base: str, me: int, candidates: list[int], timeout: float,
                   label: str, dead: Sequence[int] = ()) -> list[int]:
    """Step 1 of a round: the members, decided once; raises if ``me`` is not among them.
    ``dead``: candidates known to have died (the job records deaths): once every other
    candidate has checked in, the members are decided without waiting out ``timeout``."""
    store.set(f"{base}/in/{me}", b"1")
    key = f"{base}/members"
    if store.add(f"{base}/count", 1) >= len(candidates):
        _decide(store, key, _encode(candidates))

    def present() -> bytes:
        keys = [f"{base}/in/{r}" for r in candidates]
        return _encode([r for r, k in zip(candidates, keys) if store.check([k])])

    def all_but_dead() -> bytes | None:
        living = [r for r in candidates if r not in dead]
        return _encode(living) if store.check([f"{base}/in/{r}" for r in living]) else None

    members = _decode(_await_decision(store, key, time.monotonic() + timeout, present,
                                      all_but_dead if dead else None))
    if me not in members:
        raise DistError(f"shrink_group of group {label}: this rank ({me}) was excluded: it checked in after the "
                        f"other ranks had agreed, {timeout:g} s after the first of them arrived, on the new group "
                        f"of ranks {members} (ranks of the old group). It is not part of the new group; start "
                        "it again and let it join with gpucoll.grow_group / join_process_group")
    return members


def _agree_outcome(store: Store, base: str, me: int, members: list[int], built: bool, timeout: float) -> bool:
    """Step 3 of a round: True when every member built the new group, decided once."""
    store.set(f"{base}/built/{me}", b"1" if built else b"0")
    key = f"{base}/outcome"
    keys = [f"{base}/built/{r}" for r in members]

    def early() -> bytes | None:
        values = [store.get(k) if store.check([k]) else None for k in keys]
        if any(v == b"0" for v in values):
            return b"retry"
        return b"ok" if all(v == b"1" for v in values) else None

    return _await_decision(store, key, time.monotonic() + timeout, lambda: b"retry", early) == b"ok"


MakeGroup = Callable[[str, int, list[int], "Backend | None"], ProcessGroup]
"""``make(name, rank, old_ranks_of_members, device_backend)`` -> the new group."""


def shrink(pg: ProcessGroup, exclude: list[int] | None, timeout: float, make: MakeGroup, root: Store,
           pg_options: PGOptions | None = None) -> ProcessGroup:
    """Abort ``pg`` and return the group of its remaining ranks (see the module doc).

    Args:
        pg: the group to shrink (this rank must be a member; it is aborted here).
        exclude: ranks of ``pg`` known to be gone; None to find them by agreement.
        timeout: seconds each agreement step waits for the ranks still missing.
        make: builds the new group from its name, this rank's new rank, the members
            (as ranks of ``pg``, in order) and a device backend already made (or None).
        root: the store under which groups keep their namespaces (``pg/<name>``).
        pg_options: the new group's options; NCCL ones reach ncclCommShrink's config.

    Raises:
        DistError: this rank was excluded, or no group could be built in ``MAX_ROUNDS`` rounds.
    """
    label = pg._label()
    me = pg.rank()
    store: Store = pg.store
    nccl = pg._nccl
    shrinkable = isinstance(nccl, ShrinksCommunicator) and nccl.can_shrink
    candidates = list(range(pg.size()))
    # Where the job's launcher records deaths, a peer whose connection died is gone for
    # good: no need to wait the agreement's timeout for it (read before the abort closes it).
    cpu = pg._cpu
    dead = [r for r in candidates if r != me and isinstance(cpu, KnowsDeadPeers) and cpu.peer_gone(r)] \
        if deaths.enabled() else []
    abort_group(pg, f"group {label} was aborted by shrink_group on rank {me}", keep_device=shrinkable)
    members = None if exclude is None else [r for r in candidates if r not in exclude]
    errors: list[str] = []
    try:
        for round_ in range(1, MAX_ROUNDS + 1):
            base = f"shrink/{round_}"
            if members is None:
                # After a failed build, members may still be inside theirs (bounded by the
                # group's timeout): wait for them that much longer before leaving them out.
                wait = timeout if round_ == 1 else timeout + pg.timeout + 2 * _BACKEND_GRACE_S
                members = _agree_members(store, base, me, candidates, wait, label,
                                         dead if round_ == 1 else ())
            name = f"{pg.group_name}.shrink{round_}"
            new: ProcessGroup | None = None
            device: Backend | None = None
            try:
                if shrinkable and round_ == 1 and _all_can_shrink(store, base, me, members, timeout, label):
                    assert isinstance(nccl, ShrinksCommunicator)
                    gone = [r for r in candidates if r not in members]
                    device = nccl.shrink(gone, store=PrefixStore("nccl", PrefixStore(f"pg/{name}", root)),
                                         group_name=name, timeout=timeout + _BACKEND_GRACE_S,
                                         **backend_kwargs(pg_options, "nccl"))
                elif round_ == 1:
                    store.set(f"{base}/can_shrink/{me}", b"0")
                new = make(name, members.index(me), members, device)
            except DistError as exc:
                errors.append(f"round {round_}: {exc}")
                if device is not None and new is None:
                    device.shutdown()
            if _agree_outcome(store, base, me, members, new is not None, timeout):
                assert new is not None
                return new
            if new is not None:
                abort_group(new, f"group {new.group_name!r} was dropped: a member failed while it was built")
            candidates, members = members, None
    finally:
        if shrinkable and nccl is not None:
            try:
                nccl.abort(f"group {label} was shrunk")
                nccl.shutdown()
            except Exception:  # the old communicator is gone either way
                pass
    raise DistError(f"shrink_group of group {label} gave up after {MAX_ROUNDS} rounds, each ended by a failure "
                    f"while the new group was built: {'; '.join(errors[-3:]) or 'members went missing'}")


def _all_can_shrink(store: Store, base: str, me: int, members: list[int], timeout: float, label: str) -> bool:
    """Whether every member can carve the new communicator out of the old one
    (``ncclCommShrink`` is a collective of the remaining ranks: all or none use it).
    A member that does not say so in time fails this round's build."""
    store.set(f"{base}/can_shrink/{me}", b"1")
    keys = [f"{base}/can_shrink/{r}" for r in members]
    try:
        store.wait(keys, timeout=timeout)
    except DistStoreError as exc:
        raise DistError(f"shrink_group of group {label}: members did not report in time before the "
                        f"communicator shrink: {exc}") from exc
    return all(store.get(k) == b"1" for k in keys)
