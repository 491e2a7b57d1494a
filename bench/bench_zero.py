"""Benchmark: ZeRO levels 1, 2 and 3, ours vs torch's, with our plain DDP as the reference.

    python bench/bench_zero.py [--ranks 2 --steps 10 --rounds 4 --width 1536 --depth 4 --batch 64]

Starts itself on `--ranks` ranks (gloo, one thread each; 4 ranks on a 2-core machine are
oversubscribed, two processes per core, so their times measure contention as much as ZeRO).
Every variant gets an identical copy of the same MLP (depth x Linear(width) + ReLU, then a
10-way head: 9.46M parameters at the defaults), the same AdamW (lr 1e-3, weight decay 0.01) and
the same batches, and a step is zero_grad, forward, cross-entropy, backward, step:

    ours DDP      nc.initialize with no zero: our DistributedDataParallel (the reference)
    ours ZeRO-1   nc.initialize with zero=dict(level=1): DDP all-reduce, step my shard, all-gather
    torch ZeRO-1  torch DDP + torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)
    ours ZeRO-2   nc.initialize with zero=dict(level=2): gradients reduce-scattered in buckets
    torch FSDP2-keep   fully_shard(reshard_after_forward=False) on each Linear and on the root
                       (keeps the gathered parameters from forward to backward: ZeRO-2-like)
    ours ZeRO-3   nc.initialize with zero=dict(level=3): each Linear a unit, gathered for its
                  forward and its backward, freed after
    torch FSDP2-free   fully_shard(reshard_after_forward=True), the same wrapping (ZeRO-3)

Ours goes through `nc.initialize` and the Engine's five calls (zero_grad, engine(x), criterion,
backward, step); one launch, so before each `initialize` the config's `zero` key is set (through
`load_config`, validated as a config file is). Torch's goes through its own APIs. The variants
take turns in A/B rounds (order reversed every other round) after a warm-up; median step times,
and the ratios ours / torch (goal <= 1.0).

Bytes per rank are counted after the last step from live tensors, each storage once: the
parameters (ours: the padded flat buffer they are views of; FSDP2: the local shards), the
gradients (.grad, and our level 2's shard pieces) and the optimizer state (AdamW's exp_avg and
exp_avg_sq; the scalar `step` left out), and compared exactly with zero/optimizer.py's formulas
(Psi parameters, N ranks, my = the elements of my shard that are parameters, ~Psi/N):

    DDP      4 Psi + 4 Psi + 8 Psi          (+ DDP's buckets, 4 Psi, shown apart)
    ZeRO-1   4 Psi + 4 Psi + 8 my           (+ DDP's buckets)
    ZeRO-2   4 Psi + 4 my  + 8 my           (buckets exist only during backward)
    ZeRO-3   4 Psi/N + 4 my + 8 my          (Psi/N: the padded shard of each unit's buffer,
                                             + 4 bytes: the NaN element freed parameters share)

Torch's are shown beside: ZeroRedundancyOptimizer shards by whole parameters (its state is 8 x
the elements of the parameters it was given, so only as even as the sizes allow), and torch
DDP's buckets live in C++, not countable here (also 4 Psi by default). FSDP2 frees its gathered
parameters at the end of backward even with reshard_after_forward=False (the flag only keeps
them from forward to backward), so after a step FSDP2-keep holds only its shards, 16 Psi / N, as
ZeRO-3 does at rest; its parameters are whole only during forward and backward, where ZeRO-2
keeps them whole throughout. To show that, one untimed step per variant counts the parameter
bytes held between forward and backward (after the root's forward: a ZeRO-3 / FSDP2-free unit
is freed after its forward, so there only shards remain).

Finally every variant took the same steps on the same data from the same weights, so the
parameters must agree, and the bench asserts it (max |difference| <= 1e-5; all reported):
ours ZeRO-1/2 against our DDP always (the same buckets add the ranks' gradients in the same
order: 0.0), every other pair after the warm-up steps and, on 2 ranks, after all the timed steps
too. On 4 ranks torch's buckets (and our level 3's units) differ from our DDP's, so gloo's ring
adds the 4 gradients of an element in
another order: differences of one ulp (1e-10 in a gradient; < 1e-6 in the parameters after
the warm-up), which AdamW (dividing by sqrt(v), sensitive where a gradient is near eps) and ReLU
(a unit switching on or off) amplify step by step: after 43 steps the largest element differences
are of the order of the parameters' own movement (measured: 2e-2), between torch's ZeRO-1 and
FSDP2 as much as between either and ours, so it is the order of a sum, not an implementation.
That is reported, not asserted; on 2 ranks a + b is the same sum either way and every pair
agrees exactly.

Traffic: the elements each of our variants hands to collectives in one step are counted
(nanocolossal.traffic) and turned into what a ring sends per rank, in units of Psi (N-1)/N: the
ZeRO paper's 2 for DDP, 3 for levels 1 and 2 here (level 2's buckets are not cut on shard
boundaries, so it all-reduces; a reduce-scatter would make it a 2), 4 for level 3 (on gloo an
all-reduce stands in for each unit's reduce-scatter, faster there; on NCCL the paper's 3).

Prints a table and writes bench/results/zero.json (zero_4.json on 4 ranks).
"""
import argparse
import copy
import math
import os
import platform
import statistics
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from common import run_on_ranks, write_result  # also puts the repository on sys.path
from torch import nn

