"""FileStore on hostile or left-over files: what it refuses, what it starts afresh,
when it removes its file (side by side with torch's FileStore), and corrupt logs."""

from __future__ import annotations

import gc
import os
import signal
import stat
import struct
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest

from gpucoll.errors import DistStoreError
from gpucoll.store import FileStore
from gpucoll.store import _filelog, _fileusers
from gpucoll.store import _wire as w

_REPO = str(Path(__file__).resolve().parents[2])


def _records(path: Path) -> list[tuple[int, int, int]]:
    """(offset, length, code) of every record of a log, walked independently of the store."""
    data = path.read_bytes()
    assert data.startswith(b"gpucoll-filestore-2\n")
    pos, out = _filelog.HEADER_LEN, []
    while pos + 5 <= len(data):
        (length,) = struct.unpack_from("<I", data, pos)
        out.append((pos, length, data[pos + 4]))
        pos += 4 + length
    assert pos == len(data)
    return out


def _holder(path: Path, world_size: int | None, extra: str = "") -> subprocess.Popen[str]:
    """A process that opens a FileStore on ``path``, runs ``extra``, says "ready", then waits."""
    code = textwrap.dedent(f"""
        import sys
        from gpucoll.store import FileStore
        s = FileStore({str(path)!r}, {world_size!r}, timeout=20)
        {extra}
        print("ready", flush=True)
        sys.stdin.read()
        s.close()
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, env={**os.environ, "PYTHONPATH": _REPO})
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line.strip() == "ready", line
    return p


def _end(p: subprocess.Popen[str]) -> None:
    if p.poll() is None:
        assert p.stdin is not None
        p.stdin.close()
        p.wait(timeout=20)


# -- removal of the file, side by side with torch ------------------------------------------

def _scenario(make: Callable[[str, int], Any], path: Path, world_size: int) -> list[bool]:
    """Open two stores on one path, drop them one by one (garbage collection); report
    whether the file exists after each step and whether the second still reads."""
    seen = []
    a = make(str(path), world_size)
    b = make(str(path), world_size)
    a.set("k", "v")
    del a
    gc.collect()
    seen.append(path.exists())
    seen.append(b.get("k") == b"v")
    del b
    gc.collect()
    seen.append(path.exists())
    return seen


@pytest.mark.parametrize("world_size", [1, 2])
def test_removal_on_garbage_collection_matches_torch(tmp_path: Path, world_size: int) -> None:
    torch = pytest.importorskip("torch", reason="compares with torch's FileStore")
    dist = torch.distributed
    ours = _scenario(lambda p, n: FileStore(p, n, timeout=10), tmp_path / "ours", world_size)
    theirs = _scenario(lambda p, n: dist.FileStore(p, n), tmp_path / "torch", world_size)
    # Neither removes the file under a store still open (world_size=1 included); the
    # last one to go removes it.
    assert ours == theirs == [True, True, False]


def test_world_size_one_close_keeps_file_for_the_other_store(tmp_path: Path) -> None:
    path = tmp_path / "s"
    a, b = FileStore(path, 1, timeout=10), FileStore(path, 1, timeout=10)
    a.set("x", b"1")
    a.close()
    assert path.exists()
    b.set("y", b"2")
    assert b.get("x") == b"1"
    b.close()
    assert not path.exists()


def test_world_size_none_last_close_removes(tmp_path: Path) -> None:
    path = tmp_path / "s"
    a, b = FileStore(path), FileStore(path)
    a.close()
    assert path.exists()
    b.close()
    assert not path.exists()


def test_forked_child_does_not_count_out_the_parent(tmp_path: Path) -> None:
    path = tmp_path / "s"
    s = FileStore(path, 1, timeout=10)
    s.set("k", b"v")
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            s.close()
            del s
            gc.collect()
        finally:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert path.exists()
    assert s.get("k") == b"v"
    s.close()
    assert not path.exists()


def test_collected_while_another_store_holds_the_lock_does_not_deadlock(tmp_path: Path) -> None:
    path = tmp_path / "s"
    keep = FileStore(path, None, timeout=10)
    done = threading.Event()

    def body() -> None:
        a = FileStore(path, None, timeout=10)
        with keep._log.locked(exclusive=True):
            del a  # finalizer runs here, in a thread holding the file lock
            gc.collect()
        done.set()

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(20)
    assert done.is_set(), "dropping a FileStore while another held the file lock hung"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the deferred close ends shortly after
        with keep._log.locked(exclusive=False):
            if len(keep._log.users()) == 1:
                break
        time.sleep(0.01)
    with keep._log.locked(exclusive=False):
        assert len(keep._log.users()) == 1
    keep.close()
    assert not path.exists()


def test_close_never_removes_a_file_put_in_its_place(tmp_path: Path) -> None:
    path = tmp_path / "s"
    s = FileStore(path, 1, timeout=10)
    os.rename(path, tmp_path / "moved")
    path.write_bytes(b"somebody else's data\n")
    s.close()
    assert path.read_bytes() == b"somebody else's data\n"


# -- what is refused -----------------------------------------------------------------------

def test_dev_null_is_refused_and_left_alone() -> None:
    with pytest.raises(DistStoreError, match=r"'/dev/null'.*character device"):
        FileStore("/dev/null", 1, timeout=5)
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_fifo_directory_and_symlink_are_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(DistStoreError, match="a FIFO"):
        FileStore(fifo, timeout=5)
    with pytest.raises(DistStoreError, match="a directory"):
        FileStore(tmp_path, timeout=5)
    target = tmp_path / "real"
    real = FileStore(target, timeout=5)
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(DistStoreError, match="symbolic link"):
        FileStore(link, timeout=5)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    with pytest.raises(DistStoreError, match="symbolic link"):
        FileStore(dangling, timeout=5)
    assert not (tmp_path / "nowhere").exists()
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and link.is_symlink()
    real.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_file_of_another_user_is_refused_and_untouched(tmp_path: Path) -> None:
    path = tmp_path / "theirs"
    other = FileStore(path, timeout=5)  # a valid log, as another user would have made it
    other.set("injected", b"evil")
    before = path.read_bytes()
    os.chown(path, 12345, 12345)
    with pytest.raises(DistStoreError, match="owned by uid 12345"):
        FileStore(path, 1, timeout=5)
    st = os.stat(path)
    assert (st.st_uid, path.read_bytes()) == (12345, before)
    os.chown(path, 0, 0)
    other.close()


def test_foreign_file_and_other_version_are_refused_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_bytes(b"my notes\n")
    with pytest.raises(DistStoreError, match="not a gpucoll FileStore log"):
        FileStore(path, 1, timeout=5)
    assert path.read_bytes() == b"my notes\n"
    old = tmp_path / "old"
    old.write_bytes(b"gpucoll-filestore-1\n" + b"\x00" * 40)
    with pytest.raises(DistStoreError, match="another gpucoll version"):
        FileStore(old, 1, timeout=5)
    assert old.read_bytes() == b"gpucoll-filestore-1\n" + b"\x00" * 40


def test_new_file_is_0600_with_a_header_and_creation_id(tmp_path: Path) -> None:
    old = os.umask(0o022)  # a permissive umask must not make the file readable by others
    try:
        a, b = FileStore(tmp_path / "a", 3, timeout=5), FileStore(tmp_path / "b", 3, timeout=5)
    finally:
        os.umask(old)
    heads = []
    for name in ("a", "b"):
        p = tmp_path / name
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
        data = p.read_bytes()
        assert data.startswith(b"gpucoll-filestore-2\n")
        cid, ws, pid, created = struct.unpack_from("<16siId", data, 20)
        assert (ws, pid) == (3, os.getpid()) and abs(created - time.time()) < 60
        heads.append(cid)
    assert heads[0] != heads[1]
    a.close()
    b.close()


def test_empty_file_of_ours_is_adopted_private_and_removed(tmp_path: Path) -> None:
    # torch's tests pass a NamedTemporaryFile's path to FileStore; so may users.
    path = tmp_path / "tmpfile"
    path.touch(mode=0o644)
    os.chmod(path, 0o644)
    s = FileStore(path, 1, timeout=5)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    s.set("k", b"v")
    s.close()
    assert not path.exists()


# -- a second job, a stale file -------------------------------------------------------------

def test_second_job_with_other_world_size_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s"
    job_a = _holder(path, 2, "s.set('secret', b'A')")
    try:
        with pytest.raises(DistStoreError, match=r"another job.*world_size=2.*world_size=3"):
            FileStore(path, 3, timeout=5)
    finally:
        _end(job_a)


def test_second_job_beyond_world_size_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s"
    ranks = [_holder(path, 2, "s.set('secret', b'A')") for _ in range(2)]
    try:
        with pytest.raises(DistStoreError, match=r"in use by another job: its world_size is 2 and 2 processes"):
            FileStore(path, 2, timeout=5)
        # One process opening several stores counts once (torch allows that too).
        assert path.exists()
    finally:
        for p in ranks:
            _end(p)
    assert not path.exists()


def test_file_of_killed_job_is_started_afresh_without_waiting(tmp_path: Path) -> None:
    path = tmp_path / "s"
    job_a = _holder(path, 2, "s.set('secret', b'A'); s.add('arrived', 1)")
    job_a.kill()
    job_a.wait(timeout=20)
    assert path.exists()
    t0 = time.monotonic()
    with pytest.warns(RuntimeWarning, match=r"started afresh: every process .* gone.*pid " + str(job_a.pid)):
        s = FileStore(path, 2, timeout=30)
    assert not s.check(["secret"])
    assert s.add("arrived", 1) == 1
    assert time.monotonic() - t0 < 5
    s.close()


def test_killed_job_left_unreaped_counts_as_gone(tmp_path: Path) -> None:
    path = tmp_path / "s"
    job_a = _holder(path, 1, "s.set('secret', b'A')")
    os.kill(job_a.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # a zombie until reaped below
        st = _fileusers._start_time(job_a.pid)
        if st is not None and st[1] == "Z":
            break
        time.sleep(0.01)
    with pytest.warns(RuntimeWarning, match="started afresh"):
        s = FileStore(path, 1, timeout=5)
    job_a.wait(timeout=20)
    assert not s.check(["secret"])
    s.close()


def test_finished_job_log_is_refused_and_kept(tmp_path: Path) -> None:
    # A log whose world_size stores all closed (its removal failed, or it was copied back):
    # a new job must neither read its keys nor destroy it silently.
    path = tmp_path / "s"
    hdr = _filelog.LINE + struct.pack("<16siId", os.urandom(16), 2, 1, time.time() - 100)
    recs = [w.encode_frame(w.SET, [b"secret", b"A"]),
            w.encode_frame(w.SET, [_filelog.CLOSED, b"2"])]
    path.write_bytes(hdr + b"".join(recs))
    before = path.read_bytes()
    with pytest.raises(DistStoreError, match=r"log of a job that has finished: 2 stores of world_size=2 "
                                             r"closed it .*remove it, or use a fresh path per job"):
        FileStore(path, 2, timeout=5)
    assert path.read_bytes() == before


def test_jobs_one_after_the_other_never_share_keys(tmp_path: Path) -> None:
    """Job A's two ranks: rank 1 closes first; job B's first rank arrives while A's rank 0
    still has the file open. B must not join A's log (it would read A's keys)."""
    path = tmp_path / "s"
    a0 = _holder(path, 2, "s.set('addr/0', b'job A')")
    a1 = _holder(path, 2, "assert s.get('addr/0') == b'job A'")
    _end(a1)  # A's rank 1 is done; A's rank 0 is still closing
    try:
        with pytest.raises(DistStoreError, match=r"in use by another job: its world_size is 2 and all 2 of "
                                                 r"its processes have joined it"):
            FileStore(path, 2, timeout=5)
    finally:
        _end(a0)
    assert not path.exists()  # A's last store removed the file it created
    b = FileStore(path, 2, timeout=5)  # job B, after A: a fresh log
    try:
        assert not b.check(["addr/0"])
    finally:
        b.close()


def test_a_late_member_still_joins_its_job(tmp_path: Path) -> None:
    """Rank 0 of a world_size=2 job sets and closes before rank 1 arrives: rank 1 joins."""
    path = tmp_path / "s"
    a0 = _holder(path, 2, "s.set('addr/0', b'A')")
    _end(a0)
    assert path.exists()
    a1 = FileStore(path, 2, timeout=5)
    assert a1.get("addr/0") == b"A"
    a1.close()
    assert not path.exists()


def test_log_reset_under_an_open_store_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "s"
    s = FileStore(path, timeout=5)
    s.set("k", b"v")
    os.truncate(path, _filelog.HEADER_LEN)
    with pytest.raises(DistStoreError, match="shrank"):
        s.set("k2", b"v")


def test_file_init_method_after_killed_job(tmp_path: Path) -> None:
    import gpucoll
    path = tmp_path / "init"
    job_a = _holder(path, 1, "s.set('pg/default/x', b'A'); s.add('pg/default/y', 5)")
    job_a.kill()
    job_a.wait(timeout=20)
    t0 = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        gpucoll.init_process_group("cpu", init_method=f"file://{path}", rank=0, world_size=1, timeout=20)
    try:
        assert time.monotonic() - t0 < 10
    finally:
        gpucoll.destroy_process_group()


# -- corrupt logs ----------------------------------------------------------------------------

def _log_with_records(path: Path) -> FileStore:
    s = FileStore(path, timeout=5)
    for i in range(4):
        s.set(f"k{i}", f"v{i}")
    return s


@pytest.mark.parametrize("length", [0, 0xFFFFFF00, 1000])
def test_bad_length_in_the_middle_names_file_and_offset(tmp_path: Path, length: int) -> None:
    path = tmp_path / "s"
    s = _log_with_records(path)
    recs = _records(path)
    off = [r for r in recs if r[2] == w.SET][2][0]  # a record with later ones after it
    with open(path, "r+b") as f:
        f.seek(off)
        f.write(struct.pack("<I", length))
    with pytest.raises(DistStoreError, match=rf"{str(path)!r} is corrupt at byte {off}:"):
        FileStore(path, timeout=5)
    s.close()


def test_unknown_code_and_bad_fields_are_corruption(tmp_path: Path) -> None:
    path = tmp_path / "s"
    s = _log_with_records(path)
    recs = _records(path)
    off = recs[-2][0]
    data = bytearray(path.read_bytes())
    data[off + 4] = 99
    path.write_bytes(bytes(data))
    with pytest.raises(DistStoreError, match=rf"corrupt at byte {off}: unknown record code 99"):
        FileStore(path, timeout=5)
    data[off + 4] = w.SET
    struct.pack_into("<I", data, off + 5, 10_000)  # first field longer than its record
    path.write_bytes(bytes(data))
    with pytest.raises(DistStoreError, match=rf"corrupt at byte {off}:"):
        FileStore(path, timeout=5)
    s.close()


def test_torn_last_record_is_cut_and_earlier_ones_kept(tmp_path: Path) -> None:
    path = tmp_path / "s"
    s = _log_with_records(path)
    # The torn record is shorter than a registration record, so that s's stale offset
    # (the end of the torn record) falls inside the record t writes in its place. Were the
    # two of one length, s's offset would land on a record boundary and s would read on
    # without noticing; the length of a registration depends on the pid and the process
    # start time, so a fixed 100-byte value matched it on some machines.
    s.set("big", b"x" * 10)
    recs = _records(path)
    off, big_len = recs[-1][0], recs[-1][1]
    os.truncate(path, off + 20)  # the writer died inside the value
    t = FileStore(path, timeout=5)
    t_reg = _records(path)[-1]
    assert t_reg[0] == off and t_reg[1] > big_len  # t cut the tail and registered there
    assert t.multi_get([f"k{i}" for i in range(4)]) == [b"v0", b"v1", b"v2", b"v3"]
    assert not t.check(["big"])
    t.set("after", b"1")
    assert [r[0] for r in _records(path)][:len(recs) - 1] == [r[0] for r in recs[:-1]]
    t.close()
    # s stands for the writer that died: its own view now disagrees with the file.
    with pytest.raises(DistStoreError, match=r"corrupt at byte|shrank"):
        s.close()
