"""Control-plane collectives over a store: torch's ``_StoreCollectives``.

Small, infrequent exchanges (addresses, a vote, "is everyone here?") between ranks
that may not share a process group yet, or whose process group is stuck. Each call
is a handful of store requests under one key: rank ``r`` writes ``<key>/<r>``,
readers block on the store (woken by the write, never polling). Keys are single
use per object, as in torch: a second call with the same key raises.

Every call is bounded by its ``timeout``; when it runs out the error names the
ranks whose part never arrived, which is the point of the exercise when a job hangs.
"""

from __future__ import annotations

from typing import Sequence

from .._timeouts import to_seconds
from ..errors import DistStoreTimeoutError
from .base import Store
from .base import Timeout, ValueLike, check_value

__all__ = ["StoreCollectives"]



class StoreCollectives:
    """Barrier, broadcast, gather, scatter, all-gather and sum over a :class:`~gpucoll.Store`.

    The semantics are torch's ``torch.distributed._StoreCollectives``: same methods,
    same arguments, same key layout (``<key>/<rank>``), same results, and messages
    that lead with torch's words ("barrier failed -- missing ranks: 0, 2", "Wait
    timeout", "Key foo has already been used") and go on with the caller's key, rank
    and timeout. A timeout raises :class:`~gpucoll.DistStoreTimeoutError` (a
    RuntimeError); a reused key raises ValueError.

    Args:
        store: any gpucoll store (HashStore, FileStore, TCPStore, PrefixStore); every
            rank must use the same one (or one namespace of it).
        rank: this process's rank, >= 0. As in torch it is not checked against
            ``world_size`` here; the calls whose result is indexed by rank (gather,
            scatter, all_gather) raise ValueError when it is out of range.
        world_size: number of ranks taking part.

    Example:
        >>> sc = gpucoll.StoreCollectives(store, rank, world_size)
        >>> addrs = sc.all_gather("addrs", f"{host}:{port}", timeout=30)   # list of bytes, rank order
        >>> total = sc.all_sum("ready", 1, timeout=30)                       # == world_size
    """

    def __init__(self, store: Store, rank: int, world_size: int) -> None:
        if not isinstance(store, Store):
            raise TypeError(f"store must be a gpucoll Store; got {type(store).__name__}")
        for name, value in (("rank", rank), ("world_size", world_size)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int; got {type(value).__name__} {value!r}")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1; got {world_size}")
        if rank < 0:
            raise ValueError(f"rank must be >= 0; got {rank}")
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self._seen: set[str] = set()

    def __repr__(self) -> str:
        return f"<StoreCollectives rank={self.rank}/{self.world_size} store={type(self.store).__name__}>"

    # ----- helpers -----
    def _begin(self, key: str, timeout: Timeout) -> float:
        if not isinstance(key, str) or not key:
            raise TypeError(f"key must be a non-empty str; got {key!r}")
        seconds = to_seconds(timeout, name="timeout")
        if key in self._seen:
            # torch's words first
            raise ValueError(f"Key {key} has already been used by this StoreCollectives; "
                             "every call needs a fresh key")
        self._seen.add(key)
        return seconds

    def _in_range(self, op: str) -> None:
        if self.rank >= self.world_size:
            raise ValueError(f"{op} needs rank < world_size; this StoreCollectives has rank {self.rank} "
                             f"and world_size {self.world_size}")

    def _missing(self, key: str, ranks: Sequence[int]) -> list[int]:
        return [r for r in ranks if not self.store.check([f"{key}/{r}"])]

    def _timed_out(self, failed: str, what: str, key: str, seconds: float, cause: BaseException,
                   store_key: str | None = None) -> DistStoreTimeoutError:
        """torch's "<failed> failed -- missing ranks: 0, 2, Wait timeout", then the user's
        ``key`` (``store_key`` is where the ranks' parts are, when it is an internal one)."""
        ranks = [r for r in range(self.world_size) if r != self.rank]
        missing = self._missing(key if store_key is None else store_key, ranks)
        shown = ", ".join(map(str, missing))
        err = DistStoreTimeoutError(f"{failed} failed -- missing ranks: {shown}, Wait timeout: {what} {key!r} "
                                    f"(rank {self.rank} of {self.world_size}) timed out after {seconds:g} s")
        err.__cause__ = cause
        return err

    # ----- collectives -----
    def barrier(self, key: str, timeout: Timeout = 300.0, block: bool = True) -> None:
        """Wait until every rank has entered the barrier ``key``.

        With ``block=False`` this rank only marks its arrival and returns at once
        (the others still wait for it).

        Raises:
            DistStoreTimeoutError: not every rank arrived within ``timeout`` (names them).
            ValueError: ``key`` was used before.
        """
        seconds = self._begin(key, timeout)
        self._barrier(key, seconds, block, "barrier", key)

    def _barrier(self, key: str, seconds: float, block: bool, what: str, user_key: str) -> None:
        store = self.store
        arrived = store.add(f"{key}/num_members", 1)
        store.set(f"{key}/{self.rank}", b"joined")
        if arrived == self.world_size:
            store.set(f"{key}/last_members", b"<val_ignored>")
        elif block:
            try:
                store.wait([f"{key}/last_members"], seconds)
            except DistStoreTimeoutError as exc:
                raise self._timed_out("barrier", what, user_key, seconds, exc, store_key=key) from exc

    def broadcast_send(self, key: str, data: ValueLike, timeout: Timeout = 300.0) -> None:
        """Publish ``data`` under ``key`` for every other rank's :meth:`broadcast_recv` (one sender)."""
        self._begin(key, timeout)
        self.store.set(key, check_value(data, "data"))

    def broadcast_recv(self, key: str, timeout: Timeout = 300.0) -> bytes:
        """What the sender published under ``key``.

        Raises:
            DistStoreTimeoutError: nothing was published within ``timeout``.
        """
        seconds = self._begin(key, timeout)
        try:
            return self.store.get(key, timeout=seconds)
        except DistStoreTimeoutError as exc:
            err = DistStoreTimeoutError(f"Wait timeout: broadcast {key!r} (rank {self.rank} of {self.world_size}) "
                                        f"timed out after {seconds:g} s: the sender never published it")
            raise err from exc

    def gather_send(self, key: str, data: ValueLike, timeout: Timeout = 300.0) -> None:
        """Send ``data`` to the rank calling :meth:`gather_recv` with ``key``."""
        self._begin(key, timeout)
        self.store.set(f"{key}/{self.rank}", check_value(data, "data"))

    def gather_recv(self, key: str, data: ValueLike, timeout: Timeout = 300.0) -> list[bytes]:
        """Every rank's data in rank order (this rank's own ``data`` in its place).

        Raises:
            DistStoreTimeoutError: some ranks did not send within ``timeout`` (names them).
        """
        seconds = self._begin(key, timeout)
        self._in_range("gather_recv")
        mine = check_value(data, "data")
        others = [r for r in range(self.world_size) if r != self.rank]
        try:
            got = self.store.multi_get([f"{key}/{r}" for r in others], timeout=seconds) if others else []
        except DistStoreTimeoutError as exc:
            raise self._timed_out("gather", "gather", key, seconds, exc) from exc
        got.insert(self.rank, mine)
        return got

    def scatter_send(self, key: str, data: Sequence[ValueLike], timeout: Timeout = 300.0) -> bytes:
        """Send ``data[r]`` to each rank r's :meth:`scatter_recv`; return ``data[self.rank]``."""
        self._begin(key, timeout)
        self._in_range("scatter_send")
        if isinstance(data, (str, bytes)) or len(data) != self.world_size:
            raise ValueError(f"data must be a sequence of {self.world_size} values (one per rank); "
                             f"got {type(data).__name__} of length {len(data)}")
        values = [check_value(v, f"data[{i}]") for i, v in enumerate(data)]
        others = [r for r in range(self.world_size) if r != self.rank]
        if others:
            self.store.multi_set([f"{key}/{r}" for r in others], [values[r] for r in others])
        return values[self.rank]

    def scatter_recv(self, key: str, timeout: Timeout = 300.0) -> bytes:
        """This rank's part of the sender's :meth:`scatter_send`.

        Raises:
            DistStoreTimeoutError: nothing arrived within ``timeout``.
        """
        seconds = self._begin(key, timeout)
        try:
            return self.store.get(f"{key}/{self.rank}", timeout=seconds)
        except DistStoreTimeoutError as exc:
            err = DistStoreTimeoutError(f"Wait timeout: scatter {key!r} (rank {self.rank} of {self.world_size}) "
                                        f"timed out after {seconds:g} s: the sender never sent this rank's part")
            raise err from exc

    def all_gather(self, key: str, data: ValueLike, timeout: Timeout = 300.0) -> list[bytes]:
        """Every rank's ``data``, in rank order, on every rank.

        Raises:
            DistStoreTimeoutError: some ranks did not contribute within ``timeout`` (names them).
        """
        seconds = self._begin(key, timeout)
        self._in_range("all_gather")
        self.store.set(f"{key}/{self.rank}", check_value(data, "data"))
        try:
            return self.store.multi_get([f"{key}/{r}" for r in range(self.world_size)], timeout=seconds)
        except DistStoreTimeoutError as exc:
            raise self._timed_out("all_gather", "all_gather", key, seconds, exc) from exc

    def all_sum(self, key: str, data: int, timeout: Timeout = 300.0) -> int:
        """The sum of every rank's integer ``data``, on every rank.

        Raises:
            DistStoreTimeoutError: some ranks did not contribute within ``timeout`` (names them).
        """
        seconds = self._begin(key, timeout)
        if isinstance(data, bool) or not isinstance(data, int):
            raise TypeError(f"data must be an int; got {type(data).__name__} {data!r}")
        self.store.add(key, data)
        barrier_key = f"{key}/barrier"
        self._seen.add(barrier_key)
        # a timeout says "barrier failed" (torch's words: all_sum ends in a barrier) and
        # names the caller's key, not the internal barrier's
        self._barrier(barrier_key, seconds, True, "all_sum", key)
        return self.store.add(key, 0)
