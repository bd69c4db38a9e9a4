"""The Reducer: gradients in, reduced (averaged) gradients out, bucket by bucket, as
torch DDP's C++ Reducer does for its autograd hooks.

One iteration: ``mark_ready(i, grad)`` for every parameter as its gradient is produced
(or ``reduce(grads)`` for all at once), then ``wait()``. A bucket is issued through the
communication hook as soon as it and every bucket before it are full, so ranks issue the
same collectives in the same order whatever order their gradients come in.

Buckets: at first, parameters are bucketed in reverse order (gradients of the last
layers come first in a backward pass), the first bucket capped at
``first_bucket_cap_mb``; after the first iteration they are rebuilt once, in the order
the gradients actually arrived on rank 0 (every rank takes rank 0's order, as torch).

Agreement: with ``check_ready`` (default), the last bucket is followed by one small
all_gather of which gradients each rank handed over (``wait()`` reads it). A rank that missed some still issues its
remaining buckets (the missing gradients as zeros), so no rank is left waiting, and
every rank raises :class:`ParameterMismatchError` naming the parameters and the ranks.
"""

from __future__ import annotations

import sys
from typing import Any, Generic, Sequence, TypeVar, cast

import numpy as np

from .. import _collectives
from .._collectives import _pg
from .._group.gathered import all_reduce_gathered
from .._group import ProcessGroup
from .._reduce_op import ReduceOp
from .._work import Work
from ..array import ArrayLike
from ..errors import ParameterMismatchError
from . import kinds
from .buckets import compute_bucket_assignment_by_size
from .future import Future
from .gather import BucketGather
from .grad_bucket import GradBucket
from .helpers import describe, verify_params_across_processes
from .hooks import Hook, _sum_hook

__all__ = ["Reducer"]

_MB = 1024 * 1024


class _Bucket:
    """One bucket's layout and its state in the current iteration."""

    __slots__ = ("indices", "offsets", "flat", "views", "avg", "pending", "future", "gather")

    def __init__(self, indices: list[int], offsets: list[int], flat: Any, views: list[Any], avg: bool) -> None:
        self.indices = indices
        self.offsets = offsets
        self.flat = flat
        self.views = views
        self.avg = avg  # the default average is the bucket's all_reduce (AVG): nothing divided on the way in
        self.pending = len(indices)
        self.future: Future[Any] | None = None
        self.gather: BucketGather | None = None  # CuPy: fills the bucket in one launch (made on first use)


TreeT = TypeVar("TreeT")


