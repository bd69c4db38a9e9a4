"""An ungrouped isend/irecv exchange between two ranks on one GPU, on the plain
communicator (CuPy's) and on the scalable one (ncclCommInitRankScalable, a RawComm
driven through the ctypes shim): the values the peer sent, every round.

The GPU run of 2026-11-27 saw this exchange complete with the receiving array unwritten
and no error on the scalable communicator, when gpucoll issued each op as its own NCCL
call (both ranks then had send-then-receive on their streams, which NCCL does not define:
nccl.h asks for a group). The backend now issues the ops posted in a row as one group;
tests/nccl/test_nccl_p2p_posting.py is this body on the strict fake GPU.
"""

from __future__ import annotations

from typing import Any

import pytest

from _gpu_two_ranks import TWO_RANKS_ENV, why_not_two_ranks_on_one_gpu

from gpucoll._env import NCCL_RANKS_PER_ROOT_ENV, NCCL_SCALABLE_INIT_ENV
from gpucoll.testing import run_spmd

pytestmark = pytest.mark.gpu

ENV = TWO_RANKS_ENV
SCALABLE_ENV = {**ENV, NCCL_SCALABLE_INIT_ENV: "1", NCCL_RANKS_PER_ROOT_ENV: "1"}


_WHY_NOT_TWO = why_not_two_ranks_on_one_gpu()


def _body() -> dict[str, Any]:
    import cupy

    import gpucoll
    from gpucoll._world import default_group

    gpucoll.init_process_group("nccl", device_id=0, timeout=60)
    r, n = gpucoll.get_rank(), gpucoll.get_world_size()
    out: dict[str, Any] = {"comm": type(default_group()._nccl._comm).__name__}
    for i in range(4):  # CuPy's pool hands the same addresses back each round
        got = cupy.zeros(5, dtype=cupy.float32)
        works = [gpucoll.isend(cupy.full(5, r + 10.0 + i, dtype=cupy.float32), (r + 1) % n),
                 gpucoll.irecv(got, (r - 1) % n)]
        for w in works:
            w.wait()
        out[f"round {i}"] = (cupy.asnumpy(got).tolist(), [(r - 1) % n + 10.0 + i] * 5)
    # 1 MiB (no eager buffering to lean on), and the other order on odd ranks.
    big = cupy.zeros(1 << 18, dtype=cupy.float32)
    mine = cupy.full(1 << 18, 100.0 + r, dtype=cupy.float32)
    works = ([gpucoll.irecv(big, (r - 1) % n), gpucoll.isend(mine, (r + 1) % n)] if r % 2 else
             [gpucoll.isend(mine, (r + 1) % n), gpucoll.irecv(big, (r - 1) % n)])
    for w in works:
        w.wait()
    vals = cupy.asnumpy(big)
    out["1 MiB"] = ([float(vals.min()), float(vals.max())], [100.0 + (r - 1) % n] * 2)
    cupy.cuda.get_current_stream().synchronize()
    gpucoll.destroy_process_group()
    return out


@pytest.mark.skipif(_WHY_NOT_TWO is not None, reason=str(_WHY_NOT_TWO))
@pytest.mark.parametrize("scalable", [False, True], ids=["plain", "scalable"])
def test_an_ungrouped_isend_irecv_exchange_gets_the_peers_values(scalable: bool) -> None:
    results = run_spmd(_body, world_size=2, init=False, backend="nccl", env=SCALABLE_ENV if scalable else ENV,
                       start_method="spawn", timeout=300)
    for rank, cells in enumerate(results):
        comm = cells.pop("comm")
        assert (comm == "RawComm") == scalable, f"rank {rank}: communicator {comm}"
        for name, (got, want) in cells.items():
            assert got == want, f"rank {rank} {name}: got {got}, want {want}"
