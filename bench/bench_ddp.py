"""Benchmark: nanocolossal DDP vs torch.nn.parallel.DistributedDataParallel, same run, same data.

    python bench/bench_ddp.py [--steps 10 --rounds 5 --width 2048 --depth 4 --batch 64]

Starts itself on 2 ranks (gloo, one thread each) with `nanocolossal run`. Both wrappers get
identical copies of a ~17M-parameter MLP and identical batches; they take turns in A/B
rounds (which one goes first alternates) after a warm-up, and the median step time of each
is reported, beside Colossal-AI's DataParallelGradientHandler (all-reduce after backward, no
overlap) on a third copy. Rank 0 then times the same model with no DDP at all, alone, for scaling
efficiency (= single-process step time / DDP step time at the same per-rank batch), and both
ranks time one all-reduce of all the gradients at once (67 MB fp32, and bf16), alone: the
communication floor. Finally the DDP models' parameters are compared: they took the same steps,
so they must agree.

Prints a table and writes bench/results/ddp.json.
"""
import argparse
import copy
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from common import run_on_ranks, write_result  # also puts the repository on sys.path
from torch import nn

import nanocolossal as nc  # noqa: E402
from nanocolossal.context import gpc  # noqa: E402
from nanocolossal.ddp import DistributedDataParallel  # noqa: E402
from nanocolossal.gradient_handler import DataParallelGradientHandler  # noqa: E402


