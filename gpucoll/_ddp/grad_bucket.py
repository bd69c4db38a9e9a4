"""GradBucket: what a communication hook gets for one bucket (torch's ``dist.GradBucket``)."""

from __future__ import annotations

from typing import Any, Generic, Sequence, TypeVar

from ..array import ArrayLike

__all__ = ["GradBucket"]

#: The array type of a bucket (NumPy, CuPy, ...): ``GradBucket[numpy.ndarray]`` in a typed hook.
ArrayT = TypeVar("ArrayT", bound=ArrayLike)


class GradBucket(Generic[ArrayT]):
    """One bucket of gradients, flattened into one buffer, as a hook sees it.

    ``buffer()`` is a 1-D array of the parameters' kind (NumPy, CuPy; JAX parameters are
    staged in NumPy on CPUs and CuPy on GPUs); ``gradients()`` are views into it, shaped
    as the parameters. A hook reduces the buffer (in place or into a new array) and
    returns a :class:`~gpucoll._ddp.future.Future` of the result; the Reducer copies the
    result into the bucket (cast to its dtype) if it is another array.

    Args:
        index: the bucket's position in the Reducer (buckets are issued in index order).
        buffer: the flat buffer.
        gradients: views into ``buffer``, one per parameter of the bucket.
        parameters: the parameters, in the same order.
        is_last: whether this is the last bucket of the iteration.
        offsets: each gradient's first element in ``buffer``.
    """

    __slots__ = ("_index", "_buffer", "_gradients", "_parameters", "_is_last", "_offsets")

    def __init__(self, index: int, buffer: ArrayT, gradients: Sequence[ArrayT], parameters: Sequence[ArrayLike],
                 is_last: bool, offsets: Sequence[int] = ()) -> None:
        self._index = index
        self._buffer = buffer
        self._gradients = list(gradients)
        self._parameters = list(parameters)
        self._is_last = is_last
        self._offsets = list(offsets)

    def index(self) -> int:
        """The bucket's index (0 is issued first)."""
        return self._index

    def buffer(self) -> ArrayT:
        """The flat 1-D buffer holding every gradient of the bucket."""
        return self._buffer

    def gradients(self) -> list[ArrayT]:
        """The gradients, shaped as their parameters; views into :meth:`buffer` (as long as
        :meth:`set_buffer` has not replaced it)."""
        return list(self._gradients)

    def parameters(self) -> list[ArrayLike]:
        """The parameters whose gradients the bucket holds, in the same order."""
        return list(self._parameters)

    def is_last(self) -> bool:
        """True for the iteration's last bucket (hooks count iterations on it)."""
        return self._is_last

    def set_buffer(self, buffer: ArrayT) -> None:
        """Replace the buffer that :meth:`buffer` returns (a wrapper hook hands a cast copy
        to the hook it wraps); the gradients stay views into the original."""
        self._buffer = buffer

    def offsets(self) -> list[int]:
        """Each gradient's first element in the original buffer."""
        return list(self._offsets)

    def __repr__(self) -> str:
        return (f"<GradBucket {self._index} of {len(self._gradients)} gradients, "
                f"{getattr(self._buffer, 'size', '?')} elements{', last' if self._is_last else ''}>")
