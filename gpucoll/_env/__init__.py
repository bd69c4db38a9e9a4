"""Every ``GPUCOLL_*`` environment variable gpucoll reads or sets, named once.

Code reads and sets them through these constants only; a string that is exactly a
``GPUCOLL_*`` name appears nowhere else in the package (tests/api/test_layout.py
checks, and checks that every ``GPUCOLL_*`` name mentioned in the package's prose
(docstrings, comments, messages) is one of these). The rank-environment contract
itself (which variables a launcher sets for each rank) is written in
:mod:`gpucoll.clusters.env`.

This is the package's bottom layer: it imports nothing of gpucoll, so stores, backends,
debug tools and launchers all name variables from here, and none of them needs
``clusters`` (which reads a launcher's environment) only for a name.
"""

from __future__ import annotations

from typing import Final

# -- the job's store (set by launchers: gpucoll-run, gpucoll.testing, gpucoll-bench) -------

STORE_HOSTED_ENV: Final = "GPUCOLL_STORE_HOSTED"
"""Set to "1" by a launcher (gpucoll-run, gpucoll.testing) that already runs the job's
TCPStore server at MASTER_ADDR:MASTER_PORT: then every rank, rank 0 included,
connects as a client instead of rank 0 hosting the server."""

STORE_TOKEN_ENV: Final = "GPUCOLL_STORE_TOKEN"
"""The shared secret a TCPStore client presents before any other request."""

STORE_RELAY_ENV: Final = "GPUCOLL_STORE_RELAY"
"""``HOST:PORT`` of this node's store relay, set by gpucoll-run's agent when relays are on
(``--store-relay``): with GPUCOLL_STORE_HOSTED=1 a rank reaches the job's store through it
instead of MASTER_ADDR:MASTER_PORT. Unset or empty: directly."""

BACKEND_ENV: Final = "GPUCOLL_BACKEND"
"""The backend ``init_process_group()`` picks when called without one ("cpu" or "nccl"), set
per rank by a launcher asked for one (``gpucoll.ray.run(backend=...)``). Unset or empty: NCCL
where a GPU and NCCL are usable, else cpu."""

DEATH_RECORDS_ENV: Final = "GPUCOLL_DEATH_RECORDS"
"""Set to "1" by a launcher that writes a record into the job's store when it sees a rank die
(``gpucoll.ray``): a CPU backend that loses a peer then waits briefly for that record, so its
error names the dead process (node, pid) and the launcher's reason (gpucoll/_backends/deaths.py)."""

# -- the launcher (gpucoll-run) and its workers ---------------------------------------------

ERROR_FILE_ENV: Final = "GPUCOLL_ERROR_FILE"
"""The file a rank writes its uncaught exception to, for the launcher's summary."""

CPU_BIND_ENV: Final = "GPUCOLL_CPU_BIND"
"""The CPUs a rank binds itself to before its program runs ("3", or "2,66" for a core's two
hardware threads), set per rank by a launcher asked to bind (``gpucoll-run --bind-to core``,
``run_spmd(bind_to="core")``). Unset or empty: no binding."""

LAUNCHER_PID_ENV: Final = "GPUCOLL_LAUNCHER_PID"
"""The launcher's pid, set for its workers: a worker whose parent is no longer the launcher
(it died while the worker started) exits."""

# -- debugging -------------------------------------------------------------------------------

DEBUG_ENV: Final = "GPUCOLL_DEBUG"
"""The debug level: OFF, INFO or DETAIL (torch's TORCH_DISTRIBUTED_DEBUG)."""

NON_MEMBER_ENV: Final = "GPUCOLL_NON_MEMBER"
"""What a collective called with a group this rank is not a member of does: ``warn``
(default, torch's behaviour: a warning naming the op, and the call returns None) or
``error`` (RuntimeError). GPUCOLL_DEBUG=DETAIL also makes it an error."""

FLIGHT_RECORDER_SIZE_ENV: Final = "GPUCOLL_FLIGHT_RECORDER_SIZE"
"""How many recent ops each group's flight recorder keeps (0 turns it off)."""

FLIGHT_RECORDER_DIR_ENV: Final = "GPUCOLL_FLIGHT_RECORDER_DIR"
"""Where flight-recorder dumps go."""

CONTROL_PLANE_ENV: Final = "GPUCOLL_CONTROL_PLANE"
"""Start a rank's opt-in debugging server ("1", "HOST" or "HOST:PORT")."""

# -- the CPU backend -------------------------------------------------------------------------

CPU_TRANSPORT_ENV: Final = "GPUCOLL_CPU_TRANSPORT"
"""``auto`` (default: shared memory when every rank is on one host), ``shm`` or ``tcp``."""

CPU_CMA_ENV: Final = "GPUCOLL_CPU_CMA"
"""``0``/``off``: this rank refuses single-copy reads of its peers' memory (process_vm_readv),
so its whole group moves large all_reduces through the shared segment's copies; default: used
when every rank of the group can read every peer."""

