"""Death records: what a launcher that watches its ranks knows when one of them dies.

A CPU backend learns of a dead peer within milliseconds (its connection drops without
a goodbye), but not who that process was to the cluster or why it died. A launcher that
watches its ranks (``gpucoll.ray``: the driver sees an actor die and Ray says why)
writes a record into the job's store, at its root, and sets ``GPUCOLL_DEATH_RECORDS=1``
for its ranks. Then:

- a CPU backend that loses a peer waits up to :data:`WAIT_S` for a record written since
  the backend was made, and names it in the error every pending and later op fails with;
- ``shrink_group()`` with no list leaves out at once the ranks whose connections died
  when the job records deaths, instead of waiting out its agreement timeout.

Keys, at the root of the job's store: ``gpucoll/deaths/n`` counts the records,
``gpucoll/deaths/<i>`` (i = 1..n) holds record i as JSON: ``rank`` (the rank the job
started it as), ``node`` (address), ``node_id``, ``pid``, ``reason`` (the launcher's
words) and ``time`` (seconds since the epoch, when the launcher saw it).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from ..errors import DistError
from ..store import PrefixStore, Store
from .._env import DEATH_RECORDS_ENV

__all__ = ["WAIT_S", "enabled", "job_root", "write", "read", "await_since", "describe"]

WAIT_S = 1.0
"""Longest a backend waits for the launcher's record after a peer's connection dropped."""

_PREFIX = "gpucoll/deaths"


def enabled() -> bool:
    """True when this rank's launcher records deaths in the job's store."""
    return os.environ.get(DEATH_RECORDS_ENV, "").strip() == "1"


def job_root(store: Store) -> Store:
    """The job's store under any number of namespaces (PrefixStores)."""
    while isinstance(store, PrefixStore):
        store = store.underlying_store
    return store


def write(store: Store, record: dict[str, Any]) -> int:
    """Append ``record`` (JSON-serializable; ``time`` is set when missing) to the job's
    records; returns its number (1-based)."""
    rec = dict(record)
    rec.setdefault("time", time.time())
    root = job_root(store)
    index = root.add(f"{_PREFIX}/n", 1)
    root.set(f"{_PREFIX}/{index}", json.dumps(rec).encode())
    return index


def read(store: Store) -> list[dict[str, Any]]:
    """Every record written so far, oldest first (never blocks on a missing one)."""
    root = job_root(store)
    out = []
    for i in range(1, root.add(f"{_PREFIX}/n", 0) + 1):
        key = f"{_PREFIX}/{i}"
        if root.check([key]):
            out.append(json.loads(root.get(key)))
    return out


def await_since(store: Store, since: float, timeout: float = WAIT_S) -> list[dict[str, Any]]:
    """The records of deaths seen at or after ``since`` (epoch seconds), waiting up to
    ``timeout`` seconds for a first one. Returns [] when none came, or when the store
    cannot be reached (the caller's own error stands then, without the record)."""
    root = job_root(store)
    deadline = time.monotonic() + timeout
    try:
        i = 1
        while True:
            key = f"{_PREFIX}/{i}"
            if root.check([key]):
                i += 1
                continue
            found = [r for r in read(root) if float(r.get("time", 0.0)) >= since]
            left = deadline - time.monotonic()
            if found or left <= 0:
                return found
            try:
                root.wait([key], timeout=left)
            except DistError:
                return [r for r in read(root) if float(r.get("time", 0.0)) >= since]
    except (DistError, OSError, ValueError):
        return []


def describe(record: dict[str, Any]) -> str:
    """One record in words: ``rank 1 of the job (node 10.0.0.5, pid 4242) died: <reason>``."""
    node = record.get("node") or "?"
    if record.get("node_id"):
        node = f"{node}, node id {str(record['node_id'])[:12]}"
    return f"rank {record.get('rank')} of the job (node {node}, pid {record.get('pid')}) died: {record.get('reason')}"
