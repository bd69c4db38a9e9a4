"""torch's ``GroupMember``: ``WORLD`` (the default group) and ``NON_GROUP_MEMBER``; and
torch's ``group``, whose ``WORLD`` is the same default group.

The default group is set here by ``init_process_group`` and cleared by
``destroy_process_group`` (gpucoll._world), so that this module imports nothing
above it: no import cycle between the group and the world API.
"""

from __future__ import annotations

from typing import Any

from .group import ProcessGroup

__all__ = ["GroupMember", "group"]


class _NonGroupMember:
    """The value ``new_group`` returns on ranks that are not members (torch's sentinel)."""

    def __repr__(self) -> str:
        return "GroupMember.NON_GROUP_MEMBER"


class _GroupMember:
    """torch's ``GroupMember``: ``GroupMember.WORLD`` is the default group (None before
    ``init_process_group``); ``GroupMember.NON_GROUP_MEMBER`` is what ``new_group`` returns
    on ranks that are not members."""

    NON_GROUP_MEMBER: Any = _NonGroupMember()

    def __init__(self) -> None:
        self._world: ProcessGroup | None = None  # the default group, kept by gpucoll._world

    @property
    def WORLD(self) -> ProcessGroup | None:  # noqa: N802  (torch's name)
        return self._world

    def __repr__(self) -> str:
        return "GroupMember"


GroupMember = _GroupMember()


class _Group:
    """torch's ``dist.group``: ``group.WORLD`` is the default group (None before
    ``init_process_group``), as ``GroupMember.WORLD``; scripts pass it as ``group=``."""

    @property
    def WORLD(self) -> ProcessGroup | None:  # noqa: N802  (torch's name)
        return GroupMember._world

    def __repr__(self) -> str:
        return "group"


group = _Group()
