"""What ``gpucoll.ray`` reports: a dead rank's record and the driver's job error."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ..errors import DistError

__all__ = ["RankDied", "RayJobError", "RankFailure", "need_ray"]


@dataclass(frozen=True)
class RankDied:
    """A rank whose Ray actor died (its process or its node), as Ray reported it.

    ``gpucoll.ray.run(..., on_failure="shrink")`` returns one in that rank's place.

    Attributes:
        rank: the rank the job started it as.
        node: the address of its node.
        node_id: Ray's id of its node.
        pid: its process id (on ``node``).
        reason: Ray's words for the death.
    """

    rank: int
    node: str
    node_id: str
    pid: int
    reason: str

    def describe(self) -> str:
        """``rank 1 (node 10.0.0.5, pid 4242) died: <reason>``."""
        return f"rank {self.rank} (node {self.node}, pid {self.pid}) died: {self.reason}"


@dataclass(frozen=True)
class RankFailure:
    """One rank's part in a failed job: it raised (``traceback``) or died (``died``)."""

    rank: int
    traceback: str = ""
    died: RankDied | None = None


class RayJobError(DistError):
    """A job started by :func:`gpucoll.ray.run` failed: a rank raised, a rank died (with
    ``on_failure="raise"``), the job ran past its ``timeout``, or its ranks could not be
    placed. ``failures`` lists what each failed rank reported (empty for a timeout or a
    placement failure); ``rank`` is the first of them (None when there is none)."""

    def __init__(self, message: str, failures: Sequence[RankFailure] = ()) -> None:
        super().__init__(message)
        self.failures = list(failures)
        self.rank: int | None = self.failures[0].rank if self.failures else None


def need_ray() -> Any:
    """``import ray``, or an ImportError saying how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError("gpucoll.ray needs Ray, which is not installed here: pip install 'gpucoll[ray]' "
                          f"(or pip install ray); importing it failed with: {exc}") from exc
    return ray
