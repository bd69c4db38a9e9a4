"""compute_bucket_assignment_by_size: torch's ComputeBucketAssignmentTest
(test/distributed/test_c10d_common.py) with its assertions, on NumPy arrays, and the
same shapes given to torch's own ``dist._compute_bucket_assignment_by_size``."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpucoll import compute_bucket_assignment_by_size

F32, F64 = np.float32, np.float64


def torch_assignment(arrays: list[np.ndarray], limits: list[int], sparse: list[bool] | None = None,
                     indices: list[int] | None = None) -> tuple[list[list[int]], list[int]]:
    torch = pytest.importorskip("torch", reason="torch (CPU) is the reference; a test-only dependency")
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("this torch build has no torch.distributed")
    tensors = [torch.from_numpy(a) for a in arrays]
    args: list[Any] = [tensors, limits, sparse or []]
    if indices is not None:
        args.append(indices)
    result, per_bucket = dist._compute_bucket_assignment_by_size(*args)
    return [list(b) for b in result], list(per_bucket)


# --- torch's ComputeBucketAssignmentTest, assertions verbatim ---

def test_single_limit_single_dtype() -> None:
    tensors = [np.empty([100], F32), np.empty([200], F32), np.empty([100], F32), np.empty([50], F32)]
    result, per_bucket_size_limits = compute_bucket_assignment_by_size(tensors, [400])
    assert all(size_lim == 400 for size_lim in per_bucket_size_limits)
    assert [[0], [1], [2], [3]] == result
    assert (result, per_bucket_size_limits) == torch_assignment(tensors, [400])


def test_single_limit_multi_dtype() -> None:
    tensors = [np.empty([50], F32), np.empty([25], F64)] * 3
    result, per_bucket_size_limits = compute_bucket_assignment_by_size(tensors, [400])
    assert all(size_lim == 400 for size_lim in per_bucket_size_limits)
    assert [[0, 2], [1, 3], [4], [5]] == result
    assert (result, per_bucket_size_limits) == torch_assignment(tensors, [400])


def test_multi_limit_single_dtype() -> None:
    tensors = [np.empty([10], F32) for _ in range(4)]
    result, per_bucket_size_limits = compute_bucket_assignment_by_size(tensors, [40, 80])
    assert per_bucket_size_limits == [40, 80, 80]
    assert [[0], [1, 2], [3]] == result
    assert (result, per_bucket_size_limits) == torch_assignment(tensors, [40, 80])


def test_multi_limit_multi_dtype() -> None:
    tensors = [np.empty([50], F32), np.empty([25], F64)] * 3
    result, per_bucket_size_limits = compute_bucket_assignment_by_size(tensors, [200, 400])
    assert [[0], [1], [2, 4], [3, 5]] == result
    assert per_bucket_size_limits == [200, 200, 400, 400]
    assert (result, per_bucket_size_limits) == torch_assignment(tensors, [200, 400])


# --- beyond torch's cases: sparse, tensor_indices, random shapes, all against torch ---

def test_sparse_gradients_get_a_bucket_each() -> None:
    tensors = [np.empty([10], F32) for _ in range(5)]
    sparse = [False, True, False, False, True]
    ours = compute_bucket_assignment_by_size(tensors, [40, 80], sparse)
    assert ours == torch_assignment(tensors, [40, 80], sparse)
    assert [1] in ours[0] and [4] in ours[0]


def test_tensor_indices_keep_arrival_order() -> None:
    tensors = [np.empty([n], F32) for n in (30, 5, 12, 40, 7, 3)]
    indices = [5, 3, 0, 2, 4, 1]
    ours = compute_bucket_assignment_by_size(tensors, [64, 128], tensor_indices=indices)
    assert ours == torch_assignment(tensors, [64, 128], indices=indices)
    assert ours[0][:2] == [[5], [3, 0, 2]]  # in closing order, not sorted by index


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 300), st.sampled_from(["float32", "float64", "float16"])),
                min_size=1, max_size=30),
       st.lists(st.integers(1, 2000), min_size=1, max_size=3))
def test_random_shapes_match_torch(shapes: list[tuple[int, str]], limits: list[int]) -> None:
    tensors = [np.empty([n], dt) for n, dt in shapes]
    assert compute_bucket_assignment_by_size(tensors, limits) == torch_assignment(tensors, limits)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3), st.integers(1, 200)), min_size=1, max_size=25),
       st.lists(st.integers(1, 3000), min_size=1, max_size=3), st.randoms(use_true_random=False))
def test_random_arrival_order_one_dtype_matches_torch(shapes: list[tuple[int, int]], limits: list[int],
                                                       rnd: Any) -> None:
    # one dtype: torch's order of the still-open buckets is then defined (see buckets.py)
    tensors = [np.empty(s, F32) for s in shapes]
    order = list(range(len(tensors)))
    rnd.shuffle(order)
    arrived = [tensors[i] for i in order]
    ours = compute_bucket_assignment_by_size(arrived, limits, tensor_indices=order)
    assert ours == torch_assignment(arrived, limits, indices=order)


def test_multidimensional_and_shape_only_inputs() -> None:
    class Spec:
        def __init__(self, shape: tuple[int, ...], dtype: str) -> None:
            self.shape, self.dtype = shape, np.dtype(dtype)

    specs = [Spec((3, 4), "float32"), Spec((2, 2, 2), "float32"), Spec((10,), "float32")]
    arrays = [np.empty(s.shape, s.dtype) for s in specs]
    assert compute_bucket_assignment_by_size(specs, [64]) == compute_bucket_assignment_by_size(arrays, [64])
    assert compute_bucket_assignment_by_size(arrays, [64]) == torch_assignment(arrays, [64])


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="arrays is empty"):
        compute_bucket_assignment_by_size([], [10])
    with pytest.raises(ValueError, match="bucket_size_limits"):
        compute_bucket_assignment_by_size([np.empty(2)], [])
    with pytest.raises(ValueError, match="bucket_size_limits"):
        compute_bucket_assignment_by_size([np.empty(2)], [0])
    with pytest.raises(ValueError, match="expect_sparse_gradient has 1 entries for 2 arrays"):
        compute_bucket_assignment_by_size([np.empty(2)] * 2, [8], [True])


@pytest.mark.parametrize("model", ["resnet50", "bert-base", "gpt2"])
def test_real_models_match_torch(model: str) -> None:
    """The bench's three gradient sets (bench/ddp_bench.py) with DDP's limits (1 MiB, then
    25 MiB), in parameter order and in reverse arrival order, against torch's function on
    meta tensors (no memory)."""
    torch = pytest.importorskip("torch", reason="torch (CPU) is the reference; a test-only dependency")
    import importlib.util
    import pathlib

    import torch.distributed as dist

    path = pathlib.Path(__file__).resolve().parents[2] / "bench" / "ddp_bench.py"
    spec = importlib.util.spec_from_file_location("ddp_bench", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    shapes = bench.SHAPES[model]()

    class Spec:
        def __init__(self, shape: tuple[int, ...]) -> None:
            self.shape, self.dtype = shape, np.dtype(np.float32)

    ours = [Spec(s) for s in shapes]
    theirs = [torch.empty(s, device="meta") for s in shapes]
    limits = [1 << 20, 25 << 20]
    want = dist._compute_bucket_assignment_by_size(theirs, limits, [])
    assert compute_bucket_assignment_by_size(ours, limits) == ([list(b) for b in want[0]], list(want[1]))
    order = list(reversed(range(len(shapes))))
    got = compute_bucket_assignment_by_size([ours[i] for i in order], limits, tensor_indices=order)
    want = dist._compute_bucket_assignment_by_size([theirs[i] for i in order], limits, [], order)
    assert got == ([list(b) for b in want[0]], list(want[1]))
    assert len(got[0]) > 3


def test_the_nccl_bench_says_why_it_cannot_run() -> None:
    """bench/ddp_nccl_bench.py needs a GPU: without one it exits 2 naming why; an unknown
    model is refused by name before anything starts."""
    import pathlib
    import subprocess
    import sys

    from gpucoll._env.devices import no_gpu_reason

    script = pathlib.Path(__file__).resolve().parents[2] / "bench" / "ddp_nccl_bench.py"
    bad = subprocess.run([sys.executable, str(script), "--models", "resnet51"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "unknown model 'resnet51'" in bad.stderr, bad.stderr
    if no_gpu_reason() is None:
        pytest.skip("this machine may have a GPU: the bench would run")
    done = subprocess.run([sys.executable, str(script), "--models", "resnet50"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "ddp_nccl_bench: cannot run: this machine has no /dev/nvidia* device" in done.stderr
