"""PowerSGD gradient compression (Vogels et al., NeurIPS 2019), torch's algorithm
(``ddp_comm_hooks.powerSGD_hook``) over NumPy and CuPy buckets.

Per bucket, each gradient viewed as an n x m matrix M (first dimension by the rest) is
sent as two thin factors when that saves enough: P = M Q (all-reduced, orthogonalised),
Q = M^T P (all-reduced, averaged), M ~ P Q^T. Q is kept from one iteration to the next
(warm start) and the part of the gradient the approximation missed is added back next
time (error feedback). Vectors and matrices too small to gain are all-reduced as they are,
in one buffer. Before ``start_powerSGD_iter`` iterations, buckets are plainly averaged.

Random initial Qs come from ``numpy.random.RandomState(random_seed)``, drawn the same way
on every rank (torch seeds its own generator from the same RandomState; the numbers differ
from torch's, the algorithm does not).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from .. import _collectives
from .._collectives import _pg
from .._group import ProcessGroup
from . import kinds
from .future import Future
from .grad_bucket import GradBucket
from .hooks import _allreduce_fut

__all__ = ["PowerSGDState", "powerSGD_hook"]


def _orthogonalize(xp: Any, matrices: Any, epsilon: float = 0) -> None:
    """Orthonormalise the columns of each matrix of a (batch, n, r) stack, in place:
    QR for r > 2, Gram-Schmidt otherwise and for half precision (as torch)."""
    if not (matrices.ndim == 3 and matrices.shape[2] <= matrices.shape[1]):
        raise ValueError(f"_orthogonalize expects a (batch, n, r) stack with r <= n; got {matrices.shape}")
    rank = matrices.shape[2]
    if rank <= 2 or np.dtype(matrices.dtype).itemsize <= 2:
        _orthogonalize_gram_schmidt(xp, matrices, epsilon)
        return
    for k in range(matrices.shape[0]):
        q, _ = xp.linalg.qr(matrices[k])
        matrices[k] = q


def _orthogonalize_gram_schmidt(xp: Any, matrices: Any, epsilon: float = 0) -> None:
    num_cols = matrices.shape[2]
    for i in range(num_cols):
        col = matrices[:, :, i:i + 1]
        norm = xp.sqrt(xp.sum(col * col, axis=1, keepdims=True))
        if epsilon == 0:
            col /= norm
        else:
            col /= norm + epsilon
        if i + 1 < num_cols:
            rest = matrices[:, :, i + 1:]
            rest -= xp.sum(col * rest, axis=1, keepdims=True) * col


def _should_compress(num_rows: int, num_cols: int, matrix_approximation_rank: int,
                     min_compression_rate: float) -> tuple[bool, int, int]:
    uncompressed_size = num_rows * num_cols
    compressed_size = (num_rows + num_cols) * matrix_approximation_rank
    return (compressed_size * min_compression_rate < uncompressed_size, uncompressed_size, compressed_size)


class PowerSGDState:
    """PowerSGD's configuration and the state it keeps between iterations (torch's
    ``PowerSGDState``, same arguments and defaults).

    Args:
        process_group: the group (None: the default group).
        matrix_approximation_rank: the rank r of the factors (1 is often enough).
        start_powerSGD_iter: iterations of plain averaging before compressing (> 1 with
            error feedback or warm start: DDP rebuilds buckets after the first).
        min_compression_rate: compress a matrix only if (n + m) r x this < n m.
        use_error_feedback: add back what the approximation missed last time.
        warm_start: start from last iteration's Q instead of a random one.
        orthogonalization_epsilon: added to norms (0: none).
        random_seed: seed of the Qs' initial values (the same on every rank).
        compression_stats_logging_frequency: kept for torch's signature.
        batch_tensors_with_same_shape: compress same-shaped matrices as one batch.

    Example:
        >>> state = PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=10)
        >>> reducer.register_comm_hook(state, powerSGD_hook)
    """

    def __init__(self, process_group: ProcessGroup | None, matrix_approximation_rank: int = 1,
                 start_powerSGD_iter: int = 1_000, min_compression_rate: float = 2,
                 use_error_feedback: bool = True, warm_start: bool = True, orthogonalization_epsilon: float = 0,
                 random_seed: int = 0, compression_stats_logging_frequency: int = 10_000,
                 batch_tensors_with_same_shape: bool = False) -> None:
        if (use_error_feedback or warm_start) and start_powerSGD_iter <= 1:
            raise ValueError(
                "Expect `start_powerSGD_iter` > 1 if `use_error_feedback` or `warm_start` is enabled, "
                "because PowerSGD can only be applied after the first two iterations in DDP.")
        self.process_group = process_group
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.rng = np.random.RandomState(random_seed)
        self.error_dict: dict[int, Any] = {}
        self.p_memory_dict: dict[int, Any] = {}
        self.q_memory_dict: dict[int, Any] = {}
        self.iter = 0
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0
        self.compression_stats_logging_frequency = max(1, compression_stats_logging_frequency)
        self.next_stats_report = 0
        self.batch_tensors_with_same_shape = batch_tensors_with_same_shape

    def maybe_increase_iter(self, bucket: GradBucket[Any]) -> None:
        """Count an iteration when the last bucket of one is processed."""
        if bucket.is_last():
            self.iter += 1

    def compression_stats(self) -> tuple[float, int, int]:
        """(compression rate, elements before compression, elements after)."""
        rate = (self.total_numel_before_compression / self.total_numel_after_compression
                if self.total_numel_after_compression > 0 else 0)
        return (rate, self.total_numel_before_compression, self.total_numel_after_compression)


def powerSGD_hook(state: PowerSGDState, bucket: GradBucket[Any]) -> Future[Any]:
    """Reduce a bucket with PowerSGD: matrices as rank-r factors, the rest as one plain
    all_reduce (torch's ``powerSGD_hook``; see the module's docstring).

    Example:
        >>> reducer.register_comm_hook(PowerSGDState(None, start_powerSGD_iter=10), powerSGD_hook)
    """
    pg = _pg(state.process_group)
    world_size = pg.size()
    input_tensor = bucket.buffer()
    if state.iter < state.start_powerSGD_iter:
        state.maybe_increase_iter(bucket)
        return _allreduce_fut(pg, input_tensor)

    xp = kinds.namespace(input_tensor)
    dtype = input_tensor.dtype
    bucket_index = bucket.index()
    input_tensor_cp = None
    if state.use_error_feedback:
        if bucket_index in state.error_dict:
            input_tensor += state.error_dict[bucket_index]
        else:
            state.error_dict[bucket_index] = xp.zeros(input_tensor.shape[0], dtype=dtype)
        input_tensor_cp = input_tensor.copy()

    tensors = bucket.gradients()
    to_compress: list[Any] = []
    uncompressed: list[Any] = []
    total_ps = total_qs = 0
    for tensor in tensors:
        matrix = tensor.reshape(tensor.shape[0] if tensor.ndim else 1, -1)
        n, m = matrix.shape
        r = min(n, m, state.matrix_approximation_rank)
        ok, before, after = _should_compress(n, m, r, state.min_compression_rate)
        state.total_numel_before_compression += before
        if ok:
            to_compress.append(matrix)
            total_ps += n * r
            total_qs += m * r
            state.total_numel_after_compression += after
        else:
            uncompressed.append(tensor)
            state.total_numel_after_compression += before

    uncompressed_memory = (xp.concatenate([t.reshape(-1) for t in uncompressed]) if uncompressed
                           else xp.zeros(0, dtype=dtype))

    need_randomize_qs = False
    if not state.warm_start or bucket_index not in state.p_memory_dict:
        need_randomize_qs = True
        state.p_memory_dict[bucket_index] = xp.empty(total_ps, dtype=dtype)
        state.q_memory_dict[bucket_index] = xp.empty(total_qs, dtype=dtype)

    shape_to_tensors: dict[tuple[int, ...], list[Any]] = defaultdict(list)
    for matrix in to_compress:
        shape_to_tensors[tuple(matrix.shape)].append(matrix)

    batches: list[Any] = []
    for same in shape_to_tensors.values():
        if state.batch_tensors_with_same_shape and len(same) > 1:
            batches.append(xp.stack(same))
        else:
            batches.extend(t[None] for t in same)

    ps: list[Any] = []
    qs: list[Any] = []
    p_idx = q_idx = 0
    p_memory, q_memory = state.p_memory_dict[bucket_index], state.q_memory_dict[bucket_index]
    for batch in batches:
        batch_size, n, m = batch.shape
        r = min(n, m, state.matrix_approximation_rank)
        ps.append(p_memory[p_idx:p_idx + batch_size * n * r].reshape(batch_size, n, r))
        qs.append(q_memory[q_idx:q_idx + batch_size * m * r].reshape(batch_size, m, r))
        p_idx += batch_size * n * r
        q_idx += batch_size * m * r

    if not need_randomize_qs:
        for q in qs:
            _orthogonalize(xp, q, state.orthogonalization_epsilon)
    else:
        gen = np.random.RandomState(state.rng.randint(1_000_000_000))
        for q in qs:
            q[...] = xp.asarray(gen.standard_normal(q.shape).astype(kinds.np_dtype(np.dtype(dtype).name)))
            _orthogonalize(xp, q, state.orthogonalization_epsilon)

    for batch, q, p in zip(batches, qs, ps):
        xp.matmul(batch, q, out=p)

    def allreduce(array: Any) -> Future[Any]:
        if array.size == 0:
            done: Future[Any] = Future()
            done.set_result([array])
            return done
        work = _collectives.all_reduce(array, group=pg, async_op=True)
        assert work is not None
        return Future.from_work(work)

    def unpack_uncompressed_and_allreduce_ps(fut: Future[Any]) -> Any:
        memory = fut.value()[0]
        memory /= world_size
        idx = 0
        for tensor in uncompressed:
            tensor[...] = memory[idx:idx + tensor.size].reshape(tensor.shape)
            idx += tensor.size
        return allreduce(state.p_memory_dict[bucket_index]).wait()[0]

    def compute_qs(fut: Future[Any]) -> Any:
        state.p_memory_dict[bucket_index] = fut.value()
        for p in ps:
            _orthogonalize(xp, p, state.orthogonalization_epsilon)
        for batch, p, q in zip(batches, ps, qs):
            xp.matmul(batch.transpose(0, 2, 1), p, out=q)
        return allreduce(state.q_memory_dict[bucket_index]).wait()[0]

    def decompress(fut: Future[Any]) -> Any:
        q_all = fut.value()
        q_all /= world_size
        state.q_memory_dict[bucket_index] = q_all
        for p, q, batch in zip(ps, qs, batches):
            xp.matmul(p, q.transpose(0, 2, 1), out=batch)
        if state.batch_tensors_with_same_shape:
            for batch in batches:
                if batch.shape[0] == 1:
                    continue
                for i, original in enumerate(shape_to_tensors[tuple(batch.shape[1:])]):
                    original[...] = batch[i]
        if state.use_error_feedback:
            assert input_tensor_cp is not None
            state.error_dict[bucket_index] = input_tensor_cp - input_tensor
        if not state.warm_start:
            state.p_memory_dict.clear()
            state.q_memory_dict.clear()
        state.maybe_increase_iter(bucket)
        return input_tensor

    return (allreduce(uncompressed_memory).then(unpack_uncompressed_and_allreduce_ps)
            .then(compute_qs).then(decompress))
