"""Benchmark: the MoE GPT vs the dense GPT with the same active parameters per token, on 2 ranks.

    python bench/bench_moe.py [--dim 128 --depth 4 --heads 4 --batch 16 --seq 64 --experts 4
                               --capacity-factor 1.25 --steps 10]

Both models are train_gpt.py's GPT on 2 gloo ranks (the script starts itself there), each rank
training on its own `batch` sequences. Dense: every block has an MLP (d -> 4d -> d), data
parallel (DDP). MoE: every other block's MLP is `experts` such MLPs behind a top-1 router
(configs/gpt_moe.py's layout), experts spread over the 2 ranks (parallel.moe size 2). With
top-1 each token passes through one MLP per block either way: the same active parameters per
token (plus the router's d x E), E/2 times the MLP parameters in the MoE blocks.

Counted, per MoE layer and step: the elements each all-to-all sent (the layer's counters, forward;
backward sends the same again) against the formula. Each rank routes T = batch x seq tokens
into a buffer of C = max(ceil(cf T / E), 4) slots per expert, and every all-to-all sends it all:

    E x C x d elements (about cf x T x d: tokens x width), (G - 1) / G of them to other ranks

Prints a table, writes bench/results/moe.json.
"""
import argparse
import math
import os
import platform
import statistics
import time

import torch
from common import run_on_ranks, write_result  # also puts the repository on sys.path

import nanocolossal as nc  # noqa: E402
from nanocolossal.context import gpc  # noqa: E402
from nanocolossal.moe import moe_layers  # noqa: E402
from nanocolossal.moe.router import MIN_CAPACITY  # noqa: E402
from nanocolossal.traffic import count_collectives  # noqa: E402
from train_gpt import gpt  # noqa: E402


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=str, default="bench/results/moe.json")
    return parser.parse_args()


def measure(args, moe: bool) -> dict:
    torch.manual_seed(0)
    settings = dict(num_experts=args.experts, top_k=1,
                    capacity_factor_train=args.capacity_factor) if moe else None
    model = gpt(seq_len=args.seq, dim=args.dim, depth=args.depth, heads=args.heads, moe=settings)
    engine, *_ = nc.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                               torch.nn.CrossEntropyLoss(), verbose=False)
    g = torch.Generator().manual_seed(1 + gpc.rank)
    ids = torch.randint(0, 256, (args.batch, args.seq + 1), generator=g)
    times = []
    for i in range(args.steps + 1):
        torch.distributed.barrier()
        start = time.perf_counter()
        engine.zero_grad()
        with count_collectives() as forward:
            out = engine(ids[:, :-1])
        engine.backward(engine.criterion(out.reshape(-1, out.shape[-1]), ids[:, 1:].reshape(-1)))
        engine.step()
        if i:  # the first step warms up
            times.append(time.perf_counter() - start)
    step = statistics.median(times)
    local = sum(p.numel() for p in model.parameters())
    row = {"model": "MoE" if moe else "dense", "step_s": step,
           "tokens_per_s": gpc.world_size * args.batch * args.seq / step, "params_rank0": local}
    layers = moe_layers(model)
    if layers:
        layer, tokens = layers[0], args.batch * args.seq
        capacity = max(math.ceil(args.capacity_factor * tokens / args.experts), MIN_CAPACITY)
        p = layer.placement
        row["all_to_all"] = {
            "tokens_per_rank": tokens, "capacity": capacity,
            "counted_per_call": forward["all_to_all_single"] // (2 * len(layers)),
            "formula_E_C_d": args.experts * capacity * args.dim,
            "tokens_x_dim": tokens * args.dim,
            "remote_formula": (p.peers - 1) * p.num_local * capacity * args.dim,
            "calls_per_step": 2 * len(layers), "steps": args.steps + 1}
        total = sum(q.numel() for q in model.parameters()) + sum(
            q.numel() for m in layers for q in m.experts.parameters())  # the other rank's experts
        row["params_all_ranks"] = total
    return row


def main() -> None:
    args = parse_args()
    nc.launch_from_torch(config={"parallel": {"moe": {"size": 2}}}, seed=0)
    torch.set_num_threads(1)
    rows = [measure(args, moe=False), measure(args, moe=True)]
    if gpc.rank == 0:
        dense, moe = rows
        print(f"\nGPT dim {args.dim}, {args.depth} blocks, batch {args.batch} x seq {args.seq} per "
              f"rank, 2 gloo ranks; MoE: {args.experts} experts top-1 in every other block, "
              f"capacity factor {args.capacity_factor:g}; {os.cpu_count()} CPU cores, "
              f"torch {torch.__version__}")
        print(f"{'model':>6} {'params (all ranks)':>19} {'step':>9} {'tokens/s':>9} {'/ dense':>8}")
        for r in rows:
            params = r.get("params_all_ranks", r["params_rank0"])
            print(f"{r['model']:>6} {params:>19,} {r['step_s'] * 1e3:>7.1f}ms "
                  f"{r['tokens_per_s']:>9.0f} {r['tokens_per_s'] / dense['tokens_per_s']:>8.2f}")
        a = moe["all_to_all"]
        print(f"\nall-to-all per MoE layer and call (forward; backward sends the same): T = "
              f"{a['tokens_per_rank']} tokens/rank, C = {a['capacity']}")
        print(f"  sent {a['counted_per_call']:,} elements = E x C x d = {a['formula_E_C_d']:,} "
              f"({a['counted_per_call'] / a['tokens_x_dim']:.2f} x tokens x dim); to the other "
              f"rank (G-1)/G of it, {a['remote_formula']:,}")
        assert a["counted_per_call"] == a["formula_E_C_d"]
        write_result(args.out, {"args": vars(args), "machine": platform.machine(),
                                "cpus": os.cpu_count(), "torch": torch.__version__,
                                "rows": rows})
    gpc.destroy()


if __name__ == "__main__":
    run_on_ranks(main, __file__, nproc=2, port=29523)
