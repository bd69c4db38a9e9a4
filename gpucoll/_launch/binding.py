"""Binding each local rank to a core of its own (``gpucoll-run --bind-to core``).

Open MPI's ``mpirun`` binds each of up to two ranks to a core by default; torchrun does
not bind. A rank that keeps a core of its own meets its peers at once even when other
work competes for the machine: unbound, the scheduler may queue two ranks of one job
on the same CPU (each then waits for the other to be switched in, every op), and the
load balancer, which counts tasks and not who talks to whom, leaves them there.

The launcher plans one core per local rank (:func:`plan`) and hands each rank its CPUs
in ``GPUCOLL_CPU_BIND``; the rank's bootstrap binds every thread it has to them
(:func:`apply_from_env`) before the program runs, so threads started later (OpenMP,
the backends') inherit the binding. With more local ranks than cores nothing is bound,
as Open MPI does when oversubscribed: binding would stack ranks on cores for good.
"""

from __future__ import annotations

import os
from typing import Mapping

from .._env import CPU_BIND_ENV

__all__ = ["BIND_CHOICES", "cores", "plan", "apply", "apply_from_env", "parse", "env_value"]

BIND_CHOICES = ("none", "core")
"""``--bind-to`` values: no binding (the default, as torchrun), or one core per local rank."""


def _topology(cpu: int) -> tuple[int, int]:
    """(package, core) of logical CPU ``cpu``, from sysfs; (0, cpu) where it cannot be read."""
    base = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
    try:
        with open(base + "physical_package_id") as f:
            package = int(f.read())
        with open(base + "core_id") as f:
            core = int(f.read())
    except (OSError, ValueError):
        return 0, cpu
    return package, core


def cores(allowed: set[int] | None = None) -> list[frozenset[int]]:
    """The cores this process may run on, each as the set of its logical CPUs (hardware
    threads), in order of their first CPU."""
    if allowed is None:
        allowed = set(os.sched_getaffinity(0))
    by_core: dict[tuple[int, int], set[int]] = {}
    for cpu in sorted(allowed):
        by_core.setdefault(_topology(cpu), set()).add(cpu)
    return sorted((frozenset(c) for c in by_core.values()), key=min)


def plan(mode: str, nlocal: int, allowed: set[int] | None = None) -> list[frozenset[int]] | None:
    """The CPUs of each of ``nlocal`` local ranks: local rank i gets core i (all its
    hardware threads). None for ``none``, and when there are more ranks than cores.

    Raises:
        ValueError: ``mode`` is not one of :data:`BIND_CHOICES`, or ``nlocal`` < 1.
    """
    if mode not in BIND_CHOICES:
        raise ValueError(f"bind_to must be one of {', '.join(BIND_CHOICES)}; got {mode!r}")
    if nlocal < 1:
        raise ValueError(f"the number of local ranks must be >= 1; got {nlocal}")
    if mode == "none":
        return None
    found = cores(allowed)
    if nlocal > len(found):
        return None
    return found[:nlocal]


def apply(cpus: frozenset[int] | set[int]) -> None:
    """Bind every thread of this process to ``cpus``.

    ``os.sched_setaffinity(0, ...)`` binds the calling thread only; the others (a BLAS
    pool started at import) are bound one by one through ``/proc/self/task``.

    Raises:
        OSError: the binding was refused (a CPU outside this process's cpuset).
    """
    os.sched_setaffinity(0, cpus)
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return
    me = os.getpid()
    for tid in tids:
        if tid == me:
            continue
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:
            pass  # that thread has ended


def parse(value: str) -> frozenset[int]:
    """``GPUCOLL_CPU_BIND``'s value ("3" or "2,66") as a set of CPUs.

    Raises:
        ValueError: not a comma-separated list of CPU numbers.
    """
    try:
        cpus = frozenset(int(v) for v in value.split(","))
    except ValueError:
        cpus = frozenset()
    if not cpus or min(cpus) < 0:
        raise ValueError(f"{CPU_BIND_ENV} must be a comma-separated list of CPU numbers; got {value!r}")
    return cpus


def env_value(cpus: frozenset[int]) -> str:
    """The ``GPUCOLL_CPU_BIND`` value for ``cpus``."""
    return ",".join(str(c) for c in sorted(cpus))


def apply_from_env(environ: Mapping[str, str] | None = None) -> frozenset[int] | None:
    """Bind this process as its launcher planned (``GPUCOLL_CPU_BIND``); the CPUs, or None
    when it is unset or empty.

    Raises:
        ValueError: the value is not a list of CPUs.
        OSError: the kernel refused the binding.
    """
    value = (os.environ if environ is None else environ).get(CPU_BIND_ENV, "").strip()
    if not value:
        return None
    cpus = parse(value)
    apply(cpus)
    return cpus
