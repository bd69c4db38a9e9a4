"""Per-op cost of gpucoll.functional.all_reduce inside jax.jit against the same calls outside it.

In the same run, on 2 ranks of the CPU backend (JAX on the CPU), for a small float32 array:

- inside: one jitted ``lax.fori_loop`` of N all_reduces (each an XLA FFI call);
- outside: N calls of ``F.all_reduce`` on a jax.Array from Python;
- mpi4jax (if importable, run under ``mpirun``): a jitted ``fori_loop`` of N ``mpi4jax.allreduce``.

Every timed loop starts after a barrier, so that no rank's late start is timed, and the
jitted loops run back to back (as mpi4jax's), before the loops outside jit. The line of
gpucoll's jitted loop says which handler ran it: the compiled one (gpucoll/_jax/native.c)
or, where it could not be built or is turned off, the Python one.

Prints microseconds per op for each, and the ratios inside/outside and inside/mpi4jax
(lower is better). Times are the median of a few repetitions.

Usage::

    python bench/jax_jit_bench.py [--ops 1000] [--size 16] [--reps 5] [--ranks 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


def gpucoll_body(ops: int, size: int, reps: int) -> dict[str, float]:
    import jax
    import jax.numpy as jnp

    import gpucoll
    import gpucoll.functional as F

    @jax.jit
    def inside(x: Any) -> Any:
        return jax.lax.fori_loop(0, ops, lambda i, v: F.all_reduce(v) * 0.5, x)

    x = jnp.ones(size, jnp.float32)
    inside(x).block_until_ready()  # compile
    t_in, t_out = [], []
    # The jitted loops back to back, as mpi4jax's below, then the loops outside jit: a
    # timed jitted loop that follows 70 ms of other work on each rank starts with the
    # ranks apart (about 0.7 ms here, in either library), which 1,000 ops of 0.3 µs
    # would carry as 0.7 µs each.
    for _ in range(reps):
        # start every timed loop together: a rank that starts late would be timed as the
        # others' wait for it (tens of ms on a shared machine)
        gpucoll.barrier()
        t0 = time.perf_counter()
        inside(x).block_until_ready()
        t_in.append((time.perf_counter() - t0) / ops)
    for _ in range(reps):
        gpucoll.barrier()
        t0 = time.perf_counter()
        v = x
        for _ in range(ops):
            v = F.all_reduce(v) * 0.5
        v.block_until_ready()
        t_out.append((time.perf_counter() - t0) / ops)
    from gpucoll._jax import native

    # which handler ran the jitted loop: the compiled one (native.c), or Python's and why
    how = "compiled handler" if native.native_ops() >= ops else f"Python handler ({native.why_not() or 'see docs'})"
    return {"inside": statistics.median(t_in), "outside": statistics.median(t_out), "how": how}


MPI4JAX = r'''
import statistics, sys, time
import jax, jax.numpy as jnp, mpi4jax
from mpi4py import MPI
ops, size, reps = map(int, sys.argv[1:4])
@jax.jit
def inside(x):
    return jax.lax.fori_loop(0, ops, lambda i, v: mpi4jax.allreduce(v, op=MPI.SUM, comm=MPI.COMM_WORLD) * 0.5, x)
x = jnp.ones(size, jnp.float32)
inside(x).block_until_ready()
ts = []
for _ in range(reps):
    MPI.COMM_WORLD.Barrier()
    t0 = time.perf_counter(); inside(x).block_until_ready(); ts.append((time.perf_counter() - t0) / ops)
if MPI.COMM_WORLD.rank == 0:
    print("MPI4JAX", statistics.median(ts))
'''


def mpi4jax_time(ops: int, size: int, reps: int, ranks: int) -> float | None:
    try:
        import importlib.util
        if importlib.util.find_spec("mpi4jax") is None or shutil.which("mpirun") is None:
            return None
    except ImportError:
        return None
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(MPI4JAX)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", JAX_PLATFORMS="cpu")
    done = subprocess.run(["mpirun", "--oversubscribe", "-n", str(ranks), sys.executable, f.name,
                           str(ops), str(size), str(reps)], env=env, capture_output=True, text=True, timeout=600)
    os.unlink(f.name)
    for line in done.stdout.splitlines():
        if line.startswith("MPI4JAX"):
            return float(line.split()[1])
    print("mpi4jax run failed:\n" + done.stdout[-2000:] + done.stderr[-2000:], file=sys.stderr)
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", type=int, default=1000)
    p.add_argument("--size", type=int, default=16, help="float32 elements per all_reduce")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--ranks", type=int, default=2)
    a = p.parse_args(argv)
    from gpucoll.testing import run_spmd

    res = run_spmd(gpucoll_body, a.ranks, args=(a.ops, a.size, a.reps), timeout=600,
                   env={"JAX_PLATFORMS": "cpu"})[0]
    m4j = mpi4jax_time(a.ops, a.size, a.reps, a.ranks)
    print(f"all_reduce of {a.size} float32, {a.ranks} ranks, {a.ops} ops, median of {a.reps}")
    print(f"  gpucoll inside jit : {res['inside'] * 1e6:9.1f} us/op   ({res['how']})")
    print(f"  gpucoll outside jit: {res['outside'] * 1e6:9.1f} us/op   inside/outside = "
          f"{res['inside'] / res['outside']:.2f}")
    if m4j is None:
        print("  mpi4jax            : not measured (not importable, mpirun missing, or its run failed: see stderr)")
    else:
        print(f"  mpi4jax inside jit : {m4j * 1e6:9.1f} us/op   gpucoll inside/mpi4jax = {res['inside'] / m4j:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
