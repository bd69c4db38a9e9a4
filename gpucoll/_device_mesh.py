"""DeviceMesh: ranks laid out as an n-d array, one process group per dimension.

torch's ``init_device_mesh``/``DeviceMesh`` surface. The mesh is a NumPy array of
global ranks; along each dimension the ranks that differ only in that coordinate
form a group. Each dimension's groups come from ONE :func:`~gpucoll.split_group`
of the default group (one ``ncclCommSplit`` where the default group is bound to a
device), so a 3-d mesh costs three splits whatever the number of ranks. Sub-meshes
(``mesh["dp"]``, ``mesh["dp", "tp"]``) reuse their parent's groups.
"""

from __future__ import annotations

from typing import Any, Sequence, TypeAlias

import numpy as np
import numpy.typing as npt

from . import _new_groups, _world
from ._group import normalize_backend as _normalize_backend
from ._group import ProcessGroup

__all__ = ["DeviceMesh", "init_device_mesh"]

_DEVICE_TYPES = ("cpu", "cuda")


#: A mesh's layout of global ranks: nested sequences of ints or an integer array that
#: NumPy can read (NumPy, torch, ...).
MeshLike: TypeAlias = npt.ArrayLike


class _MeshError(RuntimeError, ValueError):
    """A bad mesh argument: RuntimeError as torch raises it, and ValueError (a bad argument)."""


def _check_device_type(device_type: Any) -> str:
    if isinstance(device_type, str) and device_type and not device_type.isalpha():
        raise _MeshError(f"Device type with index is not supported but got {device_type}. If you hold a "
                         f"device object, pass its type ({device_type.split(':')[0]!r}): a mesh spans one "
                         "device per rank")
    if not isinstance(device_type, str) or device_type.lower() not in _DEVICE_TYPES:
        raise ValueError(f"device_type must be 'cpu' or 'cuda'; got {device_type!r}")
    return device_type.lower()


def _check_names(names: Any, ndim: int) -> tuple[str, ...] | None:
    if names is None:
        return None
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"mesh_dim_names must be a tuple of str; got {names!r}")
    out = tuple(names)
    if len(set(out)) != len(out):
        raise _MeshError("Each mesh_dim_name must be unique. Found repeated mesh_dim_name in mesh_dim_names "
                         f"{out!r}")
    if len(out) != ndim:
        raise _MeshError("mesh_shape and mesh_dim_names should have same length! Found "
                         f"len(mesh_dim_names): {len(out)} and len(mesh_shape):{ndim}.")
    return out


_BackendConfig = tuple[Any, Any]  # (backend name or None, pg_options or None)


def _normalize_backend_override(override: Any, ndim: int,
                                names: tuple[str, ...] | None) -> list[_BackendConfig]:
    """``backend_override`` ({dim index or name: backend | options | (backend, options)})
    as one (backend, options) pair per dimension, with torch's errors."""
    if not isinstance(override, dict):
        raise TypeError(f"backend_override must be a dict {{dim or name: backend}}; got {type(override).__name__}")
    left = dict(override)
    out: list[_BackendConfig] = []
    for dim in range(ndim):
        name = names[dim] if names and dim < len(names) else None
        if name is not None and name in left:
            if dim in left:
                raise RuntimeError(f"Found redundant dim index {dim} and name {name} in backend_override")
            value = left.pop(name)
        elif dim in left:
            value = left.pop(dim)
        else:
            out.append((None, None))
            continue
        if isinstance(value, str):
            out.append((value, None))
        elif isinstance(value, tuple) and len(value) == 2:
            out.append((value[0], value[1]))
        else:
            out.append((None, value))
    if left:
        raise RuntimeError(f"Found invalid keys in backend_override: got {list(left)}, expected integers in "
                           f"range [0, {ndim}) or one of {names}")
    return out


