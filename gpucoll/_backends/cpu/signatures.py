"""The CPU backend's signature registry: what makes a cross-rank mismatch readable.

Every collective carries a 64-bit signature of the fields every rank must agree on
(op, dtype, count, root, reduce op, sizes); the transport compares it across ranks in
the same header as the data. The first time a rank issues an op with some fields it
publishes them in the group's store under the signature, before any peer can see it;
a rank that finds a peer's signature differs from its own reads the peer's fields
and says which differ, with both ranks' values.
"""

from __future__ import annotations

from typing import Any

from ...errors import DistBackendError
from ..mismatch import Fields, SignatureMismatch, decode, describe, encode, signature

__all__ = ["Signatures"]

CACHE = 4096
"""Distinct op signatures a backend publishes at most (one store key each)."""


class Signatures:
    """Signatures of one group's ops on this rank (see the module docstring).

    Args:
        store: the group's store; rank, size: this rank, the group size;
        timeout: the backend's timeout (reading a peer's fields waits at most 2 s of it).
    """

    def __init__(self, store: Any, rank: int, size: int, timeout: float) -> None:
        self._store = store
        self.rank = rank
        self.size = size
        self.timeout = timeout
        self._published: dict[int, Fields] = {}
        self._of: dict[tuple[object, ...], int] = {}  # an op's kind and fields -> its signature

    def of(self, op_type: str, fields: dict[str, object]) -> int:
        """The signature of an op with these fields (published the first time it is seen)."""
        # A repeated op finds its signature in one dict look-up: no digest, no store access.
        key = (op_type, *fields.items())
        sig = self._of.get(key)
        if sig is None:
            named = [("op", op_type)] + [(k.replace("_", " "), _text(v)) for k, v in fields.items() if v is not None]
            sig = signature(named)
            if sig not in self._published and self.size > 1:
                self._publish(sig, named)
            if len(self._of) >= CACHE:
                self._of.clear()  # bounded: a job with this many distinct ops recomputes some
            self._of[key] = sig
        return sig

    def _publish(self, sig: int, fields: Fields) -> None:
        """Publish an op's fields under its signature, once per distinct signature (the
        first op of each kind, dtype and size), before any peer can see the signature:
        a rank that finds it differs from its own reads them to say what differs."""
        if len(self._published) >= CACHE:
            return  # a job with this many distinct ops gets hash-only errors for the rest
        try:
            self._store.set(f"sig/{sig:016x}", encode(fields).encode())
        except Exception:
            return  # the readable error is a courtesy; the op itself goes on
        self._published[sig] = fields

    def reworded(self, exc: SignatureMismatch) -> DistBackendError:
        """``exc`` (signatures differ) as an error naming the fields that differ and both
        ranks' values."""
        theirs: Fields | None = None
        try:
            raw = self._store.get(f"sig/{exc.theirs:016x}", timeout=min(2.0, self.timeout))
            theirs = decode(raw.decode(errors="replace"))
        except Exception:
            pass
        text = describe({self.rank: self._published.get(exc.mine), exc.peer: theirs})
        return DistBackendError(f"rank {exc.peer} issued a different collective from this rank "
                                f"(rank {self.rank}); ops differ across ranks: {text}")


def _text(v: object) -> str:
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_text(x) for x in v) + "]"
    return str(v)
