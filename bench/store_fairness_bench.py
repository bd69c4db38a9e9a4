"""A well-behaved TCPStore client's latency while hostile clients hit the same server.

The server runs in its own process; a good client (this process) runs set/get/add
rounds and records each round's latency, first with nobody else connected (the
anchor), then while each hostile load runs in other processes:

* ``fuzz``: an authenticated client sends rounds of ``--frames`` fuzzed frames (random bytes, huge announced
  lengths, valid headers with random fields, well-formed requests with odd contents),
  reconnecting whenever the server drops it;
* ``idle``: hundreds of connections that never complete their HELLO (slowloris);
* ``flood``: a client pipelining well-formed ``add`` requests as fast as it can.

Reported per load: rounds, median, p99 and worst round latency, and the worst as a
ratio to the quiet run's p99. The target: a good client's worst latency under hostile
load <= 100 ms.

Usage::

    python bench/store_fairness_bench.py [--frames 1500] [--seconds 5]
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import struct
import subprocess
import sys
import textwrap
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SERVER = textwrap.dedent("""
    import sys
    from gpucoll.store._server import StoreServer
    s = StoreServer("127.0.0.1", 0, token=b"tok", max_key_size=65536, max_value_size=512 << 20)
    print(s.port, flush=True)
    sys.stdin.read()
    s.close()
""")


def _frame(code: int, fields: list[bytes]) -> bytes:
    body = bytes([code]) + b"".join(struct.pack("<I", len(f)) + f for f in fields)
    return struct.pack("<I", len(body)) + body


def _hello() -> bytes:
    return _frame(1, [b"GPCS" + (1).to_bytes(2, "little"), b"tok", b""])


def fuzz(port: int, frames: int, seconds: float) -> None:
    """Rounds of ``frames`` fuzzed frames (new seed each round) for ``seconds``."""
    end = time.monotonic() + seconds
    seed = 7
    while True:
        fuzz_round(port, frames, seed)
        seed += 1
        if time.monotonic() > end:
            return


def fuzz_round(port: int, frames: int, seed: int) -> None:
    rng = random.Random(seed)

    def one() -> bytes:
        kind = rng.random()
        if kind < 0.3:
            return rng.randbytes(rng.randint(1, 200))
        if kind < 0.5:
            return struct.pack("<IB", rng.randint(1 << 20, 1 << 30), rng.randint(0, 20)) + b"x" * 5
        if kind < 0.8:
            body = bytes([rng.randint(0, 20)]) + rng.randbytes(rng.randint(0, 64))
            return struct.pack("<I", len(body)) + body
        code = rng.choice([2, 3, 4, 6, 7, 13])
        key = rng.randbytes(8)
        if code in (3, 6, 13):
            return _frame(code, [struct.pack("<d", rng.choice([0.0, 1e-3, -1.0])), key])
        if code == 4:
            return _frame(code, [key, rng.choice([b"1", b"x", b"9" * 70])])
        return _frame(code, [key, rng.randbytes(rng.randint(0, 1000))])

    sent = 0
    s: socket.socket | None = None
    while sent < frames:
        if s is None:
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(_hello())
        try:
            s.sendall(one())
            sent += 1
        except OSError:
            s.close()
            s = None
    if s is not None:
        s.close()


def idle(port: int, count: int, seconds: float) -> None:
    socks = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        # Keep ``count`` connections open that never finish their HELLO; replace dropped ones.
        socks = [s for s in socks if not _closed(s)]
        while len(socks) < count and time.monotonic() < end:
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                s.sendall(_hello()[:3])
                socks.append(s)
            except OSError:
                break
        time.sleep(0.05)
    for s in socks:
        s.close()


def _closed(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def flood(port: int, seconds: float) -> None:
    """Pipeline ``add`` requests without waiting for replies (reconnecting when the
    server drops the connection for it)."""
    batch = _frame(4, [b"flood", b"1"]) * 256
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(_hello())
        s.recv(4096)
        s.setblocking(False)
        try:
            while time.monotonic() < end:
                try:
                    s.send(batch)
                except BlockingIOError:
                    time.sleep(0.0005)
                try:
                    while s.recv(1 << 20):
                        pass
                except BlockingIOError:
                    pass
        except OSError:
            pass
        finally:
            s.close()


def _rounds(store: object, until: "callable", limit_s: float) -> list[float]:  # type: ignore[valid-type]
    out: list[float] = []
    end = time.monotonic() + limit_s
    n = 0
    while until() and time.monotonic() < end:
        t0 = time.perf_counter()
        store.set(f"k{n % 64}", b"v" * 100)  # type: ignore[attr-defined]
        store.get(f"k{n % 64}")  # type: ignore[attr-defined]
        store.add("good", 1)  # type: ignore[attr-defined]
        out.append(time.perf_counter() - t0)
        n += 1
    return out


def _summary(name: str, lat: list[float], anchor_p99: float | None) -> str:
    lat = sorted(lat)
    p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
    worst = lat[-1]
    ratio = f"{worst / anchor_p99:.1f}x" if anchor_p99 else "-"
    return (f"{name:<8} rounds={len(lat):>6}  median={statistics.median(lat) * 1e3:7.3f} ms  "
            f"p99={p99 * 1e3:7.3f} ms  worst={worst * 1e3:8.2f} ms  worst/quiet-p99={ratio}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frames", type=int, default=1500, help="fuzzed frames (default 1500)")
    p.add_argument("--idle", type=int, default=300, help="idle connections (default 300)")
    p.add_argument("--seconds", type=float, default=3.0, help="length of the idle/flood loads")
    p.add_argument("--role", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role == "fuzz":
        fuzz(args.port, args.frames, args.seconds)
        return 0
    if args.role == "idle":
        idle(args.port, args.idle, args.seconds)
        return 0
    if args.role == "flood":
        flood(args.port, args.seconds)
        return 0

    from gpucoll.store import TCPStore

    env = {**os.environ, "PYTHONPATH": _REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    server = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        # Over TCP, like the hostile clients.
        store = TCPStore("127.0.0.1", port, timeout=30, token="tok", use_unix_socket=False)
        quiet_end = time.monotonic() + args.seconds
        quiet = _rounds(store, lambda: time.monotonic() < quiet_end, args.seconds + 1)
        anchor = sorted(quiet)[int(0.99 * (len(quiet) - 1))]
        print(_summary("quiet", quiet, None))
        for role in ("fuzz", "idle", "flood"):
            hostile = subprocess.Popen(
                [sys.executable, __file__, "--role", role, "--port", str(port), "--frames",
                 str(args.frames), "--idle", str(args.idle), "--seconds", str(args.seconds)],
                env=env)
            time.sleep(0.1)
            lat = _rounds(store, lambda: hostile.poll() is None, 60.0)
            hostile.wait(30)
            print(_summary(role, lat, anchor))
        store.close()
    finally:
        assert server.stdin is not None
        server.stdin.close()
        server.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
