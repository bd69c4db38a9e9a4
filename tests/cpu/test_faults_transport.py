"""CPU transport under faults and hostile peers: re-init generations, dead senders mid-frame,
stalled peers named, authenticated connections, host identity, /dev/shm cleanup, object size limit."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

from gpucoll.testing import run_spmd

PG_TIMEOUT = 3.0
MiB = 1 << 20


def _quiet_destroy() -> None:
    import gpucoll
    from gpucoll._world import default_group

    try:
        if gpucoll.is_initialized():
            gpucoll.destroy_process_group()
    except Exception:
        pass  # broken on purpose


def _as_victim(act: Any) -> int:
    """Run ``act`` in a forked child that takes this rank's place and dies; return its pid."""
    pid = os.fork()
    if pid == 0:
        try:
            act()
        except BaseException:
            import traceback

            traceback.print_exc()
            sys.stderr.flush()
        finally:
            os._exit(3)
    os.waitpid(pid, 0)
    return pid


# ----- 1. re-init: every init gets its own generation -----

def reinit_body(cycles: int) -> int:
    import gpucoll
    from gpucoll._world import default_group

    r = int(os.environ["RANK"])
    n = int(os.environ["WORLD_SIZE"])
    for c in range(cycles):
        gpucoll.init_process_group("cpu", timeout=10.0)
        x = np.full(4, float(r + 10 * c))
        gpucoll.all_reduce(x)
        want = sum(q + 10 * c for q in range(n))
        assert (x == want).all(), f"cycle {c}: all_reduce gave {x[0]}, expected {want}"
        out: list[Any] = [None] * n
        gpucoll.all_gather_object(out, (r, c))
        assert out == [(q, c) for q in range(n)], f"cycle {c}: all_gather_object gave {out}"
        gpucoll.destroy_process_group()
    return cycles


@pytest.mark.parametrize("world,cycles", [(2, 50), (3, 4)])
def test_reinit_cycles_never_read_another_cycle(world: int, cycles: int) -> None:
    assert run_spmd(reinit_body, world, args=(cycles,), init=False, timeout=120) == [cycles] * world


# ----- 2. dead sender mid-frame, send to an aborted peer, stalled peers, monitored_barrier -----

def recv_mid_frame_body() -> Any:
    import gpucoll
    from gpucoll._world import default_group
    from gpucoll._backends.cpu.tcp import _HDR, KIND_P2P

    r = int(os.environ["RANK"])
    if r == 0:
        def act() -> None:
            gpucoll.init_process_group("cpu", timeout=PG_TIMEOUT, )
            ready = np.zeros(1)
            gpucoll.recv(ready, src=1)  # rank 1 has posted its receive
            mesh = default_group()._cpu._mesh
            # A 64 MiB frame whose payload stops after 1 MiB: the sender dies mid-stream.
            mesh._socks[1].sendall(_HDR.pack(KIND_P2P, 0, 64 * MiB, 0) + bytes(MiB))
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGKILL)
        _as_victim(act)
        return None
    gpucoll.init_process_group("cpu", timeout=PG_TIMEOUT)
    buf = np.empty(64 * MiB, np.uint8)
    work = gpucoll.irecv(buf, src=0)
    gpucoll.send(np.ones(1), dst=0)
    t0 = time.monotonic()
    try:
        work.wait()
    except gpucoll.DistError as exc:
        return time.monotonic() - t0, str(exc)
    finally:
        _quiet_destroy()
    raise AssertionError("recv from a dead sender did not fail")


def test_recv_with_payload_in_flight_fails_fast_naming_the_dead_sender() -> None:
    elapsed, msg = run_spmd(recv_mid_frame_body, 2, init=False, timeout=60,
                            env={"GPUCOLL_CPU_TRANSPORT": "tcp"})[1]
    assert elapsed < 1.5, f"the receive failed after {elapsed:.2f} s (group timeout {PG_TIMEOUT} s): {msg}"
    assert "rank 0" in msg, msg


