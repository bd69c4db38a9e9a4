"""Ported tests that fail today, by test name, with the reason: the pytest file marks
them ``xfail(strict=True)``, so a fix that makes one pass turns the suite red until its
entry is removed here. docs/torch-differences.md (RPC) lists the GPUCOLL entries.
"""

from __future__ import annotations

HANG = "hangs: no result within the 30 s a test may take"
_HANG = HANG

GPUCOLL: dict[str, str] = {
    # error types and messages that differ from torch's
    "test_use_rref_after_shutdown": "gpucoll.rpc has no internal module (torch's test forks the deleted RRef "
                                    "with rpc.internal.serialize)",
    "test_function_not_on_callee": "a function the callee cannot import arrives as the callee's AttributeError "
                                   "(naming it); torch's test expects RuntimeError",
    # names torch has and gpucoll does not
    "test_duplicate_name": "uses torch.distributed.rendezvous(), which gpucoll does not have",
    "test_rref_type_non_blocking": "RRef._get_type(blocking=False) returns a new future on each call; torch "
                                   "returns the first one, cached",
    # dynamic groups
    "test_dynamic_rpc_init_rpc_without_rank": "init_rpc without a rank and with env:// but no RANK does not raise "
                                              "ValueError \"environment variable RANK expected\"",
    "test_dynamic_and_static_init_rpc_together": "ranks 0-2 start a static group of 3 on the test's FileStore, which "
                                                 "gpucoll refuses as another job's (it was made for 4)",
    # hangs
    "test_worker_info_pickle": _HANG + " (a WorkerInfo sent and returned by rpc_sync)",
    "test_callback_with_ret": _HANG + " (a then() callback's result as the chained future's value)",
    # the faulty agent
    "test_remote_message_dropped_pickle": "RRef._serialize() (torch's private fork of an RRef) of an RRef whose "
                                          "remote() message was dropped does not raise \"RRef creation\"",
    "test_remote_message_dropped_pickle_to_self": "as test_remote_message_dropped_pickle",
    "test_builtin_remote_message_dropped_timeout": _HANG + " (a dropped PYTHON_REMOTE_CALL: to_here() waits)",
    "test_builtin_remote_message_dropped_timeout_to_self": _HANG + " (a dropped PYTHON_REMOTE_CALL to self)",
    "test_udf_remote_message_dropped_timeout": _HANG + " (a dropped PYTHON_REMOTE_CALL: to_here() waits)",
    "test_udf_remote_message_dropped_timeout_to_self": _HANG + " (a dropped PYTHON_REMOTE_CALL to self)",
    "test_udf_remote_message_delay_timeout_to_self": _HANG + " (a delayed remote to self past its timeout)",
    "test_remote_message_builtin_delay_timeout_to_self": _HANG + " (a delayed remote to self past its timeout)",
}

# torch.distributed.rpc 2.13 (TensorPipe) failing a ported test with NumPy arguments
TORCH: dict[str, str] = {}
