"""torch's RPC test harness for :mod:`gpucoll.rpc`, under torch's names and meanings.

A test written against ``torch.testing._internal.dist_utils`` and torch's RPC agent
fixtures runs on gpucoll by changing the imports::

    from gpucoll.testing.dist_utils import TensorPipeRpcAgentTestFixture, dist_init, worker_name
    import gpucoll.rpc as rpc

    class MyTest(TensorPipeRpcAgentTestFixture):
        @dist_init
        def test_add(self):
            dst = worker_name((self.rank + 1) % self.world_size)
            assert rpc.rpc_sync(dst, operator.add, args=(1, 2)) == 3

The decorated method needs ``self.rank`` and, for the fixture's ``init_method``,
``self.file_name`` (a fresh file per test) or ``RPC_INIT_WITH_TCP=1`` with
``MASTER_ADDR``/``MASTER_PORT``; :func:`gpucoll.testing.run_spmd` (``init=False``)
gives every rank its ``RANK``. Unlike torch's, every wait here ends: the helpers that
loop take a ``timeout`` in seconds. Importing this module imports neither torch nor
:mod:`gpucoll.rpc`; the functions import the latter when called.
"""

from __future__ import annotations

import importlib
import os
import re
import time
from functools import partial, wraps
from typing import Any, Callable, Mapping, Sequence, TypeVar

__all__ = [
    "INIT_METHOD_TEMPLATE",
    "FaultyRpcAgentTestFixture",
    "RpcAgentTestFixture",
    "TensorPipeRpcAgentTestFixture",
    "default_messages_to_delay",
    "dist_init",
    "get_num_owners_and_forks",
    "get_shutdown_error_regex",
    "get_timeout_error_regex",
    "initialize_pg",
    "noop",
    "retryable_message_types",
    "wait_until_node_failure",
    "wait_until_owners_and_forks_on_rank",
    "wait_until_pending_futures_and_users_flushed",
    "worker_name",
]

INIT_METHOD_TEMPLATE = "file://{file_name}"
"""The rendezvous URL of a test's own file, as torch's ``INIT_METHOD_TEMPLATE``."""

retryable_message_types: list[str] = [
    "RREF_FORK_REQUEST",
    "RREF_CHILD_ACCEPT",
    "RREF_USER_DELETE",
    "CLEANUP_AUTOGRAD_CONTEXT_REQ",
]
"""The control messages the RRef protocol retries, which the faulty agent fails by default."""

default_messages_to_delay: dict[str, float] = {"PYTHON_CALL": 1.5, "SCRIPT_CALL": 1.5}
"""Seconds the faulty agent delays each of these message types by default."""

_F = TypeVar("_F", bound=Callable[..., Any])


def _rpc() -> Any:
    import gpucoll.rpc

    return gpucoll.rpc


def dist_init(
    old_test_method: _F | None = None,
    setup_rpc: bool = True,
    clean_shutdown: bool = True,
    faulty_messages: Sequence[str] | None = None,
    messages_to_delay: Mapping[str, float] | None = None,
) -> Any:
    """Decorate a test method to start RPC before it and shut RPC down after it.

    Used bare (``@dist_init``) or with arguments (``@dist_init(setup_rpc=False)``), as
    torch's. The wrapper sets ``self.worker_id = self.rank``, calls
    ``self.setup_fault_injection(faulty_messages, messages_to_delay)``, then (with
    ``setup_rpc``) ``init_rpc(name=f"worker{rank}", backend=self.rpc_backend, rank=...,
    world_size=self.world_size, rpc_backend_options=self.rpc_backend_options)``, runs
    the method and ends with ``shutdown(graceful=clean_shutdown)``. An RRef leaked by the
    method is reported by that shutdown (the leak check is on during the test).

    Args:
        old_test_method: the method, when used without arguments.
        setup_rpc: start and stop RPC around the method.
        clean_shutdown: a graceful shutdown (all workers agree) at the end.
        faulty_messages: message-type names the faulty agent fails (its default when None).
        messages_to_delay: message-type name -> seconds the faulty agent delays it.

    Returns:
        The wrapped method, or a decorator when called with arguments only.
    """
    if old_test_method is None:
        return partial(dist_init, setup_rpc=setup_rpc, clean_shutdown=clean_shutdown,
                       faulty_messages=faulty_messages, messages_to_delay=messages_to_delay)
    method = old_test_method

    @wraps(method)
    def new_test_method(self: Any, *args: Any, **kwargs: Any) -> Any:
        rpc = _rpc()
        api = getattr(rpc, "api", None)
        if api is not None:  # report leaked RRefs at shutdown, as torch's harness does
            api._ignore_rref_leak = False
        self.worker_id = self.rank
        self.setup_fault_injection(faulty_messages, messages_to_delay)
        if setup_rpc:
            rpc.init_rpc(name=f"worker{self.rank:d}", backend=self.rpc_backend, rank=self.rank,
                         world_size=self.world_size, rpc_backend_options=self.rpc_backend_options)
        result = method(self, *args, **kwargs)
        if setup_rpc:
            rpc.shutdown(graceful=clean_shutdown)
        return result

    return new_test_method


