"""PrefixStore: a namespace inside another store, so that groups share one server."""

from __future__ import annotations

from ..errors import DistError, DistStoreTimeoutError
from .base import Store, check_key

__all__ = ["PrefixStore"]


class PrefixStore(Store):
    """Every key (and queue) of this store is ``prefix + "/" + key`` in ``store``.

    ``num_keys`` counts every key of the underlying store, as torch's does;
    ``list_keys`` lists only this namespace. ``has_extended_api`` is the underlying
    store's. Timeouts default to the underlying store's; setting
    this store's timeout does not change the underlying one. Closing a PrefixStore
    does not close the underlying store unless ``owns_store`` is True.

    Args:
        prefix: the namespace, a str.
        store: the store to wrap (any Store, another PrefixStore included).
        owns_store: close ``store`` when this store is closed.

    Example:
        >>> base = HashStore()
        >>> group = PrefixStore("group1", base)
        >>> group.set("x", b"1"); base.get("group1/x")
        b'1'
    """

    def __init__(self, prefix: str, store: Store, *, owns_store: bool = False) -> None:
        check_key(prefix, "prefix")
        if store is None:
            raise ValueError("PrefixStore needs an underlying store; got None")  # torch's type
        if not isinstance(store, Store):
            raise TypeError(f"store must be a gpucoll Store; got {type(store).__name__}")
        super().__init__(store.timeout)
        self._prefix = prefix + "/"
        self._store = store
        self._owns = owns_store

    def close(self) -> None:
        """Close the underlying store if this one owns it (see ``owns_store``)."""
        if self._owns:
            self._store.close()

    def clone(self) -> PrefixStore:
        """The same namespace on a clone of the underlying store."""
        return PrefixStore(self.prefix, self._store.clone(), owns_store=True)

    def has_extended_api(self) -> bool:
        """The underlying store's answer (torch passes it through)."""
        return self._store.has_extended_api()

    @property
    def prefix(self) -> str:
        """The namespace (without the trailing "/")."""
        return self._prefix[:-1]

    @property
    def underlying_store(self) -> Store:
        """The wrapped store (torch's name)."""
        return self._store

    @property
    def _underlying_non_prefix_store(self) -> Store:
        """The first store under this one that is not a PrefixStore (torch's name)."""
        store = self._store
        while isinstance(store, PrefixStore):
            store = store._store
        return store

    def __repr__(self) -> str:
        return f"PrefixStore({self.prefix!r}, {self._store!r})"

    def _p(self, key: str) -> str:
        return self._prefix + key

    def _ps(self, keys: list[str]) -> list[str]:
        p = self._prefix
        return [p + k for k in keys]

    def _set(self, key: str, value: bytes) -> None:
        self._store._set(self._p(key), value)

    def _timed_out(self, exc: DistStoreTimeoutError, op: str, keys: list[str], timeout: float,
                   queue: bool = False) -> DistStoreTimeoutError:
        """The wrapped store's timeout, told in this store's keys (the ones the caller used)."""
        try:
            missing = keys if queue else [k for k in keys if not self._store._check([self._p(k)])]
        except DistError:
            missing = keys
        what = "the queue is still empty" if queue else f"still missing: {missing}"
        return DistStoreTimeoutError(
            f"Wait timeout after {timeout * 1000:.0f}ms: {op} of {keys} timed out after {timeout:g} s "
            f"on {self!r} (keys under {self.prefix + '/'!r} of the wrapped store); {what}")

    def _get(self, keys: list[str], timeout: float) -> list[bytes]:
        try:
            return self._store._get(self._ps(keys), timeout)
        except DistStoreTimeoutError as exc:
            raise self._timed_out(exc, "get", keys, timeout) from exc

    def _wait(self, keys: list[str], timeout: float) -> None:
        try:
            self._store._wait(self._ps(keys), timeout)
        except DistStoreTimeoutError as exc:
            raise self._timed_out(exc, "wait", keys, timeout) from exc

    def _add(self, key: str, amount: int) -> int:
        return self._store._add(self._p(key), amount)

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self._store._compare_set(self._p(key), expected, desired)

    def _check(self, keys: list[str]) -> bool:
        return self._store._check(self._ps(keys))

    def _delete_key(self, key: str) -> bool:
        return self._store._delete_key(self._p(key))

    def _num_keys(self) -> int:
        return self._store._num_keys()

    def _multi_set(self, keys: list[str], values: list[bytes]) -> None:
        self._store._multi_set(self._ps(keys), values)

    def _append(self, key: str, value: bytes) -> None:
        self._store._append(self._p(key), value)

    def _queue_push(self, key: str, value: bytes) -> None:
        self._store._queue_push(self._p(key), value)

    def _queue_pop(self, key: str, timeout: float | None) -> bytes:
        try:
            return self._store._queue_pop(self._p(key), timeout)
        except DistStoreTimeoutError as exc:
            raise self._timed_out(exc, "queue_pop", [key], self.timeout if timeout is None else timeout,
                                  queue=True) from exc

    def _queue_len(self, key: str) -> int:
        return self._store._queue_len(self._p(key))

    def _list_keys(self) -> list[str]:
        p = self._prefix
        n = len(p)
        return [k[n:] for k in self._store._list_keys() if k.startswith(p)]
