"""A caller's poll for its own reply before it sleeps (``_conn.reply_poller``): when it
polls, when it learns not to, and the variable that sets it."""

from __future__ import annotations

import threading
import time

import pytest

from gpucoll._timeouts import SPIN_BACKOFF_MAX, SPIN_BACKOFF_MIN
from gpucoll.rpc import _conn

from _conn_pair import pair  # noqa: F401  (a fixture)


def test_a_reply_already_there_is_seen_at_once_and_keeps_polling_on(pair) -> None:
    conn, peer = pair
    peer.sendall(b"x")
    poller, ready = _conn.reply_poller(conn, 5.0, 10_000)
    assert ready and conn.skip_spin == 0 and conn.backoff == SPIN_BACKOFF_MIN


def test_a_reply_that_misses_the_window_turns_polling_off_for_more_calls_each_time(pair) -> None:
    conn, peer = pair
    for skip in (8, 16, 32):
        poller, ready = _conn.reply_poller(conn, 0.001, 0)  # nothing comes: the poll, then 0 ms asleep
        assert not ready and conn.skip_spin == skip and conn.backoff == 2 * skip
        conn.skip_spin = 0
    conn.backoff = SPIN_BACKOFF_MAX
    _conn.reply_poller(conn, 0.001, 0)
    assert conn.skip_spin == SPIN_BACKOFF_MAX and conn.backoff == SPIN_BACKOFF_MAX


def test_while_polling_is_off_the_caller_sleeps_at_once(pair) -> None:
    conn, peer = pair
    conn.skip_spin = 2
    t0 = time.monotonic()
    _, ready = _conn.reply_poller(conn, 5.0, 0)  # a 5 s window, skipped
    assert not ready and time.monotonic() - t0 < 1.0 and conn.skip_spin == 1
    # Asleep, the reply still wakes it.
    threading.Timer(0.05, peer.sendall, (b"x",)).start()
    _, ready = _conn.reply_poller(conn, 5.0, 10_000)
    assert ready and conn.skip_spin == 0


def test_a_reply_in_the_windows_second_half_turns_polling_off(pair) -> None:
    conn, peer = pair
    threading.Timer(0.3, peer.sendall, (b"x",)).start()
    _, ready = _conn.reply_poller(conn, 0.4, 10_000)  # comes after 0.3 of a 0.4 s window
    assert ready and conn.skip_spin == SPIN_BACKOFF_MIN


def test_the_variable(monkeypatch) -> None:
    monkeypatch.delenv("GPUCOLL_RPC_SPIN_US", raising=False)
    assert _conn.spin_seconds() == pytest.approx(_conn._SPIN_US_DEFAULT * 1e-6)
    monkeypatch.setenv("GPUCOLL_RPC_SPIN_US", "0")
    assert _conn.spin_seconds() == 0.0
    monkeypatch.setenv("GPUCOLL_RPC_SPIN_US", "50")
    assert _conn.spin_seconds() == pytest.approx(50e-6)
    for bad in ("-1", "fast", "1e7"):
        monkeypatch.setenv("GPUCOLL_RPC_SPIN_US", bad)
        with pytest.raises(ValueError, match="GPUCOLL_RPC_SPIN_US"):
            _conn.spin_seconds()
