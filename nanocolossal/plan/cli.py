"""`nanocolossal plan`: will it fit? Bytes per rank, traffic per step and the bubble of a layout,
before launch -- no process started, no GPU needed.

    nanocolossal plan --config configs/gpt.py --world 2
    nanocolossal plan --dim 768 --layers 12 --heads 12 --seq 1024 --vocab 50304 --batch 8 --world 8
    nanocolossal plan --config configs/gpt.py --world 8 --memory 24GiB --search
    nanocolossal plan --config configs/gpt.py --world 2 --json        (or --explain)

The first layout is the config's own; --search adds every layout of the same ranks the model
allows, those that fit in --memory, sorted by traffic, then bubble. Not modelled: the allocator's
fragmentation, CUDA workspaces, NCCL buffers, transient tensors (a gradient in flight).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import replace
from functools import partial
from typing import Any, Optional, Sequence

from ..config import ConfigError
from .formulas import COLLECTIVES, TEACHES, Layout
from .layouts import load, read, search
from .model import GPT
from .ranks import Rank, plan_layout

BYTES = ("parameters", "gradients", "optimizer", "masters", "activations", "logits", "routing",
         "cpu", "total")
UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10,
         "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(text: str) -> int:
    """'80GiB', '24 GB', '1e9' -> bytes."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in UNITS:
        raise ConfigError(f"--memory {text!r}: write a number and a unit, e.g. 80GiB or 24GB")
    return int(float(match.group(1)) * UNITS[match.group(2).upper()])


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nanocolossal plan", description=__doc__.split("\n")[0])
    p.add_argument("--config", help="a config file as the scripts take it (configs/gpt.py)")
    p.add_argument("--world", type=int, default=None, help="ranks (default: the config's size)")
    p.add_argument("--memory", type=str, default=None, help="per-rank memory, e.g. 80GiB")
    p.add_argument("--search", action="store_true", help="every layout of --world ranks")
    p.add_argument("--json", action="store_true", help="the plan as data")
    p.add_argument("--explain", action="store_true", help="each term's formula and its file")
    p.add_argument("--top", type=int, default=25, help="--search: lines shown (0: all)")
    for flag, key in (("dim", "DIM"), ("layers", "DEPTH"), ("heads", "HEADS"), ("seq", "SEQ_LEN"),
                      ("vocab", "VOCAB"), ("batch", "BATCH_SIZE"), ("mlp-ratio", "MLP_RATIO"),
                      ("experts", "NUM_EXPERTS"), ("micro-batches", "NUM_MICRO_BATCHES")):
        p.add_argument(f"--{flag}", type=int, default=None, dest=key, help=f"overrides {key}")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default=None, dest="OPTIMIZER")
    p.add_argument("--model", help="a custom model, MODULE:FUNCTION returning it (measure.py)")
    p.add_argument("--input", help="--model's micro-batch on one rank, e.g. 32x3x224x224 or "
                                   "8x1024:int64")
    return p


def to_json(m: Any, layouts: list[tuple[Layout, list[Rank]]]) -> dict:
    model = vars(m) if isinstance(m, GPT) else {"name": m.name, "shape": m.shape, "parameters":
                                                  sum(t.numel for t in m.tensors)}
    return {"model": model, "layouts": [
        {"layout": lay.describe(), "ranks": [
            {"kind": r.kind, "bytes": r.bytes, "elements": r.elements, "bubble": r.bubble}
            for r in ranks]} for lay, ranks in layouts]}


def show_layout(m: Any, lay: Layout, ranks: list[Rank], memory: Optional[int]) -> str:
    d = lay.describe()
    shown = [k for k, v in d.items() if v is True or v not in (None, False, 1, 0)]
    head = ", ".join(f"{k} {d[k]}" for k in d if k in shown or k in ("world", "data"))
    experts = getattr(m, "experts", 0)
    model = m.describe() if not isinstance(m, GPT) else (
        f"model: GPT dim {m.dim}, {m.depth} blocks, {m.heads} heads, seq {m.seq}, vocab "
        f"{m.vocab}" + (f", {experts} experts" if experts else ""))
    lines = [f"{model}; batch {lay.batch} per data rank; {lay.optimizer}",
             f"layout: {head}", ""]
    width = max(len(r.kind) for r in ranks) + 2
    shown = [k for k in BYTES if k != "routing" or experts]
    lines.append("bytes".ljust(width) + "".join(f"{k:>13}" for k in shown))
    for r in ranks:
        lines.append(r.kind.ljust(width) + "".join(f"{human(r.bytes[k]):>13}" for k in shown))
    lines += ["", "elements/step".ljust(width) + "".join(f"{k:>15}" for k in COLLECTIVES) +
              "   ring sends/rank   bubble"]
    for r in ranks:
        lines.append(r.kind.ljust(width) + "".join(f"{r.elements[k]:>15,}" for k in COLLECTIVES)
                     + f"{ring_sends(lay, r):>18,.0f}   {r.bubble:.1%}")
    if memory:
        worst = max(r.bytes["total"] for r in ranks)
        lines.append(f"\n{'fits' if worst <= memory else 'does NOT fit'}: the fullest rank "
                     f"holds {human(worst)} of {human(memory)}")
    lines.append("not modelled: allocator fragmentation, CUDA workspaces, NCCL buffers")
    return "\n".join(lines)


