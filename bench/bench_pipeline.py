"""Benchmark: nanocolossal's pipeline schedules vs torch.distributed.pipelining, same split/data.

    python bench/bench_pipeline.py [--steps 6 --rounds 4 --no-resnet --stages 2|4]

Starts itself on 2 ranks (gloo, one thread each) with `nanocolossal run` (--stages 4: 4 ranks,
which want 4 cores; on fewer the ranks share them and the note says so). For each workload --
an 8-layer Linear(1024) MLP at batch 256 and 1024, and train_pipeline.py's ResNet-50 at batch
64 -- with M = 8:

  (a) throughput of our 1F1B vs torch's Schedule1F1B (A/B rounds, alternating who goes
      first, after a warm-up; medians), as a ratio; our ZB-H1 (zero_bubble) and ZB-V (zbv, two
      chunks per rank in a V) and torch's ScheduleInterleavedZeroBubble / ScheduleZBVZeroBubble
      (two chunks per rank) in the same rounds;
  (b) peak bytes of activations held for backward per rank, 1F1B (ZB-H1, ZB-V and torch's
      zero-bubble schedules too) vs GPipe, measured with
      saved-tensor hooks (live saved tensors, parameters excluded, a tensor saved twice
      counted once);
      the bound is P/M of GPipe's peak plus one micro-batch;
  (c) speed-up over one process running the whole model on the whole batch, against the
      ideal M*P/(M+P-1);
  (d) the limit: the slowest stage's own forward + backward over the M micro-batches (no
      communication), times (M+P-1)/M; timed alone (the other rank waiting) and busy (both
      ranks computing at once, as in the steady state). limit/ours is the fraction reached;
      the gap between the two limits is what two processes lose to sharing the machine.

Prints a table and writes bench/results/pipeline.json (pipeline_4.json for 4 stages).
"""
import argparse
import copy
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from common import run_on_ranks, write_result  # also puts the repository on sys.path
from torch import nn

import nanocolossal as nc  # noqa: E402
from nanocolossal.context import gpc  # noqa: E402
from nanocolossal.memory import SavedBytes  # noqa: E402
from nanocolossal.pipeline import (  # noqa: E402
    balanced_split,
    build_pipeline_model,
    make_schedule,
)

M = 8


def mlp(width=1024, depth=8):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def resnet():
    from train_pipeline import resnet
    torch.manual_seed(0)
    return resnet("resnet50")


def data(kind, batch, n, seed):
    g = torch.Generator().manual_seed(seed)
    shape = (batch, 1024) if kind == "mlp" else (batch, 3, 32, 32)
    return [(torch.randn(*shape, generator=g),
             torch.randint(0, 10, (batch,), generator=g)) for _ in range(n)]


class Ours:
    def __init__(self, stage, schedule="1f1b"):
        chunks = len(stage) if isinstance(stage, nn.ModuleList) else 1
        self.stage, self.schedule = stage, make_schedule(schedule, M, chunks)
        self.opt = torch.optim.SGD(stage.parameters(), lr=1e-3)

    def step(self, x, y):
        self.opt.zero_grad(set_to_none=True)
        self.schedule.forward_backward_step(self.stage, (x, y), nn.CrossEntropyLoss())
        self.opt.step()


class Torch:
    def __init__(self, stage):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B
        self.stage = stage
        self.pipe = Schedule1F1B(PipelineStage(stage, gpc.pipeline_rank, gpc.pipeline_size,
                                               gpc.device), M,
                                 loss_fn=nn.CrossEntropyLoss())
        self.opt = torch.optim.SGD(stage.parameters(), lr=1e-3)

    def step(self, x, y):
        self.opt.zero_grad(set_to_none=True)
        if gpc.is_first_stage():
            self.pipe.step(x)
        else:
            self.pipe.step(target=y, losses=[])
        self.opt.step()