class Reducer(Generic[TreeT]):
    """Averages gradients over a group in buckets, overlapping communication with the
    rest of the backward pass (torch's ``dist.Reducer``, for NumPy, CuPy and JAX).

    Args:
        params: the parameters: a list of arrays, or (with JAX installed) any pytree of
            arrays; the gradients come in the same structure.
        bucket_cap_mb: a bucket's size limit in MiB (DDP's 25).
        first_bucket_cap_mb: the first issued bucket's limit in MiB (DDP's 1): the
            first gradients go out early.
        group: the process group (None: the default group).
        check_ready: follow the last bucket with a small all_gather that turns a
            gradient missing on any rank into :class:`ParameterMismatchError` on every rank.
        rebuild_buckets: rebuild buckets after the first iteration in arrival order.
        verify: check at construction that every rank has the same parameter shapes and
            dtypes (one all_gather of their descriptions).

    Raises:
        ParameterMismatchError: the ranks' parameter lists differ (``verify``).
        ValueError/TypeError: no parameters, a bad cap, arrays of an unknown kind.

    Example:
        >>> reducer = gpucoll.Reducer(params)
        >>> for i in reversed(range(len(params))):      # a hand-written backward
        ...     reducer.mark_ready(i, grad_of(i))
        >>> grads = reducer.wait()                          # averaged over the ranks
    """

    def __init__(self, params: TreeT, bucket_cap_mb: float = 25, first_bucket_cap_mb: float = 1,
                 group: ProcessGroup | None = None, *, check_ready: bool = True,
                 rebuild_buckets: bool = True, verify: bool = True) -> None:
        self._leaves, self._treedef, self._names = _flatten(params)
        if not self._leaves:
            raise ValueError("Reducer: params is empty; expected at least one parameter")
        if not bucket_cap_mb > 0 or not first_bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb and first_bucket_cap_mb must be positive; got "
                             f"{bucket_cap_mb!r} and {first_bucket_cap_mb!r}")
        self._group = _pg(group)
        self._n = len(self._leaves)
        self._shapes = [tuple(int(d) for d in leaf.shape) for leaf in self._leaves]
        self._jax = any(kinds.is_jax(leaf) for leaf in self._leaves)
        self._limits = [int(first_bucket_cap_mb * _MB), int(bucket_cap_mb * _MB)]
        self._check_ready = check_ready
        self._xp = kinds.namespace(self._leaves[0])
        odd = [self._names[i] for i, leaf in enumerate(self._leaves) if kinds.namespace(leaf) is not self._xp]
        if odd:
            raise TypeError(f"Reducer: the parameters must all be of one array kind (their buckets are made "
                            f"by {getattr(self._xp, '__name__', self._xp)}); these differ: {_listing(odd)}")
        self._divide = self._xp.divide
        # The default average of a bucket of a floating type is the bucket's all_reduce, an
        # AVG: nothing is divided on the way in. The CPU backend divides each folded sum as
        # it copies it out (no pass of its own); NCCL's ncclAvg scales as it reduces, so no
        # gradient costs a kernel launch of its own for the division (on an H200 a CuPy
        # kernel's launch takes 7-9 us of host time). NumPy buckets of other types divide
        # inside the bucket's all_reduce, on the way into the transport
        # (all_reduce_gathered); and NumPy's reduce() reads the gradients where they are.
        self._gathered = self._xp is np
        self._cupy = getattr(self._xp, "__name__", "") == "cupy"
        self._native = type(self._xp.empty(0, dtype=np.float32))  # gradients of this class need no asarray
        if verify:
            verify_params_across_processes(self._group, self._leaves, names=self._names)
        n = len(self._leaves)
        order = list(reversed(range(n)))
        indices, _ = compute_bucket_assignment_by_size([self._leaves[i] for i in order], self._limits,
                                                       tensor_indices=order)
        self._buckets: list[_Bucket] = []
        self._where: list[tuple[int, int]] = []
        self._layout(indices)
        self._size = self._group.size()
        self._hook: Hook = _sum_hook
        self._state: Any = self._group
        self._hook_registered = False
        self._ready = [False] * n
        self._next = 0  # the next bucket to issue
        self._check_work: Work | None = None
        self._mask = self._everyone = np.zeros(0, np.uint8)
        self._started = False
        self._rebuild = rebuild_buckets
        self._arrival: list[int] = []
        self._recording = rebuild_buckets  # the first iteration's arrival order
        self.iteration = 0

    # ----- set-up -----
    def _layout(self, bucket_indices: list[list[int]]) -> None:
        for old in getattr(self, "_buckets", ()):
            if old.gather is not None:
                old.gather.close()  # its last fill done before its table goes back to the pool
        buckets: list[_Bucket] = []
        where = [(0, 0)] * len(self._leaves)
        for b, members in enumerate(bucket_indices):
            first = self._leaves[members[0]]
            sizes = [int(np.prod(self._leaves[i].shape, dtype=np.int64)) for i in members]
            offsets = [int(x) for x in np.cumsum([0, *sizes[:-1]])]
            flat = self._xp.empty(sum(sizes), dtype=kinds.np_dtype(np.dtype(first.dtype).name))
            views = [flat[o:o + s].reshape(self._leaves[i].shape) for i, o, s in zip(members, offsets, sizes)]
            for pos, i in enumerate(members):
                where[i] = (b, pos)
            avg = np.dtype(flat.dtype).kind == "f"
            buckets.append(_Bucket(list(members), offsets, flat, views, avg))
        self._buckets = buckets
        self._where = where
        self._slot = [(buckets[b], buckets[b].views[pos]) for b, pos in where]
        self._out = [view for _, view in self._slot]

    def register_comm_hook(self, state: object, hook: Hook) -> None:
        """Use ``hook(state, bucket)`` to reduce each bucket instead of the default average.

        Call once, before the first gradient (torch's rule).

        Raises:
            RuntimeError: a hook is already registered, or an iteration has started.
        """
        if self._hook_registered:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        if self._started or self.iteration:
            raise RuntimeError("register_comm_hook must be called before the first gradient is marked ready")
        if not callable(hook):
            raise TypeError(f"hook must be callable as hook(state, bucket); got {type(hook).__name__}")
        self._hook, self._state, self._hook_registered = hook, state, True

    @property
    def bucket_indices(self) -> list[list[int]]:
        """The parameter indices of each bucket, in the order buckets are issued."""
        return [list(b.indices) for b in self._buckets]

    # ----- one iteration -----
    def mark_ready(self, index: int, grad: ArrayLike) -> None:
        """Hand over parameter ``index``'s gradient; issue its bucket once it is full.

        ``grad`` is copied into the bucket (unless it is the bucket's own view, from
        :meth:`gradient_view`).

        Raises:
            ValueError: ``index`` out of range, marked twice in this iteration, or a
                gradient of the wrong shape.
        """
        g: Any = grad  # read as the array it is (shape, class); typed ArrayLike for callers
        # The hot path (once per gradient per iteration): checks by look-up, no allocation.
        if index.__class__ is not int:
            index = self._index_of(index)
        if not 0 <= index < self._n:
            raise ValueError(f"mark_ready: index={index!r} is out of range for {self._n} parameters")
        if self._ready[index]:
            raise ValueError(f"mark_ready: {self._label(index)} was marked ready twice in this iteration "
                             "(torch: Expected to mark a variable ready only once)")
        if g.shape != self._shapes[index] and tuple(g.shape) != self._shapes[index]:
            raise self._shape_error(index, g)
        bucket, view = self._slot[index]
        if self._hook_registered or self._gathered or bucket.avg:  # the hook divides, or the bucket's op
            if g is not view:
                view[...] = g if g.__class__ is self._native else self._xp.asarray(g)
        elif g is view:
            view /= self._size
        else:  # the default average: divide on the way in (one pass over the memory, not two)
            self._divide(g if g.__class__ is self._native else self._xp.asarray(g), self._size, out=view)
        self._ready[index] = True
        self._started = True
        if self._recording:
            self._arrival.append(index)
        bucket.pending -= 1
        if bucket.pending == 0:
            try:
                self._issue_ready()
            except BaseException:
                self._abandon()  # a hook that raised: the next iteration starts clean
                raise

    def _shape_error(self, i: int, g: Any) -> ValueError:
        return ValueError(f"mark_ready: the gradient of {self._names[i]} has shape {tuple(g.shape)}; "
                          f"expected {self._shapes[i]}")

    def _abandon(self) -> None:
        """A failed iteration: wait out what it issued, and start the next one clean."""
        self._settle(None)
        self._reset()
        self._arrival = []

    def _index_of(self, index: Any) -> int:
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise ValueError(f"mark_ready: index={index!r} is out of range for {self._n} parameters")
        return int(index)

    def gradient_view(self, index: int) -> Any:
        """The bucket's view for parameter ``index``'s gradient: write the gradient there
        and pass this view to :meth:`mark_ready` to save the copy (NumPy and CuPy)."""
        b, pos = self._where[index]
        return self._buckets[b].views[pos]

    def _issue_ready(self) -> None:
        while self._next < len(self._buckets) and self._buckets[self._next].pending == 0:
            self._issue(self._next)
            self._next += 1
            if self._next == len(self._buckets) and self._check_ready:
                self._issue_check()

    def _issue_check(self) -> None:
        """The all_gather of which gradients this rank handed over, queued right behind the
        last bucket (so ``wait()`` adds no round trip of its own)."""
        n, size = len(self._leaves), self._group.size()
        self._mask = np.array(self._ready, np.uint8)
        self._everyone = np.empty(n * size, np.uint8)
        self._check_work = _collectives.all_gather_single(self._everyone, self._mask, group=self._group,
                                                          async_op=True)

    def _issue(self, b: int) -> None:
        bucket = self._buckets[b]
        if not self._hook_registered and (self._gathered or bucket.avg):  # the average inside the bucket's op
            flat = bucket.flat
            work = (_collectives.all_reduce(flat, op=ReduceOp.AVG, group=self._group, async_op=True) if bucket.avg
                    else all_reduce_gathered(self._group, flat, [flat], self._size, async_op=True))
            assert work is not None
            bucket.future = Future.from_work(work).then(lambda fut: flat)
            return
        grad_bucket = GradBucket(b, bucket.flat, bucket.views, [self._leaves[i] for i in bucket.indices],
                                 b == len(self._buckets) - 1, bucket.offsets)
        future = self._hook(self._state, grad_bucket)
        if not hasattr(future, "wait"):
            raise TypeError(f"the communication hook returned {type(future).__name__}; expected a Future "
                            "(e.g. Future.from_work(gpucoll.all_reduce(x, async_op=True)))")
        bucket.future = future

    def reduce(self, grads: TreeT, timeout: float | None = None) -> TreeT:
        """Reduce a whole set of gradients (same structure as the parameters) and return
        the averaged ones, as :meth:`mark_ready` for each, then :meth:`wait`. (NumPy
        buckets with the default average and no ``timeout``: each bucket's all_reduce
        reads the gradients where they are, so nothing is copied into the buckets first;
        the gradients are left as they are.)"""
        leaves = _flatten_like(grads, self._treedef, len(self._leaves))
        if timeout is None and not self._hook_registered and not self._started and self._gathered:
            return self._reduce_gathered(leaves)
        if not self._started and self._copies_only() and all(g.__class__ is self._native for g in leaves):
            self._fill(leaves)
            return self.wait(timeout)
        for i in reversed(range(len(leaves))):  # a backward pass's order
            self.mark_ready(i, leaves[i])
        return self.wait(timeout)

    def _copies_only(self) -> bool:
        """Device buckets whose gradients go in by a plain copy (the bucket's op or the hook
        averages): a bucket can take them all in one launch."""
        return not self._gathered and not self._jax and (self._hook_registered or all(b.avg for b in self._buckets))

    def _fill(self, leaves: list[Any]) -> None:
        """:meth:`reduce` of device gradients: each bucket takes its gradients in one
        launch (CuPy: gpucoll's gather kernel, else ``concatenate(..., out=bucket)``),
        where a copy per gradient costs a launch each (6-7 us of host time on an H200),
        and is issued as soon as it is full, as :meth:`mark_ready` would."""
        for i, g in enumerate(leaves):
            if g.shape != self._shapes[i] and tuple(g.shape) != self._shapes[i]:
                raise self._shape_error(i, g)
        self._started = True
        if self._recording:
            self._arrival = list(range(self._n - 1, -1, -1))  # the order reduce() hands them over
        try:
            for bucket in self._buckets:
                parts = [leaves[i] for i in bucket.indices]
                if any(g is not v for g, v in zip(parts, bucket.views)):
                    if len(parts) == 1:
                        bucket.views[0][...] = parts[0]
                    elif not self._cupy or not self._gather(bucket).fill(parts):
                        self._xp.concatenate([g.reshape(-1) for g in parts], out=bucket.flat)
                for i in bucket.indices:
                    self._ready[i] = True
                bucket.pending = 0
                self._issue_ready()
        except BaseException:
            self._abandon()
            raise

    @staticmethod
    def _gather(bucket: _Bucket) -> BucketGather:
        if bucket.gather is None:
            bucket.gather = BucketGather(bucket.flat, bucket.offsets, [int(v.size) for v in bucket.views])
        return bucket.gather

    def _reduce_gathered(self, leaves: list[Any]) -> TreeT:
        """:meth:`reduce` of NumPy gradients with the default average: each bucket is one
        synchronous all_reduce that divides the gradients straight into the transport's
        staging buffers (``all_reduce_gathered``), with no pass of its own to copy them
        into the bucket first. Every peer sees the collectives of :meth:`mark_ready` and
        :meth:`wait` (the same buckets' all_reduces, then the agreement all_gather)."""
        flat = []
        for i, g in enumerate(leaves):
            a = g if g.__class__ is np.ndarray else np.asarray(g)
            if a.shape != self._shapes[i]:
                raise self._shape_error(i, a)
            flat.append(a.reshape(-1))
        self._started = True
        try:
            for bucket in self._buckets:
                # a floating bucket's AVG, its input read from the gradients; others' SUM of them divided
                all_reduce_gathered(self._group, bucket.flat, [flat[i] for i in bucket.indices],
                                    1 if bucket.avg else self._size, op=ReduceOp.AVG if bucket.avg else ReduceOp.SUM)
            if self._check_ready:
                self._ready = [True] * self._n
                self._issue_check()
                self._agree(None)
        except BaseException:
            self._abandon()
            raise
        self._reset()
        if self._recording:
            self._arrival = list(range(self._n - 1, -1, -1))
        return self._finish()

    def wait(self, timeout: float | None = None) -> TreeT:
        """Finish the iteration: issue what is left, wait for every bucket, and return the
        reduced gradients in the parameters' structure (NumPy/CuPy: views into the
        buckets, valid until the next iteration writes them; JAX: new arrays).

        Args:
            timeout: seconds for each op; None uses the group's timeout.

        Raises:
            ParameterMismatchError: some rank did not hand over every gradient.
            DistBackendError: an op failed or did not complete in time.
        """
        missing = [i for i, r in enumerate(self._ready) if not r]
        try:
            if missing and not self._check_ready:
                raise ParameterMismatchError(
                    f"Reducer.wait: rank {self._group.rank()} did not mark these parameters ready: "
                    f"{_listing([self._label(i) for i in missing])}")
            for i in missing:  # zeros, so that this rank still issues what its peers issue
                b, pos = self._where[i]
                self._buckets[b].views[pos][...] = 0
                self._buckets[b].pending -= 1
            self._issue_ready()
            for bucket in self._buckets:
                assert bucket.future is not None
                value = bucket.future.wait(timeout)
                if isinstance(value, (list, tuple)):
                    value = value[0]
                if value is not bucket.flat:
                    kinds.decompress_into(bucket.flat, value)
            if self._check_ready:
                self._agree(timeout)
        except BaseException:
            self._arrival = []  # a failed iteration's order is not the one to rebuild in
            self._settle(timeout)
            raise
        finally:
            self._reset()
        return self._finish()

    def _finish(self) -> TreeT:
        """The end of a completed iteration: the reduced gradients (rebuilding the buckets
        after the first iteration)."""
        out = ([kinds.to_caller(self._view(i), leaf) for i, leaf in enumerate(self._leaves)] if self._jax
               else list(self._out))
        if self._rebuild and self.iteration == 0:
            self._rebuild_buckets()  # new buffers: what ``out`` views stays as it is
        self._recording = False
        self.iteration += 1
        if self._treedef is None:
            return cast(TreeT, out)
        return cast(TreeT, self._treedef.unflatten(out))

    def _label(self, i: int) -> str:
        return f"{self._names[i]} {describe(self._leaves[i])}"

    def _view(self, i: int) -> Any:
        b, pos = self._where[i]
        return self._buckets[b].views[pos]

    def _settle(self, timeout: float | None) -> None:
        """Wait out the ops a failed iteration issued, ignoring their own errors (the first
        error is the one raised): an async op may still be running (the CPU backend hands
        one whose peers are late to its worker), and the next iteration reuses its buffers."""
        pending = [bucket.future for bucket in self._buckets if bucket.future is not None]
        for waitable in (*pending, self._check_work):
            if waitable is not None:
                try:
                    waitable.wait(timeout)
                except BaseException:  # the iteration already failed; this one's error adds nothing
                    pass

    def _reset(self) -> None:
        self._ready = [False] * len(self._leaves)
        self._next = 0
        self._started = False
        self._check_work = None
        for bucket in self._buckets:
            bucket.pending = len(bucket.indices)
            bucket.future = None

    def _agree(self, timeout: float | None) -> None:
        n, size = len(self._leaves), self._group.size()
        assert self._check_work is not None
        self._check_work.wait(timeout)
        everyone = self._everyone
        by_rank = everyone.reshape(size, n)
        if by_rank.all():
            return
        lines = [f"{self._label(int(i))} (missing on rank(s) {', '.join(map(str, np.flatnonzero(by_rank[:, i] == 0)))})"
                 for i in np.flatnonzero(~by_rank.all(axis=0))]
        raise ParameterMismatchError(
            f"Reducer.wait: not every rank marked every gradient ready in iteration {self.iteration}; "
            f"the reduction is discarded. Parameters: {_listing(lines)}")

    def _rebuild_buckets(self) -> None:
        n = len(self._leaves)
        order = np.array(self._arrival if len(self._arrival) == n else range(n - 1, -1, -1), np.int64)
        _collectives.broadcast(order, group=self._group, group_src=0)
        self._arrival = []
        indices, _ = compute_bucket_assignment_by_size([self._leaves[i] for i in order], self._limits,
                                                       tensor_indices=[int(i) for i in order])
        if indices != self.bucket_indices:
            self._layout(indices)


