"""torch.distributed.rpc.api's names: the calls, ``shutdown``, and the helpers torch's own RPC
tests reach for (``_all_gather``, ``_barrier``, ``_wait_all_workers``, ``_wait_all``,
``_delete_all_user_and_unforked_owner_rrefs``, ``_broadcast_to_followers``).

``_all_gather`` works as torch's: the worker with the smallest name leads; followers send
their object to it, and it sends the gathered map back to each. Unlike torch's, a leader
waiting for a follower that is gone (its connection broke) raises at once, naming it.
Graceful ``shutdown`` calls ``_wait_all_workers`` and then
``_delete_all_user_and_unforked_owner_rrefs`` through this module's globals, so tests that
replace them (as torch's do) change what shutdown does.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Iterable, Iterator

from ..futures import wait_all
from . import constants
from ._api import (_get_current_rpc_agent, _thread_local_var, current, finalize, get_rpc_timeout, get_worker_info,
                   remote, rpc_async, rpc_sync)
from ._info import PeerLostError
from ._join import join
from ._members import leave_dynamic

__all__ = ["rpc_sync", "rpc_async", "remote", "get_worker_info", "shutdown"]

_ = (_get_current_rpc_agent,)  # re-exported under torch's name
_ignore_rref_leak = True
"""torch's switch: with False, shutdown raises "Leaking RRef ..." when forks are left."""


class _GatherState:
    def __init__(self) -> None:
        self.gathered: dict[str, Any] = {}
        self.proceed = threading.Event()


def _states() -> tuple[threading.RLock, dict[str, int], dict[str, _GatherState]]:
    agent = current()
    if not hasattr(agent, "gather"):
        agent.gather = (threading.RLock(), {}, {})  # type: ignore[attr-defined]
    return agent.gather  # type: ignore[attr-defined,no-any-return]


def _all_names() -> set[str]:
    return {w.name for w in current().worker_infos()}


def _gather_to_leader(sequence_id: str, worker_name: str, obj: Any, worker_names: set[str] | None = None) -> None:
    lock, _, states = _states()
    with lock:
        names = worker_names or _all_names()
        if worker_name not in names:
            raise AssertionError(f"{worker_name} is not expected by leader.")
        state = states.setdefault(sequence_id, _GatherState())
        if worker_name in state.gathered:
            raise AssertionError(f"{worker_name} reported intent sequence id {sequence_id} twice. ")
        state.gathered[worker_name] = obj
        if set(names) == set(state.gathered):
            state.proceed.set()


def _broadcast_to_followers(sequence_id: str, objects_map: dict[str, Any]) -> None:
    lock, _, states = _states()
    with lock:
        state = states.setdefault(sequence_id, _GatherState())
    if state.proceed.is_set():
        raise AssertionError(f"Termination signal sequence id {sequence_id} got set twice.")
    state.gathered = objects_map
    state.proceed.set()


@contextlib.contextmanager
def _wait_all() -> Iterator[None]:
    """Collect the futures of ``rpc_async`` calls made inside the block; wait for them all on exit."""
    _thread_local_var.future_list = []
    try:
        yield
    finally:
        try:
            wait_all(_thread_local_var.future_list)
        finally:
            del _thread_local_var.future_list


def _wait_signal(state: _GatherState, names: Iterable[str], timeout: float | None) -> None:
    """Wait for the gather to complete; a worker among ``names`` that is gone fails it at once."""
    agent = current()
    deadline = None if timeout is None else time.monotonic() + timeout
    wanted = set(names)
    while not state.proceed.wait(0.05):
        gone = [agent.lost[w.id] for w in agent.worker_infos() if w.name in wanted and w.id in agent.lost]
        if gone:
            raise PeerLostError(f"_all_gather on {agent.info.name} cannot complete: " + "; ".join(gone))
        if deadline is not None and time.monotonic() > deadline:
            return