class TorchTwoChunks:
    """torch's zero-bubble schedules with two chunks per rank: the model cut into 2P parts, rank r
    holding parts r and r + P (ScheduleInterleavedZeroBubble) or r and 2P - 1 - r (the V of
    ScheduleZBVZeroBubble)."""

    def __init__(self, full, shape):
        from torch.distributed.pipelining import (
            PipelineStage,
            ScheduleInterleavedZeroBubble,
            ScheduleZBVZeroBubble,
        )
        P, r = gpc.pipeline_size, gpc.pipeline_rank
        costs = [sum(p.numel() for p in m.parameters()) + 1 for m in full]
        parts, start = [], 0
        for size in balanced_split(costs, 2 * P):
            parts.append(nn.Sequential(*list(full)[start:start + size]))
            start += size
        self.ids = (r, r + P) if shape == "interleaved" else (r, 2 * P - 1 - r)
        stages = [PipelineStage(parts[i], i, 2 * P, gpc.device) for i in self.ids]
        cls = ScheduleInterleavedZeroBubble if shape == "interleaved" else ScheduleZBVZeroBubble
        self.pipe = cls(stages, M, loss_fn=nn.CrossEntropyLoss())
        self.opt = torch.optim.SGD([p for i in self.ids for p in parts[i].parameters()], lr=1e-3)

    def step(self, x, y):
        self.opt.zero_grad(set_to_none=True)
        last = 2 * gpc.pipeline_size - 1 in self.ids
        self.pipe.step(*((x,) if 0 in self.ids else ()),
                       **(dict(target=y, losses=[]) if last else {}))
        self.opt.step()


def timed(impl, batches):
    times = []
    for x, y in batches:
        dist.barrier()
        start = time.perf_counter()
        impl.step(x, y)
        times.append(time.perf_counter() - start)
    return times


