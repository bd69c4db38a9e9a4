"""Cross-rank mismatch errors, worded once for every backend and for the DETAIL check.

An op's *fields* are what every rank must agree on, as ``(name, value)`` pairs in a
fixed order: ``op``, ``dtype``, ``count``, ``root``, ``reduce op``, ``sizes``...
:func:`signature` digests them into the 64-bit number a backend compares across
ranks (the CPU backend's shared-memory headers and TCP frames carry it); when two
ranks' numbers differ, :func:`describe` says which fields differ and each rank's
value, from the fields each rank published (see the CPU backend's signature
registry) or gathered (the DETAIL check in ``_group/core.py``).
"""

from __future__ import annotations

import hashlib
from typing import Mapping, Sequence

from ..errors import DistBackendError

__all__ = ["Fields", "SignatureMismatch", "signature", "encode", "decode", "describe", "find_mismatch"]

Fields = Sequence[tuple[str, str]]
_SEP, _EQ = "\x1f", "\x1e"


def signature(fields: Fields) -> int:
    """A 64-bit digest of an op's fields (never 0, which means "not checked" on the wire)."""
    digest = hashlib.blake2b(encode(fields).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1


def encode(fields: Fields) -> str:
    """The fields as one string (for a store value or a fixed-size fingerprint)."""
    return _SEP.join(f"{k}{_EQ}{v}" for k, v in fields)


def decode(text: str) -> list[tuple[str, str]]:
    """The inverse of :func:`encode` (a field without a name is shown under ``?``)."""
    out = []
    for part in text.split(_SEP) if text else []:
        k, eq, v = part.partition(_EQ)
        out.append((k, v) if eq else ("?", part))
    return out


def describe(per_rank: Mapping[int, Fields | None]) -> str:
    """Which fields differ across ranks, with each rank's value; then every rank's op.

    ``per_rank[r]`` is None where rank r's fields are unknown (shown as such).

    For example, ranks 0 (broadcast from root 0) and 1 (all_reduce) give
    "they differ in op (rank 0: broadcast, rank 1: all_reduce); root
    (rank 0: 0, rank 1: -). Each rank: rank 0: op=broadcast ...; rank 1: op=all_reduce ...".
    """
    known = {r: dict(f) for r, f in per_rank.items() if f is not None}
    names: list[str] = []
    for f in per_rank.values():
        for k, _ in f or ():
            if k not in names:
                names.append(k)
    differ = []
    for name in names:
        values = {r: known[r].get(name, "-") for r in known}
        if len(set(values.values())) > 1:
            differ.append(f"{name} (" + ", ".join(f"rank {r}: {v}" for r, v in sorted(values.items())) + ")")
    unknown = sorted(r for r, f in per_rank.items() if f is None)
    head = f"they differ in {'; '.join(differ)}" if differ else "their signatures differ"
    each = "; ".join(f"rank {r}: " + (" ".join(f"{k}={v}" for k, v in per_rank[r] or ()) or "?")
                     for r in sorted(known))
    tail = f"; the fields of rank(s) {unknown} are unknown" if unknown else ""
    return f"{head}. Each rank: {each}{tail}"


class SignatureMismatch(DistBackendError):
    """A peer's op signature differs from this rank's (raised by a backend's transport;
    the backend rewords it with :func:`describe`).

    Attributes:
        peer: the peer's rank in the group.
        theirs: the peer's signature; mine: this rank's.
    """

    def __init__(self, message: str, peer: int, theirs: int, mine: int) -> None:
        super().__init__(message)
        self.peer = peer
        self.theirs = theirs
        self.mine = mine


def find_mismatch(exc: BaseException) -> SignatureMismatch | None:
    """The :class:`SignatureMismatch` in ``exc``'s cause/context chain, if any."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        if isinstance(e, SignatureMismatch):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None