def ring_sends(lay: Layout, r: Rank) -> float:
    """About the elements a rank sends if every collective runs as a ring (traffic.py's
    ring_elements) -- an estimate, for sorting: every group taken as the larger of the data and
    the tensor ranks (each collective's own group would be exact; the elements per collective
    above are)."""
    N = max(lay.data, lay.tensor, 2)
    share = (N - 1) / N
    e = r.elements
    return (2 * e["all_reduce"] + e["all_gather"] + e["reduce_scatter"]) * share + e["p2p"] + \
        e["all_to_all"] * share


def show_search(results: list[tuple[Layout, list[Rank]]], memory: Optional[int],
                top: int) -> str:
    rows = []
    for lay, ranks in results:
        worst = max(r.bytes["total"] for r in ranks)
        if memory and worst > memory:
            continue
        sends = max(ring_sends(lay, r) for r in ranks)
        rows.append((sends, ranks[0].bubble, worst, lay))
    rows.sort(key=lambda row: (row[0], row[1], row[2]))
    shown = rows[:top] if top else rows
    out = [f"{len(rows)} of {len(results)} layouts fit" + (f" in {human(memory)}" if memory
                                                           else "") +
           (f"; the {len(shown)} with the least traffic:" if shown else ""),
           f"{'data':>5} {'pipe':>4} {'tensor':>11} {'zero':>4} {'offload':>7} {'ckpt':>5} "
           f"{'schedule':>11} {'M':>3} {'memory':>10} {'sends/rank':>14} {'bubble':>7}"]
    for sends, bubble, worst, lay in shown:
        tensor = f"{lay.mode} {lay.tensor}" if lay.mode else "-"
        out.append(f"{lay.data:>5} {lay.pipeline:>4} {tensor:>11} {lay.zero:>4} "
                   f"{'cpu' if lay.offload else '-':>7} {lay.checkpoint or '-':>5} "
                   f"{lay.schedule if lay.pipeline > 1 else '-':>11} "
                   f"{lay.micro_batches if lay.pipeline > 1 else '-':>3} {human(worst):>10} "
                   f"{sends:>14,.0f} {bubble:>7.1%}")
    return "\n".join(out)


def explain() -> str:
    from . import activations, formulas, traffic
    parts = ["Each term, its formula, and the file whose docstring teaches it.", ""]
    parts += [f"  {term:<15} {where}" for term, where in TEACHES.items()]
    for module in (formulas, traffic, activations):
        parts += ["", f"-- {module.__name__} " + "-" * 40, module.__doc__.strip()]
    return "\n".join(parts)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plan"]:
        argv = argv[1:]
    args = build_parser().parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if k.isupper() and v is not None}
    try:
        memory = parse_bytes(args.memory) if args.memory else None
        world = args.world
        if world is None:
            from ..config import parallel_settings
            P, T, *_ = parallel_settings(read(args.config))
            world = P * T
        if world < 1:
            raise ConfigError(f"--world must be a positive number of ranks, got {world}")
        if args.model:  # a custom nn.Module, measured on the meta device: the only torch here
            from .measure import load_measured, plan_measured, search_measured
            try:
                m, lay = load_measured(args.model, args.input or "", args.config, world,
                                       **overrides)
            except (ConfigError, ValueError):
                raise
            except Exception as e:  # the user's code, run on the meta device
                raise ConfigError(f"--model {args.model} --input {args.input}: one forward and "
                                  f"backward on the meta device failed ({type(e).__name__}: "
                                  f"{e}); it must build with no arguments and take that "
                                  f"input") from None
            planned, others = partial(plan_measured, m), search_measured(lay)
        else:
            m, lay = load(args.config, world, **overrides)
            planned, others = partial(plan_layout, m), search(m, lay)
        results = [(lay, planned(lay))]
        if args.search:
            results += [(other, planned(other)) for other in others if other != lay]
    except (ConfigError, ValueError, OSError) as e:
        print(f"nanocolossal plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(to_json(m, results), indent=1))
        return 0
    if args.explain:
        print(explain() + "\n")
    print(show_layout(m, lay, results[0][1], memory))
    if args.search:
        print("\n" + show_search(results, memory, args.top))
    return 0


def replace_layout(lay: Layout, **changes) -> Layout:
    return replace(lay, **changes)


if __name__ == "__main__":
    sys.exit(main())
