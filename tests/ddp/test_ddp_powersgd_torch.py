"""PowerSGD against torch's own ``powerSGD_hook``, on the same gradients: both hooks run
at world size 1 (gpucoll's CPU backend, torch's gloo) on the same buckets. Their random
initial Qs differ (torch draws from its own generator), so after the first compressed
iteration torch's state is given gpucoll's P, Q and error memory; from then on, with warm
start and error feedback, every output and every error must agree."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gpucoll.testing import run_spmd

SHAPES = [(40, 30), (30,), (30, 20), (3, 5, 4), (20, 30)]


def body(approx_rank: int, batch: bool) -> float:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as theirs

    import gpucoll
    from gpucoll import GradBucket
    from gpucoll import ddp_comm_hooks as ours

    store = dist.HashStore()  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        sizes = [int(np.prod(s)) for s in SHAPES]
        offsets = [int(x) for x in np.cumsum([0, *sizes[:-1]])]
        buf = np.zeros(sum(sizes), np.float32)
        views = [buf[o:o + n].reshape(s) for o, n, s in zip(offsets, sizes, SHAPES)]
        tbuf = torch.zeros(sum(sizes))
        tviews = [tbuf[o:o + n].view(s) for o, n, s in zip(offsets, sizes, SHAPES)]

        class TorchBucket:  # the methods torch's hook calls on a dist.GradBucket
            def buffer(self) -> Any:
                return tbuf

            def index(self) -> int:
                return 0

            def gradients(self) -> list[Any]:
                return tviews

            def is_last(self) -> bool:
                return True

        kw = dict(matrix_approximation_rank=approx_rank, start_powerSGD_iter=2, batch_tensors_with_same_shape=batch)
        mine = ours.PowerSGDState(None, **kw)
        their = theirs.PowerSGDState(None, **kw)
        rng = np.random.default_rng(3)
        worst = 0.0
        for it in range(8):
            g = rng.standard_normal(buf.size).astype(np.float32)
            buf[...] = g
            tbuf.copy_(torch.from_numpy(g))
            out = ours.powerSGD_hook(mine, GradBucket(0, buf, views, views, True, offsets)).wait()
            tout = theirs.powerSGD_hook(their, TorchBucket()).wait()
            if it == 2:  # the first compressed iteration: hand torch our memory
                their.p_memory_dict[0] = torch.from_numpy(mine.p_memory_dict[0].copy())
                their.q_memory_dict[0] = torch.from_numpy(mine.q_memory_dict[0].copy())
                their.error_dict[0] = torch.from_numpy(mine.error_dict[0].copy())
                continue
            np.testing.assert_allclose(out, tout.numpy(), rtol=1e-4, atol=1e-4, err_msg=f"iteration {it}")
            if it > 2:
                np.testing.assert_allclose(mine.error_dict[0], their.error_dict[0].numpy(), rtol=1e-4, atol=1e-4)
                assert np.abs(out - g).max() > 1e-2, "compressed: not the input itself"
            worst = max(worst, float(np.abs(out - tout.numpy()).max()))
        assert mine.iter == their.iter == 8
        assert mine.compression_stats() == their.compression_stats()
        return worst
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("approx_rank,batch", [(1, False), (2, True), (4, False)])
def test_powersgd_matches_torchs_hook(approx_rank: int, batch: bool) -> None:
    pytest.importorskip("torch", reason="torch (CPU) is the reference; a test-only dependency")
    (worst,) = run_spmd(body, 1, args=(approx_rank, batch), timeout=120)
    assert worst < 1e-4
