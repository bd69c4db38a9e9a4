"""torch's ``dist.Backend``: backend names as strings."""

from __future__ import annotations

from .registry import _ALIASES

__all__ = ["Backend"]


class Backend(str):
    """torch's ``dist.Backend``: a backend name, a ``str`` (``Backend("GLOO") == "gloo"``).

    ``get_backend()`` returns one: ``"gloo"`` for groups created with that spelling
    (gpucoll's CPU backend, which a ported script compares with ``Backend.GLOO``),
    else ``"cpu"``, ``"nccl"`` or ``"fake"``.

    Raises:
        ValueError: an unknown backend name, or a name that is not a str (torch's type).
    """

    UNDEFINED = "undefined"
    GLOO = "gloo"
    NCCL = "nccl"
    CPU = "cpu"
    FAKE = "fake"

    def __new__(cls, name: str) -> "Backend":
        if not isinstance(name, str):
            # torch's type and words
            raise ValueError(f"Backend constructor parameter must be string-ish; got "
                             f"{type(name).__name__} {name!r}")
        value = name.strip().lower()
        if value not in (cls.UNDEFINED, *_ALIASES):
            raise ValueError(f"unknown backend {name!r}; expected one of {sorted({cls.UNDEFINED, *_ALIASES})}")
        return super().__new__(cls, value)
