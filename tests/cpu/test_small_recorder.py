"""The flight recorder on the small host path (``Issuer.run_host``) and its ring.

- The ring is made whole when the recorder is: a dump shows only the entries that hold an
  op, oldest first, before and after the ring wraps, with no gap and no repeat.
- An op of a planned NumPy run records its start from the performance counter
  (``_Entry.t0``); the dump shows it as wall-clock time: between the wall clock read
  before and after the op, with ``time_finished`` = ``time_started`` + ``active_duration``,
  as an op recorded with the wall clock shows it.
- Checked through the public API on the path it takes (the kind's HostRun is in use), at
  two ranks, with the recorder's size set small enough to wrap.
"""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np

from gpucoll._debug.flight_recorder import FlightRecorder, Kind
from gpucoll.testing import run_spmd

CAPACITY = 16


def test_ring_shows_used_entries_in_order() -> None:
    rec = FlightRecorder("g", 0, 0, 2, 4)
    assert json.loads(rec.to_json())["entries"] == []
    kind = Kind("cpu", None)
    for seq in range(1, 4):
        rec.begin_kind(seq, "barrier", kind).complete(0.5)
    entries = json.loads(rec.to_json())["entries"]
    assert [e["seq"] for e in entries] == [1, 2, 3]
    for seq in range(4, 7):
        rec.begin_kind(seq, "barrier", kind)
    entries = json.loads(rec.to_json())["entries"]
    assert [e["seq"] for e in entries] == [3, 4, 5, 6]
    assert [e["state"] for e in entries] == ["completed", "scheduled", "scheduled", "scheduled"]
    done = entries[0]
    assert done["time_finished"] == done["time_started"] + 0.5 and done["active_duration"] == 0.5


def test_entry_started_from_perf_counter_reads_as_wall_clock() -> None:
    rec = FlightRecorder("g", 0, 0, 2, 2)
    entry = rec.begin_kind(1, "all_reduce", Kind("cpu", None))
    before = time.time()
    entry.time_started, entry.t0 = 0.0, time.perf_counter()  # as Issuer.run_host records it
    after = time.time()
    entry.complete(0.25)
    (got,) = json.loads(rec.to_json())["entries"]
    slack = 0.05  # two reads of each clock apart
    assert before - slack <= got["time_started"] <= after + slack, (before, got, after)
    assert got["time_finished"] == got["time_started"] + 0.25
    entry.fail("boom", 0.5)  # (a failure after the start, on the same clock)
    (got,) = json.loads(rec.to_json())["entries"]
    assert got["state"] == "failed" and got["error"] == "boom"
    assert before - slack <= got["time_started"] <= after + slack
    assert abs(got["time_finished"] - (got["time_started"] + 0.5)) < slack


def host_path_body() -> list[str]:
    import gpucoll
    from gpucoll._collectives import _world

    pg = _world._WORLD.default
    bad: list[str] = []
    x = np.ones(1024, np.float32)  # 4 KiB: the small path
    gpucoll.all_reduce(x)
    gpucoll.all_reduce(x)  # the kind's HostRun is made here
    if (x.dtype, x.shape, "SUM") not in pg._host_runs:
        return ["the kind has no HostRun: the test does not take the path it checks"]
    for total in (CAPACITY // 2, 3 * CAPACITY):  # the ring part-full, then wrapped
        before = time.time()
        seq0 = pg.get_sequence_number()
        while pg.get_sequence_number() < seq0 + total:
            gpucoll.all_reduce(x)
        after = time.time()
        dump = json.loads(pg.dump_flight_recorder())
        entries = [e for e in dump["entries"] if e["seq"] > seq0]
        seqs = [e["seq"] for e in dump["entries"]]
        if seqs != sorted(seqs) or len(set(seqs)) != len(seqs) or len(seqs) > CAPACITY:
            bad.append(f"{total} ops: seqs {seqs}")
        want = list(range(seq0 + 1, seq0 + total + 1))[-CAPACITY:]
        if [e["seq"] for e in entries] != want:
            bad.append(f"{total} ops: seqs {[e['seq'] for e in entries]}, want {want}")
        for e in entries:
            if e["op_type"] != "all_reduce" or e["state"] != "completed" or e["nbytes"] != 4096:
                bad.append(f"entry {e}")
            elif not before - 0.05 <= e["time_started"] <= e["time_finished"] <= after + 0.05:
                bad.append(f"times {e['time_started']}..{e['time_finished']} not in {before}..{after}")
            elif abs(e["time_finished"] - e["time_started"] - e["active_duration"]) > 1e-6:
                bad.append(f"duration {e}")
    return bad


def test_host_path_entries() -> None:
    res: list[Any] = run_spmd(host_path_body, 2, timeout=120,
                              env={"GPUCOLL_FLIGHT_RECORDER_SIZE": str(CAPACITY)})
    assert res == [[], []]
