"""Benchmark: one MLP block under each tensor-parallel mode on 8 ranks -- 1d, 2d, 2.5d, 3d.

    python bench/bench_tensor_modes.py [--tokens 512 --dim 1024 --hidden 4096 --steps 5]

Starts itself on 8 ranks (gloo, one thread each). The block is Linear(dim, hidden) -> GELU ->
Linear(hidden, dim) on `tokens` rows (b = tokens, d = dim, h = hidden), its input requiring
grad as inside a network; a step is forward + backward + SGD, the same global work in every mode:

    1d     column- then row-parallel Linear over T = 8 ranks (Megatron)
    2d     Linear2D on a 2 x 2 grid, two such grids as data-parallel replicas (DDP), b/2 each
    2.5d   Linear2p5D: 2 stacked 2 x 2 grids (q = 2, depth p = 2), b/2 tokens per grid
    3d     Linear3D on a 2 x 2 x 2 cube (q = 2), column then row

Each mode is its own job (its own 8 processes, one after the other). Per rank 0 it reports the
median step time, the bytes of parameters it holds and of the activations autograd keeps for
backward (counted from the live tensors: saved_tensors_hooks, each storage once, parameters
not counted again; 3d's gathered input and weight blocks are counted), and the
elements it hands to collectives in one step (nanocolossal.traffic) against the formula (per
Linear(i, o) on m tokens; q the grid or cube side, p the depth, T the tensor size):

    1d     forward all-reduce of the output [m, d] + backward all-reduce of dL/dx: 2 m d per
           block
    2.5d   SUMMA on the grid's m/p tokens: forward q broadcasts of an input panel and a weight
           panel, backward as many broadcasts and reduces each: 3 (m i / p + i o) / q; the bias
           summed over the batch group: o / q; the weight block over the depth group:
           i o / q^2 when p > 1.  (2d: p = 1, m = b/2, plus DDP's all-reduce of the gradients:
           the parameters' elements and one "used" flag per parameter)
    3d     forward all-gathers of the input (m i / q^2) and the weight (i o / q^2) and the
           output's reduce-scatter (m o / q^2); backward the same three: 2 (m i + i o + m o) /
           q^2; the bias summed over its plane: o / q

Prints a table and writes bench/results/tensor_modes.json (docs/tensor.md).
"""
import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from common import write_result  # also puts the repository on sys.path
from torch import nn

import nanocolossal as nc  # noqa: E402
from nanocolossal.context import gpc  # noqa: E402
from nanocolossal.ddp import DistributedDataParallel  # noqa: E402
from nanocolossal.run import main as run  # noqa: E402
from nanocolossal.tensor import layers_1d, layers_2d, layers_3d  # noqa: E402
from nanocolossal.tensor.base import slice_of  # noqa: E402
from nanocolossal.traffic import count_collectives  # noqa: E402

MODES = {  # name: (parallel.tensor, input blocks)
    "1d": ({"size": 8, "mode": "1d"}, []),
    "2d": ({"size": 4, "mode": "2d"}, [(0, "row"), (1, "col")]),
    "2.5d": ({"size": 8, "mode": "2.5d", "depth": 2}, [(0, "depth"), (0, "row"), (1, "col")]),
    "3d": ({"size": 8, "mode": "3d"}, [(0, "x"), (0, "y"), (1, "z")]),
}


def block(mode: str, d: int, h: int) -> nn.Module:
    if mode == "1d":
        layers = layers_1d.ColumnLinear1D(d, h), layers_1d.RowLinear1D(h, d)
    elif mode == "3d":
        layers = layers_3d.Linear3D(d, h, parallel="column"), layers_3d.Linear3D(h, d,
                                                                                  parallel="row")
    else:
        layers = layers_2d.Linear2D(d, h), layers_2d.Linear2D(h, d)
    return nn.Sequential(layers[0], nn.GELU(), layers[1])


