"""Process groups (private; the public names are re-exported by ``gpucoll``).

Layers, imports pointing down only (tests/api/test_layout.py checks for cycles):

- ``group``: :class:`ProcessGroup`: identity, backends, dispatch, one thin method per op, teardown;
- ``core``: the :class:`~.core.Issuer` a group holds: the one issue path (plans, sequence
  numbers, flight recorder, hooks, timeout);
- ``arglists``: checks of argument lists (one array per rank, splits, p2p ranks and tags);
- ``coalescing``: ``coalescing()`` blocks and every rule about them;
- ``barrier``: the monitored barrier;
- ``checks``: the rank-independent checks and the group's dtype x op table;
- ``registry``: backends by name and the device-backend lifecycle (make, split);
- ``watchdog``: the thread that completes, times out and reports ops;
- ``member``: torch's ``GroupMember`` (the default group lives there).
"""

from __future__ import annotations

from .coalescing import CoalescingManager as CoalescingManager
from .group import ProcessGroup as ProcessGroup
from .member import GroupMember as GroupMember
from .backend_name import Backend as Backend
from .registry import default_backend as default_backend
from .registry import nccl_usable as nccl_usable
from .registry import normalize_backend as normalize_backend

__all__ = ["Backend", "ProcessGroup", "GroupMember", "CoalescingManager", "normalize_backend", "nccl_usable",
           "default_backend"]
