"""Benchmark gpucoll's TCPStore, and torch.distributed.TCPStore when torch is importable.

Rows (each run against a server in its own process, clients in other processes):

* latency of one ``set``/``get``/``add``/``check`` from a single client (median, p99);
* ``add`` throughput with 1, 8 and 32 client processes hammering one counter;
* rendezvous of N = 64, 256, 1024 clients: each connects, joins with ``add``, then
  waits on a key that a master client sets once all have joined; the time from the
  start signal until the last client returns from ``wait``. The clients are
  bench/store_loadgen.py's (non-blocking sockets, at most 4,096 per process, speaking
  the server's own protocol: gpucoll's frames, torch's c10d protocol for torch), so
  16,384 of them fit in a few processes; ``--load threads`` uses the real clients
  instead, one thread each in 16 processes;
* ``get`` of a 16 MiB value.

Usage::

    python bench/store_bench.py            # the full run (a few minutes)
    python bench/store_bench.py --quick    # a smoke run (~30 s)
    python bench/store_bench.py --impl gpucoll,gpucoll-tcp,torch --markdown

``gpucoll-tcp`` turns off the Unix-socket path that same-host clients otherwise take;
``gpucoll-torchwire`` is gpucoll's server driven in torch's protocol (rendezvous only).
``floor`` (rendezvous only) is bench/store_floor.c, built with ``cc``: a server that
answers every gpucoll frame at once and keeps nothing, so what its rows show is what any
server pays per client here (the generator's clients, the kernel's TCP), the least a
server can take. The ratio columns are each implementation / torch for the same row of
the same run. ``--rendezvous-only`` adds the servers' CPU per client (from
``/proc/<pid>/stat``, in 10 ms ticks) beside each time.
``floor-py`` (``--ops-only``, add throughput only) is bench/store_floor.py, the same
do-nothing server in Python: what separates it from ``floor`` is what the interpreter
costs per request, which no server in Python avoids. With a floor in the run, a
``gpucoll/floor`` column compares gpucoll's server with it, row by row.
``gpucoll-relays`` (rendezvous only) is gpucoll's server reached through node-local relays,
as ``gpucoll-run --store-relay`` runs a job: each of the generator's processes is a node
whose clients reach their own relay through its Unix socket, as a rank reaches its node's
relay, and each relay (a process of its own) carries them over one TCP connection to the
server. The generator's processes and their clients are the same as in the direct runs;
only where the clients connect differs. Its CPU column is the server's alone (the relays'
runs on their nodes).

``send-unix`` and ``send-tcp`` (``--ops-only``, the ``set`` rows only) time a bare
``socket.send`` from Python of a frame the size of gpucoll's ``set`` frame, in the same
loop as the ``set`` row, to a process that only drains its connections (an epoll loop and
one ``recv`` per wake-up), over the same-host Unix socket and over loopback TCP: what a
``set`` costs a client in Python before any of its own work, on each transport.

``--placement`` (``--ops-only``) adds two ``set`` rows per implementation in each round:
the server's threads pinned to one CPU and the client to the same CPU (``same core``), or
to another (``other core``). A ``set`` has no reply, so its time is the sender's side of
the kernel's hand-over, and that depends on where the reader runs: on the same CPU the
woken reader runs when the scheduler switches to it, usually after several sends; on
another CPU the sender's call wakes it there, and loopback TCP also runs the reader's
receive path in the sender's call. Unpinned, the scheduler mostly keeps one placement for
a whole run, so the plain ``set`` row of one run is one placement or the other; the
pinned rows give both.

torch's server and client call ``getnameinfo()`` on each peer's address, which on
some machines sends a reverse DNS query that stalls for seconds now and then. With
torch in the run the benchmark builds a small ``LD_PRELOAD`` shim (with ``cc``) that
makes those look-ups numeric, and re-runs itself under it; ``--no-numeric-names``
keeps torch's look-ups as they are. The report says which.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import multiprocessing as mp
import os
import resource
import socket
import statistics
import struct
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any, Callable, Iterator

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, _HERE)

import store_loadgen as lg  # noqa: E402  (bench/, beside this file)

_CTX = mp.get_context("fork")  # cheap copies of a parent that has already imported torch
_SPAWN = mp.get_context("spawn")
_TIMEOUT = 120.0


def _raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _torch_available() -> bool:
    try:
        import torch.distributed  # noqa: F401
    except Exception:
        return False
    return True


def _master(impl: str) -> Any:
    if impl == "torch":
        import torch.distributed as dist

        return dist.TCPStore("127.0.0.1", 0, None, True,  # type: ignore[attr-defined]
                             timedelta(seconds=_TIMEOUT), wait_for_workers=False)
    from gpucoll.store import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=_TIMEOUT,
                    use_unix_socket=impl != "gpucoll-tcp")


def _client(impl: str, port: int) -> Any:
    if impl == "torch":
        import torch.distributed as dist

        return dist.TCPStore("127.0.0.1", port, None, False,  # type: ignore[attr-defined]
                             timedelta(seconds=_TIMEOUT))
    from gpucoll.store import TCPStore

    return TCPStore("127.0.0.1", port, timeout=_TIMEOUT, use_unix_socket=impl != "gpucoll-tcp")


def _serve(impl: str, conn: Connection) -> None:
    _raise_nofile()
    store = _master(impl)
    conn.send(store.port)
    conn.recv()  # block until told to stop
    del store


class _Server:
    """A store server in its own process, so that clients never share its CPU time slice
    or (for gpucoll) its GIL."""

    def __init__(self, impl: str) -> None:
        self._conn, child = _CTX.Pipe()
        self._proc = _CTX.Process(target=_serve, args=(impl, child), daemon=True)
        self._proc.start()
        if not self._conn.poll(60):
            raise RuntimeError(f"{impl} store server did not start")
        self.port: int = self._conn.recv()
        self.pid = self._proc.pid

    def stop(self) -> None:
        try:
            self._conn.send(None)
        except OSError:
            pass
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()


class _FloorServer:
    """bench/store_floor.c, built here with the machine's C compiler and run as a process."""

    def __init__(self) -> None:
        import shutil
        import subprocess
        import tempfile

        cc = shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            raise RuntimeError("--impl floor needs a C compiler (cc) to build bench/store_floor.c")
        self._dir = tempfile.mkdtemp(prefix="gpucoll-bench-")
        exe = os.path.join(self._dir, "store_floor")
        subprocess.run([cc, "-O2", "-o", exe, os.path.join(_HERE, "store_floor.c")], check=True)
        self._proc = subprocess.Popen([exe], stdout=subprocess.PIPE)
        self.port, self.pid = _port_of(self._proc, self.stop, "store_floor"), self._proc.pid

    def stop(self) -> None:
        import shutil

        self._proc.kill()
        self._proc.wait(10)
        shutil.rmtree(self._dir, ignore_errors=True)


