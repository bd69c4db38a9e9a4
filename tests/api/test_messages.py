"""Errors a new user meets first say what was wrong, the value, and what to do, and the
same situation gives the same message on every rank."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gpucoll
from gpucoll.errors import BackendUnavailableError, DistStoreTimeoutError
from gpucoll.store import HashStore, PrefixStore
from gpucoll.testing import run_spmd

ROOT = Path(__file__).resolve().parents[2]
NO_GPU = not glob.glob("/dev/nvidia[0-9]*")


def wrong_world_size() -> str:
    os.environ["WORLD_SIZE"] = "3"  # two processes were started
    try:
        gpucoll.init_process_group("cpu", timeout=2)
    except DistStoreTimeoutError as exc:
        return str(exc)
    return "joined"


def test_wrong_world_size_same_message_on_every_rank() -> None:
    out = run_spmd(wrong_world_size, 2, init=False, timeout=60)
    assert out[0] == out[1], out
    assert out[0].startswith("only 2 of world_size=3 processes joined within 2 s")
    assert "WORLD_SIZE=3 is the number of processes started" in out[0]


def test_world_size_notice_counts_generations() -> None:
    from gpucoll._group.join import await_all_joined

    store = HashStore()
    for _ in range(2):  # a store that outlives a group counts the next init too
        await_all_joined(store, 0, 1, timeout=1)
    with pytest.raises(DistStoreTimeoutError, match="only 1 of world_size=2 processes joined within 0.2 s"):
        await_all_joined(store, 0, 2, timeout=0.2)


@pytest.mark.skipif(not NO_GPU, reason="checks the message on a machine without an NVIDIA device")
def test_nccl_without_gpu_raises_at_init() -> None:
    with pytest.raises(BackendUnavailableError, match=r"no /dev/nvidia\* device.*Use backend='cpu'"):
        gpucoll.init_process_group("nccl", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    assert not gpucoll.is_initialized()


@pytest.mark.skipif(not NO_GPU, reason="checks the message on a machine without an NVIDIA device")
def test_device_array_without_gpu_is_a_gpucoll_error() -> None:
    from _fake_arrays import FakeCudaArray

    import gpucoll.functional as F

    gpucoll.init_process_group("cpu", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        with pytest.raises(BackendUnavailableError, match=r"device array \(FakeCudaArray\).*no /dev/nvidia"):
            F.all_reduce(FakeCudaArray(np.ones(4, np.float32)))
    finally:
        gpucoll.destroy_process_group()


def test_env_messages_name_only_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "GPUCOLL_STORE_HOSTED",
                 "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError) as info:
        gpucoll.init_process_group("cpu", rank=0, world_size=1)
    text = str(info.value)
    assert "needs MASTER_ADDR, MASTER_PORT" in text and "pass rank=" not in text
    assert "init_method='tcp://127.0.0.1:0'" in text
    with pytest.raises(ValueError, match=r"pass rank= and world_size="):
        gpucoll.init_process_group("cpu")
    with pytest.raises(ValueError, match=r"init_method='env:/' is not a rendezvous URL; did you mean 'env://'"):
        gpucoll.init_process_group("cpu", init_method="env:/", rank=0, world_size=1)


def test_prefix_store_timeout_names_the_callers_key() -> None:
    store = PrefixStore("p", HashStore())
    store.set("there", b"1")
    with pytest.raises(DistStoreTimeoutError) as info:
        store.wait(["there", "missing"], timeout=0.1)
    text = str(info.value)
    assert text.startswith("Wait timeout after 100ms: wait of ['there', 'missing'] timed out after 0.1 s "
                           "on PrefixStore('p', ")
    assert text.endswith("still missing: ['missing']") and "p/missing" not in text
    with pytest.raises(DistStoreTimeoutError, match=r"queue_pop of \['q'\] .* the queue is still empty"):
        store.queue_pop("q", timeout=0.1)


def test_run_spmd_without_main_guard_says_what_to_do(tmp_path: Any) -> None:
    script = tmp_path / "unguarded.py"
    script.write_text("from gpucoll.testing import run_spmd\n\ndef f():\n    return 1\n\n"
                      "print(run_spmd(f, 2, timeout=30))\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode != 0
    assert 'under `if __name__ == "__main__":`' in done.stderr
    assert "SPMDError: rank" in done.stderr and "died before running fn" in done.stderr


@pytest.mark.skipif(not NO_GPU, reason="checks the message on a machine without an NVIDIA device")
def test_gpu_skips_say_no_gpu_not_driver() -> None:
    """Without device nodes the GPU tests' skip reason says "no GPU", not CUDA's driver error."""
    from conftest import _gpu_reason

    reason = _gpu_reason()
    assert reason is not None and reason.startswith("no GPU: "), reason
    assert "/dev/nvidia" in reason and "Driver" not in reason and "driver version" not in reason, reason


def world_size_against_launcher() -> str:
    import time

    start = time.monotonic()
    try:
        gpucoll.init_process_group("cpu", world_size=4, timeout=60)
    except ValueError as exc:
        assert time.monotonic() - start < 10, "the contradiction must not wait for the store"
        return str(exc)
    return "joined"


def test_world_size_contradicting_the_launcher_is_an_error_at_once() -> None:
    out = run_spmd(world_size_against_launcher, 2, init=False, timeout=60)
    assert out[0] == out[1], out
    assert "world_size=4" in out[0] and "world_size=2 processes" in out[0], out[0]


def test_gpucoll_run_with_a_contradicting_world_size_fails_fast(tmp_path: Path) -> None:
    import time

    script = tmp_path / "job.py"
    script.write_text("import gpucoll\ngpucoll.init_process_group('cpu', world_size=4)\n")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "gpucoll.run", "--nproc-per-node", "2", str(script)],
                          capture_output=True, text=True, timeout=120)
    took = time.monotonic() - start
    assert proc.returncode != 0
    assert "init_process_group(world_size=4) contradicts the launcher" in proc.stdout + proc.stderr
    assert "world_size=2 processes" in proc.stdout + proc.stderr
    assert took < 30, f"took {took:.1f} s"
