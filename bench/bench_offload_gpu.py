"""Benchmark: ZeRO offload='cpu' on one GPU -- what the step costs and where its time goes.

    python bench/bench_offload_gpu.py              # GPT-2 small, bf16 O1, ZeRO level 2, 1 rank
    python bench/bench_offload_gpu.py --cpu-small  # the default without CUDA: a tiny shape

Three runs of train_gpt's GPT through nc.initialize and the Engine, each in a process of its own
(a fresh allocator: one run's peak never includes another's leftovers):

    device          zero=dict(level=2), AdamW(fused=True) on the GPU: masters and state there
    offload foreach zero=dict(level=2, offload='cpu'), AdamW(foreach=True): steps on the CPU
    offload fused   the same with AdamW(fused=True): torch's fused CPU kernel

Per run: ms per step split into forward + backward and the optimizer step (a synchronise between
them), and the GPU's peak bytes. Then the step's three parts measured alone on tensors of the
same sizes (Psi / N fp32 elements; N = 1 here): the copy-out (device -> pinned host), the CPU's
AdamW step on them (foreach, fused) and the copy-in (pinned host -> device). offload.py's
timeline: the copy-out is waited for, the CPU step runs with the GPU idle, the copy-in overlaps
the next forward -- so the offloaded step costs about copy-out + CPU step over the device's.
Prints a table, writes bench/results/offload_gpu.json.
"""
import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import write_result  # also puts the repository on sys.path

import nanocolossal as nc  # noqa: E402
import nanocolossal.nn as col_nn  # noqa: E402
from nanocolossal.amp import AMP_TYPE  # noqa: E402
from nanocolossal.config import load_config  # noqa: E402
from nanocolossal.context import gpc  # noqa: E402
from train_gpt import gpt  # noqa: E402

GPT2_SMALL = dict(dim=768, layers=12, heads=12, seq=1024, batch=8, vocab=50304)
CPU_SMALL = dict(dim=64, layers=2, heads=4, seq=64, batch=2, vocab=512)
RUNS = {"device": (None, "fused"), "offload foreach": ("cpu", "foreach"),
        "offload fused": ("cpu", "fused")}
FP16 = {"mode": AMP_TYPE.TORCH, "dtype": "bfloat16"}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def adamw(params, kind: str) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=6e-4, betas=(0.9, 0.95), **{kind: True})


def one_run(name: str, shape: dict, steps: int) -> dict:
    """Train `steps` steps under RUNS[name]; ms of forward + backward and of the step."""
    offload, kind = RUNS[name]
    nc.launch_from_torch(FP16, backend="gloo" if shape is CPU_SMALL else None,
                         allow_single_process=True)
    gpc.config = load_config({"fp16": FP16, "zero": {"level": 2, "offload": offload}})
    torch.manual_seed(0)
    model = gpt(vocab=shape["vocab"], seq_len=shape["seq"], dim=shape["dim"],
                depth=shape["layers"], heads=shape["heads"])
    engine, *_ = nc.initialize(model, adamw(model.parameters(), kind),
                               col_nn.VocabParallelCrossEntropyLoss(), verbose=False)
    tokens = torch.randint(0, shape["vocab"], (steps, shape["batch"], shape["seq"] + 1),
                           generator=torch.Generator().manual_seed(1)).to(gpc.device)
    if gpc.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = {"forward_backward": [], "step": []}
    for i, t in enumerate(tokens):
        sync()
        start = time.perf_counter()
        engine.zero_grad()
        _, _, loss = engine.execute_schedule((t[:, :-1], t[:, 1:]))
        sync()
        middle = time.perf_counter()
        engine.step()
        sync()
        if i >= 2:  # the first steps allocate and warm up
            times["forward_backward"].append((middle - start) * 1e3)
            times["step"].append((time.perf_counter() - middle) * 1e3)
    peak = torch.cuda.max_memory_allocated() if gpc.device.type == "cuda" else None
    gpc.destroy()
    return dict(**{k: statistics.median(v) for k, v in times.items()}, peak_bytes=peak,
                last_loss=float(loss))


def parts_alone(numel: int, repeats: int = 5) -> dict:
    """The step's parts on `numel` fp32 elements: copies each way, AdamW on the CPU."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    on_device = torch.randn(numel, device=device)
    host = torch.empty(numel, pin_memory=cuda)
    master = torch.nn.Parameter(torch.randn(numel))
    master.grad = torch.randn(numel)
    timed = {}

    def clock(name, fn):
        fn()  # warm-up (AdamW: allocates its state)
        sync()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        sync()
        timed[name] = (time.perf_counter() - start) * 1e3 / repeats

    clock("copy_out", lambda: host.copy_(on_device, non_blocking=True))
    for kind in ("foreach", "fused"):
        clock(f"cpu_adamw_{kind}", adamw([master], kind).step)
    clock("copy_in", lambda: on_device.copy_(host, non_blocking=True))
    return timed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu-small", action="store_true", help="a tiny shape on the CPU")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (10; CPU 4)")
    parser.add_argument("--one", choices=sorted(RUNS), help=argparse.SUPPRESS)  # a child
    parser.add_argument("--out", type=str,
                        default=str(Path(__file__).parent / "results" / "offload_gpu.json"))
    args = parser.parse_args()
    small = args.cpu_small or not torch.cuda.is_available()
    shape = CPU_SMALL if small else GPT2_SMALL
    steps = args.steps or (4 if small else 10)
    if small:
        torch.set_num_threads(1)
    if args.one:
        print(json.dumps(one_run(args.one, shape, steps)))
        return
    runs = {}
    for name in RUNS:
        child = [sys.executable, __file__, "--one", name, "--steps", str(steps)]
        out = subprocess.run(child + ["--cpu-small"] * small, check=True, capture_output=True,
                             text=True).stdout
        runs[name] = json.loads(out.strip().splitlines()[-1])
    torch.manual_seed(0)
    numel = sum(p.numel() for p in gpt(vocab=shape["vocab"], seq_len=shape["seq"],
                                       dim=shape["dim"], depth=shape["layers"],
                                       heads=shape["heads"]).parameters())
    parts = parts_alone(numel)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"\nZeRO level 2 on one rank, GPT {shape['dim']} x {shape['layers']} layers "
          f"({numel / 1e6:.1f}M parameters), {shape['batch']} x {shape['seq']} tokens, bf16 O1: "
          f"{device}, median of {steps - 2} steps")
    print(f"  {'':<16} {'fwd+bwd ms':>10} {'step ms':>8} {'total':>7} {'/ device':>8} "
          f"{'peak GiB':>8}")
    base = runs["device"]["forward_backward"] + runs["device"]["step"]
    for name, run in runs.items():
        total = run["forward_backward"] + run["step"]
        run["over_device"] = total / base
        peak = "-" if run["peak_bytes"] is None else f"{run['peak_bytes'] / 2**30:.2f}"
        print(f"  {name:<16} {run['forward_backward']:>10.1f} {run['step']:>8.1f} "
              f"{total:>7.1f} {run['over_device']:>8.2f} {peak:>8}")
    print("  the step's parts alone, ms: " + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()))
    write_result(args.out, dict(benchmark="offload_gpu", device=device, shape=shape,
                                params=numel, steps=steps, runs=runs, parts=parts,
                                torch_version=torch.__version__,
                                date=time.strftime("%Y-%m-%d")))


if __name__ == "__main__":
    main()