def noop() -> None:
    """Do nothing: the function :func:`wait_until_node_failure` calls on its peer."""


def wait_until_node_failure(rank: int, expected_error_regex: str = ".*", timeout: float = 60.0) -> str:
    """Call :func:`noop` on ``worker{rank}`` until a call fails with a matching message.

    Args:
        rank: the rank expected to fail.
        expected_error_regex: the error message must match this (``re.search``).
        timeout: seconds before giving up (torch's loops forever).

    Returns:
        The matching error message.

    Raises:
        TimeoutError: no matching failure within ``timeout``; names the last error seen.
    """
    rpc = _rpc()
    deadline = time.monotonic() + timeout
    last = "none (every call succeeded)"
    while True:
        try:
            rpc.rpc_sync(f"worker{rank}", noop, args=())
            time.sleep(0.1)
        except Exception as exc:  # any failure counts, as in torch; the regex selects it
            if re.search(pattern=expected_error_regex, string=str(exc)):
                return str(exc)
            last = f"{type(exc).__name__}: {exc}"
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker{rank} did not fail with an error matching {expected_error_regex!r} "
                               f"within {timeout} s; last error: {last}")


def wait_until_pending_futures_and_users_flushed(timeout: float = 20) -> None:
    """Wait until this worker has no pending RRef futures and no unconfirmed users.

    The owner's confirmation of a fork may still be in flight after ``to_here()``
    returns; call this before asserting on the RRef debug counters.

    Args:
        timeout: seconds to wait.

    Raises:
        ValueError: the counters did not reach zero within ``timeout`` (torch's type);
            the message gives both counts.
    """
    rpc = _rpc()
    start = time.monotonic()
    while True:
        info = rpc._rref_context_get_debug_info()
        futures, users = int(info["num_pending_futures"]), int(info["num_pending_users"])
        if futures == 0 and users == 0:
            return
        time.sleep(0.1)
        if time.monotonic() - start > timeout:
            raise ValueError(f"Timed out waiting to flush pending futures and users, "
                             f"had {futures} pending futures and {users} pending users")


def get_num_owners_and_forks() -> tuple[str, str]:
    """This worker's ``(num_owner_rrefs, num_forks)``, as strings (torch's debug info)."""
    info = _rpc()._rref_context_get_debug_info()
    return info["num_owner_rrefs"], info["num_forks"]


def wait_until_owners_and_forks_on_rank(num_owners: int, num_forks: int, rank: int, timeout: float = 20) -> None:
    """Wait until ``worker{rank}`` holds exactly ``num_owners`` OwnerRRefs and ``num_forks`` forks.

    Args:
        num_owners: the expected count of OwnerRRefs on that rank.
        num_forks: the expected count of forks on that rank.
        rank: the rank to ask (by RPC, a 5 s timeout per call).
        timeout: seconds to wait.

    Raises:
        ValueError: the counts did not match within ``timeout`` (torch's type); the
            message gives the counts last seen.
    """
    rpc = _rpc()
    start = time.monotonic()
    while True:
        owners_s, forks_s = rpc.rpc_sync(worker_name(rank), get_num_owners_and_forks, args=(), timeout=5)
        owners, forks = int(owners_s), int(forks_s)
        if owners == num_owners and forks == num_forks:
            return
        time.sleep(1)
        if time.monotonic() - start > timeout:
            raise ValueError(f"Timed out waiting {timeout} sec for {num_owners} owners and {num_forks} forks on rank,"
                             f" had {owners} owners and {forks} forks")