import nanocolossal as nc  # noqa: E402
from nanocolossal.config import load_config  # noqa: E402
from nanocolossal.context import gpc  # noqa: E402
from nanocolossal.traffic import count_collectives, ring_elements  # noqa: E402

LR, WEIGHT_DECAY = 1e-3, 0.01
TOLERANCE = 1e-5  # max |param ours - param torch| after the timed steps


def mlp(width: int, depth: int) -> nn.Module:
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def adamw(params) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)


class Variant:
    """One implementation: how it steps, and which tensors it holds."""

    def __init__(self, name: str, step, model: nn.Module, optimizers: list, extra_grads=(),
                 buckets=None, fsdp: bool = False, extra_params=None) -> None:
        self.name, self.step, self.model, self.optimizers = name, step, model, optimizers
        self.extra_grads = extra_grads  # callable: more gradient tensors (our level 2's pieces)
        self.buckets = buckets  # callable: DDP's bucket buffers (ours only)
        self.fsdp = fsdp
        self.extra_params = extra_params  # callable: our optimizer's parameters (level 3: shards)


def ours(base: nn.Module, level: int) -> Variant:
    """nc.initialize with zero=dict(level=level) (0: no zero: our DDP)."""
    gpc.config = load_config({"zero": {"level": level}} if level else {})
    model = copy.deepcopy(base)
    engine, *_ = nc.initialize(model, adamw(model.parameters()), nn.CrossEntropyLoss(),
                               verbose=False)

    def step(x, y):
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))
        engine.step()

    inner = engine.optimizer.optimizer  # the torch AdamW (ours at level 1-2: over my segments)
    def extra_params():
        return [p for g in inner.param_groups for p in g["params"]]

    def extra_grads():
        return [p.grad for g in inner.param_groups for p in g["params"] if p.grad is not None]

    def buckets():
        return [b.buffer for b in getattr(engine.forward_module, "buckets", [])
                if b.buffer is not None]
    name = f"ours ZeRO-{level}" if level else "ours DDP"
    return Variant(name, step, engine.model, [inner], extra_grads, buckets,
                   extra_params=extra_params)


def torch_zero1(base: nn.Module) -> Variant:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    model = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR,
                                  weight_decay=WEIGHT_DECAY)
    return Variant("torch ZeRO-1", plain_step(model, opt), model.module, [opt.optim])


def torch_fsdp2(base: nn.Module, reshard_after_forward: bool) -> Variant:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (gpc.world_size,))
    model = copy.deepcopy(base)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    opt = adamw(model.parameters())
    name = f"torch FSDP2-{'free' if reshard_after_forward else 'keep'}"
    return Variant(name, plain_step(model, opt), model, [opt], fsdp=True)


def plain_step(model: nn.Module, opt):
    def step(x, y):
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return step


