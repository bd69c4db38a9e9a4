"""Which RPC library a ported body runs on: the adapter between torch's tests and the
two implementations.

A rank binds one implementation (``torch`` or ``gpucoll``), named by the
``RPC_CONFORMANCE_IMPL`` environment variable, before the ported modules are imported.
The ported code then reads as torch's: ``rpc`` is ``torch.distributed.rpc`` or
``gpucoll.rpc``, ``futures`` is ``torch.futures`` or ``gpucoll.futures``, ``dist`` is
``torch.distributed`` or ``gpucoll``, ``dist_utils`` torch's
``torch.testing._internal.dist_utils`` or ``gpucoll.testing.dist_utils``. Decorators
that run at import (``rpc.functions.async_execution``) get the bound module's own. With
nothing bound (the pytest process, which only lists the checks) they are stand-ins
that do nothing.
"""

from __future__ import annotations

import importlib
import os
import types
from functools import partial, wraps
from typing import Any, Callable

ENV = "RPC_CONFORMANCE_IMPL"
IMPLS = ("gpucoll", "torch")

_MODULES = {
    "torch": {"rpc": "torch.distributed.rpc", "futures": "torch.futures", "dist": "torch.distributed",
              "dist_utils": "torch.testing._internal.dist_utils"},
    "gpucoll": {"rpc": "gpucoll.rpc", "futures": "gpucoll.futures", "dist": "gpucoll",
                "dist_utils": "gpucoll.testing.dist_utils"},
}

IMPL: str | None = os.environ.get(ENV) or None
assert IMPL in (None, *IMPLS), f"{ENV}={IMPL!r}; expected one of {IMPLS}"


def _listing_rpc() -> types.SimpleNamespace:
    """What the listing process sees as ``rpc``: decorators that return their function."""
    return types.SimpleNamespace(functions=types.SimpleNamespace(async_execution=lambda f: f),
                                 RpcBackendOptions=object)


def module(role: str) -> Any:
    if IMPL is None:
        if role == "rpc":
            return _listing_rpc()
        raise RuntimeError(f"no RPC implementation bound ({ENV} is unset); {role} is not available")
    mod = importlib.import_module(_MODULES[IMPL][role])
    if role == "rpc" and IMPL == "gpucoll":
        importlib.import_module("gpucoll.rpc")
    return mod


class _Module:
    """A module of the bound implementation, looked up on each attribute access."""

    def __init__(self, role: str) -> None:
        self._role = role

    def __getattr__(self, name: str) -> Any:
        return getattr(module(self._role), name)

    def __repr__(self) -> str:
        return f"<{self._role} of {IMPL}>"


rpc: Any = _Module("rpc")
futures: Any = _Module("futures")
dist: Any = _Module("dist")
dist_utils: Any = _Module("dist_utils")


def dist_init(old_test_method: Callable[..., Any] | None = None, **kwargs: Any) -> Any:
    """torch's ``@dist_init`` / ``@dist_init(setup_rpc=False, ...)``: the bound
    implementation's own decorator, applied when the test runs."""
    if old_test_method is None:
        return partial(dist_init, **kwargs)
    method = old_test_method

    @wraps(method)
    def run(self: Any, *args: Any, **kw: Any) -> Any:
        return self.dist_utils.dist_init(method, **kwargs)(self, *args, **kw)

    run.dist_init_kwargs = kwargs  # type: ignore[attr-defined]
    return run


def initialize_pg(init_method: str, rank: int, world_size: int) -> None:
    dist_utils.initialize_pg(init_method, rank, world_size)


def wait_until_node_failure(rank: int, expected_error_regex: str = ".*") -> str:
    return str(dist_utils.wait_until_node_failure(rank, expected_error_regex))


def wait_until_pending_futures_and_users_flushed(timeout: int = 20) -> None:
    dist_utils.wait_until_pending_futures_and_users_flushed(timeout)


def wait_until_owners_and_forks_on_rank(num_owners: int, num_forks: int, rank: int, timeout: int = 20) -> None:
    dist_utils.wait_until_owners_and_forks_on_rank(num_owners, num_forks, rank, timeout)


def get_num_owners_and_forks() -> tuple[str, str]:
    return dist_utils.get_num_owners_and_forks()  # type: ignore[no-any-return]


def worker_name(rank: int) -> str:
    return f"worker{rank}"
