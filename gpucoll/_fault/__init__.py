"""Surviving rank failures: ``shrink_group``, ``grow_group`` and ``join_process_group``
(the world-level API; the agreement and rebuild live in ``gpucoll._group.shrink`` and
``gpucoll._group.grow``). See docs/fault-tolerance.md."""
