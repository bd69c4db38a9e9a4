"""``pg_options``: :class:`NCCLOptions` and :class:`CPUOptions`, and the one function that
turns what a caller passed (ours, or torch's ``ProcessGroupNCCL.Options`` shape) into them."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol, Union

from .._backends.nccl.config import FIELD_NAMES, UNDEF_INT, check_value
from .._timeouts import to_seconds

__all__ = ["NCCLOptions", "CPUOptions", "FakeOptions", "FakeProcessGroup", "PGOptions", "PGOptionsLike", "TorchOptionsLike", "DeviceLike",
           "coerce_options", "options_timeout"]

_TRANSPORTS = ("auto", "shm", "tcp")


def _check_timeout(value: Any) -> float | None:
    return None if value is None else to_seconds(value, name="pg_options.timeout")


@dataclass(frozen=True)
class NCCLOptions:
    """Options of an NCCL group (torch's ``ProcessGroupNCCL.Options``): the communicator's
    ``ncclConfig_t`` fields, its stream priority and a timeout.

    Every config field defaults to None: left to NCCL (and its ``NCCL_*`` environment
    variables). A field the loaded NCCL is too old for is refused with
    BackendUnavailableError naming it when the communicator is made; see
    docs/nccl-backend.md for what each needs and what the CuPy runtime can apply.

    Attributes:
        blocking: False makes NCCL calls non-blocking (ncclInProgress until done).
        cga_cluster_size, min_ctas, max_ctas, nvls_ctas: NCCL's CTA tuning.
        net_name: the network plugin to use ("IB", "Socket", ...).
        split_share: communicators split from this one share its resources.
        comm_name: a name NCCL shows in its logs and profiler events.
        traffic_class, collnet_enable, cta_policy, shrink_share, n_channels_per_net_peer,
        nvlink_centric_sched, graph_usage_mode, num_rma_ctx, max_p2p_peers,
        graph_stream_ordering, launch_order_implicit, num_rma_sig, rma_eager_init,
        host_cft_mode, nvls_host_mode: the rest of nccl.h 2.32's ``ncclConfig_t``.
        is_high_priority_stream: run the group's communication stream at the device's
            highest stream priority.
        timeout: the group's timeout (seconds or timedelta) when the call that makes
            the group gives none.

    Raises:
        TypeError, ValueError: a field of the wrong type or out of range (naming it).

    Example:
        >>> opts = gpucoll.NCCLOptions(comm_name="tp", max_ctas=8, is_high_priority_stream=True)
        >>> tp = gpucoll.new_group([0, 1], backend="nccl", pg_options=opts)
    """

    blocking: bool | None = None
    cga_cluster_size: int | None = None
    min_ctas: int | None = None
    max_ctas: int | None = None
    net_name: str | None = None
    split_share: bool | None = None
    traffic_class: int | None = None
    comm_name: str | None = None
    collnet_enable: bool | None = None
    cta_policy: int | None = None
    shrink_share: bool | None = None
    nvls_ctas: int | None = None
    n_channels_per_net_peer: int | None = None
    nvlink_centric_sched: bool | None = None
    graph_usage_mode: int | None = None
    num_rma_ctx: int | None = None
    max_p2p_peers: int | None = None
    graph_stream_ordering: int | None = None
    launch_order_implicit: int | None = None
    num_rma_sig: int | None = None
    rma_eager_init: int | None = None
    host_cft_mode: int | None = None
    nvls_host_mode: int | None = None
    is_high_priority_stream: bool = False
    timeout: float | timedelta | None = None

    def __post_init__(self) -> None:
        for name in FIELD_NAMES:
            object.__setattr__(self, name, check_value(name, getattr(self, name)))
        if not isinstance(self.is_high_priority_stream, bool):
            raise TypeError("NCCLOptions.is_high_priority_stream must be a bool; got "
                            f"{type(self.is_high_priority_stream).__name__} {self.is_high_priority_stream!r}")
        object.__setattr__(self, "timeout", _check_timeout(self.timeout))

    @property
    def config(self) -> dict[str, Any]:
        """The config fields that are set, by name (what reaches ``ncclConfig_t``)."""
        return {name: getattr(self, name) for name in FIELD_NAMES if getattr(self, name) is not None}


@dataclass(frozen=True)
class CPUOptions:
    """Options of a CPU group (and of the host side of an NCCL group's ``timeout``).

    Attributes:
        timeout: the group's timeout (seconds or timedelta) when the call that makes
            the group gives none.
        transport: ``"auto"`` (shared memory when every rank is on one host, else TCP),
            ``"shm"`` (shared memory or an error) or ``"tcp"``; overrides
            ``GPUCOLL_CPU_TRANSPORT`` for this group. None: the environment decides.

    Raises:
        TypeError, ValueError: a field of the wrong type or value (naming it).
    """

    timeout: float | timedelta | None = None
    transport: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "timeout", _check_timeout(self.timeout))
        if self.transport is not None:
            if not isinstance(self.transport, str):
                raise TypeError(f"CPUOptions.transport must be a str; got {type(self.transport).__name__}")
            mode = self.transport.strip().lower()
            if mode not in _TRANSPORTS:
                raise ValueError(f"CPUOptions.transport must be one of {', '.join(_TRANSPORTS)}; "
                                 f"got {self.transport!r}")
            object.__setattr__(self, "transport", mode)


@dataclass  # not frozen: torch's tests set fields on FakeProcessGroup.Options() after making it
class FakeOptions:
    """Options of a ``"fake"`` group (torch's ``FakeProcessGroup.Options``).

    Attributes:
        error_on_collective: every op of the group raises ``DistBackendError``
            ("FakeProcessGroup collective operation error") instead of completing, to
            check that a code path issues no collective.
        timeout: the group's timeout when the call that makes the group gives none.

    Example:
        >>> opts = gpucoll.FakeOptions(error_on_collective=True)
        >>> gpucoll.init_process_group("fake", rank=0, world_size=8, pg_options=opts)
    """

    error_on_collective: bool = False
    timeout: float | timedelta | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.error_on_collective, bool):
            raise TypeError("FakeOptions.error_on_collective must be a bool; got "
                            f"{type(self.error_on_collective).__name__}")
        self.timeout = _check_timeout(self.timeout)


class FakeProcessGroup:
    """torch's ``FakeProcessGroup``, as scripts name it: ``FakeProcessGroup.Options`` is
    :class:`FakeOptions`, so torch's ``opts = FakeProcessGroup.Options();
    opts.error_on_collective = True`` ports by changing the import.

    A fake group itself is a :class:`~gpucoll.ProcessGroup` made by
    ``init_process_group("fake", ...)`` or ``new_group(..., backend="fake")``; this class
    makes none.

    Example:
        >>> opts = gpucoll.FakeProcessGroup.Options()
        >>> opts.error_on_collective = True
        >>> gpucoll.init_process_group("fake", rank=0, world_size=8, pg_options=opts)
    """

    Options = FakeOptions

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise TypeError("FakeProcessGroup is not made directly: init_process_group('fake', rank=..., world_size=...) "
                        "makes a fake group (FakeProcessGroup.Options() is its options)")


PGOptions = Union[NCCLOptions, CPUOptions, FakeOptions]


class TorchOptionsLike(Protocol):
    """An object shaped like torch's ``ProcessGroupNCCL.Options``: what :func:`coerce_options`
    reads from one (its ``config``; ``is_high_priority_stream`` and ``_timeout`` when present)."""

    @property
    def config(self) -> object: ...


#: What ``pg_options`` accepts: gpucoll's options, torch's NCCL options, or None.
PGOptionsLike = Union[NCCLOptions, CPUOptions, FakeOptions, TorchOptionsLike, None]


class _HasIndex(Protocol):
    @property
    def index(self) -> int | None: ...  # torch.device


class _HasId(Protocol):
    @property
    def id(self) -> int: ...  # cupy.cuda.Device


#: What ``device_id`` / ``device`` accept: a CUDA device index, ``"cuda:N"``, a device
#: object with an ``index`` (torch.device) or ``id`` (cupy.cuda.Device), or None.
DeviceLike = Union[int, str, _HasIndex, _HasId, None]


def _from_torch(obj: Any) -> NCCLOptions:
    """torch's ``ProcessGroupNCCL.Options`` shape: ``.config`` (an NCCLConfig whose unset
    ints are INT_MIN), ``.is_high_priority_stream``, ``._timeout``."""
    config = obj.config
    values: dict[str, Any] = {}
    for name in FIELD_NAMES:
        value = getattr(config, name, None)
        if value == UNDEF_INT or value == "" or value is None:
            continue
        values[name] = value
    timeout = getattr(obj, "_timeout", None)
    return NCCLOptions(**values, is_high_priority_stream=bool(getattr(obj, "is_high_priority_stream", False)),
                       timeout=timeout)


def coerce_options(pg_options: PGOptionsLike, backend: str) -> PGOptions | None:
    """``pg_options`` as gpucoll's options for a group of ``backend`` ("cpu", "nccl", "fake").

    Accepts None, :class:`NCCLOptions` (NCCL groups), :class:`CPUOptions` (CPU groups),
    :class:`FakeOptions` ("fake" groups) and an object shaped like torch's
    ``ProcessGroupNCCL.Options`` (has ``config``). A "fake" group takes the NCCL and CPU
    kinds too and applies none of them.

    Raises:
        TypeError: any other object, or options of the other backend's kind.
    """
    if pg_options is None:
        return None
    if isinstance(pg_options, FakeOptions):
        if backend == "fake":
            return pg_options
        raise TypeError(f"pg_options is FakeOptions but the group's backend is {backend!r}; FakeOptions is "
                        "for 'fake' groups")
    if not isinstance(pg_options, (NCCLOptions, CPUOptions)) and hasattr(pg_options, "config"):
        pg_options = _from_torch(pg_options)
    if isinstance(pg_options, NCCLOptions):
        if backend in ("nccl", "fake"):
            return pg_options
        raise TypeError(f"pg_options is NCCLOptions but the group's backend is {backend!r}; "
                        "pass gpucoll.CPUOptions for a cpu group")
    if isinstance(pg_options, CPUOptions):
        if backend in ("cpu", "fake"):
            return pg_options
        raise TypeError(f"pg_options is CPUOptions but the group's backend is {backend!r}; "
                        "pass gpucoll.NCCLOptions for an nccl group")
    raise TypeError("pg_options must be None, gpucoll.NCCLOptions, gpucoll.CPUOptions, gpucoll.FakeOptions or torch's "
                    f"ProcessGroupNCCL.Options; got {type(pg_options).__name__}")


def options_timeout(pg_options: PGOptions | None) -> float | None:
    """The timeout ``pg_options`` sets, in seconds (None when unset)."""
    if pg_options is None:
        return None
    value = pg_options.timeout
    if value is None:
        return None
    return value.total_seconds() if isinstance(value, timedelta) else float(value)

