"""The public surface is exactly what ``gpucoll/__init__.py`` re-exports."""

from __future__ import annotations

import __future__
import importlib
import subprocess
import sys
import types

import gpucoll


def public_names() -> set[str]:
    names = set()
    for name, value in vars(gpucoll).items():
        if name.startswith("_") or isinstance(value, __future__._Feature):
            continue
        # submodules appear as attributes once imported; only those listed are public
        if isinstance(value, types.ModuleType) and name not in gpucoll.__all__:
            continue
        names.add(name)
    return names


def test_all_is_exactly_the_public_names() -> None:
    assert len(gpucoll.__all__) == len(set(gpucoll.__all__)), "duplicates in __all__"
    assert set(gpucoll.__all__) == public_names()


def test_every_name_is_importable_and_documented() -> None:
    for name in gpucoll.__all__:
        obj = getattr(gpucoll, name)
        assert obj is not None
        exec(f"from gpucoll import {name}", {})
        if callable(obj) or isinstance(obj, types.ModuleType):
            assert (obj.__doc__ or "").strip(), f"gpucoll.{name} has no docstring"


def test_torch_names_and_aliases() -> None:
    assert gpucoll.all_gather_into_tensor is gpucoll.all_gather_single
    assert gpucoll.reduce_scatter_tensor is gpucoll.reduce_scatter_single
    for name in ("init_process_group", "destroy_process_group", "new_group", "get_rank", "get_world_size",
                 "all_reduce", "broadcast", "all_to_all_single", "batch_isend_irecv", "P2POp",
                 "monitored_barrier", "all_gather_object", "broadcast_object_list", "GroupMember", "group"):
        assert name in gpucoll.__all__


def test_nccl_memory_names() -> None:
    """The NCCL allocator's pool and buffer registration (torch: torch.cuda.MemPool,
    ProcessGroupNCCL.register_mem_pool / deregister_mem_pool)."""
    for name in ("nccl_mem_pool", "NcclMemPool", "BufferRegistration", "RegistrationError"):
        assert name in gpucoll.__all__
    assert issubclass(gpucoll.RegistrationError, gpucoll.DistBackendError)
    for method in ("register_buffer", "deregister_buffer", "register_mem_pool", "deregister_mem_pool"):
        assert (getattr(gpucoll.ProcessGroup, method).__doc__ or "").strip(), method


def test_testing_and_functional_modules() -> None:
    testing = importlib.import_module("gpucoll.testing")
    assert callable(testing.run_spmd) and testing.SPMDError.__doc__
    functional = importlib.import_module("gpucoll.functional")
    assert gpucoll.functional is functional
    for name in functional.__all__:
        assert callable(getattr(functional, name))


def test_import_does_not_import_cupy() -> None:
    code = ("import sys, gpucoll, gpucoll.functional, gpucoll.testing, gpucoll.ray\n"
            "import numpy as np\n"
            "from gpucoll.array import as_buffer\n"
            "as_buffer(np.zeros(2))\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('cupy', 'cupy_backends', 'torch', 'jax', 'ray')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
