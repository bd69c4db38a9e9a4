"""``ncclConfig_t``: the fields gpucoll can set, the NCCL release each needs, and a
ctypes mirror of the struct for ``ncclCommInitRankConfig``/``ncclCommSplit``/``ncclCommShrink``.

The struct is versioned and append-only (nccl.h). NCCL's ``parseCommConfig``
(src/init.cc) reads ``size`` first and copies ``min(config.size, its own sizeof)``
bytes, checks ``magic``, then resets to its defaults every field newer than the
struct's ``version`` (``if (version < NCCL_VERSION(2, 28, 0)) nChannelsPerNetPeer =
default``...). So a field newer than the loaded library would be dropped without a
word: :func:`check_config` refuses such a field instead, naming it and the release it
needs. And :func:`make_struct` builds the struct the loaded NCCL's own nccl.h
declares: its fields only, ``size`` its sizeof, ``version`` its NCCL_VERSION_CODE
(what NCCL_CONFIG_INITIALIZER gives a program built against that header).
Importing this module imports no CuPy.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ...errors import BackendUnavailableError

__all__ = ["ConfigField", "FIELDS", "FIELD_NAMES", "NCCL_API_MAGIC", "CONFIG_LAYOUT_VERSION", "LAYOUT",
           "UNDEF_INT", "NcclConfigStruct", "check_value", "check_config", "usable_config", "version_code",
           "struct_for", "make_struct"]

NCCL_API_MAGIC = 0xCAFEBEEF
"""nccl.h's NCCL_API_MAGIC: NCCL_CONFIG_INITIALIZER's ``magic``."""
LAYOUT = (2, 32, 3)
"""The NCCL release whose nccl.h :class:`NcclConfigStruct` mirrors whole."""
CONFIG_LAYOUT_VERSION = 23203
"""The NCCL_VERSION_CODE of :data:`LAYOUT`: the ``version`` of a struct passed to that
NCCL or a newer one, so that a newer library resets only the fields this layout lacks."""
UNDEF_INT = -(2 ** 31)
"""NCCL_CONFIG_UNDEF_INT (INT_MIN): the field is left to NCCL (or its environment variable)."""


@dataclass(frozen=True)
class ConfigField:
    """One settable ``ncclConfig_t`` field.

    Attributes:
        name: gpucoll's (and torch's) spelling, e.g. ``"cga_cluster_size"``.
        c_name: nccl.h's, e.g. ``"cgaClusterSize"``.
        kind: ``"bool"``, ``"int"`` (>= 0) or ``"str"``.
        since: the first NCCL release whose nccl.h declares it in ``ncclConfig_t``
            (NCCL's release tags; init.cc's version guards agree but for
            trafficClass, guarded from 2.25.0 and declared from 2.26). The fields of
            one release are those with ``since`` at or below it, in this order.
    """

    name: str
    c_name: str
    kind: str
    since: tuple[int, int, int]


FIELDS: tuple[ConfigField, ...] = (
    ConfigField("blocking", "blocking", "bool", (2, 14, 0)),
    ConfigField("cga_cluster_size", "cgaClusterSize", "int", (2, 17, 0)),
    ConfigField("min_ctas", "minCTAs", "int", (2, 17, 0)),
    ConfigField("max_ctas", "maxCTAs", "int", (2, 17, 0)),
    ConfigField("net_name", "netName", "str", (2, 17, 0)),
    ConfigField("split_share", "splitShare", "bool", (2, 18, 0)),
    ConfigField("traffic_class", "trafficClass", "int", (2, 26, 0)),
    ConfigField("comm_name", "commName", "str", (2, 27, 0)),
    ConfigField("collnet_enable", "collnetEnable", "bool", (2, 27, 0)),
    ConfigField("cta_policy", "CTAPolicy", "int", (2, 27, 0)),
    ConfigField("shrink_share", "shrinkShare", "bool", (2, 27, 0)),
    ConfigField("nvls_ctas", "nvlsCTAs", "int", (2, 27, 0)),
    ConfigField("n_channels_per_net_peer", "nChannelsPerNetPeer", "int", (2, 28, 0)),
    ConfigField("nvlink_centric_sched", "nvlinkCentricSched", "bool", (2, 28, 0)),
    ConfigField("graph_usage_mode", "graphUsageMode", "int", (2, 29, 0)),
    ConfigField("num_rma_ctx", "numRmaCtx", "int", (2, 29, 0)),
    ConfigField("max_p2p_peers", "maxP2pPeers", "int", (2, 30, 0)),
    ConfigField("graph_stream_ordering", "graphStreamOrdering", "int", (2, 30, 5)),
    ConfigField("launch_order_implicit", "launchOrderImplicit", "int", (2, 32, 0)),
    ConfigField("num_rma_sig", "numRmaSig", "int", (2, 32, 0)),
    ConfigField("rma_eager_init", "rmaEagerInit", "int", (2, 32, 0)),
    ConfigField("host_cft_mode", "hostCftMode", "int", (2, 32, 0)),
    ConfigField("nvls_host_mode", "nvlsHostMode", "int", (2, 32, 0)),
)
FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in FIELDS)
_BY_NAME = {f.name: f for f in FIELDS}
_INT_MAX = 2 ** 31 - 1


class NcclConfigStruct(ctypes.Structure):
    """``ncclConfig_t`` as nccl.h 2.32 lays it out (tests/nccl/test_pg_options.py checks
    it against the installed header)."""

    _fields_ = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint), ("version", ctypes.c_uint)] + [
        (f.c_name, ctypes.c_char_p if f.kind == "str" else ctypes.c_int) for f in FIELDS]


def check_value(name: str, value: Any) -> Any:
    """``value`` checked for field ``name`` (None = unset); bools as bool, ints as int.

    Raises:
        TypeError: an unknown field, or a value of the wrong type (naming the field).
        ValueError: an int out of range, or an empty string or one with a NUL.
    """
    field = _BY_NAME.get(name)
    if field is None:
        raise TypeError(f"{name!r} is not an NCCL config field; known: {', '.join(FIELD_NAMES)}")
    if value is None:
        return None
    if field.kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise TypeError(f"NCCL config field {name} must be a bool; got {type(value).__name__} {value!r}")
    if field.kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"NCCL config field {name} must be an int; got {type(value).__name__} {value!r}")
        if not 0 <= value <= _INT_MAX:
            raise ValueError(f"NCCL config field {name} must be in [0, {_INT_MAX}]; got {value}")
        return value
    if not isinstance(value, str):
        raise TypeError(f"NCCL config field {name} must be a str; got {type(value).__name__} {value!r}")
    if not value or "\0" in value:
        raise ValueError(f"NCCL config field {name} must be a non-empty str without NUL; got {value!r}")
    return value


def check_config(fields: Mapping[str, Any], version: tuple[int, int, int]) -> None:
    """Refuse the set ``fields`` that the loaded NCCL (``version``) does not have.

    Raises:
        BackendUnavailableError: naming every such field and the release it needs.
    """
    old = [f"{name} (NCCL >= {'.'.join(map(str, _BY_NAME[name].since))})"
           for name, value in fields.items() if value is not None and version < _BY_NAME[name].since]
    if old:
        raise BackendUnavailableError(
            f"the loaded NCCL {'.'.join(map(str, version))} is too old for the NCCL config field(s) "
            f"{', '.join(old)}; upgrade NCCL or leave them unset")


def usable_config(config: Mapping[str, Any] | None, version: tuple[int, int, int],
                  runtime_check: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """``config``'s set fields, checked: their values, ``blocking=False`` (the NCCL backend
    drives communicators in blocking mode), the loaded NCCL's ``version``, and what the
    runtime can apply (``runtime_check``, called only when a field is set).

    Raises:
        TypeError, ValueError: a bad value, or blocking=False.
        BackendUnavailableError: a field the NCCL or the runtime cannot apply.
    """
    out = {name: check_value(name, value) for name, value in (config or {}).items() if value is not None}
    if out.get("blocking") is False:
        raise ValueError("NCCL config field blocking=False is not supported: the NCCL backend drives "
                         "its communicators in blocking mode")
    check_config(out, version)
    if out:
        runtime_check(out)
    return out


def version_code(version: tuple[int, int, int]) -> int:
    """nccl.h's NCCL_VERSION(X, Y, Z) (releases from 2.9): X*10000 + Y*100 + Z."""
    x, y, z = version
    return x * 10000 + y * 100 + z