def _listing(items: Sequence[str], limit: int = 20) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", and {len(items) - limit} more" if len(items) > limit else "")


def _flatten(params: Any) -> tuple[list[Any], Any, list[str]]:
    """(leaves, JAX treedef or None, a name per leaf for messages)."""
    if isinstance(params, (list, tuple)) and all(hasattr(p, "shape") and hasattr(p, "dtype") for p in params):
        leaves = list(params)
        return leaves, None, [f"parameter {i}" for i in range(len(leaves))]
    jax = sys.modules.get("jax")
    if jax is None:
        raise TypeError(f"params must be a list of arrays (or a JAX pytree, with JAX imported); "
                        f"got {type(params).__name__}")
    with_path, treedef = jax.tree_util.tree_flatten_with_path(params)
    leaves = [leaf for _, leaf in with_path]
    names = [f"parameter {i} {jax.tree_util.keystr(path)}" for i, (path, _) in enumerate(with_path)]
    return leaves, treedef, names


def _flatten_like(grads: Any, treedef: Any, n: int) -> list[Any]:
    if treedef is None:
        leaves = list(grads)
    else:
        import jax

        leaves, other = jax.tree_util.tree_flatten(grads)
        if other != treedef:
            raise ValueError(f"reduce: the gradients' structure {other} differs from the parameters' {treedef}")
    if len(leaves) != n:
        raise ValueError(f"reduce: got {len(leaves)} gradients for {n} parameters")
    return leaves
