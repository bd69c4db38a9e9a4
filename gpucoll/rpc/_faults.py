"""Injected send failures and delays, by message type (the faulty agent of tests)."""

from __future__ import annotations

import threading
from typing import Mapping, Sequence

__all__ = ["FaultSpec"]


class FaultSpec:
    """Which sends fail and which are delayed, as torch's FaultyTensorPipeAgent decides.

    The first ``num_fail_sends`` sends of each message type named in ``messages_to_fail``
    fail with "Send attempt failed intentionally for TYPE"; a message type named in
    ``messages_to_delay`` is written that many seconds after it is sent.
    """

    def __init__(self, messages_to_fail: Sequence[str], messages_to_delay: Mapping[str, float],
                 num_fail_sends: int) -> None:
        self.messages_to_fail = set(messages_to_fail)
        self.messages_to_delay = dict(messages_to_delay)
        self.num_fail_sends = num_fail_sends
        self._failed: dict[str, int] = {}
        self._lock = threading.Lock()

    def should_fail(self, kind: str) -> bool:
        if kind not in self.messages_to_fail:
            return False
        with self._lock:
            n = self._failed.get(kind, 0)
            if n >= self.num_fail_sends:
                return False
            self._failed[kind] = n + 1
            return True

    def delay(self, kind: str) -> float:
        return float(self.messages_to_delay.get(kind, 0.0))