def local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)  # a DTensor's shard on this rank


def storage_bytes(tensors, seen: set) -> int:
    """Bytes of the storages behind `tensors`, each storage counted once (across calls too)."""
    total = 0
    for t in tensors:
        s = local(t).untyped_storage()
        if s.data_ptr() not in seen and s.nbytes():
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def held_bytes(v: Variant) -> dict:
    """What this rank holds after a step, from live tensors."""
    seen: set = set()
    params = list(v.model.parameters())
    out = {"params": storage_bytes(params + (v.extra_params() if v.extra_params else []), seen)}
    grads = [p.grad for p in params if p.grad is not None]
    out["grads"] = storage_bytes(grads + (v.extra_grads() if v.extra_grads else []), seen)
    out["state"] = storage_bytes([t for o in v.optimizers for s in o.state.values()
                                  for k, t in s.items() if k != "step" and torch.is_tensor(t)],
                                 seen)
    out["total"] = out["params"] + out["grads"] + out["state"]
    out["buckets"] = storage_bytes(v.buckets(), seen) if v.buckets else None
    return out


def unsharded_param_bytes(v: Variant, x, y) -> int:
    """Parameter bytes held between forward and backward (FSDP2's gathered parameters are in
    its private FSDPParam objects; ours are the parameters themselves)."""
    holder = {}

    def count(module, inputs, output):
        seen: set = set()
        total = storage_bytes(list(v.model.parameters()) +
                              (v.extra_params() if v.extra_params else []), seen)
        if v.fsdp:
            for m in v.model.modules():
                state = m._get_fsdp_state() if hasattr(m, "_get_fsdp_state") else None
                group = getattr(state, "_fsdp_param_group", None)
                for fp in getattr(group, "fsdp_params", []):
                    total += storage_bytes([fp.sharded_param], seen)
                    total += storage_bytes(getattr(fp, "all_gather_outputs", []), seen)
                    unsharded = getattr(fp, "_unsharded_param", None)
                    if unsharded is not None:
                        total += storage_bytes([unsharded], seen)
        holder["bytes"] = total
    handle = v.model.register_forward_hook(count)  # after the root's forward, before backward
    v.step(x, y)
    handle.remove()
    return holder["bytes"]


def full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()


