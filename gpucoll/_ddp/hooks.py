"""The built-in communication hooks (torch's ``ddp_comm_hooks.default_hooks``).

A hook takes ``(state, bucket)`` and returns a :class:`Future` of the reduced buffer.
For these hooks the state is the process group (None: the default group), as in torch.
"""

from __future__ import annotations

from typing import Any, Callable

from .. import _collectives
from .._collectives import _pg
from .._group import ProcessGroup
from . import kinds
from .future import Future
from .grad_bucket import GradBucket

__all__ = ["allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "fp16_compress_wrapper",
           "bf16_compress_wrapper", "Hook"]

#: A communication hook: ``hook(state, bucket) -> Future`` of the reduced buffer.
Hook = Callable[[Any, "GradBucket[Any]"], Future[Any]]


def _allreduce_fut(group: ProcessGroup | None, array: Any) -> Future[Any]:
    """Divide ``array`` by the group's size, all-reduce it (sum) asynchronously; a Future of it."""
    pg = _pg(group)
    array /= pg.size()
    work = _collectives.all_reduce(array, group=pg, async_op=True)
    assert work is not None
    return Future.from_work(work).then(lambda fut: array)


def _sum_hook(process_group: ProcessGroup | None, bucket: GradBucket[Any]) -> Future[Any]:
    """The Reducer's default for buckets it cannot average inside their all_reduce (device
    buckets of an integer type): the bucket was divided by the group's size as the
    gradients were copied in (one pass over the memory instead of two); here only the sum."""
    array = bucket.buffer()
    work = _collectives.all_reduce(array, group=process_group, async_op=True)
    assert work is not None
    return Future.from_work(work).then(lambda fut: array)


def allreduce_hook(process_group: ProcessGroup | None, bucket: GradBucket[Any]) -> Future[Any]:
    """Average the bucket over the group with one all_reduce: what the Reducer does
    without a hook (torch's ``allreduce_hook``).

    Example:
        >>> reducer.register_comm_hook(None, allreduce_hook)
    """
    return _allreduce_fut(process_group, bucket.buffer())


def _compress_hook(dtype: str, process_group: ProcessGroup | None, bucket: GradBucket[Any]) -> Future[Any]:
    pg = _pg(process_group)
    buffer = bucket.buffer()
    compressed = kinds.compress(buffer, dtype, pg.size())
    work = _collectives.all_reduce(kinds.collective_arg(compressed), group=pg, async_op=True)
    assert work is not None
    return Future.from_work(work).then(lambda fut: kinds.decompress_into(buffer, compressed))


def fp16_compress_hook(process_group: ProcessGroup | None, bucket: GradBucket[Any]) -> Future[Any]:
    """Cast the bucket to float16, divide by the group's size, all-reduce, cast back:
    half the bytes on the wire (torch's ``fp16_compress_hook``).

    Example:
        >>> reducer.register_comm_hook(None, fp16_compress_hook)
    """
    return _compress_hook("float16", process_group, bucket)


def bf16_compress_hook(process_group: ProcessGroup | None, bucket: GradBucket[Any]) -> Future[Any]:
    """As :func:`fp16_compress_hook` with bfloat16 (float32's range, 8 bits of mantissa).
    NumPy buffers use ``ml_dtypes.bfloat16``; CuPy buffers are rounded to bfloat16 bits.
    """
    return _compress_hook("bfloat16", process_group, bucket)


def _compress_wrapper(dtype: str, hook: Hook) -> Hook:
    def wrapped(state: Any, bucket: GradBucket[Any]) -> Future[Any]:
        original = bucket.buffer()
        compressed = kinds.compress(original, dtype, 1)  # the wrapped hook divides
        if isinstance(compressed, kinds.Carried):
            raise TypeError(f"{dtype}_compress_wrapper: the wrapped hook would get raw bfloat16 bits "
                            "(CuPy has no bfloat16); use bf16_compress_hook on device buffers")
        bucket.set_buffer(compressed)
        fut = hook(state, bucket)

        def decompress(f: Future[Any]) -> Any:
            bucket.set_buffer(original)
            return kinds.decompress_into(original, f.value())
        return fut.then(decompress)

    wrapped.__name__ = f"{dtype[:2]}{dtype[-2:]}_compress_wrapper_hook"
    return wrapped


def fp16_compress_wrapper(hook: Hook) -> Hook:
    """Wrap ``hook`` so that it runs on a float16 copy of the bucket, whose result is cast
    back to the bucket's dtype: ``fp16_compress_wrapper(allreduce_hook)`` is
    :func:`fp16_compress_hook` (torch's ``fp16_compress_wrapper``).

    Example:
        >>> reducer.register_comm_hook(state, fp16_compress_wrapper(powerSGD_hook))
    """
    return _compress_wrapper("float16", hook)


def bf16_compress_wrapper(hook: Hook) -> Hook:
    """As :func:`fp16_compress_wrapper` with bfloat16 (NumPy buffers, through ml_dtypes)."""
    return _compress_wrapper("bfloat16", hook)
