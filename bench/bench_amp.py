"""Benchmark: nanocolossal AMP (O1 + DynamicLossScaler) vs torch.autocast + torch.amp.GradScaler.

    python bench/bench_amp.py [--steps 20 --rounds 5 --width 1024 --depth 4 --batch 256]

Both sides train identical copies of an MLP on identical batches, in interleaved A/B rounds
after a warm-up; the median step time of each is reported, as a ratio. On a fixed schedule
the loss is made infinite on both sides, so both must skip that step and back off: the two
loss-scale trajectories are recorded and compared step by step.

Precision: on CUDA both sides use float16. CPUs have no fast float16 kernels (a step is
~30x slower than fp32), which would bury any difference in the scaling machinery, so on CPU
both sides use bfloat16 autocast with loss scaling switched on. Speed-ups of the 16-bit
dtypes over fp32 are measured where they apply (bf16 on CPU; fp16 and bf16 on CUDA) and the
rest is listed as skipped. Prints a table and writes bench/results/amp.json.
"""
import argparse
import copy
import platform
import statistics
import time
from pathlib import Path

import torch
from common import write_result  # also puts the repository on sys.path
from torch import nn

from nanocolossal import amp  # noqa: E402


def mlp(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


class Ours:
    def __init__(self, model, dtype, device, scaler_kwargs):
        self.model, self.opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=1e-3),
                                              "O1", dtype=dtype, device_type=device.type)
        # on for bf16 too, to compare like with like
        self.opt.scaler = amp.DynamicLossScaler(**scaler_kwargs)

    def step(self, x, y, poison):
        self.opt.zero_grad()
        loss = nn.functional.cross_entropy(self.model(x), y) * poison
        with amp.scale_loss(loss, self.opt) as scaled:
            scaled.backward()
        self.opt.step()
        return self.opt.loss_scale


class Torch:
    def __init__(self, model, dtype, device, scaler_kwargs):
        self.model, self.dtype, self.device = model, dtype, device
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        self.scaler = torch.amp.GradScaler(device.type, **scaler_kwargs)

    def step(self, x, y, poison):
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=self.dtype):
            loss = nn.functional.cross_entropy(self.model(x), y) * poison
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        return self.scaler.get_scale()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def run(side, batches, device):
    times, scales = [], []
    for x, y, poison in batches:
        sync(device)
        start = time.perf_counter()
        scales.append(side.step(x, y, poison))
        sync(device)
        times.append(time.perf_counter() - start)
    return times, scales


def plain_step_time(model, dtype, batches, device):
    """Median step time with autocast in `dtype` (None: fp32), no scaling: the dtype speed-up."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    times = []
    for x, y, _ in batches:
        sync(device)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:] or times) * 1e3  # the first steps warm up


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=str,
                        default=str(Path(__file__).parent / "results" / "amp.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    scaler_kwargs = dict(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                         growth_interval=10)

    base = mlp(args.width, args.depth).to(device)
    sides = {"ours": Ours(copy.deepcopy(base), dtype, device, scaler_kwargs),
             "torch": Torch(copy.deepcopy(base), dtype, device, scaler_kwargs)}
    g = torch.Generator().manual_seed(1)
    step_no = [0]

    def batches(n):
        out = []
        for _ in range(n):
            step_no[0] += 1
            # the same overflow schedule for both
            poison = float("inf") if step_no[0] % 13 == 0 else 1.0
            out.append((torch.randn(args.batch, args.width, generator=g).to(device),
                        torch.randint(0, 10, (args.batch,), generator=g).to(device), poison))
        return out

    warm = batches(3)
    for side in sides.values():
        run(side, warm, device)
    times = {"ours": [], "torch": []}
    trajectory = {"ours": [], "torch": []}
    for r in range(args.rounds):
        data = batches(args.steps)
        for name in (["ours", "torch"] if r % 2 == 0 else ["torch", "ours"]):
            t, s = run(sides[name], data, device)
            times[name] += t
            trajectory[name] += s
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}

    speed = {"fp32_ms": plain_step_time(copy.deepcopy(base), None, batches(args.steps), device)}
    skipped = []
    for name, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        if device.type == "cpu" and dt == torch.float16:
            skipped.append("fp16 vs fp32 speed-up (CPU float16 kernels are emulated; CUDA only)")
            continue
        speed[f"{name}_ms"] = plain_step_time(copy.deepcopy(base), dt, batches(args.steps), device)
        speed[f"{name}_speedup"] = round(speed["fp32_ms"] / speed[f"{name}_ms"], 3)

    result = dict(
        benchmark="amp", device=device.type, dtype=str(dtype).replace("torch.", ""),
        threads=args.threads,
        model=f"MLP {args.depth}x Linear({args.width}) + head", batch=args.batch,
        steps_timed=len(times["ours"]),
        ours_ms=round(med["ours"], 2), torch_ms=round(med["torch"], 2),
        ratio_ours_over_torch=round(med["ours"] / med["torch"], 3),
        scale_trajectories_equal=trajectory["ours"] == trajectory["torch"],
        skipped_steps=sum(1 for a, b in zip([2.0**16] + trajectory["ours"],
                                            trajectory["ours"]) if b < a),
        final_scale=trajectory["ours"][-1], scale_trajectory=trajectory["ours"],
        dtype_speed=speed, skipped=skipped, torch_version=torch.__version__,
        machine=platform.machine(), date=time.strftime("%Y-%m-%d"))
    print(f"\nAMP benchmark: {result['model']}, batch {args.batch}, {device.type} "
          f"{result['dtype']}, {args.threads} thread(s), {len(times['ours'])} timed steps each")
    rows = [("step time, nanocolossal amp O1", f"{med['ours']:.1f} ms"),
            ("step time, autocast + GradScaler", f"{med['torch']:.1f} ms"),
            ("ratio ours / torch", f"{result['ratio_ours_over_torch']:.3f}"),
            ("loss-scale trajectories equal", f"{result['scale_trajectories_equal']} "
                                              f"({result['skipped_steps']} backoffs)"),
            ("fp32 step (no autocast)", f"{speed['fp32_ms']:.1f} ms")]
    rows += [(f"{k[:4]} speed-up over fp32",
              f"{v:.2f}x") for k, v in speed.items() if k.endswith("speedup")]
    for label, value in rows:
        print(f"  {label:<34} {value:>22}")
    for reason in skipped:
        print(f"  skipped: {reason}")
    write_result(args.out, result)


if __name__ == "__main__":
    main()