def param_diffs(variants: list[Variant], pairs: list) -> dict:
    """max |p - q| over all parameters, for each pair that must agree."""
    # (state_dict: our level 3 gathers its units there, FSDP2 gives DTensors; both collective)
    params = {v.name: [full(t) for t in v.model.state_dict().values()] for v in variants}
    def max_diff(a, b):
        return max((p - q).abs().max().item() for p, q in zip(params[a], params[b]))
    return {f"{a} vs {b}": max_diff(a, b) for a, b in
            pairs + [("ours ZeRO-1", "ours DDP"), ("ours ZeRO-2", "ours DDP"),
                     ("ours ZeRO-3", "ours DDP"), ("torch ZeRO-1", "ours DDP"),
                     ("torch FSDP2-keep", "ours DDP"), ("torch FSDP2-free", "ours DDP"),
                     ("torch FSDP2-keep", "torch ZeRO-1")]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2, help="ranks to start")
    parser.add_argument("--steps", type=int, default=10,
                        help="timed steps per round per implementation")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--width", type=int, default=1536)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64, help="per rank")
    parser.add_argument("--out", type=str, default=None,
                        help="default bench/results/zero.json (zero_4.json on 4 ranks)")
    args = parser.parse_args()

    torch.set_num_threads(1)
    nc.launch_from_torch({}, backend="gloo")
    N, rank = gpc.world_size, gpc.rank
    torch.manual_seed(0)
    base = mlp(args.width, args.depth)
    psi = sum(p.numel() for p in base.parameters())
    variants = [ours(base, 0), ours(base, 1),
                torch_zero1(base), ours(base, 2), torch_fsdp2(base, reshard_after_forward=False),
                ours(base, 3), torch_fsdp2(base, reshard_after_forward=True)]
    pairs = [("ours ZeRO-1", "torch ZeRO-1"), ("ours ZeRO-2", "torch FSDP2-keep"),
             ("ours ZeRO-3", "torch FSDP2-free")]

    g = torch.Generator().manual_seed(1 + rank)
    def batches(n):
        return [(torch.randn(args.batch, args.width, generator=g),
                 torch.randint(0, 10, (args.batch,), generator=g)) for _ in range(n)]

    for x, y in batches(args.warmup):
        for v in variants:
            v.step(x, y)
    x, y = batches(1)[0]  # one untimed step each: parameter bytes held during the step
    during, traffic = {}, {}
    for v in variants:  # ... and the elements that step handed to collectives (ours: all of them)
        with count_collectives() as counted:
            during[v.name] = unsharded_param_bytes(v, x, y)
        traffic[v.name] = dict(counted)
    early = param_diffs(variants, pairs)  # after warmup + 1 steps
    times = {v.name: [] for v in variants}
    for r in range(args.rounds):
        data = batches(args.steps)
        for v in (variants if r % 2 == 0 else list(reversed(variants))):
            dist.barrier()
            for x, y in data:
                start = time.perf_counter()
                v.step(x, y)
                times[v.name].append(time.perf_counter() - start)

    held = {v.name: held_bytes(v) for v in variants}
    # the formulas (zero/optimizer.py): flat buffer padded to N equal shards, my shard's elements
    shard = math.ceil(psi / N)
    my = max(0, min(psi, (rank + 1) * shard) - rank * shard)
    units = [p.numel() + layer.bias.numel() for layer in base if isinstance(layer, nn.Linear)
             for p in [layer.weight]]  # level 3: one flat buffer per unit (each Linear)
    shards = [math.ceil(u / N) for u in units]
    mine = [max(0, min(u, (rank + 1) * s) - rank * s) for u, s in zip(units, shards)]
    formula = {"ours DDP": dict(params=4 * psi, grads=4 * psi, state=8 * psi),
               "ours ZeRO-1": dict(params=4 * shard * N, grads=4 * psi, state=8 * my),
               "ours ZeRO-2": dict(params=4 * shard * N, grads=4 * my, state=8 * my),
               "ours ZeRO-3": dict(params=4 * sum(shards) + 4, grads=4 * sum(mine),
                                   state=8 * sum(mine))}
    for name, f in formula.items():
        got = {k: held[name][k] for k in f}
        assert got == f, f"[rank {rank}] {name}: held {got}, formula {f}"

    # same weights, same data, same steps: the same parameters
    diffs = param_diffs(variants, pairs)
    exact = ["ours ZeRO-1 vs ours DDP", "ours ZeRO-2 vs ours DDP"]  # DDP's buckets, same order
    # the others (level 3 reduces per unit): asserted after the timed steps on 2 ranks (a + b is
    # the same sum in either order), after the first steps only on more (see the docstring)
    checked = {label: d for label, d in diffs.items() if label in exact or N == 2}
    bad = {label: f"{d:.2e}" for label, d in {**early, **checked}.items()
           if not d <= TOLERANCE}  # (NaN too)
    assert not bad, f"[rank {rank}] parameters differ: {bad} (all: {diffs}, early: {early})"
    params = {v.name: [full(t) for t in v.model.state_dict().values()] for v in variants}
    moved = max((p - q).abs().max().item() for p, q in zip(params["ours DDP"],
                                                            base.parameters()))
    assert moved > 100 * TOLERANCE, f"[rank {rank}] the parameters barely moved: {moved:.2e}"

    everyone = [None] * N
    dist.all_gather_object(everyone, {"held": held, "during": during})
    if rank == 0:
        med = {k: statistics.median(t) * 1e3 for k, t in times.items()}
        ratios = {f"{a} / {b}": round(med[a] / med[b], 3) for a, b in pairs}
        ratios["ours ZeRO-1 / ours DDP"] = round(med["ours ZeRO-1"] / med["ours DDP"], 3)
        ratios["ours ZeRO-2 / ours DDP"] = round(med["ours ZeRO-2"] / med["ours DDP"], 3)
        ratios["ours ZeRO-3 / ours DDP"] = round(med["ours ZeRO-3"] / med["ours DDP"], 3)
        # what a ring sends per rank, in units of the paper's Psi (N-1)/N (DDP: 2)
        sent = {k: round(ring_elements(Counter(c), N) / (psi * (N - 1) / N), 3)
                for k, c in traffic.items() if k.startswith("ours")}
        result = dict(
            benchmark="zero", world_size=N, backend=gpc.backend, threads_per_rank=1,
            oversubscribed=N > (os.cpu_count() or 1),
            model=f"MLP {args.depth}x Linear({args.width}) + head", params=psi,
            optimizer=f"AdamW lr={LR} weight_decay={WEIGHT_DECAY}", batch_per_rank=args.batch,
            steps_timed=len(times["ours DDP"]),
            step_ms={k: round(v, 2) for k, v in med.items()}, ratios=ratios,
            bytes_per_rank=[e["held"] for e in everyone],
            param_bytes_during_step=[e["during"] for e in everyone],
            formula_rank0={k: {**f, "total": sum(f.values())} for k, f in formula.items()},
            collective_elements_per_step=traffic, ring_sent_per_rank_in_psi=sent,
            max_param_diff=diffs, max_param_diff_after_first_steps=early,
            steps_before_first_check=args.warmup + 1, max_param_moved_from_start=moved,
            torch_version=torch.__version__, machine=platform.machine(), cpus=os.cpu_count(),
            date=time.strftime("%Y-%m-%d"))
        mb = 1 / 2**20
        print(f"\nZeRO benchmark: {result['model']}, {psi / 1e6:.2f}M params, AdamW, batch "
              f"{args.batch}/rank, {N} gloo ranks x 1 thread"
              f"{' (oversubscribed: more ranks than cores)' if result['oversubscribed'] else ''}, "
              f"{result['steps_timed']} timed steps each")
        print(f"  {'':<16} {'step ms':>8} {'params MiB':>11} {'grads MiB':>10} {'state MiB':>10}"
              f" {'total MiB':>10} {'formula':>8} {'buckets':>8} {'params in step':>15}")
        for v in variants:
            h, f = held[v.name], formula.get(v.name)
            f_text = f"{sum(f.values()) * mb:.1f}" if f else "-"
            b_text = (f"{h['buckets'] * mb:.1f}" if h["buckets"] is not None
                      else "-" if v.fsdp else "C++")
            print(f"  {v.name:<16} {med[v.name]:>8.1f} {h['params'] * mb:>11.1f} "
                  f"{h['grads'] * mb:>10.1f} {h['state'] * mb:>10.1f} {h['total'] * mb:>10.1f} "
                  f"{f_text:>8} {b_text:>8} {during[v.name] * mb:>15.1f}")
        for label, value in ratios.items():
            print(f"  step time {label:<34} {value:.3f}")
        print(f"  max |param diff| after {args.warmup + 1} steps / after all "
              f"{args.warmup + 1 + result['steps_timed']}:")
        for label, d in diffs.items():
            print(f"    {label:<34} {early[label]:.1e} / {d:.1e}")
        print(f"  max |param - start| (ours DDP): {moved:.1e}")
        print("  elements handed to collectives in one step (counted) -> a ring sends per rank:")
        for name, multiple in sent.items():
            shown = ", ".join(f"{k} {n / 1e6:.2f}M" for k, n in sorted(traffic[name].items()))
            print(f"    {name:<14} {shown:<42} {multiple:.2f} Psi (N-1)/N")
        print("  (torch's DDP and FSDP2 collectives run in C++ or by other names: not counted)")
        print("  (bytes of rank 0 after a step; every rank's in the JSON; ours equal the "
              "formulas on every rank, asserted)")
        default = "zero.json" if N == 2 else f"zero_{N}.json"
        write_result(args.out or str(Path(__file__).parent / "results" / default), result)
    gpc.destroy()


if __name__ == "__main__":
    import sys
    nproc = 2
    if "--ranks" in sys.argv:
        nproc = int(sys.argv[sys.argv.index("--ranks") + 1])
    run_on_ranks(main, __file__, nproc=nproc, port=29515)