class DeviceMesh:
    """An n-d layout of ranks with a process group along each dimension.

    Build one with :func:`init_device_mesh` (or ``DeviceMesh(device_type, mesh)`` for
    an arbitrary layout of global ranks, or :meth:`from_group`). Every rank of the
    default group must construct it, in the same order, like any group.

    Attributes:
        device_type: ``"cpu"`` or ``"cuda"``.
        mesh: the global ranks, an ``np.ndarray`` of int32 (read-only; torch.int, as torch).
        mesh_dim_names: the dimensions' names, or None.

    Example:
        >>> mesh = gpucoll.init_device_mesh("cuda", (2, 4), mesh_dim_names=("dp", "tp"))
        >>> gpucoll.all_reduce(grads, group=mesh.get_group("dp"))
        >>> tp = mesh["tp"]                 # the 1-d sub-mesh this rank is in
    """

    def __init__(self, device_type: str, mesh: MeshLike, *, mesh_dim_names: Sequence[str] | None = None,
                 backend_override: Sequence[_BackendConfig] | None = None,
                 _groups: Sequence[ProcessGroup | None] | None = None) -> None:
        self.device_type = _check_device_type(device_type)
        array = np.array(mesh, dtype=np.int32, copy=True)  # torch keeps the layout as torch.int
        if array.ndim == 0 or array.size == 0:
            raise ValueError(f"mesh must be a non-empty array of ranks with at least one dimension; got {mesh!r}")
        flat = array.ravel().tolist()
        if len(set(flat)) != len(flat):
            raise ValueError(f"mesh holds duplicate ranks: {array.tolist()}")
        array.setflags(write=False)
        self.mesh: np.ndarray[Any, np.dtype[np.int32]] = array
        self.mesh_dim_names = _check_names(mesh_dim_names, array.ndim)
        overrides = list(backend_override) if backend_override is not None else [(None, None)] * array.ndim
        if len(overrides) != array.ndim:
            raise ValueError("backend_override should have the same length as the number of mesh dimensions, "
                             f"but got {len(overrides)} and {array.ndim}.")
        default = _world.default_group()
        size = default.size()
        if min(flat) < 0 or max(flat) >= size:
            raise ValueError(f"mesh holds ranks outside the default group [0, {size}): {array.tolist()}")
        self._rank = default.rank()
        found = np.argwhere(array == self._rank)
        self._coordinate: tuple[int, ...] | None = tuple(int(c) for c in found[0]) if len(found) else None
        self._groups: list[ProcessGroup | None] = (list(_groups) if _groups is not None
                                                   else self._make_groups(default, overrides))

    def _make_groups(self, default: ProcessGroup, overrides: Sequence[_BackendConfig]) -> list[ProcessGroup | None]:
        """One group per line along each dimension; every default-group rank calls it.

        A 1-d mesh of the whole world in rank order is the default group itself (torch
        reuses it too); otherwise one split of the default group per dimension, or, for
        a dimension whose ``backend_override`` names another backend or options, one
        :func:`~gpucoll.new_group` per line."""
        groups: list[ProcessGroup | None] = []
        for dim in range(self.mesh.ndim):
            backend, options = overrides[dim]
            lines = np.moveaxis(self.mesh, dim, -1).reshape(-1, self.mesh.shape[dim]).tolist()
            name = self.mesh_dim_names[dim] if self.mesh_dim_names else str(dim)
            same = (backend is None or _normalize_backend(backend) == default.backend_name) and options is None
            if same and self.mesh.ndim == 1 and lines == [list(range(default.size()))]:
                groups.append(default)
            elif same:
                groups.append(_new_groups.split_group(None, split_ranks=lines, group_desc=f"mesh_{name}"))
            else:
                mine = None
                for line in lines:
                    pg = _new_groups.new_group(line, backend=backend, pg_options=options, group_desc=f"mesh_{name}")
                    if isinstance(pg, ProcessGroup):
                        mine = pg
                groups.append(mine)
        return groups

    @staticmethod
    def from_group(group: ProcessGroup | Sequence[ProcessGroup], device_type: str, mesh: MeshLike | None = None, *,
                   mesh_dim_names: Sequence[str] | None = None) -> DeviceMesh:
        """A mesh over existing groups (no new groups are made).

        Args:
            group: one group (a 1-d mesh of its ranks) or one group per dimension.
            device_type: ``"cpu"`` or ``"cuda"``.
            mesh: the global ranks' layout; required with a list of groups, where
                group ``i`` must be this rank's line along dimension ``i``.
            mesh_dim_names: names of the dimensions.

        Raises:
            ValueError: ``mesh`` missing or inconsistent with the groups.
        """
        if isinstance(group, ProcessGroup):
            ranks = list(group.global_ranks)
            if mesh is not None and np.array(mesh).tolist() != ranks:
                raise ValueError(f"Invalid mesh {np.array(mesh).tolist()} for ProcessGroup with ranks {ranks}: "
                                 "a 1-d mesh of one group lists the group's global ranks in order")
            return DeviceMesh(device_type, ranks, mesh_dim_names=mesh_dim_names, _groups=[group])
        groups = list(group)
        if not groups:
            raise ValueError("Expects at least one ProcessGroup to be passed")
        if mesh is None:
            raise ValueError("Must pass mesh if passing multiple ProcessGroups")
        if np.ndim(mesh) != len(groups):
            raise ValueError("Expects mesh with ndim equal to number of ProcessGroups but got mesh "
                             f"{np.array(mesh).tolist()} and {len(groups)} ProcessGroups")
        out = DeviceMesh(device_type, mesh, mesh_dim_names=mesh_dim_names, _groups=groups)
        for dim, pg in enumerate(groups):
            want = out._line(dim)
            if want is not None and list(pg.global_ranks) != want:
                raise ValueError(f"group {dim} ({pg.group_name!r}) has ranks {list(pg.global_ranks)} but this "
                                 f"rank's line along dimension {dim} of the mesh is {want}")
        return out

    # ----- shape -----
    @property
    def shape(self) -> tuple[int, ...]:
        """The mesh's shape."""
        return tuple(int(s) for s in self.mesh.shape)

    @property
    def ndim(self) -> int:
        """Number of mesh dimensions."""
        return int(self.mesh.ndim)

    def size(self, mesh_dim: int | str | None = None) -> int:
        """Number of ranks in the mesh, or along ``mesh_dim``."""
        if mesh_dim is None:
            return int(self.mesh.size)
        return self.shape[self._dim(mesh_dim)]

    def _dim(self, mesh_dim: int | str | None) -> int:
        if mesh_dim is None:
            if self.ndim > 1:
                raise RuntimeError(f"Found the DeviceMesh have {self.ndim} dimensions. Optional kwarg `mesh_dim` "
                                   "needs to be specified when device_mesh.ndim > 1: pass mesh_dim (or use "
                                   "get_all_groups() for every dimension's group)")
            return 0
        if isinstance(mesh_dim, str):
            return self._get_mesh_dim_by_name(mesh_dim)
        if isinstance(mesh_dim, bool) or not isinstance(mesh_dim, int) or not -self.ndim <= mesh_dim < self.ndim:
            raise ValueError(f"mesh_dim must be a dimension name or an int in [0, {self.ndim}); got {mesh_dim!r}")
        return mesh_dim % self.ndim

    def _get_mesh_dim_by_name(self, mesh_dim_name: str) -> int:
        """The index of the dimension named ``mesh_dim_name`` (torch's private helper, same errors)."""
        if not self.mesh_dim_names:
            raise KeyError("No `mesh_dim_names` found. This mesh's dimensions have no names; pass "
                           "mesh_dim_names= when making it, or select a dimension by index")
        if mesh_dim_name not in self.mesh_dim_names:
            raise KeyError(f"Mesh dimension '{mesh_dim_name}' does not exist. Available mesh dimensions are: "
                           f"mesh_dim_names={self.mesh_dim_names}")
        return self.mesh_dim_names.index(mesh_dim_name)

    def _line(self, dim: int) -> list[int] | None:
        if self._coordinate is None:
            return None
        index: list[Any] = list(self._coordinate)
        index[dim] = slice(None)
        return [int(r) for r in self.mesh[tuple(index)].tolist()]

    # ----- groups and coordinates -----
    def get_group(self, mesh_dim: int | str | None = None) -> ProcessGroup:
        """This rank's group along ``mesh_dim`` (optional on a 1-d mesh).

        Raises:
            RuntimeError: this rank is not in the mesh, or ``mesh_dim`` is missing on an n-d mesh.
        """
        dim = self._dim(mesh_dim)
        pg = self._groups[dim]
        if pg is None:
            raise RuntimeError(f"rank {self._rank} is not in this DeviceMesh {self.mesh.tolist()}")
        return pg

    def get_all_groups(self) -> list[ProcessGroup]:
        """This rank's group along each dimension, in dimension order."""
        return [self.get_group(d) for d in range(self.ndim)]

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        """This rank's coordinate along ``mesh_dim`` (= its rank in that dimension's group)."""
        dim = self._dim(mesh_dim)
        if self._coordinate is None:
            raise RuntimeError(f"rank {self._rank} is not in this DeviceMesh {self.mesh.tolist()}")
        return self._coordinate[dim]

    def get_rank(self) -> int:
        """This process's global rank."""
        return self._rank

    def get_coordinate(self) -> tuple[int, ...] | None:
        """This rank's coordinates in the mesh (a tuple, as torch 2.13 returns), or None
        if it is not in it."""
        return self._coordinate

    # ----- sub-meshes -----
    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        """The sub-mesh over the named dimensions (in the mesh's order) that holds this rank.

        Raises:
            KeyError: unknown names, or names out of the mesh's order.
        """
        wanted = (names,) if isinstance(names, str) else tuple(names)
        if not self.mesh_dim_names:
            raise RuntimeError("Cannot slice a DeviceMesh without mesh_dim_names! Sub-meshes are selected by "
                               "name: pass mesh_dim_names= when making the mesh")
        unknown = [n for n in wanted if n not in self.mesh_dim_names]
        if unknown or not wanted:
            raise KeyError(f"Invalid mesh_dim_names {wanted!r} specified. Valid mesh_dim_names are "
                           f"{list(self.mesh_dim_names)} (invalid mesh_dim_names: {unknown or wanted!r})")
        dims = [self.mesh_dim_names.index(n) for n in wanted]
        if dims != sorted(dims) or len(set(dims)) != len(dims):
            raise KeyError(f"Invalid mesh_dim_names {wanted!r} specified. Mesh dim indices should be in "
                           f"ascending order: names must be distinct and in the mesh's order "
                           f"{list(self.mesh_dim_names)}")
        if wanted == self.mesh_dim_names:
            return self
        if self._coordinate is None:
            raise RuntimeError(f"rank {self._rank} is not in this DeviceMesh {self.mesh.tolist()}")
        index = tuple(slice(None) if d in dims else self._coordinate[d] for d in range(self.ndim))
        return DeviceMesh(self.device_type, self.mesh[index], mesh_dim_names=wanted,
                          _groups=[self._groups[d] for d in dims])

    # ----- identity -----
    def __repr__(self) -> str:
        dims = ", ".join(f"{n}={s}" for n, s in zip(self.mesh_dim_names, self.shape)) if self.mesh_dim_names \
            else ", ".join(map(str, self.shape))
        return f"DeviceMesh(({dims}), {self.device_type!r}, mesh={self.mesh.tolist()})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DeviceMesh):
            return NotImplemented
        return (self.device_type == other.device_type and self.mesh_dim_names == other.mesh_dim_names
                and self.shape == other.shape and bool(np.array_equal(self.mesh, other.mesh)))

    def __hash__(self) -> int:
        return hash((self.device_type, self.mesh_dim_names, self.shape, tuple(self.mesh.ravel().tolist())))


