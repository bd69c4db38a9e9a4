"""Raw CUDA events of one device, pooled: what the synchronous issue path records.

An event here is a bare handle (an int), taken from :class:`EventPool` and given back
by whoever completes the op that recorded it: no object is made, and no ``__del__``
runs, per op. Making one (``cudaEventCreateWithFlags``, 1.5 µs on an H200) happens
only while the pool is empty, on the pool's device whatever device is current.
"""

from __future__ import annotations

from .runtime import Runtime, enter_device, leave_device

__all__ = ["EventPool"]


class EventPool:
    """Untimed events of ``device``: :meth:`take` one, :meth:`give` it back once
    nothing will record, wait on or query it again.

    Args:
        rt: makes and destroys events.
        device: the device the events belong to.
        limit: events kept for reuse; more given back are destroyed.
    """

    __slots__ = ("_rt", "_device", "_free", "_limit")

    def __init__(self, rt: Runtime, device: int, limit: int = 4096) -> None:
        self._rt = rt
        self._device = device
        self._free: list[int] = []
        self._limit = limit

    def take(self) -> int:
        free = self._free
        if free:
            try:
                return free.pop()
            except IndexError:  # emptied by another thread meanwhile
                pass
        return self._make()

    def give(self, event: int) -> None:
        free = self._free
        if len(free) < self._limit:
            free.append(event)
        else:
            self._rt.destroy_event(event)

    def _make(self) -> int:
        rt = self._rt
        prev = enter_device(rt, self._device)
        try:
            return rt.new_event(False)
        finally:
            leave_device(rt, prev)

    def clear(self) -> None:
        """Destroy the pooled events (the backend is done with the device)."""
        free, self._free = self._free, []
        for event in free:
            self._rt.destroy_event(event)