def _port_of(proc: Any, stop: Callable[[], None], what: str) -> int:
    """The port a server process printed as its first line; ``stop()`` and an error naming
    ``what`` if it printed anything else."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.strip().isdigit():
        stop()
        raise RuntimeError(f"{what} did not start (said {line!r})")
    return int(line)


class _PyFloorServer:
    """bench/store_floor.py, the floor in Python, run as a process."""

    def __init__(self) -> None:
        import subprocess

        self._proc = subprocess.Popen([sys.executable, os.path.join(_HERE, "store_floor.py")],
                                      stdout=subprocess.PIPE)
        self.port, self.pid = _port_of(self._proc, self.stop, "store_floor.py"), self._proc.pid

    def stop(self) -> None:
        self._proc.kill()
        self._proc.wait(10)


_BASE_SERVE = (
    "import sys\n"
    "from gpucoll.store import TCPStore\n"
    "s = TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False, timeout=120.0)\n"
    "print(s.port, flush=True)\n"
    "sys.stdin.read()\n")


class _TreeServer:
    """gpucoll's server imported from another checkout (``--base-tree``), in a process of
    its own: ``--impl gpucoll-base`` beside ``gpucoll`` compares two versions of the server
    in one run, both driven by this tree's client."""

    def __init__(self, tree: str) -> None:
        import subprocess

        env = dict(os.environ)
        env["PYTHONPATH"] = os.path.abspath(tree)
        self._proc = subprocess.Popen([sys.executable, "-c", _BASE_SERVE], stdout=subprocess.PIPE,
                                      stdin=subprocess.PIPE, env=env, cwd=os.path.abspath(tree))
        self.port, self.pid = _port_of(self._proc, self.stop, f"the server from {tree}"), self._proc.pid

    def stop(self) -> None:
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.close()
            self._proc.wait(10)
        except Exception:
            self._proc.kill()
            self._proc.wait(10)