def formula(mode: str, b: int, d: int, h: int) -> int:
    """Elements this rank hands to collectives in one step (the module docstring)."""
    if mode == "1d":
        return 2 * b * d
    if mode == "3d":
        q = gpc.cube_dim
        return sum(2 * (b * i + i * o + b * o) // q ** 2 + o // q for i, o in ((d, h), (h, d)))
    q, p = gpc.summa_dim, gpc.tensor_depth
    m = b // gpc.data_size  # 2d: each data replica's tokens
    total = sum(3 * (m * i // p + i * o) // q + o // q + (i * o // q ** 2 if p > 1 else 0)
                for i, o in ((d, h), (h, d)))
    if gpc.data_size > 1:  # DDP averages the grids' blocks' gradients, each with a "used" flag
        total += 2 * d * h // q ** 2 + (h + d) // q + 4
    return total


def saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd keeps for backward in one forward (each storage once), but for the
    parameters themselves (counted as weights; a gathered copy of one counts here)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        model(x).sum()
    return sum(seen.values())


def measure(mode: str, args) -> dict:
    tensor, cut = MODES[mode]
    nc.launch_from_torch({"parallel": {"tensor": tensor}}, backend="gloo")
    b, d, h = args.tokens, args.dim, args.hidden
    torch.manual_seed(0)
    model = block(mode, d, h)
    if gpc.data_size > 1:
        model = DistributedDataParallel(model, process_group=gpc.data_group)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    mine = lambda x: slice_of(x.chunk(gpc.data_size)[gpc.data_rank], cut).clone()  # noqa: E731
    batches = [mine(torch.randn(b, d, generator=g)).requires_grad_() for _ in range(args.steps + 1)]

    def step(x):
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
    step(batches[0])  # warm-up
    with count_collectives() as counted:
        step(batches[0])
    times = []
    for x in batches[1:]:  # (the batches' blocks are drawn before: not timed)
        dist.barrier()
        start = time.perf_counter()
        step(x)
        times.append(time.perf_counter() - start)
    result = {"step_ms": round(statistics.median(times) * 1e3, 2),
              "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
              "activation_bytes": saved_bytes(model, batches[0]),
              "elements_sent": sum(counted.values()), "by_collective": dict(counted),
              "formula": formula(mode, b, d, h)}
    gpc.destroy()
    return result


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--mode", type=str, default=None, help="(one mode's job: internal)")
    parser.add_argument("--out", type=str,
                        default=str(Path(__file__).parent / "results" / "tensor_modes.json"))
    return parser.parse_args()


def one_mode() -> None:
    """A rank of one mode's job: measure, and rank 0 writes the mode's part of the result."""
    args = parse_args()
    torch.set_num_threads(1)
    result = measure(args.mode, args)
    if int(os.environ["RANK"]) == 0:
        Path(f"{args.out}.{args.mode}").write_text(json.dumps(result))


def main() -> None:
    """Each mode's job in turn, then the table and the JSON."""
    args = parse_args()
    results = {}
    for mode in MODES:
        code = run(["--nproc_per_node", "8", "--master_port",
                    os.environ.get("MASTER_PORT", "29517"), __file__, *sys.argv[1:],
                    "--mode", mode])
        if code:
            sys.exit(code)
        part = Path(f"{args.out}.{mode}")
        results[mode] = json.loads(part.read_text())
        part.unlink()
    b, d, h = args.tokens, args.dim, args.hidden
    print(f"\nMLP block Linear({d},{h}) GELU Linear({h},{d}) on {b} tokens, 8 gloo ranks x 1 "
          f"thread, {args.steps} timed steps; rank 0")
    print(f"  {'mode':<6} {'step ms':>9} {'weights MiB':>12} {'activations MiB':>16} "
          f"{'elements sent':>14} {'formula':>12}")
    for mode, r in results.items():
        print(f"  {mode:<6} {r['step_ms']:>9.1f} {r['weight_bytes'] / 2**20:>12.2f} "
              f"{r['activation_bytes'] / 2**20:>16.2f} {r['elements_sent']:>14,} "
              f"{r['formula']:>12,}")
    write_result(args.out, dict(benchmark="tensor_modes", world_size=8, backend="gloo",
                                threads_per_rank=1,
                                block=f"Linear({d},{h}) GELU Linear({h},{d}) on {b} tokens",
                                modes=results, steps_timed=args.steps,
                                torch_version=torch.__version__, machine=platform.machine(),
                                cpus=os.cpu_count(), date=time.strftime("%Y-%m-%d")))


if __name__ == "__main__":
    one_mode() if "RANK" in os.environ else main()
