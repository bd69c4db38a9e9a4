"""Ported tests that fail today, by test name, with the reason: the pytest file marks
them ``xfail(strict=True)``, so a fix that makes one pass turns the suite red until its
entry is removed here. docs/torch-differences.md (RPC) lists the GPUCOLL entries.
"""

from __future__ import annotations

_GET_TYPE = "RRef._get_type() (torch's private query of the owner's value type) is not implemented"
_DYNAMIC_FILE = ("a dynamic group (world_size=None) needs init_method env:// or tcp://; torch's test "
                 "rendezvouses through the test's file:// store")
_HANG = "hangs: no result within the 30 s a test may take"

GPUCOLL: dict[str, str] = {
    # error types and messages that differ from torch's
    "test_worker_id": "get_worker_info of an unknown name says \"Unknown destination worker\"; torch's test "
                      "matches \"could not find destination\"",
    "test_duplicate_name_2": "a duplicate name raises ValueError; torch raises RuntimeError",
    "test_invalid_names": "init_rpc accepts the names torch refuses (pattern ^[A-Za-z0-9-_:]*$, < 128 characters) "
                          "without RuntimeError",
    "test_py_raise_in_user_func": "the callee does not print the remote traceback to its stderr as torch's "
                                  "agent does",
    "test_py_raise_in_user_func_escaped_str": "the caller's exception message repr()s the remote message "
                                              "(its newlines escaped); torch keeps the text",
    "test_local_value_not_on_owner": "local_value() on a user RRef says otherwise than torch's \"For UserRRef(...) "
                                     "can't call localValue() on user ...\"",
    "test_use_rref_after_shutdown": "to_here() after shutdown says \"RPC has been shut down\", not \"Cannot call "
                                    "to_here() on it after deletion\"; no rpc.internal.serialize",
    "test_rref_py_pickle_not_supported": "pickling an RRef outside RPC says \"RRef can only be pickled as an argument "
                                         "...\"; torch: \"Can not pickle rref in python pickler\"",
    "test_tensorpipe_options_throw_on_timedelta_timeout": "a timedelta rpc_timeout raises TypeError from float(); "
                                                          "torch: \"incompatible constructor arguments\"",
    "test_function_not_on_callee": "a function the callee cannot import arrives as the callee's AttributeError; "
                                   "torch raises RuntimeError naming the function",
    "test_callback_wrong_arg_num": "a then() callback with the wrong arity raises TypeError at wait(); torch "
                                   "reports it as RuntimeError",
    "test_callback_wrong_arg_type": "a then() callback's error is raised as itself at wait(); torch wraps it",
    "test_callback_none": "Future.then(None) is accepted; torch raises TypeError",
    "test_async_function_wrong_return_type": "says \"marked @async_execution but returned ndarray, not a "
                                             "gpucoll.futures.Future\"; torch: \"Functions decorated with "
                                             "@rpc.async_function must return a torch.futures.Future object,\"",
    "test_async_function_wrong_return_type_async": "as test_async_function_wrong_return_type",
    "test_async_function_wrong_return_type_remote": "as test_async_function_wrong_return_type",
    "test_pickle_future": "a Future passed to an RPC fails to pickle with TypeError (a lock); torch refuses it with "
                          "RuntimeError \"Can not pickle torch.futures.Future\"",
    "test_return_future": "a Future returned by an RPC fails to pickle with TypeError (a lock); torch: RuntimeError "
                          "\"Can not pickle torch.futures.Future\"",
    "test_return_future_async": "as test_return_future",
    "test_return_future_remote": "as test_return_future",
    # names torch has and gpucoll does not
    "test_duplicate_name": "uses torch.distributed.rendezvous(), which gpucoll does not have",
    "test_infer_backend_from_options": "asserts the agent is an rpc.TensorPipeAgent, a class gpucoll does not have",
    "test_rref_proxy_non_exist": "the proxy of an RRef does not raise AttributeError for a method the value lacks",
    "test_rref_type_blocking": _GET_TYPE,
    "test_rref_type_non_blocking": _GET_TYPE,
    "test_rref_type_with_error_blocking": _GET_TYPE,
    "test_rref_type_with_error_non_blocking": _GET_TYPE,
    "test_rref_type_owner_blocking": _GET_TYPE,
    "test_rref_type_owner_non_blocking": _GET_TYPE,
    "test_rref_type_slow_init": _GET_TYPE,
    "test_rref_get_type_timeout_blocking": _GET_TYPE,
    "test_rref_get_type_timeout_non_blocking": _GET_TYPE,
    "test_rref_leak": "a leaked RRef (shutdown's RRef cleanup patched out) is not reported: no RuntimeError "
                      "\"Leaking RRef\"",
    "test_rref_proxy_timeout": "the RRef proxies (rpc_sync()/rpc_async()/remote()) take no timeout= of their own",
    # dynamic groups
    "test_dynamic_rpc_init_rpc": _DYNAMIC_FILE,
    "test_dynamic_rpc_new_rank_can_communicated_with_existing_rank": _DYNAMIC_FILE,
    "test_dynamic_rpc_existing_rank_can_communicate_with_new_rank": _DYNAMIC_FILE,
    "test_dynamic_rpc_init_rpc_without_rank": _DYNAMIC_FILE,
    "test_dynamic_and_static_init_rpc_together": "ranks 0-2 start a static group of 3 on the test's FileStore, which "
                                                 "gpucoll refuses as another job's (it was made for 4)",
    # hangs
    "test_worker_info_pickle": _HANG + " (a WorkerInfo sent and returned by rpc_sync)",
    "test_wait_all_exit_early_python": _HANG + " (futures.wait_all does not raise at the first failed future)",
    "test_wait_all_exit_early_builtin": _HANG + " (futures.wait_all does not raise at the first failed future)",
    "test_callback_with_ret": _HANG + " (a then() callback's result as the chained future's value)",
    # the faulty agent
    "test_remote_message_dropped_pickle": "RRef._serialize() (torch's private fork of an RRef) is not implemented",
    "test_remote_message_dropped_pickle_to_self": "RRef._serialize() is not implemented",
    "test_builtin_remote_message_dropped_timeout": _HANG + " (a dropped PYTHON_REMOTE_CALL: to_here() waits)",
    "test_builtin_remote_message_dropped_timeout_to_self": _HANG + " (a dropped PYTHON_REMOTE_CALL to self)",
    "test_udf_remote_message_dropped_timeout": _HANG + " (a dropped PYTHON_REMOTE_CALL: to_here() waits)",
    "test_udf_remote_message_dropped_timeout_to_self": _HANG + " (a dropped PYTHON_REMOTE_CALL to self)",
    "test_udf_remote_message_delay_timeout_to_self": _HANG + " (a delayed remote to self past its timeout)",
    "test_remote_message_builtin_delay_timeout_to_self": _HANG + " (a delayed remote to self past its timeout)",
}

# torch.distributed.rpc 2.13 (TensorPipe) failing a ported test with NumPy arguments
TORCH: dict[str, str] = {}
