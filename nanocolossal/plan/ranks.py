"""The plan of each kind of rank: its bytes (formulas.py, activations.py), the elements it hands
to collectives per step (traffic.py) and its pipeline's bubble (pipeline/simulate.py)."""
from __future__ import annotations

from dataclasses import dataclass

from .activations import activation_bytes, routing_bytes
from .formulas import Layout, model_states
from .model import GPT, rank_tensors, stage_layers
from .traffic import traffic


@dataclass
class Rank:
    """One kind of rank: where it sits, and what the formulas give it."""
    kind: str
    pipeline_rank: int
    bytes: dict
    elements: dict
    bubble: float


def rank_kinds(m: GPT, lay: Layout) -> list[tuple[str, int]]:
    """(kind, pipeline rank): first, middle and last stage where they differ."""
    P = lay.pipeline
    if P == 1:
        return [("every rank", 0)]
    kinds = [("first stage", 0)]
    if P > 2:
        kinds.append(("middle stage", 1))
    return kinds + [("last stage", P - 1)]


def plan_layout(m: GPT, lay: Layout) -> list[Rank]:
    """Every rank kind's bytes, elements per step and bubble."""
    return [plan_rank(m, lay, p, kind) for kind, p in rank_kinds(m, lay)]


def plan_rank(m: GPT, lay: Layout, p: int, kind: str = "", data_rank: int = 0) -> Rank:
    """Pipeline rank p's (data rank `data_rank`'s: ZeRO's last shards are shorter) plan."""
    chunks = stage_layers(m, lay.pipeline, lay.chunks, p, lay.v_shape)
    layers = tuple(layer for c in chunks for layer in c)
    ts = rank_tensors(m, layers, lay.mode, lay.tensor, lay.depth, lay.ep)
    b = model_states(ts, lay, data_rank)
    b["activations"], b["logits"] = activation_bytes(m, lay, p, chunks)
    b["routing"] = routing_bytes(m, lay, layers)
    b["total"] = sum(v for k, v in b.items() if k != "cpu")
    return Rank(kind, p, b, traffic(m, lay, p, chunks, ts), pipeline_bubble(lay))


def pipeline_bubble(lay: Layout) -> float:
    """simulate.py's bubble_formula for the layout's schedule (0 without a pipeline)."""
    if lay.pipeline == 1:
        return 0.0
    from ..pipeline.simulate import bubble_formula
    return bubble_formula(lay.schedule, lay.pipeline, lay.micro_batches, lay.chunks)