def stage_compute_ms(stage, kind, batch, steps, alone: bool) -> float:
    """This rank's stage: forward + backward over M micro-batches, with no communication at all.

    alone=True: one rank at a time, the other waiting (the issue's limit: the machine to itself).
    alone=False: every rank at once, as in a pipeline's steady state (what two busy processes get
    from a 2-core machine: they share memory bandwidth and caches)."""
    x, y = data(kind, batch // M, 1, 3)[0]
    inputs = [x]  # each stage's micro-batch input: computed by the stage before and handed on
    for s in range(gpc.pipeline_size - 1):
        out = [stage(inputs[-1]).detach() if gpc.pipeline_rank == s else None]
        dist.broadcast_object_list(out, src=gpc.pipeline_ranks[s])
        inputs.append(out[0])
    x = inputs[gpc.pipeline_rank]
    grad = None if gpc.is_last_stage() else torch.ones_like(stage(x)) / x.numel()

    def one_batch() -> float:
        start = time.perf_counter()
        for _ in range(M):
            out = stage(x)
            if gpc.is_last_stage():
                nn.functional.cross_entropy(out, y).backward()
            else:
                out.backward(grad)
        return time.perf_counter() - start

    times = []
    for turn in range(gpc.pipeline_size if alone else 1):
        dist.barrier()
        if not alone or turn == gpc.pipeline_rank:
            one_batch()  # warm-up
            times = [one_batch() for _ in range(steps)]
    dist.barrier()
    everyone = [None] * gpc.world_size
    dist.all_gather_object(everyone, statistics.median(times) * 1e3)
    return max(everyone)  # the slowest stage sets the pace


def run_workload(kind, batch, args):
    build = mlp if kind == "mlp" else resnet
    full = build()
    stage = build_pipeline_model(copy.deepcopy(full),
                                 partition="parameters" if kind == "mlp" else "profile",
                                 sample_input=data(kind, batch // M, 1,
                                                   9)[0][0] if kind != "mlp" else None)
    v_stage = build_pipeline_model(copy.deepcopy(full), num_chunks=2, partition="parameters",
                                   schedule="zbv")  # torch's TorchTwoChunks cuts the same way
    impls = {"ours": Ours(copy.deepcopy(stage)), "torch": Torch(copy.deepcopy(stage)),
             "zero_bubble": Ours(copy.deepcopy(stage), "zero_bubble"),
             "zbv": Ours(v_stage, "zbv"),
             "torch_interleaved_zb": TorchTwoChunks(copy.deepcopy(full), "interleaved"),
             "torch_zbv": TorchTwoChunks(copy.deepcopy(full), "v")}
    for impl in impls.values():
        timed(impl, data(kind, batch, 2, 1))  # warm-up (and torch's shape inference)
    times = {k: [] for k in impls}
    for r in range(args.rounds):
        batches = data(kind, batch, args.steps, 100 + r)
        order = list(impls)[r % len(impls):] + list(impls)[:r % len(impls)]  # who goes first
        for name in order:
            times[name] += timed(impls[name], batches)
    med = {k: statistics.median(v) for k, v in times.items()}

    peaks = {}
    x, y = data(kind, batch, 1, 7)[0]
    for name, impl in [(n, Ours(copy.deepcopy(stage), n)) for n in ("1f1b", "gpipe")] + \
            [(n, impls[n]) for n in ("zero_bubble", "zbv", "torch_interleaved_zb", "torch_zbv")]:
        with SavedBytes(p for group in impl.opt.param_groups for p in group["params"]) as meter:
            impl.step(x, y)
        peaks[name] = meter.peak
    all_peaks = [None] * gpc.world_size
    dist.all_gather_object(all_peaks, peaks)

    dist.barrier()
    single_ms = None
    if gpc.rank == 0:  # the whole model, whole batch, one process (the other rank waits)
        model = copy.deepcopy(full)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        ts = []
        for x, y in data(kind, batch, args.steps + 1, 5):
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            ts.append(time.perf_counter() - start)
        single_ms = statistics.median(ts[1:]) * 1e3
    dist.barrier()
    P = gpc.pipeline_size
    # the limit: the slowest stage's compute for M micro-batches, stretched by the bubble (M+P-1)/M
    stretch = (M + P - 1) / M
    limit_ms = stage_compute_ms(copy.deepcopy(stage), kind, batch, args.steps, alone=True) * stretch
    busy_limit_ms = stage_compute_ms(copy.deepcopy(stage), kind, batch, args.steps,
                                     alone=False) * stretch
    ours_ms, torch_ms = med["ours"] * 1e3, med["torch"] * 1e3
    return dict(workload=f"{kind} batch {batch}", ours_ms=round(ours_ms, 1),
                torch_ms=round(torch_ms, 1), throughput_ratio=round(torch_ms / ours_ms, 3),
                peak_bytes_1f1b=[p["1f1b"] for p in all_peaks],
                peak_bytes_gpipe=[p["gpipe"] for p in all_peaks],
                peak_ratio_1f1b_over_gpipe=[round(p["1f1b"] / p["gpipe"], 3) for p in all_peaks],
                zero_bubble_ms=round(med["zero_bubble"] * 1e3, 1),
                zbv_ms=round(med["zbv"] * 1e3, 1),
                zbv_over_1f1b_throughput=round(ours_ms / (med["zbv"] * 1e3), 3),
                zbv_over_torch_zbv_throughput=round(med["torch_zbv"] / med["zbv"], 3),
                zero_bubble_over_torch_izb_throughput=round(
                    med["torch_interleaved_zb"] / med["zero_bubble"], 3),
                peak_bytes={name: [p[name] for p in all_peaks] for name in peaks},
                peak_ratio_zbv_over_1f1b=[round(p["zbv"] / p["1f1b"], 3) for p in all_peaks],
                torch_interleaved_zb_ms=round(med["torch_interleaved_zb"] * 1e3, 1),
                torch_zbv_ms=round(med["torch_zbv"] * 1e3, 1),
                zero_bubble_over_1f1b_throughput=round(ours_ms / (med["zero_bubble"] * 1e3), 3),
                peak_ratio_zero_bubble_over_1f1b=[round(p["zero_bubble"] / p["1f1b"], 3)
                                                  for p in all_peaks],
                # GPipe holds M micro-batches: P/M of that, plus one
                bound_ratio=round((P + 1) / M, 3),
                single_process_ms=round(single_ms, 1) if single_ms else None,
                speedup=round(single_ms / ours_ms, 2) if single_ms else None,
                ideal_speedup=round(M * P / (M + P - 1), 2),
                limit_ms=round(limit_ms, 1), ours_over_limit=round(limit_ms / ours_ms, 3),
                torch_over_limit=round(limit_ms / torch_ms, 3),
                busy_limit_ms=round(busy_limit_ms, 1),
                ours_over_busy_limit=round(busy_limit_ms / ours_ms, 3))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--no-resnet", action="store_true")
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages (ranks)")
    parser.add_argument("--out", type=str, default=None,
                        help="default bench/results/pipeline.json (pipeline_4.json: 4 stages)")
    args = parser.parse_args()
    args.out = args.out or str(Path(__file__).parent / "results" / (
        "pipeline.json" if args.stages == 2 else f"pipeline_{args.stages}.json"))
    torch.set_num_threads(1)
    nc.launch_from_torch({"parallel": {"pipeline": int(os.environ["WORLD_SIZE"])}}, backend="gloo")
    workloads = [("mlp", 256), ("mlp", 1024)] + ([] if args.no_resnet else [("resnet", 64)])
    results = [run_workload(kind, batch, args) for kind, batch in workloads]
    if gpc.rank == 0:
        P, cpus = gpc.pipeline_size, os.cpu_count() or 1
        skipped = [] if P == 2 or cpus >= P else [f"{P} stages share {cpus} cores: timings "
                                                  f"are oversubscribed"]
        print(f"\nPipeline benchmark: {gpc.pipeline_size} stages (gloo, 1 thread each), M={M}, "
              f"1F1B unless noted")
        print(f"  {'workload':<18}{'ours ms':>9}{'torch ms':>10}{'thrpt ours/torch':>18}"
              f"{'1F1B/GPipe act.':>21}{'bound':>7}{'speed-up':>10}{'ideal':>7}{'limit ms':>10}"
              f"{'limit/ours':>12}{'busy limit/ours':>17}{'ZB ms':>8}{'thrpt ZB/1F1B':>15}"
              f"{'ZB/1F1B act.':>21}{'torch IZB ms':>14}{'torch ZBV ms':>14}{'ZBV ms':>9}"
              f"{'thrpt ZBV/1F1B':>16}{'ZBV/1F1B act.':>21}")
        for r in results:
            ratios = "/".join(f"{x:.2f}" for x in r["peak_ratio_1f1b_over_gpipe"])
            print(f"  {r['workload']:<18}{r['ours_ms']:>9.1f}{r['torch_ms']:>10.1f}"
                  f"{r['throughput_ratio']:>18.3f}{ratios:>21}{r['bound_ratio']:>7.3f}"
                  f"{r['speedup']:>10.2f}{r['ideal_speedup']:>7.2f}{r['limit_ms']:>10.1f}"
                  f"{r['ours_over_limit']:>12.3f}{r['ours_over_busy_limit']:>17.3f}"
                  f"{r['zero_bubble_ms']:>8.1f}{r['zero_bubble_over_1f1b_throughput']:>15.3f}"
                  f"{'/'.join(f'{x:.2f}' for x in r['peak_ratio_zero_bubble_over_1f1b']):>21}"
                  f"{r['torch_interleaved_zb_ms']:>14.1f}{r['torch_zbv_ms']:>14.1f}"
                  f"{r['zbv_ms']:>9.1f}{r['zbv_over_1f1b_throughput']:>16.3f}"
                  f"{'/'.join(f'{x:.2f}' for x in r['peak_ratio_zbv_over_1f1b']):>21}")
        print("  peak activation bytes held per stage (MiB):")
        for r in results:
            for name, per_rank in r["peak_bytes"].items():
                print(f"    {r['workload']:<18}{name:<22}"
                      + " ".join(f"{b / 2**20:>8.2f}" for b in per_rank))
        for reason in skipped:
            print(f"  skipped: {reason}")
        out = dict(benchmark="pipeline", stages=gpc.pipeline_size, microbatches=M,
                   threads_per_rank=1,
                   results=results, skipped=skipped, torch_version=torch.__version__,
                   machine=platform.machine(), cpus=os.cpu_count(), date=time.strftime("%Y-%m-%d"))
        write_result(args.out, out)
    gpc.destroy()


if __name__ == "__main__":
    run_on_ranks(main, __file__, nproc=int(dict(zip(sys.argv, sys.argv[1:])).get("--stages", 2)),
                 port=29512)
