"""Shared pytest setup: the ``gpu`` marker is decided here, in the parent process.

Without a usable CUDA device, tests marked ``@pytest.mark.gpu`` are skipped;
``--require-gpu`` turns those skips into failures (use it on GPU machines so that
a broken CUDA setup cannot pass as "all skipped").
"""

from __future__ import annotations

import subprocess
import sys

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--require-gpu", action="store_true", default=False,
                     help="fail (instead of skip) GPU tests when no usable GPU/NCCL is found")
    parser.addoption("--soak", action="store_true", default=False,
                     help="run the long fault-injection tests marked soak (skipped by default)")


def _gpu_reason() -> str | None:
    """Why GPU tests cannot run here, or None if they can. Probed in a subprocess so
    that the test process itself does not initialise CUDA before forking ranks.

    A machine without NVIDIA device nodes is said to have no GPU in those words, before CUDA
    is asked: CUDA's own answer there (cudaErrorInsufficientDriver) would send the reader
    after their driver."""
    from gpucoll._env.devices import no_gpu_reason

    if (absent := no_gpu_reason()) is not None:
        return f"no GPU: {absent}"
    code = (
        "import sys\n"
        "try:\n"
        "    import cupy\n"
        "    from cupy.cuda import nccl\n"
        "    n = cupy.cuda.runtime.getDeviceCount()\n"
        "    print('ok' if n > 0 else 'no CUDA device')\n"
        "except Exception as e:\n"
        "    print(f'{type(e).__name__}: {e}')\n"
    )
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "probing CuPy/CUDA timed out"
    line = (out.stdout.strip().splitlines() or [out.stderr.strip()[-300:]])[-1]
    return None if line == "ok" else line


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--soak"):
        soak = pytest.mark.skip(reason="soak test: pass --soak to run it")
        for it in items:
            if it.get_closest_marker("soak"):
                it.add_marker(soak)
    gpu_items = [it for it in items if it.get_closest_marker("gpu")]
    if not gpu_items:
        return
    reason = _gpu_reason()
    if reason is None:
        return
    if config.getoption("--require-gpu"):
        raise pytest.UsageError(f"--require-gpu given but GPU tests cannot run: {reason}")
    skip = pytest.mark.skip(reason=reason if reason.startswith("no GPU") else f"no usable GPU: {reason}")
    for it in gpu_items:
        it.add_marker(skip)
