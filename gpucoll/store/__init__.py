"""Key-value stores for rendezvous and control messages: torch.distributed's Store API.

* :class:`HashStore` — in one process, shared by its threads.
* :class:`FileStore` — processes sharing a file (one host, or a shared filesystem).
* :class:`TCPStore` — a server in one process (rank 0 or the launcher), clients anywhere.
* :class:`PrefixStore` — a namespace inside any of them.
"""

from __future__ import annotations

from .base import Store as Store
from .file import FileStore as FileStore
from .hash import HashStore as HashStore
from .prefix import PrefixStore as PrefixStore
from .tcp import TCPStore as TCPStore

__all__ = ["Store", "HashStore", "FileStore", "TCPStore", "PrefixStore"]
