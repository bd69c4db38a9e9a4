"""Data-parallel gradient reduction: gpucoll's Reducer against torch DDP over gloo, on the
gradient sets of three real models, at world size 2 on the CPU backend.

Shapes come from the models' public definitions (built here, no download):

- ResNet-50 (torchvision ``resnet50``): 161 tensors, 25,557,032 parameters;
- BERT-base (``bert-base-uncased``'s ``BertModel``): 199 tensors, 109,482,240 parameters;
- GPT-2 small (``gpt2``'s ``GPT2Model``, tied head not counted twice): 148 tensors, 124,439,808.

Ways, timed in the same run (float32 gradients, the time of one whole reduction, the
slower rank's, median over iterations):

- ``bucketed``: ``Reducer(params)`` (25 MiB buckets, the first 1 MiB), ``reduce(grads)``,
  after the first iteration's rebuild: one all_reduce per bucket, which reads the
  gradients, divided by the world size, straight into the transport's staging buffers
  and writes the result into the bucket;
- ``bucketed, views``: ``mark_ready`` and ``wait()`` with the gradients computed into the
  buckets (``Reducer.gradient_view``, torch's ``gradient_as_bucket_view``): no copy, each
  bucket's all_reduce async as it fills;
- ``flat``: one all_reduce of one array holding everything (the floor: no copy, one op);
  ``flat, AVG``: the same with ``ReduceOp.AVG`` (the floor of an average);
- ``per tensor``: one all_reduce per gradient, what a script without buckets does;
- ``fp16``: the Reducer with ``fp16_compress_hook`` (half the bytes); its largest error
  against the exact mean is printed in float16 ulps of the largest value summed;
- ``torch DDP``: ``DistributedDataParallel`` (gloo, 25 MiB buckets,
  ``gradient_as_bucket_view=True``) over a module with the same parameters, whose backward
  hands over precomputed gradients (a custom autograd Function: no compute), so the time
  is DDP's reducer and gloo; ``torch no_sync`` is the same backward without reduction.

Overlap: a simulated backward calls ``mark_ready`` for each gradient once the layer's
time, in proportion to its size, has passed (a sleep to a schedule); the whole backward
lasts 2x the flat all_reduce (a stress test: the buckets' all_reduces take about as long
as the compute, so the one before the last is still running when the last gradient
comes), then 8x (still far shorter than a real backward of these models); printed: the
time from the last gradient to ``wait()`` returning, against one all_reduce of the last
bucket's size, timed in the loop of the other ways and timed after the ranks were idle as
long as the backward spends on the last bucket's layers (the tail's conditions: on a VM
an op after an idle spell is slower than one in a busy loop), as medians and paired: the
median over iterations of each tail over the reference timed just before it.

gpucoll and torch take turns, ``--rounds`` times (default 3), and each figure is the
median over the rounds. The machine is shared: compare the ratios of one run, not
absolute times across runs.

Usage::

    python bench/ddp_bench.py                       # all three models, 2 ranks, 3 rounds
    python bench/ddp_bench.py --models resnet50 --iters 5
    python bench/ddp_bench.py --skip-torch --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Sequence

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

MODELS = ("resnet50", "bert-base", "gpt2")
BACKWARD_FACTORS = (2, 8)  # the simulated backward's length, in flat all_reduces


# ----- shapes from the public definitions -----

def resnet50() -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for planes, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            shapes += [(planes, inplanes, 1, 1), (planes,), (planes,), (planes, planes, 3, 3), (planes,), (planes,),
                       (planes * 4, planes, 1, 1), (planes * 4,), (planes * 4,)]
            if b == 0:
                shapes += [(planes * 4, inplanes, 1, 1), (planes * 4,), (planes * 4,)]
            inplanes = planes * 4
    return shapes + [(1000, 2048), (1000,)]


def bert_base() -> list[tuple[int, ...]]:
    h, ff = 768, 3072
    shapes: list[tuple[int, ...]] = [(30522, h), (512, h), (2, h), (h,), (h,)]
    for _ in range(12):
        shapes += [(h, h), (h,)] * 4 + [(h,), (h,), (ff, h), (ff,), (h, ff), (h,), (h,), (h,)]
    return shapes + [(h, h), (h,)]


def gpt2_small() -> list[tuple[int, ...]]:
    h = 768
    shapes: list[tuple[int, ...]] = [(50257, h), (1024, h)]
    for _ in range(12):
        shapes += [(h,), (h,), (h, 3 * h), (3 * h,), (h, h), (h,), (h,), (h,), (h, 4 * h), (4 * h,), (4 * h, h), (h,)]
    return shapes + [(h,), (h,)]


SHAPES: dict[str, Callable[[], list[tuple[int, ...]]]] = {"resnet50": resnet50, "bert-base": bert_base, "gpt2": gpt2_small}
EXPECTED = {"resnet50": (161, 25_557_032), "bert-base": (199, 109_482_240), "gpt2": (148, 124_439_808)}


def grads_for(shapes: list[tuple[int, ...]], rank: int) -> list[np.ndarray]:
    rng = np.random.default_rng(rank)
    return [rng.standard_normal(s, dtype=np.float32) for s in shapes]


def _median_of_max(times: list[float], gather: Callable[[Any], list[Any]]) -> float:
    everyone = gather(times)
    return float(statistics.median(max(t[i] for t in everyone) for i in range(len(times))))


# ----- gpucoll -----

def turns(ways: dict[str, Callable[[], Any]], iters: int, gather: Callable[[Any], list[Any]]) -> dict[str, float]:
    """Each way once per iteration, in turn (after a barrier each); per way the median
    over iterations of the slower rank's time. One untimed turn first."""
    import gpucoll

    times: dict[str, list[float]] = {name: [] for name in ways}
    for it in range(iters + 1):
        for name, fn in ways.items():
            gpucoll.barrier()
            t0 = time.perf_counter()
            fn()
            if it:
                times[name].append(time.perf_counter() - t0)
    return {name: _median_of_max(t, gather) for name, t in times.items()}