def init_device_mesh(device_type: str, mesh_shape: Sequence[int], *,
                     mesh_dim_names: Sequence[str] | None = None,
                     backend_override: dict[int | str, Any] | None = None) -> DeviceMesh:
    """Lay the default group's ranks out in ``mesh_shape`` (row-major) and make a group per dimension.

    Initializes the default group first if needed (``init_process_group`` with the
    backend for ``device_type`` and the environment's rendezvous). Every rank must call it.

    Args:
        device_type: ``"cuda"`` (NCCL groups, split from the default group's
            communicator) or ``"cpu"``.
        mesh_shape: the mesh's shape; its product must be the world size.
        mesh_dim_names: one unique name per dimension (for ``mesh["dp"]``, ``get_group("dp")``).
        backend_override: per dimension (by index or name), the backend of its groups
            (``"cpu"``/``"gloo"``, ``"nccl"``, ``"fake"``), their ``pg_options``, or a
            ``(backend, pg_options)`` pair; other dimensions split the default group.

    Raises:
        ValueError: the shape does not multiply to the world size or a bad device type.
        RuntimeError: repeated names, a name count that differs from the shape's,
            a device type with an index (``"cpu:0"``) or bad ``backend_override`` keys
            (torch's messages; the first three are ValueErrors too).

    Example:
        >>> mesh = gpucoll.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        >>> mesh.get_coordinate()             # on rank 3: [1, 1]
    """
    if mesh_dim_names is not None and not isinstance(mesh_dim_names, str):
        names = tuple(mesh_dim_names)
        if len(set(names)) != len(names) or (not isinstance(mesh_shape, int) and len(names) != len(mesh_shape)):
            _check_names(names, 1 if isinstance(mesh_shape, int) else len(mesh_shape))
    overrides = None
    if backend_override is not None:
        n = 1 if isinstance(mesh_shape, int) else len(mesh_shape)
        overrides = _normalize_backend_override(backend_override, n,
                                                 tuple(mesh_dim_names) if mesh_dim_names is not None else None)
    kind = _check_device_type(device_type)
    if isinstance(mesh_shape, int) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1
                                              for s in mesh_shape):
        raise ValueError(f"mesh_shape must be a tuple of ints >= 1; got {mesh_shape!r}")
    shape = tuple(mesh_shape)
    if not shape:
        raise ValueError("mesh_shape must have at least one dimension")
    _check_names(mesh_dim_names, len(shape))
    try:
        default = _world.default_group()
    except RuntimeError:  # not initialized: join the job as torch does
        _world.init_process_group("nccl" if kind == "cuda" else "cpu")
        default = _world.default_group()
    if kind == "cuda" and default.backend_name != "nccl":
        raise ValueError(f"device_type='cuda' needs an NCCL default group; this one uses {default.backend_name!r} "
                         "(init_process_group('nccl'))")
    total = int(np.prod(shape))
    if total != default.size():
        raise ValueError(f"mesh_shape {shape} holds {total} ranks but the world size is {default.size()}")
    return DeviceMesh(kind, np.arange(total).reshape(shape), mesh_dim_names=mesh_dim_names,
                      backend_override=overrides)
