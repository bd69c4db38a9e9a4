"""Checks that fail today, keyed by check name (all world sizes) or "name@ws", with the
catalogue id of tests/conformance/CATALOGUE.md and a short cause. The pytest files mark
them ``xfail(strict=True)``: a fix that makes one pass turns the suite red until its
entry is removed here.
"""

from __future__ import annotations

_AGC = "C01: all_gather_coalesced fills output_tensor_lists[k][rank], torch [rank][k]"
_REDUCE_OP = "C08: dist.reduce_op resolves to the submodule gpucoll.reduce_op (no SUM)"

GPUCOLL: dict[str, str] = {
    "all_gather_coalesced_layout": _AGC,
    "all_gather_coalesced_shapes": _AGC,
    "new_group_local_sync_disjoint": "C02: new_group names groups by a global counter; "
                                     "use_local_synchronization ignored -> cross-talk",
    "mismatch_names_ops": "C03: broadcast on one rank vs all_reduce on others completes silently",
    "premul_sum_per_rank_factor": "C04: PREMUL_SUM factor is part of the cross-rank signature",
    "gather_default_dst": "C05: gather without dst is refused (torch: dst=0)",
    "scatter_default_src": "C05: scatter without src is refused (torch: src=0)",
    "pg_monitored_barrier_timedelta": "C06: ProcessGroup.monitored_barrier takes float seconds only",
    "monitored_barrier_after_p2p@3": "C07: monitored_barrier keys the store by the op counter, "
                                     "which p2p advances differently per rank",
    "monitored_barrier_after_p2p@4": "C07: monitored_barrier keys the store by the op counter, "
                                     "which p2p advances differently per rank",
    "monitored_barrier_timeout_zero": "C09: timeout=0 refused as a bad argument",
    "reduce_op_legacy_alias": _REDUCE_OP,
    "tutorial_all_reduce_group": _REDUCE_OP,
    "tutorial_average_gradients": _REDUCE_OP,
    "backend_class": "C10: no gpucoll.Backend",
    "get_backend_gloo": "C11: get_backend() returns 'cpu' after init_process_group('gloo')",
    "all_reduce_coalesced_async": "C12: all_reduce_coalesced(async_op=True).wait() returns True, not the arrays",
    "reduce_scatter_uneven": "C13: list reduce_scatter refuses per-rank sizes that differ",
    "all_gather_dtype_mismatch_valueerror": "C14: dtype mismatch raises TypeError (torch ValueError)",
    "all_gather_complex_real_views": "C15: all_gather refuses complex input with real-view outputs",
    "mismatch_names_dtypes": "C16: mismatch error shows hash signatures, not the dtypes",
    "mismatch_names_counts": "C16: mismatch error shows hash signatures, not the counts",
    **{f"simple_wait[{k}]": "C17: store wait timeout message says 'timed out', torch tests match 'timeout'"
       for k in ("hash", "file", "tcp", "prefix_file", "prefix_tcp")},
}

# torch.distributed 2.13 (gloo) failing a ported check; none at present.
TORCH: dict[str, str] = {}


def reason(table: dict[str, str], check: str, ws: int) -> str | None:
    return table.get(f"{check}@{ws}") or table.get(check)
