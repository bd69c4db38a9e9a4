"""Raw CUDA events of one device, pooled: what the synchronous issue path records.

An event here is a bare handle (an int), taken from :class:`EventPool` and given back
by whoever completes the op that recorded it: no object is made, and no ``__del__``
runs, per op. Making one (``cudaEventCreateWithFlags``, 1.5 µs on an H200) happens
only while the pool is empty, on the pool's device whatever device is current.

The Works of async ops need an :class:`~.protocols.Event` (an object with ``ptr``): the
pool keeps :class:`Handle` objects for them too, one per raw event, reused with it
(:meth:`EventPool.take_handle`, :meth:`EventPool.give_handle`), so that an async op makes
no event object and runs no ``__del__`` either.
"""

from __future__ import annotations

from .runtime import Runtime, enter_device, leave_device

__all__ = ["EventPool", "Handle"]


class Handle:
    """A raw event of an :class:`EventPool` as an Event (``ptr``), given back whole."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


class EventPool:
    """Untimed events of ``device``: :meth:`take` one, :meth:`give` it back once
    nothing will record, wait on or query it again.

    Args:
        rt: makes and destroys events.
        device: the device the events belong to.
        limit: raw events kept for reuse; more given back are destroyed (Handles are
            kept whatever the limit: see :meth:`give_handle`).
    """

    __slots__ = ("_rt", "_device", "_free", "_limit", "handles")

    def __init__(self, rt: Runtime, device: int, limit: int = 4096) -> None:
        self._rt = rt
        self._device = device
        self._free: list[int] = []
        self._limit = limit
        # Free events as Handles (take_handle, give_handle). The issue path pops from it
        # directly, under its backend's issue lock (the only taker); anyone may give back
        # (a list's append is atomic).
        self.handles: list[Handle] = []

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

    def take_handle(self) -> Handle:
        """A free event as a :class:`Handle` (the issue path inlines this: ``handles.pop()``
        when not empty)."""
        handles = self.handles
        return handles.pop() if handles else Handle(self.take())

    def give_handle(self, handle: Handle) -> None:
        """Give back ``handle``, taken with :meth:`take_handle`, once its op completed.
        Kept whatever the limit, destroyed only by :meth:`clear`: a Work's ``wait()`` that
        raced with its completion may still make a stream wait on the event (on its next
        use, which is more order, never less), so the event must stay valid."""
        self.handles.append(handle)

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
        handles, self.handles = self.handles, []
        for event in (*free, *(h.ptr for h in handles)):
            self._rt.destroy_event(event)