def send_to_aborted_body() -> Any:
    import gpucoll
    from gpucoll._world import default_group
    from gpucoll._backends.cpu import tcp

    r = gpucoll.get_rank()
    if r == 0:
        mesh = default_group()._cpu._mesh
        orig = tcp.TcpMesh._deliver

        def stalled_reader(self: Any, peer: int, s: Any, kind: int, tag: int, nbytes: int, meta: int) -> None:
            if nbytes > MiB:  # stop reading big frames: the sender blocks mid-send
                while not self._closed:
                    time.sleep(0.01)
                raise EOFError("closed")
            orig(self, peer, s, kind, tag, nbytes, meta)

        tcp.TcpMesh._deliver = stalled_reader  # type: ignore[method-assign]
        assert mesh is not None
    gpucoll.barrier()
    if r == 0:
        time.sleep(0.5)
        default_group()._cpu.abort("rank 0 gave up: injected fault 4711")
        return None
    t0 = time.monotonic()
    try:
        gpucoll.send(np.zeros(64 * MiB, np.uint8), dst=0)
    except gpucoll.DistError as exc:
        return time.monotonic() - t0, str(exc)
    raise AssertionError("the send to an aborted peer did not fail")


def test_send_to_a_peer_that_aborted_names_its_reason() -> None:
    res = run_spmd(send_to_aborted_body, 2, pg_timeout=PG_TIMEOUT, timeout=60,
                   env={"GPUCOLL_CPU_TRANSPORT": "tcp"})
    elapsed, msg = res[1]
    assert "injected fault 4711" in msg and "rank 0" in msg, msg
    assert "Broken pipe" not in msg and "Bad file descriptor" not in msg, msg
    assert elapsed < 0.5 + 1.5, elapsed


def stalled_body() -> Any:
    import gpucoll
    from gpucoll._world import default_group

    r = gpucoll.get_rank()
    pids: list[Any] = [None, None]
    gpucoll.all_gather_object(pids, os.getpid())
    os.environ["GPUCOLL_CPU_TRANSPORT"] = "tcp"
    g_tcp = gpucoll.new_group([0, 1])
    g_p2p = gpucoll.new_group([0, 1])
    gpucoll.barrier()
    if r == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
        return None  # resumed by rank 0 when it is done; every group is broken by then
    time.sleep(0.3)
    msgs = []
    for what in ("all_reduce shm", "all_reduce tcp", "recv"):
        t0 = time.monotonic()
        try:
            if what == "recv":
                gpucoll.recv(np.empty(64 * MiB, np.uint8), src=1, group=g_p2p)
            else:
                gpucoll.all_reduce(np.ones(8 * MiB), group=None if what.endswith("shm") else g_tcp)
        except gpucoll.DistError as exc:
            msgs.append((what, time.monotonic() - t0, str(exc)))
    os.kill(pids[1], signal.SIGCONT)
    return msgs


def test_timeouts_with_a_stopped_peer_name_it() -> None:
    msgs = run_spmd(stalled_body, 2, pg_timeout=2.0, timeout=60)[0]
    assert [m[0] for m in msgs] == ["all_reduce shm", "all_reduce tcp", "recv"], msgs
    for what, elapsed, msg in msgs:
        assert "rank 1" in msg, (what, msg)
        assert elapsed < 2.0 + 5.0, (what, elapsed)


def barrier_dead_peer_body() -> Any:
    import gpucoll
    from gpucoll._world import default_group

    r = int(os.environ["RANK"])
    if r == 2:
        def act() -> None:
            gpucoll.init_process_group("cpu", timeout=PG_TIMEOUT)
            os.kill(os.getpid(), signal.SIGKILL)
        _as_victim(act)
        return None
    gpucoll.init_process_group("cpu", timeout=PG_TIMEOUT)
    time.sleep(0.5)  # rank 2 is dead and the transport knows it
    t0 = time.monotonic()
    try:
        gpucoll.monitored_barrier(timeout=30.0)
    except gpucoll.DistError as exc:
        return time.monotonic() - t0, str(exc)
    finally:
        _quiet_destroy()
    raise AssertionError("monitored_barrier passed with a dead rank")