_STRUCTS: dict[int, type[ctypes.Structure]] = {len(FIELDS): NcclConfigStruct}


def struct_for(version: tuple[int, int, int]) -> type[ctypes.Structure]:
    """The ``ncclConfig_t`` of NCCL ``version``'s nccl.h: ``size``, ``magic``, ``version``,
    then the fields that release declares (:class:`NcclConfigStruct` from :data:`LAYOUT` on)."""
    n = sum(1 for f in FIELDS if f.since <= version)
    cls = _STRUCTS.get(n)
    if cls is None:
        cls = _STRUCTS[n] = type(f"NcclConfigStruct_{n}", (ctypes.Structure,),
                                 {"_fields_": NcclConfigStruct._fields_[:3 + n]})
    return cls


def make_struct(fields: Mapping[str, Any], version: tuple[int, int, int] = LAYOUT) -> Any:
    """An ``ncclConfig_t`` for NCCL ``version`` (the loaded library's), made as
    NCCL_CONFIG_INITIALIZER makes it in a program built against that release's nccl.h:
    its fields, ``size`` its sizeof, ``version`` its NCCL_VERSION_CODE (:data:`LAYOUT`'s
    for a newer NCCL); ``fields`` set (check them first with :func:`check_config`). The
    struct keeps the string fields' bytes alive."""
    layout = min(version, LAYOUT)
    cls = struct_for(layout)
    cfg = cls()
    cfg.size = ctypes.sizeof(cls)
    cfg.magic = NCCL_API_MAGIC
    cfg.version = version_code(layout)
    names = {name for name, _ in cls._fields_}  # type: ignore[misc]
    for f in FIELDS:
        if f.c_name not in names:
            if fields.get(f.name) is not None:
                raise ValueError(f"NCCL config field {f.name} is not in NCCL {'.'.join(map(str, version))}'s "
                                 f"ncclConfig_t (it needs {'.'.join(map(str, f.since))})")
            continue
        value = fields.get(f.name)
        if f.kind == "str":
            setattr(cfg, f.c_name, None if value is None else str(value).encode())
        else:
            setattr(cfg, f.c_name, UNDEF_INT if value is None else int(value))
    return cfg
