"""Benchmark: one tensor-parallel MLP block, ours (1d and 2d) vs torch.distributed.tensor.parallel.

    python bench/bench_tensor.py [--tokens 512 --dim 1024 --hidden 4096 --steps 10 --rounds 4]

Starts itself on 4 ranks (gloo, one thread each). The block is Linear(dim, hidden) -> GELU ->
Linear(hidden, dim) on `tokens` rows, its input requiring grad as inside a network; a step is
forward + backward + SGD. Three implementations take turns (A/B rounds, order alternating):

    ours 1d    column- then row-parallel Linear over 4 ranks (Megatron)
    torch 1d   the same split with DTensor: ColwiseParallel / RowwiseParallel on a 4-rank mesh
    ours 2d    Linear2D (SUMMA) on a 2 x 2 grid: tokens split over rows, features over columns

and the median step times are reported (1d: ours / torch). Each collective's payload is
counted on rank 0 and compared with the formulas (elements per rank per step, one rank's
tensor passed to each collective; b = tokens, d = dim, h = hidden, T = 4, q = 2):

    1d:  forward all-reduce of the block's output [b, d] + backward all-reduce of dL/dx [b, d]
         = 2 b d
    2d:  per Linear2D(in, out): forward q steps broadcasting an input panel [b/q, in/q] and a
         weight panel [out/q, in/q]; backward twice as many panels plus as many reduced partials
         = 3 (b in + in out) / q, + the bias's all-reduce (out/q) down the column

Prints a table and writes bench/results/tensor.json. The four modes side by side on 8 ranks
(1d, 2d, 2.5d, 3d: step time, memory and traffic per rank) are bench/bench_tensor_modes.py's.
"""
import argparse
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
from nanocolossal.tensor import layers_1d, layers_2d  # noqa: E402
from nanocolossal.tensor.base import slice_of  # noqa: E402


class Counter:
    """Counts the elements this rank hands to each collective (wraps torch.distributed)."""

    def __init__(self) -> None:
        self.elements, self.on = 0, False
        for name in ("all_reduce", "broadcast", "reduce", "all_gather"):
            original = getattr(dist, name)
            setattr(dist, name, self._wrap(original))

    def _wrap(self, fn):
        def counted(tensor, *args, **kwargs):
            if self.on:
                self.elements += (args[0] if isinstance(tensor, list) else tensor).numel()
            return fn(tensor, *args, **kwargs)
        return counted


def block(linear1, linear2) -> nn.Module:
    return nn.Sequential(linear1, nn.GELU(), linear2)


def timed_steps(model, opt, batches) -> list[float]:
    times = []
    for x in batches:
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        x = x.detach().requires_grad_()
        model(x).square().mean().backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", type=str,
                        default=str(Path(__file__).parent / "results" / "tensor.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    nc.launch_from_torch({"parallel": {"tensor": {"size": 4, "mode": "2d"}}}, backend="gloo")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    b, d, h, q = args.tokens, args.dim, args.hidden, gpc.summa_dim
    torch.manual_seed(0)
    plain = block(nn.Linear(d, h), nn.Linear(h, d))
    torch.manual_seed(0)
    # same draws: the same weights
    ours_1d = block(layers_1d.ColumnLinear1D(d, h), layers_1d.RowLinear1D(h, d))
    torch.manual_seed(0)
    ours_2d = block(layers_2d.Linear2D(d, h), layers_2d.Linear2D(h, d))
    theirs = parallelize_module(plain, init_device_mesh("cpu", (gpc.world_size,)),
                                {"0": ColwiseParallel(), "2": RowwiseParallel()})
    models = {"ours 1d": ours_1d, "torch 1d": theirs, "ours 2d": ours_2d}
    inputs = {"ours 1d": lambda x: x, "torch 1d": lambda x: x,
              "ours 2d": lambda x: slice_of(x, [(0, "row"), (1, "col")])}
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}

    # the same batches on every rank (tensor parallel: one replica)
    g = torch.Generator().manual_seed(1)
    def batches(name, n):
        return [inputs[name](torch.randn(b, d, generator=g)) for _ in range(n)]

    x = torch.randn(b, d, generator=torch.Generator().manual_seed(9))
    out_1d, out_torch = ours_1d(x), theirs(x)
    max_diff = (out_1d - out_torch).abs().max().item()

    counter = Counter()
    elements = {}
    for name, model in models.items():  # one counted step each
        counter.elements, counter.on = 0, True
        timed_steps(model, opts[name], batches(name, 1))
        counter.on = False
        elements[name] = counter.elements
    times = {name: [] for name in models}
    for r in range(args.rounds):
        for name in (list(models) if r % 2 == 0 else list(reversed(models))):
            data = batches(name, args.steps)
            dist.barrier()
            times[name] += timed_steps(models[name], opts[name], data)

    formula_1d = 2 * b * d
    formula_2d = 3 * (b * d + d * h) // q + 3 * (b * h + h * d) // q + h // q + d // q
    if gpc.rank == 0:
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        result = dict(benchmark="tensor", world_size=gpc.world_size, backend=gpc.backend,
                      threads_per_rank=1,
                      block=f"Linear({d},{h}) GELU Linear({h},{d}) on {b} tokens",
                      ours_1d_ms=round(med["ours 1d"], 2), torch_1d_ms=round(med["torch 1d"], 2),
                      ours_2d_ms=round(med["ours 2d"], 2),
                      ratio_ours_1d_over_torch=round(med["ours 1d"] / med["torch 1d"], 3),
                      elements_per_step_rank0={k: v for k, v in elements.items()},
                      formula_1d=formula_1d, formula_2d=formula_2d,
                      max_output_diff_1d_vs_torch=max_diff,
                      steps_timed=len(times["ours 1d"]), torch_version=torch.__version__,
                      machine=platform.machine(), cpus=os.cpu_count(),
                      date=time.strftime("%Y-%m-%d"))
        print(f"\nTensor-parallel MLP block: {result['block']}, {gpc.world_size} gloo ranks x 1 "
              f"thread, {result['steps_timed']} timed steps each")
        print(f"  {'':<10} {'step ms':>9} {'elements sent/step':>20} {'formula':>12}")
        for name in models:
            formula = {"ours 1d": formula_1d, "ours 2d": formula_2d}.get(name)
            print(f"  {name:<10} {med[name]:>9.1f} {elements[name]:>20,} "
                  f"{formula if formula else '-':>12,}"
                  if formula else f"  {name:<10} {med[name]:>9.1f} {elements[name]:>20,} {'-':>12}")
        print(f"  ratio ours 1d / torch 1d: {result['ratio_ours_1d_over_torch']:.3f}; "
              f"max |output ours - torch| {max_diff:.1e}")
        write_result(args.out, result)
    gpc.destroy()


if __name__ == "__main__":
    run_on_ranks(main, __file__, nproc=4, port=29513)
