"""Benchmark: activation checkpointing -- peak activation bytes and step time, with and without.

    python bench/bench_activation_checkpoint.py [--dim 256 --heads 4 --depth 4 --seq 256
                                                 --batch 8 --steps 5]

The GPT of train_gpt.py (byte vocabulary, causal blocks, fp32, dropout 0) trains one step
(forward, backward, SGD) on one process, under each ACTIVATION_CHECKPOINT (none, 'full',
'selective', 2: every 2nd block) and each attention ('fused', 'explicit'). Peak activation
bytes are counted from live saved tensors (memory.SavedBytes: what autograd keeps
for backward, parameters not counted, a tensor saved twice once) over the whole step. The blocks'
part follows the module docstring: L·A without, L·x + A - x with 'full' (k = 1 micro-batch);
the embeddings' and the head's saved tensors (the logits) are the same in every mode. Step time:
the median of `steps` steps after one warm-up. Prints a table, writes
bench/results/activation_checkpoint.json.
"""
import argparse
import platform
import socket
import statistics
import time

import torch
from common import write_result  # also puts the repository on sys.path

import nanocolossal as nc  # noqa: E402
from nanocolossal.context import gpc  # noqa: E402
from nanocolossal.memory import SavedBytes  # noqa: E402
from train_gpt import gpt  # noqa: E402

MODES = [None, "full", "selective", 2]


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=str, default="bench/results/activation_checkpoint.json")
    return parser.parse_args()


def measure(args, mode, attention: str) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nc.launch({"ACTIVATION_CHECKPOINT": mode} if mode else {}, rank=0, world_size=1,
              host="127.0.0.1", port=port, seed=0)
    model = gpt(seq_len=args.seq, dim=args.dim, depth=args.depth, heads=args.heads,
                attention=attention)
    engine, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=1e-3),
                               torch.nn.CrossEntropyLoss(), verbose=False)
    ids = torch.randint(0, 256, (args.batch, args.seq + 1),
                        generator=torch.Generator().manual_seed(1))
    x, y = ids[:, :-1], ids[:, 1:]

    def step():
        engine.zero_grad()
        out = engine(x)
        engine.backward(engine.criterion(out.reshape(-1, out.shape[-1]), y.reshape(-1)))
        engine.step()

    with SavedBytes(model.parameters()) as saved:
        step()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    gpc.destroy()
    return {"mode": mode, "attention": attention, "peak_bytes": saved.peak,
            "step_s": statistics.median(times)}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    b, s, d, h, L = args.batch, args.seq, args.dim, args.heads, args.depth
    A, x = 4 * (16 * b * s * d + 4 * b * s + b * h * s), 4 * b * s * d  # fused, fp32
    rows = [measure(args, mode, attention) for attention in ("fused", "explicit")
            for mode in MODES]
    print(f"GPT dim {d}, {h} heads, {L} blocks, {b} x {s} tokens, fp32, 1 process; blocks' "
          f"formula (fused): without L·A = {L * A / 2**20:.1f} MiB, 'full' L·x + A - x = "
          f"{(L * x + A - x) / 2**20:.1f} MiB")
    print(f"{'attention':10} {'ACTIVATION_CHECKPOINT':22} {'peak MiB':>9} {'vs none':>8} "
          f"{'step ms':>8} {'vs none':>8}")
    for row in rows:
        base = next(r for r in rows if r["attention"] == row["attention"] and r["mode"] is None)
        row["peak_vs_none"] = row["peak_bytes"] / base["peak_bytes"]
        row["time_vs_none"] = row["step_s"] / base["step_s"]
        print(f"{row['attention']:10} {str(row['mode']):22} {row['peak_bytes'] / 2**20:9.1f} "
              f"{row['peak_vs_none']:8.2f} {row['step_s'] * 1e3:8.1f} {row['time_vs_none']:8.2f}")
    write_result(args.out, {"args": vars(args), "formula_blocks_bytes": {
        "without": L * A, "full": L * x + A - x}, "rows": rows,
        "machine": platform.processor() or platform.machine(), "torch": torch.__version__})


if __name__ == "__main__":
    main()