def mlp(width: int, depth: int) -> nn.Module:
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def timed_steps(model, optimizer, batches, after_backward=None, set_to_none=True) -> list[float]:
    times = []
    for x, y in batches:
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=set_to_none)
        nn.functional.cross_entropy(model(x), y).backward()
        if after_backward is not None:
            after_backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10,
                        help="timed steps per round per implementation")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64, help="per rank")
    parser.add_argument("--out", type=str,
                        default=str(Path(__file__).parent / "results" / "ddp.json"))
    args = parser.parse_args()

    torch.set_num_threads(1)
    nc.launch_from_torch({}, backend="gloo")
    torch.manual_seed(0)
    base = mlp(args.width, args.depth)
    n_params = sum(p.numel() for p in base.parameters())
    ours = DistributedDataParallel(copy.deepcopy(base))
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    # Colossal-AI's gradient handler: all-reduce after backward, no overlap
    handled = copy.deepcopy(base)
    handler = DataParallelGradientHandler(handled)
    # gradient_as_bucket_view: .grad is the bucket slot
    # (zeroed in place, so backward writes into it)
    ours_view = DistributedDataParallel(copy.deepcopy(base), gradient_as_bucket_view=True)
    theirs_view = nn.parallel.DistributedDataParallel(copy.deepcopy(base),
                                                      gradient_as_bucket_view=True)
    # bf16 compression: ours (compress="bf16") vs torch's bf16_compress_hook
    ours_bf16 = DistributedDataParallel(copy.deepcopy(base), compress="bf16")
    theirs_bf16 = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
    theirs_bf16.register_comm_hook(None, bf16_compress_hook)
    models = {"ours": ours, "torch": theirs, "handler": handled, "ours view": ours_view,
              "torch view": theirs_view, "ours bf16": ours_bf16, "torch bf16": theirs_bf16}
    opt = {name: torch.optim.SGD(m.parameters(), lr=0.01,
                                 momentum=0.9) for name, m in models.items()}
    hooks = {"handler": handler.handle_gradient}
    keep = {"ours view": False, "torch view": False}  # set_to_none=False keeps the views

    g = torch.Generator().manual_seed(1 + gpc.rank)
    def batches(n):
        return [(torch.randn(args.batch, args.width, generator=g),
                 torch.randint(0, 10, (args.batch,), generator=g))
                for _ in range(n)]

    warm = batches(args.warmup)
    for name in models:
        timed_steps(models[name], opt[name], warm, hooks.get(name), keep.get(name, True))
    times = {name: [] for name in models}
    for r in range(args.rounds):
        data = batches(args.steps)
        order = list(models) if r % 2 == 0 else list(reversed(models))
        for name in order:
            dist.barrier()
            times[name] += timed_steps(models[name], opt[name], data, hooks.get(name),
                                       keep.get(name, True))

    def max_diff_from_ours(other) -> float:
        return max((p - q).abs().max().item() for p, q in zip(ours.parameters(),
                                                              other.parameters()))
    max_diff = max(max_diff_from_ours(m) for m in (theirs, handled, ours_view, theirs_view))
    bf16_diff = {"ours": max_diff_from_ours(ours_bf16), "torch": max_diff_from_ours(theirs_bf16)}

    # the floor: one all-reduce of every gradient at once (67 MB in fp32), nothing else running
    flat = {"fp32": torch.ones(n_params), "bf16": torch.ones(n_params, dtype=torch.bfloat16)}
    all_reduce_times = {}
    for name, buffer in flat.items():
        dist.all_reduce(buffer)
        samples = []
        for _ in range(args.steps):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(buffer)
            samples.append(time.perf_counter() - start)
        all_reduce_times[name] = statistics.median(samples) * 1e3

    dist.barrier()
    single_times = []
    # the other rank waits, so rank 0 has the machine to itself as in a 1-rank run
    if gpc.rank == 0:
        single = copy.deepcopy(base)
        single_opt = torch.optim.SGD(single.parameters(), lr=0.01, momentum=0.9)
        timed_steps(single, single_opt, warm)
        single_times = timed_steps(single, single_opt, batches(args.steps * 2))
    dist.barrier()

    if gpc.rank == 0:
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        single_ms = statistics.median(single_times) * 1e3
        result = dict(
            benchmark="ddp", world_size=gpc.world_size, backend=gpc.backend, threads_per_rank=1,
            model=f"MLP {args.depth}x Linear({args.width}) + head", params=n_params,
            batch_per_rank=args.batch,
            steps_timed=len(times["ours"]), ours_ms=round(med["ours"], 2),
            torch_ms=round(med["torch"], 2),
            ratio_ours_over_torch=round(med["ours"] / med["torch"], 3),
            handler_ms=round(med["handler"], 2),
            ratio_handler_over_torch=round(med["handler"] / med["torch"], 3),
            bucket_view_ours_ms=round(med["ours view"], 2),
            bucket_view_torch_ms=round(med["torch view"], 2),
            bf16_ours_ms=round(med["ours bf16"], 2), bf16_torch_hook_ms=round(med["torch bf16"], 2),
            ratio_bf16_ours_over_torch_hook=round(med["ours bf16"] / med["torch bf16"], 3),
            bf16_max_param_diff_from_fp32=bf16_diff,
            ratio_bucket_view_ours_over_torch=round(med["ours view"] / med["torch view"], 3),
            single_rank_ms=round(single_ms, 2),
            all_reduce_mb=round(n_params * 4 / 1e6, 1),
            all_reduce_fp32_ms=round(all_reduce_times["fp32"], 2),
            all_reduce_bf16_ms=round(all_reduce_times["bf16"], 2),
            scaling_efficiency_ours=round(single_ms / med["ours"], 3),
            scaling_efficiency_torch=round(single_ms / med["torch"], 3),
            max_param_diff=max_diff, torch_version=torch.__version__, machine=platform.machine(),
            cpus=os.cpu_count(), date=time.strftime("%Y-%m-%d"))
        rows = [("step time, nanocolossal DDP", f"{med['ours']:.1f} ms"),
                ("step time, torch DDP", f"{med['torch']:.1f} ms"),
                ("ratio ours / torch", f"{result['ratio_ours_over_torch']:.3f}"),
                ("step time, gradient handler", f"{med['handler']:.1f} ms"),
                ("step time, ours / torch, bucket view",
                 f"{med['ours view']:.1f} / {med['torch view']:.1f} ms"),
                ("ratio ours / torch, bucket view",
                 f"{result['ratio_bucket_view_ours_over_torch']:.3f}"),
                ("step time, bf16 ours / torch hook",
                 f"{med['ours bf16']:.1f} / {med['torch bf16']:.1f} ms"),
                ("ratio bf16 ours / torch hook",
                 f"{result['ratio_bf16_ours_over_torch_hook']:.3f}"),
                ("bf16: max |param - fp32 param| ours/torch",
                 f"{bf16_diff['ours']:.1e} / {bf16_diff['torch']:.1e}"),
                ("ratio handler / torch", f"{result['ratio_handler_over_torch']:.3f}"),
                ("step time, 1 rank without DDP", f"{single_ms:.1f} ms"),
                (f"all-reduce {n_params * 4 / 1e6:.0f} MB alone, fp32 / bf16",
                 f"{all_reduce_times['fp32']:.1f} / {all_reduce_times['bf16']:.1f} ms"),
                ("scaling efficiency ours / torch", f"{result['scaling_efficiency_ours']:.2f} / "
                                                    f"{result['scaling_efficiency_torch']:.2f}"),
                ("max |param diff| ours vs torch, handler", f"{max_diff:.2e}")]
        print(f"\nDDP benchmark: {result['model']}, {n_params / 1e6:.1f}M params, batch "
              f"{args.batch}/rank, {gpc.world_size} gloo ranks x 1 thread, {len(times['ours'])} "
              f"timed steps each")
        for label, value in rows:
            print(f"  {label:<34} {value:>14}")
        write_result(args.out, result)
    gpc.destroy()


if __name__ == "__main__":
    run_on_ranks(main, __file__, port=29511)