def initialize_pg(init_method: str, rank: int, world_size: int) -> None:
    """Start the default process group (CPU backend) unless one exists: for tests that
    use collectives such as ``barrier`` beside RPC.

    Args:
        init_method: the rendezvous URL (``file://``, ``tcp://`` or ``env://``).
        rank: this process's rank.
        world_size: the number of processes.
    """
    import gpucoll

    if not gpucoll.is_initialized():
        gpucoll.init_process_group(backend="gloo", init_method=init_method, rank=rank, world_size=world_size)


def worker_name(rank: int) -> str:
    """The worker name :func:`dist_init` gives ``rank``: ``f"worker{rank}"``."""
    return f"worker{rank}"


def get_shutdown_error_regex(faulty: bool = False) -> str:
    """The errors a call may see while its peer shuts down (the fixtures' method).

    Args:
        faulty: the faulty agent's list rather than the TensorPipe agent's (any message).
    """
    errors = (["Exception in thread pool task", "Connection reset by peer", "Connection closed by peer"]
              if faulty else [".*"])
    return "|".join(f"({e})" for e in errors)


def get_timeout_error_regex() -> str:
    """The part of a timed-out call's message that names the timeout, as torch's."""
    return "RPC ran for more than"


class RpcAgentTestFixture:
    """What :func:`dist_init` needs from a test case: ``world_size`` (4, as torch's),
    ``init_method``, ``rpc_backend``, ``rpc_backend_options`` and the fault hook.

    The test case gives ``self.rank`` and ``self.file_name`` (torch's
    MultiProcessTestCase does; so can a harness such as :func:`gpucoll.testing.run_spmd`).
    """

    rank: int
    file_name: str

    @property
    def world_size(self) -> int:
        return 4

    @property
    def init_method(self) -> str:
        """``tcp://MASTER_ADDR:MASTER_PORT`` with ``RPC_INIT_WITH_TCP=1``, else the test's file."""
        if os.environ.get("RPC_INIT_WITH_TCP") == "1":
            return f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        return self.file_init_method

    @property
    def file_init_method(self) -> str:
        return INIT_METHOD_TEMPLATE.format(file_name=self.file_name)

    @property
    def rpc_backend(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} names no rpc_backend")

    @property
    def rpc_backend_options(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} names no rpc_backend_options")

    def setup_fault_injection(self, faulty_messages: Sequence[str] | None,
                              messages_to_delay: Mapping[str, float] | None) -> None:
        """Prepare the faulty agent (called by :func:`dist_init`); nothing for other agents."""

    def get_shutdown_error_regex(self) -> str:
        return get_shutdown_error_regex()

    def get_timeout_error_regex(self) -> str:
        return get_timeout_error_regex()


class TensorPipeRpcAgentTestFixture(RpcAgentTestFixture):
    """The default agent (torch's ``TENSORPIPE`` name; gpucoll's transport)."""

    @property
    def rpc_backend(self) -> Any:
        return _rpc().backend_registry.BackendType["TENSORPIPE"]

    @property
    def rpc_backend_options(self) -> Any:
        return _rpc().TensorPipeRpcBackendOptions(init_method=self.init_method)


class FaultyRpcAgentTestFixture(RpcAgentTestFixture):
    """The faulty agent (``FAULTY_TENSORPIPE``): fails the first ``num_fail_sends`` sends
    of ``messages_to_fail`` and delays ``messages_to_delay``, with torch's defaults."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.messages_to_fail: list[str] = list(retryable_message_types)
        self.messages_to_delay: dict[str, float] = dict(default_messages_to_delay)

    @property
    def rpc_backend(self) -> Any:
        importlib.import_module("gpucoll.rpc._testing")  # registers FAULTY_TENSORPIPE
        return _rpc().backend_registry.BackendType["FAULTY_TENSORPIPE"]

    @property
    def rpc_backend_options(self) -> Any:
        options = importlib.import_module("gpucoll.rpc._testing").FaultyTensorPipeRpcBackendOptions
        return options(
            num_worker_threads=8, init_method=self.init_method, num_fail_sends=3,
            messages_to_fail=self.messages_to_fail, messages_to_delay=self.messages_to_delay)

    def setup_fault_injection(self, faulty_messages: Sequence[str] | None,
                              messages_to_delay: Mapping[str, float] | None) -> None:
        if faulty_messages is not None:
            self.messages_to_fail = list(faulty_messages)
        if messages_to_delay is not None:
            self.messages_to_delay = dict(messages_to_delay)

    def get_shutdown_error_regex(self) -> str:
        return get_shutdown_error_regex(faulty=True)

