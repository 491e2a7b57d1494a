"""Benchmark: sequence parallelism, ring against all-to-all (Ulysses) attention -- how long a
sequence fits a memory budget, step time, and what each sends.

    python bench/bench_sequence.py [--dim 64 --heads 4 --depth 2 --batch 1 --seq 1024
                                    --budget-mib 64 --steps 5 --attention explicit|fused]

The GPT of train_gpt.py (byte vocabulary, learned positions, causal blocks) trains one step
(forward, backward, SGD) on `batch` sequences under N = 1 (one process: the torch baseline), and
on N = 2, 4 ranks of parallel.tensor=dict(size=N, mode='sequence', attention=kind) for both
kinds (the script starts itself on N ranks, gloo, one thread each). `--attention` is the model's
attention on whole sequences -- one process's, and what Ulysses runs for its h/N heads:
'explicit' (softmax(q k^T) v of torch ops, the s x s weights kept for backward) or 'fused'
(F.scaled_dot_product_attention: no s x s tensor kept) -- and how the ring computes each block
(explicit scores, or the fused kernel with its lse: tensor/ring_attention.py). torch's own
`context_parallel` only handles CUDA's SDPA kernels (flash / efficient / cudnn), so it cannot
run here on CPU.

Memory, counted from live tensors: the bytes autograd keeps between forward and backward (every
tensor saved for backward, each storage once) plus, for the explicit ring, the largest tensor
any op makes meanwhile (memory.LargestMade: one block of scores, made and dropped). Per layer
and rank, with s tokens, h heads, width w:

    one process, explicit   h s^2 (the softmax, saved for backward)  + O(s w)
    Ulysses, explicit       (h/N) s^2: whole sequences, h/N heads    + O(s w / N)
    ring, explicit          h (s/N)^2 (one block, transient)        + O(s w / N)
    fused (one process, Ulysses, ring): no s^2 term; O(s w), O(s w / N), O(s w / N)

The longest sequence within `budget-mib` per rank is found by running one step at each length
of a doubling grid and counting -- not extrapolated.

Traffic per layer and step, counted (traffic.py): the ring's K/V and dK/dV blocks sent (N-1 K/V
pairs forward; N-1 and N dK/dV pairs backward), the all-to-all's elements handed to
all_to_all_single (4 s w / N each way), both as elements leaving a rank, against
tensor/ulysses.py's formulas. Prints a table, writes bench/results/sequence.json.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import write_result  # also puts the repository on sys.path

import nanocolossal as nc  # noqa: E402
from nanocolossal.context import gpc  # noqa: E402
from nanocolossal.memory import LargestMade  # noqa: E402
from nanocolossal.sequence import split_batch  # noqa: E402
from nanocolossal.traffic import count_collectives  # noqa: E402
from train_gpt import gpt  # noqa: E402

GRID = [256, 512, 1024, 2048, 4096, 8192, 16384]


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=1024, help="sequence length of the timing")
    parser.add_argument("--budget-mib", type=float, default=64.0)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--kinds", nargs="+", default=["ring", "all_to_all"])
    parser.add_argument("--attention", choices=["explicit", "fused"], default="explicit")
    parser.add_argument("--out", type=str, default="bench/results/sequence.json")
    parser.add_argument("--worker", type=str, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--kind", type=str, default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


def saved_bytes(step) -> int:
    """Bytes autograd keeps for backward during `step`'s forward, each storage once."""
    kept: list[torch.Tensor] = []

    def pack(t):
        kept.append(t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step()
    seen, total = set(), 0
    for t in kept:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    loss.backward()
    return total


def measure(args, n: int, kind: str) -> dict:
    """This rank's figures for N = n (n = 1: one process, no launch)."""
    def build(s):
        torch.manual_seed(0)
        model = gpt(seq_len=s, dim=args.dim, depth=args.depth, heads=args.heads,
                    attention=args.attention)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        engine, *_ = nc.initialize(model, opt, torch.nn.CrossEntropyLoss(), verbose=False)
        ids = torch.randint(0, 256, (args.batch, s + 1), generator=torch.Generator().manual_seed(1))
        x, y = split_batch((ids[:, :-1], ids[:, 1:]), n, gpc.sequence_rank)

        def forward():
            out = engine(x)
            return engine.criterion(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        return engine, forward

    peaks, longest = {}, None
    for s in GRID:  # the longest sequence within the budget: run each length, count
        engine, forward = build(s)
        with LargestMade() as made:
            saved = saved_bytes(forward)
        # the explicit ring's score block is made and dropped, never saved (elsewhere: saved)
        transient = n > 1 and kind == "ring" and args.attention == "explicit"
        peak = saved + made.most * 4 * transient
        peaks[s] = peak
        if gpc.world_size > 1:  # every rank stops at the same length
            t = torch.tensor([peak], dtype=torch.float64)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
            peak = t.item()
        if peak > args.budget_mib * 2**20:
            break
        longest = s
    engine, forward = build(args.seq)
    times = []
    for i in range(args.steps + 1):
        if gpc.world_size > 1:
            torch.distributed.barrier()
        start = time.perf_counter()
        engine.zero_grad()
        with count_collectives() as counted:
            engine.backward(forward())
        engine.step()
        if i:  # the first step warms up
            times.append(time.perf_counter() - start)
    block = args.batch * args.seq // n * args.dim  # one K (or V) block of a ring step
    sent = counted["batch_isend_irecv"] // args.depth  # every block sent goes to a neighbour
    exchanged = counted["all_to_all_single"] // args.depth
    leaving = {"ring": sent, "all_to_all": exchanged * (n - 1) // n}
    return {"ranks": n, "kind": kind if n > 1 else "one process",
            "longest_seq_in_budget": longest, "peak_bytes_by_seq": peaks,
            "step_s": statistics.median(times), "block_pairs_per_layer_step": sent // (2 * block),
            "elements_leaving_per_layer_step": leaving[kind] if n > 1 else 0}


def formula(n: int, kind: str, s: int, w: int) -> int:
    """Elements leaving a rank per layer and step (tensor/ulysses.py's table), B = 1."""
    return {"ring": 2 * s * w * (3 * n - 2) // n,
            "all_to_all": 8 * s * w * (n - 1) // (n * n)}[kind] if n > 1 else 0


def worker(args) -> None:
    n = int(os.environ["WORLD_SIZE"])
    nc.launch_from_torch(config={"parallel": {"tensor": {"size": n, "mode": "sequence",
                                                         "attention": args.kind}}}, seed=0)
    torch.set_num_threads(1)
    result = measure(args, gpc.sequence_size, args.kind)
    if gpc.rank == 0:
        Path(args.worker).write_text(json.dumps(result))
    gpc.destroy()


def on_ranks(args, n: int, kind: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        argv = [sys.executable, "-m", "nanocolossal.run", "--nproc_per_node", str(n),
                "--master_port", os.environ.get("MASTER_PORT", "29517"), __file__,
                *sys.argv[1:], "--worker", str(out), "--kind", kind]
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def main() -> None:
    args = parse_args()
    if args.worker:
        return worker(args)
    torch.set_num_threads(1)  # as each rank: one thread
    rows = [measure(args, 1, "ring") if n == 1 else on_ranks(args, n, kind)
            for n in args.ranks for kind in (args.kinds if n > 1 else [None])]
    base = rows[0]
    print(f"\nGPT dim {args.dim}, {args.depth} layers, {args.heads} heads, batch {args.batch}, "
          f"{args.attention} attention; budget {args.budget_mib:g} MiB per rank; "
          f"{os.cpu_count()} CPU cores, torch {torch.__version__}")
    print(f"{'ranks':>5} {'attention':>12} {'longest seq':>12} {'x one proc':>10} "
          f"{'step @' + str(args.seq):>12} {'/ one proc':>10} {'sent/layer-step':>16} "
          f"{'formula':>9}")
    for r in rows:
        print(f"{r['ranks']:>5} {r['kind']:>12} {r['longest_seq_in_budget']:>12} "
              f"{r['longest_seq_in_budget'] / base['longest_seq_in_budget']:>10.2f} "
              f"{r['step_s'] * 1e3:>10.1f}ms {r['step_s'] / base['step_s']:>10.2f} "
              f"{r['elements_leaving_per_layer_step']:>16} "
              f"{formula(r['ranks'], r['kind'], args.batch * args.seq, args.dim):>9}")
    write_result(args.out, {"args": {k: v for k, v in vars(args).items()
                                     if k not in ("worker", "kind")},
                            "machine": platform.machine(), "cpus": os.cpu_count(),
                            "torch": torch.__version__, "rows": rows})


if __name__ == "__main__":
    main()
