"""DDP communication hooks (torch's ``torch.distributed.algorithms.ddp_comm_hooks``).

A hook reduces one :class:`~gpucoll.GradBucket` and returns a :class:`Future` of the
result; register it with :meth:`gpucoll.Reducer.register_comm_hook`. The built-in
hooks average over the group as the default does, with compression:

* :func:`allreduce_hook`: one all_reduce (the default's behaviour);
* :func:`fp16_compress_hook`, :func:`bf16_compress_hook`: cast, all_reduce, cast back;
* :func:`fp16_compress_wrapper`, :func:`bf16_compress_wrapper`: run another hook on a
  cast copy;
* :class:`PowerSGDState` and :func:`powerSGD_hook`: low-rank compression of matrices.

Example:
    >>> from gpucoll.ddp_comm_hooks import PowerSGDState, powerSGD_hook
    >>> reducer.register_comm_hook(PowerSGDState(None, start_powerSGD_iter=10), powerSGD_hook)
"""

from __future__ import annotations

from .._ddp.future import Future as Future
from .._ddp.hooks import allreduce_hook as allreduce_hook
from .._ddp.hooks import bf16_compress_hook as bf16_compress_hook
from .._ddp.hooks import bf16_compress_wrapper as bf16_compress_wrapper
from .._ddp.hooks import fp16_compress_hook as fp16_compress_hook
from .._ddp.hooks import fp16_compress_wrapper as fp16_compress_wrapper
from .._ddp.powersgd import PowerSGDState as PowerSGDState
from .._ddp.powersgd import powerSGD_hook as powerSGD_hook

__all__ = ["allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "fp16_compress_wrapper",
           "bf16_compress_wrapper", "PowerSGDState", "powerSGD_hook", "Future"]