def gpucoll_rank(models: list[str], iters: int) -> dict[str, Any]:
    import gpucoll
    from gpucoll.ddp_comm_hooks import fp16_compress_hook

    rank, world = gpucoll.get_rank(), gpucoll.get_world_size()

    def gather(obj: Any) -> list[Any]:
        out: list[Any] = [None] * world
        gpucoll.all_gather_object(out, obj)
        return out

    def timed(fn: Callable[[], Any], n: int = iters) -> float:
        times = []
        for _ in range(n):
            gpucoll.barrier()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return _median_of_max(times, gather)

    results: dict[str, Any] = {}
    for model in models:
        shapes = SHAPES[model]()
        grads = grads_for(shapes, rank)
        params = [np.zeros(s, np.float32) for s in shapes]
        row: dict[str, Any] = {"tensors": len(shapes), "params": int(sum(g.size for g in grads))}
        flat = np.concatenate([g.reshape(-1) for g in grads])
        reducer = gpucoll.Reducer(params)
        reducer.reduce(grads)  # the first iteration rebuilds the buckets
        row["buckets"] = len(reducer.bucket_indices)
        views = [reducer.gradient_view(i) for i in range(len(grads))]
        for v, g in zip(views, grads):
            v[...] = g
        per_tensor = [g.copy() for g in grads]  # (reduced in place: the values change)
        last = reducer.bucket_indices[-1]
        last_buf = np.zeros(sum(grads[i].size for i in last), np.float32)
        row["last_bucket_mib"] = last_buf.nbytes / 2**20

        def in_place() -> None:  # gradients computed into the buckets: no copy
            for i in reversed(range(len(views))):
                reducer.mark_ready(i, views[i])
            reducer.wait()

        def one_per_tensor() -> None:
            for g in per_tensor:
                gpucoll.all_reduce(g)

        # The ways take turns, iteration after iteration: the machine's speed drifts (a
        # shared VM), and each way's median then sees the same moments as the others'.
        row.update(turns({
            "flat": lambda: gpucoll.all_reduce(flat),
            "flat_avg": lambda: gpucoll.all_reduce(flat, op=gpucoll.ReduceOp.AVG),
            "bucketed": lambda: reducer.reduce(grads),
            "bucketed_views": in_place,
            "per_tensor": one_per_tensor,
            "last_bucket_all_reduce": lambda: gpucoll.all_reduce(last_buf),
        }, iters, gather))
        del flat, per_tensor

        # overlap: a simulated backward, the last layers' gradients first, lasting SLOW x the
        # flat all_reduce (a stress test: communication nearly as long as the compute) and
        # FAST x (still far from a real backward, which is hundreds of times longer)
        for factor in BACKWARD_FACTORS:
            rate = factor * row["flat"] / sum(g.nbytes for g in grads)  # seconds per byte
            idle = sum(grads[i].nbytes for i in last) * rate  # the backward's time on the last bucket
            tails, totals, cold = [], [], []
            for _ in range(iters):
                # the reference, in the tail's conditions: the last bucket's all_reduce after
                # the ranks were idle as long as the backward spends on that bucket's layers
                # (on this VM an op after an idle spell takes 2-3x one in a busy loop)
                gpucoll.barrier()
                due = time.perf_counter() + idle
                gpucoll.barrier()
                time.sleep(max(0.0, due - time.perf_counter()))
                t0 = time.perf_counter()
                gpucoll.all_reduce(last_buf)
                cold.append(time.perf_counter() - t0)
                gpucoll.barrier()
                t0 = due = time.perf_counter()
                for i in reversed(range(len(grads))):
                    # The layer's compute, as a sleep until its planned end (a schedule: the
                    # overshoot of one sleep does not add up over 161 layers, nor differ
                    # between the ranks by the sum of theirs).
                    due += grads[i].nbytes * rate
                    ahead = due - time.perf_counter()
                    if ahead > 0:
                        time.sleep(ahead)
                    reducer.mark_ready(i, grads[i])
                t1 = time.perf_counter()
                reducer.wait()
                t2 = time.perf_counter()
                tails.append(t2 - t1)
                totals.append(t2 - t0)
            row[f"overlap_tail_{factor}"] = _median_of_max(tails, gather)
            row[f"last_bucket_after_idle_{factor}"] = _median_of_max(cold, gather)
            # the tail against its own iteration's reference (both the slower rank's): the
            # drift of this machine cancels within an iteration, not across medians
            all_tails, all_cold = gather(tails), gather(cold)
            row[f"overlap_tail_paired_{factor}"] = statistics.median(
                max(t[i] for t in all_tails) / max(c[i] for c in all_cold) for i in range(iters))
            row[f"overlap_total_{factor}"] = _median_of_max(totals, gather)
            row[f"simulated_backward_{factor}"] = factor * row["flat"]
        del reducer

        grads = grads_for(shapes, rank)
        fp16 = gpucoll.Reducer(params)
        fp16.register_comm_hook(None, fp16_compress_hook)
        fp16.reduce(grads)
        row["fp16"] = timed(lambda: fp16.reduce(grads), max(2, iters // 3))  # slow on CPUs: see docs
        out = fp16.reduce(grads)
        # error against the exact mean, in units of float16's spacing at the largest of
        # the summed values (each rank's gradient / world, and the mean itself)
        others = [grads_for(shapes, k) for k in range(world)]
        worst = 0.0
        for i in range(len(shapes)):
            exact = np.mean([o[i].astype(np.float64) for o in others], axis=0)
            largest = np.max([np.abs(o[i] / world) for o in others] + [np.abs(exact)], axis=0)
            ulp = np.spacing(largest.astype(np.float16)).astype(np.float64)
            worst = max(worst, float(np.max(np.abs(out[i] - exact) / ulp)))
        row["fp16_err_ulps"] = worst
        del fp16, out, others
        results[model] = row
    return results


def run_gpucoll(models: list[str], iters: int) -> dict[str, Any]:
    from gpucoll.testing import run_spmd

    res: dict[str, Any] = run_spmd(gpucoll_rank, 2, args=(models, iters), timeout=3000, backend="cpu",
                                   pg_timeout=300.0)[0]
    return res


# ----- torch DDP over gloo (subprocess workers over a torch TCPStore on port 0) -----

def ddp_steps(shapes: list[tuple[int, ...]], grads: list[Any], device: Any) -> tuple[Callable[[], None], Callable[[], None]]:
    """torch DDP (25 MiB buckets, ``gradient_as_bucket_view=True``) over a module with
    parameters of ``shapes`` on ``device`` (None: the CPU) whose backward hands over the
    precomputed ``grads`` (a custom autograd Function: no compute, only DDP's work): the
    training step with its reduction, and the same under ``no_sync()``."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    class HandOver(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, grads: list[Any], *params: Any) -> Any:
            ctx.grads = grads
            return params[0].new_zeros(())

        @staticmethod
        def backward(ctx: Any, _: Any) -> Any:
            return (None, *ctx.grads)

    class Module(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(s, device=device)) for s in shapes])

        def forward(self, _: Any) -> Any:
            return HandOver.apply(grads, *self.ps)  # type: ignore[no-untyped-call]

    ids = None if device is None else [device.index]
    ddp = DDP(Module(), device_ids=ids, bucket_cap_mb=25, gradient_as_bucket_view=True)
    dummy = torch.zeros((), device=device)  # DDP with device_ids wants an input to move

    def step() -> None:
        ddp(dummy).backward()

    def no_sync() -> None:
        with ddp.no_sync():
            ddp(dummy).backward()
    return step, no_sync


def torch_world(backend: str, rank: int, world: int, port: int, device: Any) -> Callable[[Any], list[Any]]:
    """Join the torch job whose store ``run_torch_workers`` serves on ``port``; its
    all_gather_object, as a function."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False)  # type: ignore[attr-defined]
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, device_id=device)

    def gather(obj: Any) -> list[Any]:
        out: list[Any] = [None] * world
        dist.all_gather_object(out, obj)
        return out
    return gather


def common_args(ap: argparse.ArgumentParser, iters: int, rounds: int) -> None:
    """The options both data-parallel benches take."""
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--iters", type=int, default=iters, help="timed iterations per way (median)")
    ap.add_argument("--rounds", type=int, default=rounds, help="rounds, the libraries taking turns (median)")
    ap.add_argument("--skip-torch", action="store_true", help="do not run torch DDP")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)


