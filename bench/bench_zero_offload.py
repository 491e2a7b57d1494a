"""ZeRO with and without offload='cpu': bytes per rank on each side, and step time.

    python bench/bench_zero_offload.py [--ranks 2]

bench_zero.py's MLP (4 x Linear(1536) + head, Psi = 9.46M, AdamW, fp32) on gloo ranks, levels
1-3 through nc.initialize(zero=dict(level=L, offload=...)) and the Engine. Bytes are rank 0's,
counted from live tensors in the step right after the copy-out (zero/offload.py), when the CPU
side is largest: "device" is what the model's device holds (parameters, gradients as the level
keeps them, and without offload the optimizer state), "CPU" the offload's masters, their
gradients and the state. Each is asserted equal to its formula on every rank; DDP's buckets
(level 1, 4 Psi) are left out as in bench_zero.py. Here both sides are this machine's memory, so
the time shows only the copies' cost on a CPU, not a GPU's PCIe transfers.
"""
import argparse
import math
import statistics
import time

import torch
import torch.distributed as dist
from bench_zero import adamw, mlp
from common import run_on_ranks
from torch import nn

import nanocolossal as nc
from nanocolossal.config import load_config
from nanocolossal.context import gpc

MiB = 2**20


def grad_bytes(tensors) -> int:
    return sum(t.grad.numel() * t.grad.element_size() for t in tensors if t.grad is not None)


def measure(base: nn.Module, level: int, offload, x, y, steps: int) -> dict:
    gpc.config = load_config({"zero": {"level": level, "offload": offload}})
    model = mlp(base[0].in_features, len(base) // 2)
    model.load_state_dict(base.state_dict())
    engine, *_ = nc.initialize(model, adamw(model.parameters()), nn.CrossEntropyLoss(),
                               verbose=False)
    opt = engine.optimizer
    times = []
    for step in range(steps + 1):
        dist.barrier()
        start = time.perf_counter()
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))
        if step == steps:  # the last step: counted after its copy-out
            opt.overflow_flag()
            homes = [opt.home(s) for b in opt.buffers for s in b.segments]
            params = opt.shard_bytes() if level == 3 else sum(
                {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                 for p in model.parameters()}.values())
            seen = {p.grad.untyped_storage().data_ptr() for p in model.parameters()
                    if p.grad is not None}  # level 1's segment gradients are views of these
            grads = grad_bytes(model.parameters()) + grad_bytes(
                h for h in homes if h.grad is not None
                and h.grad.untyped_storage().data_ptr() not in seen)
            cpu = (opt.master_bytes() + grad_bytes(m for _, m in opt.master_pairs())
                   if offload else 0)
            state = opt.state_bytes()
            device, cpu = params + grads + (0 if offload else state), cpu + (state if offload
                                                                            else 0)
        engine.step()
        times.append(time.perf_counter() - start)
    return dict(device=device, cpu=cpu, ms=1e3 * statistics.median(times[1:steps]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2, help="ranks to start")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--width", type=int, default=1536)
    parser.add_argument("--batch", type=int, default=64, help="per rank")
    args = parser.parse_args()
    torch.set_num_threads(1)
    nc.launch_from_torch({}, backend="gloo")
    N, rank = gpc.world_size, gpc.rank
    torch.manual_seed(0)
    base = mlp(args.width, 4)
    g = torch.Generator().manual_seed(1 + rank)
    x, y = torch.randn(args.batch, args.width, generator=g), torch.randint(0, 10, (args.batch,))
    psi = sum(p.numel() for p in base.parameters())
    shard = math.ceil(psi / N)
    my = max(0, min(psi, (rank + 1) * shard) - rank * shard)
    units = [layer.weight.numel() + layer.bias.numel() for layer in base
             if isinstance(layer, nn.Linear)]  # level 3: one flat buffer per unit
    shards = [math.ceil(u / N) for u in units]
    mine = sum(max(0, min(u, (rank + 1) * s) - rank * s) for u, s in zip(units, shards))
    # (device bytes, CPU bytes) per rank: zero/optimizer.py's and zero/offload.py's tables
    formula = {(1, None): (4 * shard * N + 4 * psi + 8 * my, 0),
               (1, "cpu"): (4 * shard * N + 4 * psi, 16 * my),
               (2, None): (4 * shard * N + 4 * my + 8 * my, 0),
               (2, "cpu"): (4 * shard * N, 16 * my),
               (3, None): (4 * sum(shards) + 12 * mine, 0),
               (3, "cpu"): (4 * sum(shards), 16 * mine)}
    rows = []
    for (level, offload), (device, cpu) in formula.items():
        got = measure(base, level, offload, x, y, args.steps)
        assert (got["device"], got["cpu"]) == (device, cpu), \
            f"[rank {rank}] level {level} offload={offload}: {got}, formula {(device, cpu)}"
        rows.append((level, offload, got))
    if rank == 0:
        print(f"Psi = {psi / 1e6:.2f}M, {N} ranks, rank 0 (MiB; equal to the formulas)")
        print("| level | offload | device | CPU | step |\n|---|---|---|---|---|")
        for level, offload, got in rows:
            print(f"| {level} | {offload or '-'} | {got['device'] / MiB:.1f} | "
                  f"{got['cpu'] / MiB:.1f} | {got['ms']:.1f} ms |")
    gpc.destroy()


if __name__ == "__main__":
    import sys
    nproc = int(sys.argv[sys.argv.index("--ranks") + 1]) if "--ranks" in sys.argv else 2
    run_on_ranks(main, __file__, nproc=nproc, port=29513)
