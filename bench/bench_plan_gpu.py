"""Benchmark: `nanocolossal plan`'s bytes for one GPU against torch.cuda.max_memory_allocated().

    python bench/bench_plan_gpu.py [--cpu-small] [--out bench/results/plan_gpu.json]

GPT-2 small (dim 768, 12 layers, 12 heads, sequence 1024, vocabulary 50304; --cpu-small: 64, 2,
4, 64, 512) on one device through nc.launch, nc.initialize and the Engine: bf16 O1
(fp16=dict(mode='torch', dtype='bfloat16')), fused AdamW, no clipping; batch 8 and 32 (--cpu-small
2 and 4), ACTIVATION_CHECKPOINT off and 'full': four runs of 3 steps each. Per run:

    states      the bytes allocated after a step (parameters, gradients, AdamW's two states)
                against the plan's parameters + gradients + optimizer + masters
    peak        the most allocated at once over the steps against the plan's total (states,
                activations at the peak, logits)
    ratio       peak / plan total; what the difference is: everything the plan does not model,
                the transient tensors of a backward (an activation's gradient, the logits'
                gradient, autocast's bf16 copies of the weights), CUDA workspaces, the
                allocator's rounding to 512-byte blocks

On a GPU the allocator counts (torch.cuda.memory_allocated / max_memory_allocated, reset after the
build). Without one (--cpu-small, what CI runs) the same figures come from live tensors: states
from the parameters, their gradients and the optimizer's state; the peak as states + memory.py's
SavedBytes peak, which is what the plan models and nothing transient -- the code path, no claim.
Prints a table and writes bench/results/plan_gpu.json.
"""
import argparse
import socket

import torch
from common import write_result  # also puts the repository on sys.path

import nanocolossal as nc  # noqa: E402
import nanocolossal.nn as col_nn  # noqa: E402
from nanocolossal.memory import SavedBytes  # noqa: E402
from nanocolossal.plan.layouts import load  # noqa: E402
from nanocolossal.plan.ranks import plan_rank  # noqa: E402
from train_gpt import gpt  # noqa: E402

GPT2_SMALL = dict(VOCAB=50304, SEQ_LEN=1024, DIM=768, DEPTH=12, HEADS=12, MLP_RATIO=4)
CPU_SMALL = dict(VOCAB=512, SEQ_LEN=64, DIM=64, DEPTH=2, HEADS=4, MLP_RATIO=4)
STATES = ("parameters", "gradients", "optimizer", "masters")


def config(shape: dict, batch: int, checkpoint) -> dict:
    return {**shape, "BATCH_SIZE": batch, "ACTIVATION_CHECKPOINT": checkpoint,
            "OPTIMIZER": "adamw", "fp16": {"mode": "torch", "dtype": "bfloat16"}}


def live_states(model: torch.nn.Module, optimizer) -> int:
    """Bytes of the parameters, their gradients and the optimizer's state tensors."""
    tensors = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None)]
    tensors += [t for state in optimizer.optimizer.state.values() for t in state.values()
                if isinstance(t, torch.Tensor)]
    return sum(t.untyped_storage().nbytes() for t in tensors)


def measure(cfg: dict, cuda: bool) -> dict:
    """3 steps of train_gpt's GPT under `cfg` on one rank: (states, peak) bytes."""
    nc.launch({k: v for k, v in cfg.items() if k in ("fp16", "ACTIVATION_CHECKPOINT")},
              rank=0, world_size=1, host="127.0.0.1", port=free_port(),
              backend="nccl" if cuda else "gloo")
    torch.manual_seed(0)
    model = gpt(vocab=cfg["VOCAB"], seq_len=cfg["SEQ_LEN"], dim=cfg["DIM"], depth=cfg["DEPTH"],
                heads=cfg["HEADS"])
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    engine, *_ = nc.initialize(model, adamw, col_nn.VocabParallelCrossEntropyLoss(),
                               verbose=False)
    shape = (cfg["BATCH_SIZE"], cfg["SEQ_LEN"])
    ids = torch.randint(0, cfg["VOCAB"], shape, device=nc.gpc.device)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    peak = 0
    for _ in range(3):
        with SavedBytes(engine.model.parameters()) as saved:
            engine.zero_grad()
            engine.execute_schedule((ids, ids))
            engine.step()
        states = torch.cuda.memory_allocated() if cuda else live_states(model, engine.optimizer)
        peak = torch.cuda.max_memory_allocated() if cuda else max(peak, states + saved.peak)
    nc.gpc.destroy()
    return {"states": states, "peak": peak}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-small", action="store_true", help="tiny shape on the CPU")
    parser.add_argument("--out", default="bench/results/plan_gpu.json")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.cpu_small
    shape, batches = (GPT2_SMALL, (8, 32)) if cuda else (CPU_SMALL, (2, 4))
    runs = []
    print(f"{'batch':>5} {'checkpoint':>10} {'plan states':>12} {'live':>12} {'plan total':>12} "
          f"{'peak':>12} {'peak/plan':>9}")
    for batch in batches:
        for checkpoint in (None, "full"):
            cfg = config(shape, batch, checkpoint)
            model, layout = load(cfg, 1)
            plan = plan_rank(model, layout, 0).bytes
            got = measure(cfg, cuda)
            run = {"batch": batch, "checkpoint": checkpoint, "plan": plan, **got,
                   "plan_states": sum(plan[k] for k in STATES),
                   "ratio": got["peak"] / plan["total"]}
            runs.append(run)
            print(f"{batch:>5} {str(checkpoint):>10} {run['plan_states']:>12,} "
                  f"{got['states']:>12,} {plan['total']:>12,} {got['peak']:>12,} "
                  f"{run['ratio']:>9.3f}")
    device = torch.cuda.get_device_name() if cuda else "cpu"
    write_result(args.out, {"benchmark": "plan_gpu", "device": device, "shape": shape,
                            "runs": runs})


if __name__ == "__main__":
    main()