def parse_models(ap: argparse.ArgumentParser, text: str) -> list[str]:
    """The models named in ``text`` (comma-separated), each checked against its public count."""
    models = [m for m in text.split(",") if m]
    for m in models:
        if m not in SHAPES:
            ap.error(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
        shapes = SHAPES[m]()
        got = (len(shapes), sum(int(np.prod(s)) for s in shapes))
        assert got == EXPECTED[m], f"{m}: {got} tensors/parameters, expected {EXPECTED[m]}"
    return models


def gloo_worker(rank: int, world: int, port: int, models: list[str], iters: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    gather = torch_world("gloo", rank, world, port, None)

    results: dict[str, Any] = {}
    try:
        for model in models:
            shapes = SHAPES[model]()
            grads = [torch.from_numpy(g) for g in grads_for(shapes, rank)]
            step_sync, step_no_sync = ddp_steps(shapes, grads, None)

            def step(sync: bool = True) -> None:
                (step_sync if sync else step_no_sync)()

            def timed(fn: Callable[[], Any]) -> float:
                times = []
                for _ in range(iters):
                    dist.barrier()
                    t0 = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t0)
                return _median_of_max(times, gather)

            step()
            step()  # the first iteration rebuilds the buckets
            results[model] = {"ddp": timed(step), "no_sync": timed(lambda: step(False))}
            del step_sync, step_no_sync
    finally:
        dist.destroy_process_group()
    return results


def run_torch_workers(script: str, nproc: int, models: list[str], iters: int, extra: Sequence[str] = (),
                      env: dict[str, str] | None = None, timeout: float = 3000.0) -> dict[str, Any] | str:
    """Run ``script --worker`` as ``nproc`` torch ranks over a torch TCPStore on port 0 (here,
    the master); rank 0's JSON line, or why there is none."""
    try:
        import torch.distributed as dist
    except ImportError:
        return "torch is not installed"
    master = dist.TCPStore("127.0.0.1", 0, nproc + 1, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
    procs = [subprocess.Popen([sys.executable, script, "--worker", "--rank", str(r), "--port", str(master.port),
                               "--models", ",".join(models), "--iters", str(iters), *extra],
                              stdout=subprocess.PIPE, text=True, env=env) for r in range(nproc)]
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(p.returncode for p in procs):
        return f"torch workers failed (exit codes {[p.returncode for p in procs]})"
    res: dict[str, Any] = json.loads(outs[0].strip().splitlines()[-1])
    return res


def run_gloo(models: list[str], iters: int) -> dict[str, Any] | str:
    return run_torch_workers(__file__, 2, models, iters)


# ----- report -----

def median_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each model's figures, the median over the rounds (counts are the same in every round)."""
    out: dict[str, Any] = {}
    for model in rounds[0]:
        out[model] = {k: (statistics.median(r[model][k] for r in rounds) if isinstance(v, float) else v)
                      for k, v in rounds[0][model].items()}
    return out


def _ms(s: float) -> str:
    return f"{s * 1e3:8.1f} ms"


def report(ours: dict[str, Any], theirs: dict[str, Any] | str, rounds: int = 1) -> str:
    lines = [f"world size 2, CPU backend, float32 gradients; times: slower rank, median over iterations, "
             f"then over {rounds} round(s); ratios within this run", ""]
    for model, row in ours.items():
        mib = row["params"] * 4 / 2**20
        lines.append(f"{model}: {row['tensors']} tensors, {row['params']:,} parameters ({mib:.1f} MiB), "
                     f"{row['buckets']} buckets")
        lines.append(f"  flat (the floor)   {_ms(row['flat'])}")
        lines.append(f"  flat, AVG          {_ms(row['flat_avg'])}   {row['flat_avg'] / row['flat']:.2f}x flat "
                     "(the floor of an average)")
        lines.append(f"  bucketed           {_ms(row['bucketed'])}   {row['bucketed'] / row['flat']:.2f}x flat, "
                     f"{row['bucketed'] / row['flat_avg']:.2f}x flat AVG (reduce(grads): the gradients copied)")
        lines.append(f"  bucketed, views    {_ms(row['bucketed_views'])}   {row['bucketed_views'] / row['flat']:.2f}x flat, "
                     f"{row['bucketed_views'] / row['flat_avg']:.2f}x flat AVG "
                     "(gradients computed into the buckets: no copy)")
        lines.append(f"  per tensor         {_ms(row['per_tensor'])}   {row['per_tensor'] / row['flat']:.2f}x flat")
        lines.append(f"  fp16 compress      {_ms(row['fp16'])}   {row['fp16'] / row['flat']:.2f}x flat; "
                     f"half the bytes; worst error {row['fp16_err_ulps']:.2f} float16 ulps of the largest value summed")
        if isinstance(theirs, dict) and model in theirs:
            t = theirs[model]
            lines.append(f"  torch DDP (gloo)   {_ms(t['ddp'])}   bucketed / DDP = {row['bucketed'] / t['ddp']:.3f}, "
                         f"bucketed views / DDP = {row['bucketed_views'] / t['ddp']:.3f} "
                         "(DDP: gradient_as_bucket_view=True)")
            lines.append(f"  torch no_sync      {_ms(t['no_sync'])}   (the same backward without reduction)")
        lines.append(f"  overlap (one all_reduce of the last bucket, {row['last_bucket_mib']:.1f} MiB: "
                     f"{_ms(row['last_bucket_all_reduce'])}; without overlap the whole reduction, "
                     f"{_ms(row['bucketed'])}, follows the backward):")
        for factor in BACKWARD_FACTORS:
            tail = row[f"overlap_tail_{factor}"]
            idle_ref = row[f"last_bucket_after_idle_{factor}"]
            lines.append(f"    backward {factor}x flat {_ms(row[f'simulated_backward_{factor}'])}: whole step "
                         f"{_ms(row[f'overlap_total_{factor}'])}, after the last gradient {_ms(tail)}, "
                         f"{tail / row['last_bucket_all_reduce']:.2f}x the last bucket's all_reduce, "
                         f"{tail / idle_ref:.2f}x the same after as long idle ({_ms(idle_ref)}; paired "
                         f"iteration by iteration {row[f'overlap_tail_paired_{factor}']:.2f}x)")
        lines.append("")
    if isinstance(theirs, str):
        lines.append(f"torch DDP: skipped ({theirs})")
    return "\n".join(lines)


def take_turns(rounds: int, ours: Callable[[], dict[str, Any]], theirs: Callable[[], dict[str, Any] | str] | None,
               median: Callable[[list[dict[str, Any]]], dict[str, Any]],
               each: Callable[[dict[str, Any], dict[str, Any] | str, int], None] | None = None
               ) -> tuple[dict[str, Any], dict[str, Any] | str]:
    """gpucoll and torch take turns, round after round, and each figure is the median over
    the rounds: on a shared machine the load drifts within minutes, and one library's
    whole run after the other's would compare different moments. torch's figures, or why
    there are none; ``each`` sees the medians so far (and how many rounds) after every round."""
    ours_rounds: list[dict[str, Any]] = []
    theirs_rounds: list[dict[str, Any]] = []
    why: dict[str, Any] | str = "--skip-torch"
    for _ in range(rounds):
        ours_rounds.append(ours())
        if theirs is not None:
            got = theirs()
            if isinstance(got, str):
                why = got
            else:
                theirs_rounds.append(got)
        if each is not None:
            each(median(ours_rounds), median(theirs_rounds) if theirs_rounds else why, len(ours_rounds))
    return median(ours_rounds), median(theirs_rounds) if theirs_rounds else why


def write_json(path: str | None, ours: dict[str, Any], theirs: dict[str, Any] | str) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"gpucoll": ours, "torch": theirs}, f, indent=1)



def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_args(ap, iters=7, rounds=3)
    args = ap.parse_args(argv)
    models = parse_models(ap, args.models)
    if args.worker:
        print(json.dumps(gloo_worker(args.rank, 2, args.port, models, args.iters)))
        return 0
    ours, theirs = take_turns(args.rounds, lambda: run_gpucoll(models, args.iters),
                              None if args.skip_torch else lambda: run_gloo(models, args.iters), median_rounds)
    print(report(ours, theirs, args.rounds))
    write_json(args.json, ours, theirs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