def _all_gather(obj: Any, worker_names: Iterable[str] | None = None,
                timeout: float = constants.UNSET_RPC_TIMEOUT) -> dict[str, Any]:
    """Gather ``obj`` from every worker (or those named), keyed by worker name, on every one of them.

    Raises:
        RuntimeError: a follower did not answer the leader ("Followers [...] timed out in
            _all_gather after N seconds"), or a call to the leader failed (its timeout, a lost worker).
    """
    names = set(worker_names) if worker_names else _all_names()
    leader = min(names)
    me = current().info.name
    lock, sequences, states = _states()
    with lock:
        key = "".join(sorted(names))
        n = sequences.get(key, 0)
        sequences[key] = n + 1
        sequence_id = key + str(n)
    if timeout == constants.UNSET_RPC_TIMEOUT:
        rpc_timeout, signal_timeout = get_rpc_timeout(), None
    elif timeout == constants.DEFAULT_SHUTDOWN_TIMEOUT:
        rpc_timeout, signal_timeout = timeout, None
    else:
        rpc_timeout = signal_timeout = timeout
    if leader == me:
        _gather_to_leader(sequence_id, me, obj, names)
    else:
        rpc_sync(leader, _gather_to_leader, args=(sequence_id, me, obj, names), timeout=rpc_timeout)
    with lock:
        state = states.setdefault(sequence_id, _GatherState())
    _wait_signal(state, names, signal_timeout)
    if leader == me:
        futs = {f: rpc_async(f, _broadcast_to_followers, args=(sequence_id, state.gathered), timeout=rpc_timeout)
                for f in sorted(names - {leader})}
        errors = []
        for follower, fut in futs.items():
            try:
                fut.wait()
            except RuntimeError as ex:
                errors.append((follower, ex))
        if errors:
            raise RuntimeError(f"Followers {[e[0] for e in errors]} timed out in _all_gather after {rpc_timeout:.2f} "
                               f"seconds. The first exception is {errors[0][1]}")
    with lock:
        states.pop(sequence_id, None)
    return state.gathered


def _barrier(worker_names: Iterable[str]) -> None:
    """Block until every named worker has reached this barrier (failures are logged, as torch's)."""
    try:
        _all_gather(None, set(worker_names))
    except RuntimeError:
        import logging

        logging.getLogger("gpucoll.rpc").exception("Failed to complete barrier")


def _wait_all_workers(timeout: float = constants.DEFAULT_SHUTDOWN_TIMEOUT) -> None:
    """Block until every worker has reached this call (the first step of a graceful shutdown)."""
    _all_gather(None, timeout=timeout)


def _delete_all_user_and_unforked_owner_rrefs(timeout: float = 300.0) -> None:
    """Delete this worker's user RRefs (their owners learn of it) once pending forks are confirmed,
    and wait until this worker's owned RRefs have lost their forks."""
    current().rrefs.delete_all_users(timeout)  # type: ignore[attr-defined]


def shutdown(graceful: bool = True, timeout: float = constants.DEFAULT_SHUTDOWN_TIMEOUT) -> None:
    """Shut RPC down on this worker.

    With ``graceful=True`` (torch's steps): wait until every worker has called ``shutdown``
    (``_wait_all_workers``), delete this worker's user RRefs so that their owners learn of it,
    wait until the outstanding work of every worker has drained, then stop. A worker that is
    gone makes it raise, naming that worker, after stopping locally. ``graceful=False``
    stops at once: pending calls fail. RRefs still forked when it stops are reported as
    torch reports them (a warning listing "Leaking RRef ... with fork Id ...").

    Args:
        graceful: agree with the other workers first (see above).
        timeout: seconds to wait for the others (0: no limit, as torch).

    Raises:
        RuntimeError: RPC is not initialized, or (graceful) a worker is gone or the
            agreement did not complete within ``timeout``.
    """
    agent = current()
    try:
        if graceful:
            deadline = None if timeout <= 0 else time.monotonic() + timeout
            if agent.is_static_group:
                _wait_all_workers(timeout)
                _delete_all_user_and_unforked_owner_rrefs()
                join(agent, deadline, timeout)
            else:
                leave_dynamic(agent, deadline)
                agent.drain(deadline)
    finally:
        finalize(agent, _ignore_rref_leak)