def test_monitored_barrier_stops_at_a_known_dead_peer() -> None:
    res = run_spmd(barrier_dead_peer_body, 3, init=False, timeout=60)
    for elapsed, msg in res[:2]:
        assert elapsed < 2.0, (elapsed, msg)
        assert "[2]" in msg, msg



def test_a_rank_that_leaves_after_its_peers_goodbye_is_not_taken_for_dead(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks leaving after the same error: the one that hears the other's goodbye first
    still says its own, so the other (which may be slower to close) does not record a death.
    monitored_barrier counts a peer recorded dead as missing at once."""
    from gpucoll.store import HashStore

    monkeypatch.setenv("GPUCOLL_STORE_TOKEN", "t0ken")
    meshes = _mesh_pair(HashStore())
    assert all(not isinstance(m, BaseException) for m in meshes), meshes
    m0, m1 = meshes
    try:
        # Rank 1 has rank 0's goodbye (rank 0 is between its goodbyes and its own close).
        m1._peer_gone(0, "shut down its CPU backend", fatal=False)
        m1.close("after an error")
        deadline = time.monotonic() + 5.0
        while 1 not in m0._gone and time.monotonic() < deadline:
            time.sleep(0.01)
        assert 1 in m0._gone, "rank 0 never saw rank 1 leave"
        assert m0.dead(1) is None, m0._gone[1]
        assert "after an error" in m0._gone[1], m0._gone[1]
    finally:
        m0.close()
        m1.close()

# ----- 3. transport security: loopback listener, idle strangers, impostors, 0600 segments -----

def _mesh_pair(store: Any, timeout: float = 8.0, started: Any = None) -> list[Any]:
    """Two TcpMesh ranks in threads of this process; rank 1 starts after ``started()``."""
    from gpucoll._backends.cpu.tcp import TcpMesh

    out: list[Any] = [None, None]

    def make(rank: int) -> None:
        try:
            out[rank] = TcpMesh(store, rank, 2, timeout=timeout, host_id=f"h{rank}", advertise="127.0.0.1",
                                on_broken=lambda e: None)
        except BaseException as exc:
            out[rank] = exc

    t0 = threading.Thread(target=make, args=(0,))
    t0.start()
    store.wait(["tcp/0"], 10.0)
    if started is not None:
        started()
    t1 = threading.Thread(target=make, args=(1,))
    t1.start()
    for t in (t0, t1):
        t.join(timeout + 5)
    return out


def _listening_on(port: int) -> list[str]:
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in list(f)[1:]]
    return [r[1] for r in rows if r[3] == "0A" and r[1].endswith(f":{port:04X}")]


def test_listener_is_loopback_only_and_idle_strangers_do_not_block(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpucoll.store import HashStore

    monkeypatch.setenv("GPUCOLL_STORE_TOKEN", "t0ken")
    store = HashStore()
    idle: list[socket.socket] = []
    seen: list[list[str]] = []

    def strangers() -> None:
        _, addr, port = store.get("tcp/0").decode().split("|")
        seen.append(_listening_on(int(port)))
        idle.extend(socket.create_connection((addr, int(port))) for _ in range(3))

    t0 = time.monotonic()
    meshes = _mesh_pair(store, started=strangers)
    elapsed = time.monotonic() - t0
    try:
        assert all(not isinstance(m, BaseException) for m in meshes), meshes
        assert seen == [[f"0100007F:{int(store.get('tcp/0').decode().split('|')[2]):04X}"]], seen
        assert elapsed < 3.0, f"3 idle connections delayed setup by {elapsed:.1f} s"
    finally:
        for s in idle:
            s.close()
        for m in meshes:
            if not isinstance(m, BaseException) and m is not None:
                m.close()


def test_a_process_without_the_token_cannot_pose_as_a_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    import hashlib
    import hmac

    from gpucoll._backends.cpu import auth
    from gpucoll.errors import DistNetworkError
    from gpucoll.store import HashStore

    monkeypatch.setenv("GPUCOLL_STORE_TOKEN", "the-real-token")
    store = HashStore()
    fake = socket.socket()
    fake.bind(("127.0.0.1", 0))
    fake.listen(4)
    wrong = hmac.new(b"a-guessed-token", b"gpucoll cpu transport v1", hashlib.sha256).digest()

    def impostor() -> None:  # overwrites rank 0's address and answers with a wrong key
        store.set("tcp/0", f"h0|127.0.0.1|{fake.getsockname()[1]}".encode())

        def serve() -> None:
            conn, _ = fake.accept()
            _, peer, _, nonce = auth.HELLO.unpack(conn.recv(auth.HELLO.size, socket.MSG_WAITALL))
            conn.sendall(auth.make_reply(wrong, 0, peer, nonce)[0])
            conn.close()
        threading.Thread(target=serve, daemon=True).start()

    meshes = _mesh_pair(store, timeout=4.0, started=impostor)
    fake.close()
    assert isinstance(meshes[1], DistNetworkError), meshes
    assert "failed authentication" in str(meshes[1])
    for m in meshes:
        if m is not None and not isinstance(m, BaseException):
            m.close()


def test_a_dialer_with_a_wrong_key_is_refused_and_the_real_rank_still_connects(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from gpucoll._backends.cpu import auth
    from gpucoll.store import HashStore

    monkeypatch.setenv("GPUCOLL_STORE_TOKEN", "the-real-token")
    store = HashStore()
    got: list[bytes] = []

    def intruder() -> None:
        _, addr, port = store.get("tcp/0").decode().split("|")
        s = socket.create_connection((addr, int(port)))
        hello, _ = auth.make_hello(1, 0)
        s.sendall(hello)
        s.recv(auth.REPLY.size, socket.MSG_WAITALL)
        s.sendall(bytes(auth.PROOF.size))  # cannot compute the proof
        s.settimeout(5)
        got.append(s.recv(1))  # the listener drops it: b""
        s.close()

    meshes = _mesh_pair(store, started=intruder)
    assert got == [b""]
    assert all(not isinstance(m, BaseException) for m in meshes), meshes
    for m in meshes:
        m.close()


def test_shm_segments_are_0600_and_foreign_segments_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpucoll._backends.cpu import shm
    from gpucoll.store import HashStore

    modes: list[int] = []
    real_unlink = shm._unlink

    def spy(path: str) -> None:
        try:
            modes.append(os.stat(path).st_mode & 0o777)
        except FileNotFoundError:
            pass
        real_unlink(path)

    monkeypatch.setattr(shm, "_unlink", spy)
    store = HashStore()
    old = os.umask(0)
    try:
        segs: list[Any] = [None, None]
        ts = [threading.Thread(target=lambda r=r: segs.__setitem__(r, shm.ShmSegment(
            store, r, 2, small_bytes=4096, bulk_bytes=4096, timeout=10.0, spin_seconds=0.0))) for r in (0, 1)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(15)
    finally:
        os.umask(old)
    assert modes and set(modes) == {0o600}, modes
    assert not os.path.exists(segs[0].path)
    for s in segs:
        s.close()
    path = f"/dev/shm/gpucoll-test-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    os.fchmod(fd, 0o644)
    os.ftruncate(fd, 8192)
    os.close(fd)
    try:
        with pytest.raises(OSError, match="mode 644"):
            shm._open_ours(path, 8192, 0x01)
    finally:
        os.unlink(path)


# ----- 4. host identity: same hostname is not same host -----

def test_same_hostname_in_another_network_namespace_is_another_host() -> None:
    from gpucoll._backends.cpu.auth import host_id

    mine = host_id()
    assert mine.startswith(socket.gethostname() + "/")
    assert mine.endswith("/" + str(os.stat("/proc/self/ns/net").st_ino))
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("unshare(1) is not installed: cannot start a process in a new network namespace")
    code = "from gpucoll._backends.cpu.auth import host_id; print(host_id())"
    proc = subprocess.run([unshare, "--net", sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=30, env={**os.environ, "PYTHONPATH": os.getcwd()})
    if proc.returncode != 0:
        pytest.skip(f"this machine forbids new network namespaces: {proc.stderr.strip()[-200:]}")
    other = proc.stdout.strip()
    assert other.split("/")[0] == mine.split("/")[0]  # same hostname
    assert other != mine


# ----- 5. rank 0 killed while creating its segment: nothing left in /dev/shm -----

def shm_init_death_body() -> Any:
    import gpucoll

    r = int(os.environ["RANK"])
    if r == 0:
        def act() -> None:
            real = os.posix_fallocate

            def then_die(fd: int, off: int, n: int) -> None:
                real(fd, off, n)
                os.kill(os.getpid(), signal.SIGKILL)
            os.posix_fallocate = then_die  # type: ignore[assignment]
            gpucoll.init_process_group("cpu", timeout=PG_TIMEOUT)
        return _as_victim(act)
    t0 = time.monotonic()
    try:
        gpucoll.init_process_group("cpu", timeout=PG_TIMEOUT)
    except gpucoll.DistError as exc:
        return time.monotonic() - t0, str(exc)
    raise AssertionError("init succeeded although rank 0 died")


def test_rank0_killed_during_init_leaves_no_segment() -> None:
    pid, (elapsed, msg) = run_spmd(shm_init_death_body, 2, init=False, timeout=60)
    left = [n for n in os.listdir("/dev/shm") if re.fullmatch(rf"gpucoll-(\d+-)?{pid}-[0-9a-f]+", n)]
    assert left == [], left
    assert "rank 0" in msg, msg
    assert elapsed < PG_TIMEOUT + 5.0, elapsed


# ----- 6. object size limit: refused everywhere before sending, group still usable -----

def big_object_body() -> Any:
    import gpucoll

    r = gpucoll.get_rank()
    errors = []
    for call in ("broadcast", "all_gather"):
        try:
            if call == "broadcast":
                gpucoll.broadcast_object_list([b"x" * (2 * MiB)] if r == 0 else [None], src=0)
            else:
                out: list[Any] = [None] * gpucoll.get_world_size()
                gpucoll.all_gather_object(out, b"y" * (2 * MiB if r == 1 else 10))
        except ValueError as exc:
            errors.append(str(exc))
    x = np.full(3, float(r))
    gpucoll.all_reduce(x)
    objs = [{"r": 0}] if r == 0 else [None]
    gpucoll.broadcast_object_list(objs, src=0)
    return errors, x.tolist(), objs


def test_object_over_the_limit_fails_everywhere_and_group_stays_usable() -> None:
    res = run_spmd(big_object_body, 3, pg_timeout=PG_TIMEOUT, timeout=60,
                   env={"GPUCOLL_MAX_OBJECT_BYTES": str(MiB)})
    for errors, x, objs in res:
        assert len(errors) == 2 and all("exceeds the limit" in e for e in errors), errors
        assert "rank 0" in errors[0] and "rank 1" in errors[1], errors
        assert x == [3.0] * 3 and objs == [{"r": 0}]


def test_a_key_set_just_before_its_peer_left_still_wins() -> None:
    """The peer sets the key, finishes and leaves between a rank's look for the key and
    its look at the peer: the key is read, not the peer's departure raised (a rank of a
    group whose peer returned at once failed with "rank 0 shut down its CPU backend while
    the shared-memory segment was set up"). A peer gone without the key still fails, named."""
    from gpucoll._backends.cpu.shm import get_while_alive
    from gpucoll.errors import DistBackendError

    class Store:
        def __init__(self, appears: bool) -> None:
            self.looks, self.appears = 0, appears

        def check(self, keys: list[str]) -> bool:
            self.looks += 1
            return self.appears and self.looks > 1  # set right after the first look

        def get(self, key: str) -> bytes:
            return b"1"

        def wait(self, keys: list[str], timeout: float) -> None:
            raise AssertionError("no wait: the peer is already gone")

    def gone(peer: int) -> str:
        return "shut down its CPU backend"

    deadline = time.monotonic() + 5
    assert get_while_alive(Store(True), "shm/ready", deadline, 0, gone) == "1"
    with pytest.raises(DistBackendError, match="rank 0 shut down its CPU backend while the shared-memory"):
        get_while_alive(Store(False), "shm/ready", deadline, 0, gone)
