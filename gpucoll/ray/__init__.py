"""gpucoll on Ray: a job across Ray actors in one call, gpucoll on existing actors, and
gpucoll as a ``ray.util.collective`` backend.

- :func:`run` starts ``world_size`` ranks as actors in a placement group, gives each the
  environment ``gpucoll-run`` gives, serves the job's store from the driver, and returns
  ``fn``'s results; a rank that raises or dies is named in the driver, and a dead rank's
  record reaches the survivors' collectives within a second.
- :func:`init_group` makes the default process group in actors the user already has.
- :func:`register` makes gpucoll the ``"GPUCOLL"`` backend of ``ray.util.collective``.

Importing this module does not import Ray; each function does, and raises ImportError
naming the install command (``pip install 'gpucoll[ray]'``) where Ray is missing.
See docs/launching.md ("Ray").
"""

from __future__ import annotations

from ._group import RayGroup as RayGroup
from ._group import init_group as init_group
from ._records import RankDied as RankDied
from ._records import RankFailure as RankFailure
from ._records import RayJobError as RayJobError
from ._register import BACKEND_NAME as BACKEND_NAME
from ._register import register as register
from ._run import run as run

__all__ = ["run", "init_group", "register", "RayGroup", "RankDied", "RankFailure", "RayJobError", "BACKEND_NAME"]