class _RelayedServer:
    """gpucoll's server with ``relays`` relays in front of it, each in a process of its own
    (as each node's gpucoll-run runs one); ``relay_ports[i]`` serves generator process i."""

    def __init__(self, relays: int) -> None:
        self._server = _Server("gpucoll")
        self.port, self.pid = self._server.port, self._server.pid
        self._relays = [lg.start_relay(self.port) for _ in range(relays)]
        self.relay_ports = [r[2] for r in self._relays]

    def stop(self) -> None:
        for relay in self._relays:
            lg.stop_relay(relay)
        self._server.stop()


def _cpu_split(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of process ``pid`` and its threads so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tck = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tck, int(fields[12]) / tck


def _cpu_seconds(pid: int) -> float:
    """User plus system CPU of process ``pid`` and its threads so far."""
    return sum(_cpu_split(pid))


_PLACEMENTS = ("same core", "other core")
"""The pinned ``set`` rows of ``--placement`` (see the module's docstring)."""


def _pin_threads(pid: int, cpus: set[int]) -> None:
    """Set the CPU affinity of every thread of process ``pid`` (``sched_setaffinity`` of a
    pid sets only the thread with that id)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            pass


@contextlib.contextmanager
def _placed(server_pid: int, where: str) -> Iterator[tuple[int, int]]:
    """Pin the server's threads to this process's first allowed CPU and this thread to
    the same CPU (``same core``) or the next allowed one (``other core``); yield the two
    CPUs, and give both back every CPU they had.

    Raises:
        ValueError: ``where`` is not one of :data:`_PLACEMENTS`.
        RuntimeError: ``other core`` with only one CPU allowed.
    """
    mine = os.sched_getaffinity(0)
    theirs = os.sched_getaffinity(server_pid)
    allowed = sorted(mine & theirs)
    if where not in _PLACEMENTS:
        raise ValueError(f"placement {where!r}: one of {_PLACEMENTS}")
    if not allowed or (where == "other core" and len(allowed) < 2):
        raise RuntimeError(f"--placement needs two CPUs that the client and the server may both "
                           f"use; allowed: {allowed}")
    server_cpu = allowed[0]
    client_cpu = allowed[1] if where == "other core" else server_cpu
    _pin_threads(server_pid, {server_cpu})
    try:
        os.sched_setaffinity(0, {client_cpu})
        yield server_cpu, client_cpu
    finally:
        os.sched_setaffinity(0, mine)
        _pin_threads(server_pid, theirs)


_SENDS = ("send-unix", "send-tcp")
"""Bare sends to a draining reader (see the module's docstring): the set rows only."""

_SET_FRAME = bytes(34)
"""The size of gpucoll's frame for ``set("lat/k", 16 bytes)`` (header 5, two fields)."""


def _drain(kind: str, conn: Connection) -> None:
    """Accept connections on ``kind``'s listener and read whatever arrives, nothing else."""
    import select

    if kind == "send-unix":
        ls = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        name = f"\0gpucoll-bench-drain/{os.getpid()}"
        ls.bind(name)
        addr: Any = name
    else:
        ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        ls.bind(("127.0.0.1", 0))
        addr = ls.getsockname()
    ls.listen(64)
    ls.setblocking(False)
    ep = select.epoll()
    ep.register(ls.fileno(), select.EPOLLIN)
    ep.register(conn.fileno(), select.EPOLLIN)
    socks: dict[int, socket.socket] = {}
    buf = bytearray(1 << 16)
    conn.send(addr)
    while True:
        for fd, _ in ep.poll():
            if fd == conn.fileno():
                return  # told to stop
            if fd == ls.fileno():
                try:
                    sock, _ = ls.accept()
                except BlockingIOError:
                    continue
                sock.setblocking(False)
                socks[sock.fileno()] = sock
                ep.register(sock.fileno(), select.EPOLLIN)
                continue
            sock = socks[fd]
            try:
                n = sock.recv_into(buf)
            except BlockingIOError:
                continue
            if not n:
                del socks[fd]
                sock.close()


class _DrainServer:
    """A reader for ``send-unix``/``send-tcp`` in its own process (see ``_drain``)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._conn, child = _CTX.Pipe()
        self._proc = _CTX.Process(target=_drain, args=(kind, child), daemon=True)
        self._proc.start()
        if not self._conn.poll(60):
            raise RuntimeError(f"{kind} reader did not start")
        self.addr: Any = self._conn.recv()
        self.port = 0
        self.pid = self._proc.pid

    def stop(self) -> None:
        self._conn.send(None)
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()


def _send_latency(server: _DrainServer, iters: int) -> tuple[float, float]:
    """The ``set`` row's loop around a bare send of a ``set``-sized frame: median, p99 (us)."""
    if server.kind == "send-unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(server.addr)
    else:
        sock = socket.create_connection(server.addr)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as gpucoll's and torch's
    # A send that finds no room for 10 s fails (EAGAIN) rather than hang; set in the kernel,
    # as gpucoll's client does, since a Python-level timeout would poll before each send.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 10, 0))
    try:
        send = sock.send
        frame = _SET_FRAME
        for _ in range(min(200, iters)):
            send(frame)
        samples = []
        for _ in range(iters):
            t0 = time.perf_counter_ns()
            send(frame)
            samples.append(time.perf_counter_ns() - t0)
    finally:
        sock.close()
    samples.sort()
    return statistics.median(samples) / 1e3, samples[int(0.99 * (len(samples) - 1))] / 1e3


# -- workloads ------------------------------------------------------------------------------

def _latency(impl: str, port: int, iters: int,
             only: tuple[str, ...] | None = None) -> dict[str, tuple[float, float]]:
    """Median and p99 (us) of each op of ``only`` (every op when None) from one client."""
    store = _client(impl, port)
    store.set("lat/k", b"x" * 16)
    ops: dict[str, Callable[[], Any]] = {
        "set": lambda: store.set("lat/k", b"x" * 16),
        "get": lambda: store.get("lat/k"),
        "add": lambda: store.add("lat/n", 1),
        "check": lambda: store.check(["lat/k"]),
    }
    out = {}
    for name, op in ops.items():
        if only is not None and name not in only:
            continue
        for _ in range(min(200, iters)):
            op()
        samples = []
        for _ in range(iters):
            t0 = time.perf_counter_ns()
            op()
            samples.append(time.perf_counter_ns() - t0)
        samples.sort()
        out[name] = (statistics.median(samples) / 1e3, samples[int(0.99 * (len(samples) - 1))] / 1e3)
    return out


def _adder(impl: str, port: int, seconds: float, barrier: Any, results: Any) -> None:
    store = _client(impl, port)
    store.add("tput/warm", 1)
    barrier.wait()
    n = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        store.add("tput/n", 1)
        n += 1
    results.put(n)


def _throughput(impl: str, port: int, clients: int, seconds: float) -> float:
    barrier = _CTX.Barrier(clients + 1)
    results = _CTX.Queue()
    procs = [_CTX.Process(target=_adder, args=(impl, port, seconds, barrier, results), daemon=True)
             for _ in range(clients)]
    for p in procs:
        p.start()
    barrier.wait(timeout=_TIMEOUT)
    total = sum(int(results.get(timeout=_TIMEOUT)) for _ in procs)
    for p in procs:
        p.join(10)
    return total / seconds


def _joiner(impl: str, port: int, n: int, threads: int, tag: str, start: Any, results: Any) -> None:
    ends: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()

    ready = threading.Barrier(threads, action=lambda: results.put("ready"))

    go = threading.Event()  # one thread per process waits on the cross-process event

    def one() -> None:
        try:
            ready.wait()
            go.wait()
            store = _client(impl, port)
            if store.add(f"{tag}/joined", 1) == n:
                store.set(f"{tag}/all", b"1")
            store.wait([f"{tag}/go"])
            t = time.monotonic()
            with lock:
                ends.append(t)
        except Exception as e:  # reported to the parent, which fails the row
            with lock:
                errors.append(f"{type(e).__name__}: {e}")

    ts = [threading.Thread(target=one) for _ in range(threads)]
    for t in ts:
        t.start()
    start.wait()
    go.set()
    for t in ts:
        t.join()
    results.put((ends, errors))


_SOURCES = itertools.count()
_PER_PROCESS = 4096
"""Load-generator clients per process (the open-file limit here is 20,000)."""


def _gen_joiner(protocol: str, port: int, n: int, k: int, tag: str, start: Any,
                results: Any, source: str, unix: str | None = None) -> None:
    _raise_nofile()
    script = lg.rendezvous_script(tag, n)
    results.put("ready")
    start.wait()
    try:
        results.put((lg.drive("127.0.0.1", port, protocol, [script] * k, timeout=_TIMEOUT,
                              source=source, unix=unix), []))
    except Exception as e:  # reported to the parent, which fails the row
        results.put(([], [f"{type(e).__name__}: {e}"]))


def _rendezvous(impl: str, port: int, n: int, run: int, load: str = "threads",
                relay_ports: list[int] | None = None) -> float:
    tag = f"rdv{n}-{run}"
    if load == "loadgen":
        nproc = max(1, -(-n // _PER_PROCESS))
        protocol = "torch" if impl in ("torch", "gpucoll-torchwire") else "gpucoll"
        worker: Callable[..., None] = _gen_joiner
        first: Any = protocol
    else:
        nproc = min(16, n)
        worker = _joiner
        first = impl
    # The generator's processes start fresh (spawn), not as copies of this one: once torch
    # is imported here, forked copies carry its modules, and the implementation measured
    # after the import got slower generators than the one measured before it.
    ctx = _SPAWN if load == "loadgen" else _CTX
    start = ctx.Event()
    results = ctx.Queue()
    per = [n // nproc + (1 if i < n % nproc else 0) for i in range(nproc)]
    procs = []
    from gpucoll.store._sockets import unix_socket_name

    for i, k in enumerate(per):
        # With relays, this process is a node: its clients reach its relay's Unix socket.
        to = port if relay_ports is None else relay_ports[i]
        a: tuple[Any, ...] = (first, to, n, k, tag, start, results)
        if load == "loadgen":
            # Its own loopback address, hence its own local ports (see lg.drive).
            src = next(_SOURCES)
            a += (f"127.{1 + src // 62500 % 250}.{src // 250 % 250}.{1 + src % 250}",
                  None if relay_ports is None else unix_socket_name("127.0.0.1", to))
        procs.append(ctx.Process(target=worker, args=a, daemon=True))
    for p in procs:
        p.start()
    # The floor server answers every wait at once: it has no master to release them.
    master = None if impl == "floor" else _client(impl, port)
    for _ in procs:  # every worker's threads are at start.wait()
        if results.get(timeout=_TIMEOUT) != "ready":
            raise RuntimeError("rendezvous worker out of step")
    t0 = time.monotonic()
    start.set()
    if master is not None:
        master.wait([f"{tag}/all"])
        master.set(f"{tag}/go", b"1")
    ends: list[float] = []
    for _ in procs:
        e, errs = results.get(timeout=_TIMEOUT)
        if errs:
            raise RuntimeError(f"{impl} rendezvous of {n}: {len(errs)} clients failed: {errs[0]}")
        ends += e
    for p in procs:
        p.join(10)
    return float(max(ends) - t0)


def _big_get(impl: str, port: int, size: int, iters: int) -> float | str:
    store = _client(impl, port)
    value = os.urandom(size)
    try:
        store.set("big", value)
        assert store.get("big") == value
    except Exception as e:
        return f"refused ({type(e).__name__}: {str(e)[:40]})"
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        store.get("big")
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


# -- the run --------------------------------------------------------------------------------

@dataclass
class Row:
    name: str
    unit: str
    values: dict[str, float | str]
    higher_is_better: bool = False


def run(impl: str, args: argparse.Namespace) -> list[Row]:
    # Import before forking workers, so that no timed section pays for an import.
    if impl == "torch":
        import torch.distributed  # noqa: F401
    else:
        import gpucoll.store  # noqa: F401
    rows: list[Row] = []
    server = _Server(impl)
    try:
        if not args.rendezvous_only:
            lat = _latency(impl, server.port, args.iters)
            for op, (med, p99) in lat.items():
                rows.append(Row(f"{op} latency, median", "us", {impl: med}))
                rows.append(Row(f"{op} latency, p99", "us", {impl: p99}))
            for c in args.clients:
                rows.append(Row(f"add throughput, {c} clients", "ops/s",
                                {impl: _throughput(impl, server.port, c, args.seconds)}, True))
        for n in args.rendezvous:
            times = [_rendezvous(impl, server.port, n, r, args.load) for r in range(args.repeats)]
            rows.append(Row(f"rendezvous, {n} clients", "s", {impl: statistics.median(times)}))
        if not args.rendezvous_only:
            rows.append(Row("get 16 MiB, median", "ms",
                            {impl: _big_get(impl, server.port, 16 << 20, args.big_iters)}))
    finally:
        server.stop()
    return rows


def _merge(parts: list[list[Row]]) -> list[Row]:
    merged: dict[str, Row] = {}
    for rows in parts:
        for r in rows:
            if r.name in merged:
                merged[r.name].values.update(r.values)
            else:
                merged[r.name] = Row(r.name, r.unit, dict(r.values), r.higher_is_better)
    return list(merged.values())


_FLOORS = ("floor", "floor-py")
"""The do-nothing servers (bench/store_floor.c and .py): add-throughput rows only."""


def _fmt(v: float | str | None) -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    if v >= 1000:
        return f"{v:,.0f}"
    if v >= 10:
        return f"{v:.1f}"
    return f"{v:.3g}"


def report(rows: list[Row], impls: list[str], markdown: bool) -> str:
    # Each implementation against torch; gpucoll's server also against each floor.
    ratios = [(i, "torch") for i in impls if i != "torch"] if "torch" in impls else []
    ratios += [("gpucoll", f) for f in _FLOORS + ("gpucoll-base",) if f in impls and "gpucoll" in impls]
    head = ["metric", "unit"] + impls + [f"{a}/{b}" for a, b in ratios]
    lines = []
    for r in rows:
        cells = [r.name, r.unit] + [_fmt(r.values.get(i)) for i in impls]
        for a, b in ratios:
            g, t = r.values.get(a), r.values.get(b)
            cells.append(f"{g / t:.2f}x" if isinstance(g, float) and isinstance(t, float) and t else "-")
        lines.append(cells)
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        out += ["| " + " | ".join(c) + " |" for c in lines]
        return "\n".join(out)
    widths = [max(len(x[i]) for x in [head] + lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(wd) for c, wd in zip(cells, widths)) for cells in [head] + lines)


_NUMERIC_ENV = "GPUCOLL_BENCH_NUMERIC_NAMES"
_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <netdb.h>
#include <sys/socket.h>
typedef int (*fn_t)(const struct sockaddr *, socklen_t, char *, socklen_t, char *, socklen_t, int);
int getnameinfo(const struct sockaddr *sa, socklen_t salen, char *host, socklen_t hostlen,
                char *serv, socklen_t servlen, int flags) {
    static fn_t real;
    if (!real) real = (fn_t)dlsym(RTLD_NEXT, "getnameinfo");
    return real(sa, salen, host, hostlen, serv, servlen, flags | NI_NUMERICHOST | NI_NUMERICSERV);
}
"""


def _rerun_numeric(argv: list[str] | None) -> None:
    """Build the getnameinfo shim and exec this benchmark again under it; return (with a
    note) when there is no C compiler."""
    import shutil
    import subprocess
    import tempfile

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        print("# no C compiler: torch's getnameinfo() look-ups stay as they are", file=sys.stderr)
        return
    d = tempfile.mkdtemp(prefix="gpucoll-bench-")
    src, lib = os.path.join(d, "numeric_names.c"), os.path.join(d, "numeric_names.so")
    with open(src, "w") as f:
        f.write(_SHIM)
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", lib, src, "-ldl"], check=True)
    env = dict(os.environ)
    env["LD_PRELOAD"] = " ".join(x for x in (env.get("LD_PRELOAD"), lib) if x)
    env[_NUMERIC_ENV] = lib
    args = sys.argv[1:] if argv is None else argv
    os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *args], env)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="few iterations, small N: a smoke run")
    p.add_argument("--impl", default=None,
                   help="comma list of gpucoll, gpucoll-tcp (no Unix-socket fast path), torch, "
                        "gpucoll-torchwire, floor, floor-py, send-unix, send-tcp (--ops-only) and gpucoll-relays "
                        "(rendezvous only; see above) "
                        "(default: gpucoll,torch, or gpucoll alone when torch does not import)")
    p.add_argument("--repeats", type=int, default=None, help="rendezvous runs per size (median)")
    p.add_argument("--clients", default=None, help="comma list of add-throughput client counts")
    p.add_argument("--rendezvous", default=None, help="comma list of rendezvous sizes")
    p.add_argument("--markdown", action="store_true", help="print a markdown table")
    p.add_argument("--rendezvous-only", action="store_true",
                   help="only the rendezvous rows, the implementations taking turns")
    p.add_argument("--ops-only", action="store_true",
                   help="only the latency and add-throughput rows, every server up at once and "
                        "the implementations taking turns, --repeats rounds (median); floor "
                        "joins the add-throughput rows, driven by gpucoll's client")
    p.add_argument("--load", choices=("loadgen", "threads"), default="loadgen",
                   help="rendezvous clients: the load generator (default) or real clients in threads")
    p.add_argument("--base-tree", default=None,
                   help="another gpucoll checkout whose server --impl gpucoll-base runs (--ops-only), "
                        "driven by this tree's client: an A/B of two servers in one run")
    p.add_argument("--seconds", type=float, default=None, help="seconds per add-throughput row")
    p.add_argument("--placement", action="store_true",
                   help="(--ops-only) add the set rows with the server and the client pinned to one "
                        "CPU, and to two (see above)")
    p.add_argument("--no-numeric-names", action="store_true",
                   help="leave torch's getnameinfo() look-ups as they are (see above)")
    args = p.parse_args(argv)
    args.iters = 500 if args.quick else 5000
    args.seconds = args.seconds or (0.5 if args.quick else 3.0)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.big_iters = 3 if args.quick else 10
    args.clients = [int(x) for x in (args.clients or ("1,8" if args.quick else "1,8,32")).split(",")]
    args.rendezvous = [int(x) for x in (args.rendezvous or ("64" if args.quick else "64,256,1024")).split(",")]
    impls = args.impl.split(",") if args.impl else (["gpucoll", "torch"] if _torch_available() else ["gpucoll"])
    if args.ops_only and args.rendezvous_only:
        p.error("--ops-only and --rendezvous-only exclude each other")
    for only in _SENDS:
        if only in impls and not args.ops_only:
            p.error(f"--impl {only} has only the set rows: add --ops-only")
    if args.placement and not args.ops_only:
        p.error("--placement adds to the --ops-only rows: add --ops-only")
    if "gpucoll-base" in impls and not (args.ops_only and args.base_tree):
        p.error("--impl gpucoll-base needs --ops-only and --base-tree")
    if "floor-py" in impls and not args.ops_only:
        p.error("--impl floor-py has only the add-throughput rows: add --ops-only")
    for only in ("floor", "gpucoll-relays"):
        if only == "floor" and args.ops_only:
            continue
        if only in impls and not (args.rendezvous_only and args.load == "loadgen"):
            p.error(f"--impl {only} has only the rendezvous rows, with the load generator: add "
                    f"--rendezvous-only{' (or --ops-only)' if only == 'floor' else ''}")
    if "gpucoll-relays" in impls and args.ops_only:
        p.error("--impl gpucoll-relays has only the rendezvous rows: add --rendezvous-only")
    if "torch" in impls and not args.no_numeric_names and _NUMERIC_ENV not in os.environ:
        _rerun_numeric(argv)  # does not return when the shim builds
    _raise_nofile()
    if "torch" in impls:
        names = "numeric (LD_PRELOAD shim)" if os.environ.get(_NUMERIC_ENV) else "as torch makes them"
        print(f"# torch's getnameinfo() look-ups: {names}", file=sys.stderr)
    if args.rendezvous_only:
        print(report(interleaved(impls, args), impls, args.markdown))
        return 0
    if args.ops_only:
        print(report(interleaved_ops(impls, args), impls, args.markdown))
        return 0
    parts = []
    for impl in impls:
        t0 = time.monotonic()
        parts.append(run(impl, args))
        print(f"# {impl}: {time.monotonic() - t0:.1f} s", file=sys.stderr)
    print(report(_merge(parts), impls, args.markdown))
    return 0


def interleaved(impls: list[str], args: argparse.Namespace) -> list[Row]:
    """The rendezvous rows with every implementation's server up at once, taking turns
    (the order rotating) at each size and repeat: on a shared machine, each ratio then
    compares runs made within seconds of each other, not minutes apart."""
    import gpucoll.store  # noqa: F401

    # gpucoll's servers are forked before torch is imported: a server forked from a parent
    # holding torch's modules would carry them in its heap, and every full garbage
    # collection in the server's loop would walk them.
    nodes = max(1, -(-max(args.rendezvous) // _PER_PROCESS))  # the most generator processes a size uses
    servers: dict[str, _Server | _FloorServer | _RelayedServer] = {
        impl: _FloorServer() if impl == "floor" else _RelayedServer(nodes) if impl == "gpucoll-relays"
        else _Server(impl) for impl in impls if impl != "torch"}
    if "torch" in impls:
        import torch.distributed  # noqa: F401

        servers["torch"] = _Server("torch")
    try:
        rows = []
        for n in args.rendezvous:
            times: dict[str, list[float]] = {impl: [] for impl in impls}
            cpus: dict[str, list[float]] = {impl: [] for impl in impls}
            for r in range(args.repeats):
                for k in range(len(impls)):
                    impl = impls[(r + k) % len(impls)]
                    if impl in _SENDS:
                        continue
                    before = _cpu_seconds(servers[impl].pid)
                    srv = servers[impl]
                    times[impl].append(_rendezvous(impl, srv.port, n, r, args.load,
                                                   srv.relay_ports if isinstance(srv, _RelayedServer) else None))
                    cpus[impl].append((_cpu_seconds(servers[impl].pid) - before) / n * 1e6)
            rows.append(Row(f"rendezvous, {n} clients", "s",
                            {impl: statistics.median(t) for impl, t in times.items()}))
            rows.append(Row(f"server CPU per client, {n} clients", "us",
                            {impl: statistics.median(c) for impl, c in cpus.items()}))
            print(f"# {n} clients: " + ", ".join(f"{i} {' '.join(f'{x:.3f}' for x in t)}"
                                                 for i, t in times.items()), file=sys.stderr)
        return rows
    finally:
        for srv in servers.values():
            srv.stop()


def interleaved_ops(impls: list[str], args: argparse.Namespace) -> list[Row]:
    """The latency and add-throughput rows with every implementation's server up at once,
    taking turns (the order rotating) in each of ``--repeats`` rounds; each row is the
    median of its rounds. Each add-throughput row has a server-CPU row beside it: the
    server process's user and system CPU (``/proc/<pid>/stat``, 10 ms ticks) over the
    adds it served, in microseconds per add. ``floor`` (bench/store_floor.c, driven by
    gpucoll's own client) and ``floor-py`` (bench/store_floor.py, the same in Python)
    have only the add-throughput rows: they answer every request with "1"."""
    import gpucoll.store  # noqa: F401

    servers: dict[str, _Server | _FloorServer | _PyFloorServer | _DrainServer | _TreeServer] = {
        impl: _FloorServer() if impl == "floor" else _PyFloorServer() if impl == "floor-py"
        else _TreeServer(args.base_tree) if impl == "gpucoll-base"
        # Beside another checkout's server, this one's is started the same way (a fresh
        # process, not a fork of this one), so that only the code differs.
        else _TreeServer(os.path.dirname(_HERE)) if impl == "gpucoll" and "gpucoll-base" in impls
        else _DrainServer(impl) if impl in _SENDS
        else _Server(impl) for impl in impls if impl != "torch"}
    if "torch" in impls:
        import torch.distributed  # noqa: F401

        servers["torch"] = _Server("torch")
    samples: dict[tuple[str, str], list[float]] = {}
    try:
        for r in range(args.repeats):
            for k in range(len(impls)):
                impl = impls[(r + k) % len(impls)]
                if impl in _FLOORS:
                    continue
                srv = servers[impl]
                for where in _PLACEMENTS if getattr(args, "placement", False) else ():
                    with _placed(srv.pid, where):
                        med = (_send_latency(srv, args.iters) if isinstance(srv, _DrainServer)
                               else _latency(impl, srv.port, args.iters, ("set",))["set"])[0]
                    samples.setdefault((f"set latency, {where}, median", impl), []).append(med)
                if isinstance(srv, _DrainServer):
                    med, p99 = _send_latency(srv, args.iters)
                    samples.setdefault(("set latency, median", impl), []).append(med)
                    samples.setdefault(("set latency, p99", impl), []).append(p99)
                    continue
                for op, (med, p99) in _latency(impl, srv.port, args.iters).items():
                    samples.setdefault((f"{op} latency, median", impl), []).append(med)
                    samples.setdefault((f"{op} latency, p99", impl), []).append(p99)
            for c in args.clients:
                for k in range(len(impls)):
                    impl = impls[(r + k) % len(impls)]
                    if impl in _SENDS:
                        continue
                    u0, s0 = _cpu_split(servers[impl].pid)
                    ops = _throughput(impl, servers[impl].port, c, args.seconds)
                    u1, s1 = _cpu_split(servers[impl].pid)
                    samples.setdefault((f"add throughput, {c} clients", impl), []).append(ops)
                    # Where the server's time goes: every server here makes the same system
                    # calls per add (one recv, one send, a share of one epoll_wait), so what
                    # separates them is their own CPU per request, in user and in system mode.
                    per = 1e6 / max(1.0, ops * args.seconds)
                    samples.setdefault((f"server CPU per add, {c} clients", impl), []).append(
                        (u1 - u0 + s1 - s0) * per)
                    samples.setdefault((f"  user, {c} clients", impl), []).append((u1 - u0) * per)
                    samples.setdefault((f"  system, {c} clients", impl), []).append((s1 - s0) * per)
            print(f"# round {r}: " + "; ".join(
                f"{name} {impl} {vals[-1]:.1f}" for (name, impl), vals in samples.items()
                if "throughput" in name), file=sys.stderr)
    finally:
        for srv in servers.values():
            srv.stop()
    rows: dict[str, Row] = {}
    for (name, impl), vals in samples.items():
        row = rows.setdefault(name, Row(name, "ops/s" if "throughput" in name else "us", {},
                                        "throughput" in name))
        row.values[impl] = statistics.median(vals)
    return list(rows.values())


if __name__ == "__main__":
    sys.exit(main())
