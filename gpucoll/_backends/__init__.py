"""Backends: one implementation of the :class:`~gpucoll._backends.base.Backend` protocol
per kind of memory. ``cpu`` (NumPy, host arrays) always works; ``nccl`` (CuPy + NCCL,
device arrays) loads CuPy lazily, only when a group asks for it."""
