"""Benchmark: train_gpt's GPT on one GPU against a nanoGPT-style GPT of the same shape.

    python bench/bench_gpt_gpu.py [--compile] [--steps 20 --warmup 5] [--peak-tflops 989]
    python bench/bench_gpt_gpu.py --cpu-small    # the default without CUDA: a tiny shape
    python bench/bench_gpt_gpu.py --host-bound   # GPT-2 small's 12 layers, tiny, on the GPU

One shape (GPT-2 small: dim 768, 12 layers, 12 heads, sequence 1024, batch 8, vocabulary
50304; --cpu-small: 64, 2, 4, 64, 2, 512), random tokens, bf16 autocast, AdamW (fused), no
clipping, trained four ways:

    engine          train_gpt.gpt() through nc.initialize and the Engine (fp16=AMP_TYPE.TORCH,
                    bf16)
    bare            the same module in a bare loop: autocast forward, loss.backward(), step()
    bare_fp32_loss  the same, the output cast to fp32 and the loss taken outside autocast
                    (apex's O1 outside the Engine, amp.initialize): what an fp32 copy of the
                    logits, held through backward, costs -- the Engine's O1 runs the loss
                    under autocast instead (amp.autocast_loss)
    reference       the nanoGPT-style GPT below: the same layers, F.scaled_dot_product_attention

Each side is built and warmed up in turn, its peak memory counted meanwhile
(torch.cuda.max_memory_allocated above what was allocated before it was built); then the timed
steps take turns, in rounds. Reported per side: ms/step, the median of the steps' intervals
between CUDA events (torch.cuda.synchronize around each round's: the host may run ahead, as in
training); tokens/s; MFU = tokens/s x F / peak, F = 6N + 12 L d s FLOPs per token (N parameters
less the position table, as nanoGPT counts; 12 L d s: attention's scores and weights) against
the GPU's bf16 dense peak (from its name, or --peak-tflops); peak memory. The goals (issue
34): engine / reference <= 1.05 in time and <= 1.1 in memory, engine / bare <= 1.03 in time.
`--compile` runs every side through torch.compile. `--host-bound` keeps GPT-2 small's depth
(12 layers, so as many parameters and launches per step) at a tiny width (96, sequence 32,
batch 2): every kernel takes microseconds, the GPU waits on the host, and a step's time is what
the host spends launching it -- engine / bare is then the Engine's own Python and launches per
step, the cost that shows at full size on a host too slow to keep ahead of the GPU. Prints a
table and writes bench/results/gpt_gpu.json.
"""
import argparse
import gc
import platform
import statistics
import time
from pathlib import Path

import torch
from common import write_result  # also puts the repository on sys.path
from torch import nn
from torch.nn import functional as F

import nanocolossal as nc  # noqa: E402
import nanocolossal.nn as col_nn  # noqa: E402
from nanocolossal.amp import AMP_TYPE  # noqa: E402
from nanocolossal.context import gpc  # noqa: E402
from train_gpt import gpt  # noqa: E402