CPU_IFADDR_ENV: Final = "GPUCOLL_CPU_IFADDR"
"""The address the CPU backend's TCP transport listens on and publishes."""

MAX_OBJECT_BYTES_ENV: Final = "GPUCOLL_MAX_OBJECT_BYTES"
"""The largest payload (bytes) one rank may send in an object or bytes collective."""

# -- the NCCL backend ------------------------------------------------------------------------

NCCL_SCALABLE_INIT_ENV: Final = "GPUCOLL_NCCL_SCALABLE_INIT"
"""From how many ranks a group's NCCL communicator is made with ncclCommInitRankScalable
(several roots' unique ids) where the loaded NCCL has it (>= 2.23); default 1024; "off" or
0: never (one root, ncclCommInitRank)."""

NCCL_RANKS_PER_ROOT_ENV: Final = "GPUCOLL_NCCL_RANKS_PER_ROOT"
"""Ranks per unique id on the scalable path (GPUCOLL_NCCL_SCALABLE_INIT): ceil(ranks / this)
roots, spread evenly over the group; default 256."""

NCCL_CALLER_STREAM_MAX_ENV: Final = "GPUCOLL_NCCL_CALLER_STREAM_MAX"
"""Bytes up to which a repeated async NCCL op runs on the caller's current stream rather
than on the communication stream (its wait() on that stream is then free, but later work on that stream runs
after the op rather than beside it); default 0: every async op on the communication
stream (torch's scheduling). 65536 is what the figures in docs/nccl-backend.md use."""

# -- JAX: collectives inside jax.jit ---------------------------------------------------------

JAX_NATIVE_ENV: Final = "GPUCOLL_JAX_NATIVE"
"""The compiled handler of small collectives inside jax.jit (built with the machine's C
compiler on first use): "0" never builds or uses it; "1" makes a failed build an error;
unset uses it when it builds (else the Python handler, with a warning)."""

CACHE_DIR_ENV: Final = "GPUCOLL_CACHE_DIR"
"""Where gpucoll keeps what it builds on first use (the compiled jit handler, the store
loop's compiled repeated ADD); default
``$XDG_CACHE_HOME/gpucoll``, else ``~/.cache/gpucoll``. Must be this user's alone."""

STORE_NATIVE_ENV: Final = "GPUCOLL_STORE_NATIVE"
"""The store server's compiled repeated ADD (built with the machine's C compiler against
this interpreter's headers on first use, gpucoll/store/_native.py): "0" never builds or
uses it; "1" makes a failed build an error at the server's start; unset uses it when it
builds (no compiler, or no ``Python.h``: the loop's Python serves every request, as
without it)."""

# -- remote calls (gpucoll.rpc) ---------------------------------------------------------------

RPC_UNIX_ENV: Final = "GPUCOLL_RPC_UNIX"
"""``0``: every RPC connection of this worker is TCP (it neither listens on nor dials a Unix
socket). Default (unset, or any other value): same-host peers (same boot id and network
namespace) connect over a Unix socket (Linux) when both have it on (docs/rpc.md)."""

RPC_SPIN_US_ENV: Final = "GPUCOLL_RPC_SPIN_US"
"""Microseconds a caller waiting for its own reply (``rpc_sync``, ``to_here``) polls its
connection before it sleeps (default 200; ``0``: never). Replies that miss the window, or
arrive in its second half, turn polling off for the next calls on that connection, more
of them each time, so a loaded machine's cores go to the work (docs/rpc.md)."""

# -- gpucoll-bench ---------------------------------------------------------------------------

BENCH_COMMAND_ENV: Final = "GPUCOLL_BENCH_COMMAND"
"""The command line the user typed, handed to the ranks for the report's ``command``."""

BENCH_CORRUPT_ENV: Final = "GPUCOLL_BENCH_CORRUPT"
"""Test hook: "1" perturbs every checked output, so ``#wrong`` must come out non-zero."""

NAMES: Final = (STORE_HOSTED_ENV, STORE_TOKEN_ENV, STORE_RELAY_ENV, BACKEND_ENV, DEATH_RECORDS_ENV, ERROR_FILE_ENV, CPU_BIND_ENV, LAUNCHER_PID_ENV,
                DEBUG_ENV, NON_MEMBER_ENV, FLIGHT_RECORDER_SIZE_ENV, FLIGHT_RECORDER_DIR_ENV, CONTROL_PLANE_ENV, CPU_TRANSPORT_ENV,
                CPU_CMA_ENV, CPU_IFADDR_ENV, MAX_OBJECT_BYTES_ENV, NCCL_SCALABLE_INIT_ENV, NCCL_RANKS_PER_ROOT_ENV,
                NCCL_CALLER_STREAM_MAX_ENV, RPC_UNIX_ENV, RPC_SPIN_US_ENV,
                JAX_NATIVE_ENV, CACHE_DIR_ENV, STORE_NATIVE_ENV, BENCH_COMMAND_ENV, BENCH_CORRUPT_ENV)
"""Every name above."""