GPT2_SMALL = dict(dim=768, layers=12, heads=12, seq=1024, batch=8, vocab=50304)
CPU_SMALL = dict(dim=64, layers=2, heads=4, seq=64, batch=2, vocab=512)
HOST_BOUND = dict(dim=96, layers=12, heads=12, seq=32, batch=2, vocab=512)
# bf16 dense tensor-core peaks (FLOP/s), the first name found in the device's wins
PEAKS = [("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12),
         ("A100", 312e12), ("L40S", 362e12), ("L4", 121e12), ("A10", 125e12)]
# engine / another side in time (ms) or memory (peak_gib), and the goal (None: reported only)
COMPARISONS = [("reference", "ms", 1.05), ("reference", "peak_gib", 1.10), ("bare", "ms", 1.03),
               ("bare_fp32_loss", "ms", 1.03), ("bare_fp32_loss", "peak_gib", None)]


# -- the reference: a nanoGPT-style GPT ----------------------------------------------------------

class RefBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.c_attn, self.c_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.c_fc, self.mlp_proj = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class RefGPT(nn.Module):
    def __init__(self, vocab: int, seq: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(RefBlock(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        for m in self.modules():  # GPT-2's initialisation: weights N(0, 0.02), biases 0
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


# -- the three sides -----------------------------------------------------------------------------

def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.0,
                             fused=True)


def ours(shape: dict) -> nn.Module:
    torch.manual_seed(0)
    return gpt(vocab=shape["vocab"], seq_len=shape["seq"], dim=shape["dim"],
               depth=shape["layers"], heads=shape["heads"])


def maybe_compile(model: nn.Module, compile_: bool) -> nn.Module:
    return torch.compile(model) if compile_ else model


def engine_side(shape: dict, compile_: bool):
    """train_gpt's model through nc.initialize: the Engine's five calls per step."""
    model = maybe_compile(ours(shape), compile_)
    engine, *_ = nc.initialize(model, adamw(model), col_nn.VocabParallelCrossEntropyLoss(),
                               verbose=False)

    def step(ids, target):
        engine.zero_grad()
        _, _, loss = engine.execute_schedule((ids, target))
        engine.step()
        return loss
    return step, model


def bare_side(shape: dict, compile_: bool, reference: bool = False, fp32_loss: bool = False):
    """A bare loop: autocast forward and loss, backward, the optimizer's step."""
    if reference:
        torch.manual_seed(0)
        model = RefGPT(shape["vocab"], shape["seq"], shape["dim"], shape["layers"], shape["heads"])
    else:
        model = ours(shape)
    model = maybe_compile(model.to(gpc.device), compile_)
    opt = adamw(model)

    def step(ids, target):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(gpc.device.type, dtype=torch.bfloat16):
            logits = model(ids)
            loss = None if fp32_loss else F.cross_entropy(logits.flatten(0, 1), target.flatten())
        if fp32_loss:  # the output cast to fp32, the loss outside autocast
            loss = F.cross_entropy(logits.float().flatten(0, 1), target.flatten())
        loss.backward()
        opt.step()
        return loss
    return step, model


SIDES = {"engine": engine_side, "bare": bare_side,
         "bare_fp32_loss": lambda shape, compile_: bare_side(shape, compile_, fp32_loss=True),
         "reference": lambda shape, compile_: bare_side(shape, compile_, reference=True)}


# -- timing --------------------------------------------------------------------------------------

def build_side(name: str, shape: dict, args, batches: list) -> dict:
    """Build a side and run its warm-up steps: its peak memory counts from before it was built
    (the sides built before it sit unchanged meanwhile)."""
    cuda = gpc.device.type == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    step, model = SIDES[name](shape, args.compile)
    for ids, target in batches[:args.warmup]:
        loss = step(ids, target)
    plain = getattr(model, "_orig_mod", model)
    params = {id(p): p.numel() for p in plain.parameters()}  # a tied table counts once
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else None
    return dict(step=step, times=[], loss=loss, peak_gib=peak,
                params=sum(params.values()) - shape["seq"] * shape["dim"])  # less the positions


def time_steps(side: dict, batches: list) -> None:
    """Run `batches`, adding each step's time (ms) to the side's: on CUDA the intervals between
    events recorded after each step, the host free to run ahead between the two syncs."""
    if gpc.device.type == "cuda":
        torch.cuda.synchronize()
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(len(batches) + 1)]
        marks[0].record()
        for mark, (ids, target) in zip(marks[1:], batches):
            side["loss"] = side["step"](ids, target)
            mark.record()
        torch.cuda.synchronize()
        side["times"] += [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
        return
    for ids, target in batches:
        start = time.perf_counter()
        side["loss"] = side["step"](ids, target)
        side["times"].append((time.perf_counter() - start) * 1e3)


def run_sides(shape: dict, args, batches: list) -> dict:
    """Build the sides one by one, then time them in rounds, their order reversed every other
    round (a GPU's clock drifts over a run)."""
    sides = {name: build_side(name, shape, args, batches) for name in SIDES}
    timed = batches[args.warmup:]
    per_round = -(-len(timed) // args.rounds)
    for r in range(args.rounds):
        for name in (list(sides) if r % 2 == 0 else reversed(list(sides))):
            time_steps(sides[name], timed[r * per_round:(r + 1) * per_round])
    return {name: dict(ms=statistics.median(side["times"]),
                       last_loss=float(side["loss"].detach()), peak_gib=side["peak_gib"],
                       params=side["params"]) for name, side in sides.items()}


def peak_flops(args) -> tuple:
    if args.peak_tflops:
        return args.peak_tflops * 1e12, "--peak-tflops"
    if gpc.device.type != "cuda":
        return None, "none (CPU)"
    name = torch.cuda.get_device_name()
    return next(((peak, name) for key, peak in PEAKS if key in name), (None, f"unknown: {name}"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--compile", action="store_true", help="torch.compile every side")
    parser.add_argument("--cpu-small", action="store_true",
                        help="a tiny shape on the CPU (the default without CUDA)")
    parser.add_argument("--host-bound", action="store_true",
                        help="GPT-2 small's depth at a tiny width on the GPU: the host's cost")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps (20; CPU 3; host-bound 200)")
    parser.add_argument("--warmup", type=int, default=None, help="steps before timing (5; CPU 1)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds the timed steps take turns")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the GPU's bf16 dense peak, where its name does not say")
    parser.add_argument("--out", type=str,
                        default=str(Path(__file__).parent / "results" / "gpt_gpu.json"))
    args = parser.parse_args()
    small = args.cpu_small or not torch.cuda.is_available()
    if args.host_bound and small:
        parser.error("--host-bound measures what a GPU's host spends launching a step: it needs "
                     "CUDA and no --cpu-small (on a CPU, --cpu-small is the tiny shape)")
    args.steps = args.steps or (3 if small else 200 if args.host_bound else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if small else 5)
    shape = CPU_SMALL if small else HOST_BOUND if args.host_bound else GPT2_SMALL
    if small:
        torch.set_num_threads(1)
    # one process: the GPU (nccl), or the CPU (gloo) with the tiny shape
    nc.launch_from_torch({"fp16": {"mode": AMP_TYPE.TORCH, "dtype": "bfloat16"}},
                         backend="gloo" if small else None, allow_single_process=True)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, shape["vocab"], (args.warmup + args.steps, shape["batch"],
                                               shape["seq"] + 1), generator=g).to(gpc.device)
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens]
    sides = run_sides(shape, args, batches)
    if len({s["params"] for s in sides.values()}) != 1:
        raise AssertionError(f"the models differ in size: {sides}")

    N, L, d, s = sides["engine"]["params"], shape["layers"], shape["dim"], shape["seq"]
    flops_per_token = 6 * N + 12 * L * d * s
    peak, peak_from = peak_flops(args)
    for side in sides.values():
        side["tokens_per_s"] = shape["batch"] * s / (side["ms"] / 1e3)
        side["mfu"] = side["tokens_per_s"] * flops_per_token / peak if peak else None
    ratios, goals = {}, []
    for other, measure, limit in COMPARISONS:
        what = "time" if measure == "ms" else "memory"
        mine, theirs = sides["engine"][measure], sides[other][measure]
        ratio = ratios[f"engine_over_{other}_{what}"] = mine / theirs if theirs else None
        if args.host_bound and other != "bare":  # the host's cost: the same module's alone
            limit = None
        if limit is not None:
            goals.append(dict(goal=f"engine / {other} {what} <= {limit}", value=ratio,
                              met=None if ratio is None else ratio <= limit))
    device = torch.cuda.get_device_name() if gpc.device.type == "cuda" else platform.processor()
    result = dict(benchmark="gpt_gpu", device=device or platform.machine(),
                  compile=args.compile, shape=shape, params=N, flops_per_token=flops_per_token,
                  peak_flops=peak, peak_from=peak_from, warmup_steps=args.warmup,
                  steps_timed=args.steps, sides=sides, ratios=ratios, goals=goals,
                  torch_version=torch.__version__, date=time.strftime("%Y-%m-%d"))

    print(f"\nGPT {d} x {L} layers, {shape['heads']} heads, {shape['batch']} x {s} tokens, "
          f"vocab {shape['vocab']} ({N / 1e6:.1f}M parameters), bf16 autocast, fused AdamW"
          f"{', torch.compile' if args.compile else ''}: {result['device']}, median of "
          f"{args.steps} steps in {args.rounds} rounds")
    print(f"  {'':<14} {'ms/step':>9} {'tokens/s':>10} {'MFU':>6} {'peak GiB':>9} {'loss':>8}")
    for name, side in sides.items():
        mfu = f"{side['mfu']:.3f}" if side["mfu"] else "-"
        mem = f"{side['peak_gib']:.2f}" if side["peak_gib"] is not None else "-"
        print(f"  {name:<14} {side['ms']:>9.2f} {side['tokens_per_s']:>10.0f} {mfu:>6} "
              f"{mem:>9} {side['last_loss']:>8.4f}")
    for goal in goals:
        value = "-" if goal["value"] is None else f"{goal['value']:.3f}"
        verdict = {True: "PASS", False: "MISS", None: "n/a"}[goal["met"]]
        print(f"  goal {goal['goal']:<38} {value:>7}  {verdict}")
    write_result(args.out, result)
    gpc.destroy()


if __name__ == "__main__":
    main()
