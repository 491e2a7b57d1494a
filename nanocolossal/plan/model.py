"""What the planner knows of a model: train_gpt.py's GPT as a list of parameter tensors, each with
the rule that cuts it over the tensor ranks, and the stage and ZeRO-3 unit it belongs to.

    layer 0        Embeddings: tok (V x D, vocab-parallel, tied to the head), pos (S x D)
    layers 1..L    Block: norm1 (D, D), qkv (3D x D + 3D, column), proj (D x D + D, row),
                   norm2 (D, D), fc1 (rD x D + rD, column), fc2 (D x rD + D, row)
    layer L + 1    LMHead: norm (D, D); the classifier *is* tok (no tensor of its own)

How each tensor mode cuts them (elements on one tensor rank; q the grid's side, T the group):

    tensor        none, sequence   1d            2d, 2.5d         3d
    tok  V x D    V D              V/T D         V/q D/q          V/q D/q^2
    pos  S x D    S D              S D/T         S D/q            S D/q
    norm D        D                D             D/q              D/q
    Linear o x i  o i              o/T i (col)   o/q i/q          o/q i/q^2
                                   o i/T (row)
    bias o        o                o/T (col)     o/q              o/q
                                   o (row)

(nn/layers.py picks the layer, tensor/layers_1d.py, layers_2d.py, layers_3d.py and
vocab_parallel.py teach the splits.) A weight two stages share (tok, on the first and the last
stage) is held by both: pipeline/tied.py. Every other block's MLP is an MoE layer with E experts
(moe/): a router (E x D) and E / EP expert MLPs per rank.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from ..pipeline.steps import uniform_sizes, virtual_stage


@dataclass(frozen=True)
class GPT:
    """train_gpt.py's gpt(...) sizes; `experts` 0: no MoE layers."""
    vocab: int = 256
    seq: int = 64
    dim: int = 128
    depth: int = 4
    heads: int = 4
    mlp_ratio: int = 4
    experts: int = 0
    top_k: int = 1
    capacity: float = 1.25
    attention: str = "fused"

    @property
    def layers(self) -> int:
        return self.depth + 2

    def is_moe(self, block: int) -> bool:
        """Blocks 1, 3, ... (0-based: the 2nd, 4th) hold experts, as train_gpt.gpt builds them."""
        return bool(self.experts) and block % 2 == 1


@dataclass(frozen=True)
class Tensor:
    """One parameter on one rank: its name, elements, the layer (Sequential index) and ZeRO-3
    unit it lives in, and whether it is an expert's (reduced over the expert's data ranks)."""
    name: str
    numel: int
    layer: int
    unit: str
    expert: bool = False
    fp32_under_o2: bool = False  # LayerNorm: amp.py keeps it fp32 under O2


def grid(mode: Optional[str], T: int, depth: int = 1) -> int:
    """The side q of the grid (2d, 2.5d) or cube (3d); T for 1d, 1 otherwise."""
    if mode == "2d":
        return math.isqrt(T)
    if mode == "2.5d":
        return math.isqrt(T // depth)
    if mode == "3d":
        return round(T ** (1 / 3))
    return T if mode == "1d" else 1


def _linear(out: int, inp: int, mode: Optional[str], q: int, side: str) -> tuple[int, int]:
    """(weight, bias) elements of a Linear(inp -> out) on one tensor rank (the table above)."""
    if mode == "1d":
        return (out // q * inp, out // q) if side == "col" else (out * (inp // q), out)
    if mode in ("2d", "2.5d"):
        return out // q * (inp // q), out // q
    if mode == "3d":
        return out // q * (inp // q // q), out // q
    return out * inp, out


@lru_cache(maxsize=512)
def tensors(m: GPT, mode: Optional[str] = None, T: int = 1, depth: int = 1,
            ep: int = 1) -> tuple[Tensor, ...]:
    """Every parameter one tensor rank holds of the whole model, in the model's order."""
    q = grid(mode, T, depth)
    D, r = m.dim, m.mlp_ratio
    vec = D // q if mode in ("2d", "2.5d", "3d") else D
    tok = {None: m.vocab * D, "sequence": m.vocab * D, "1d": m.vocab // q * D,
           "3d": m.vocab // q * (D // q // q)}.get(mode, m.vocab // q * (D // q))
    pos = m.seq * (D if mode in (None, "sequence") else D // q)
    out = [Tensor("tok", tok, 0, "root"), Tensor("pos", pos, 0, "0")]
    for b in range(m.depth):
        layer, unit = b + 1, str(b + 1)

        def add(name: str, n: int, expert: bool = False, fp32: bool = False) -> None:
            out.append(Tensor(f"{layer}.{name}", n, layer, unit, expert, fp32))

        add("norm1.weight", vec, fp32=True)
        add("norm1.bias", vec, fp32=True)
        w, bias = _linear(3 * D, D, mode, q, "col")
        add("attn.qkv.weight", w)
        add("attn.qkv.bias", bias)
        w, bias = _linear(D, D, mode, q, "row")
        add("attn.proj.weight", w)
        add("attn.proj.bias", bias)
        add("norm2.weight", vec, fp32=True)
        add("norm2.bias", vec, fp32=True)
        if m.is_moe(b):
            add("mlp.router", m.experts * D)
            for e in range(max(1, m.experts // ep)):  # ep > E: each expert replicated
                for name, n in (("fc1.weight", r * D * D), ("fc1.bias", r * D),
                                ("fc2.weight", D * r * D), ("fc2.bias", D)):
                    add(f"mlp.experts.{e}.{name}", n, expert=True)
            continue
        for name, (o, i, side) in (("fc1", (r * D, D, "col")), ("fc2", (D, r * D, "row"))):
            w, bias = _linear(o, i, mode, q, side)
            add(f"mlp.{name}.weight", w)
            add(f"mlp.{name}.bias", bias)
    head = m.depth + 1
    out += [Tensor("head.norm.weight", vec, head, str(head), fp32_under_o2=True),
            Tensor("head.norm.bias", vec, head, str(head), fp32_under_o2=True)]
    return tuple(out)


def stage_layers(m: GPT, P: int, V: int, rank: int, v_shape: bool) -> list[list[int]]:
    """The layers of each chunk pipeline rank `rank` holds: partition='uniform' over P * V parts
    (pipeline/partition.py), chunk c being part virtual_stage(c, rank) (pipeline/steps.py)."""
    sizes = uniform_sizes(m.layers, P * V)
    starts = [sum(sizes[:k]) for k in range(P * V)]
    parts = [virtual_stage(c, rank, P, v_shape) for c in range(V)]
    return [list(range(starts[p], starts[p] + sizes[p])) for p in parts]


@lru_cache(maxsize=4096)
def rank_tensors(m: GPT, layers: tuple[int, ...], mode: Optional[str] = None, T: int = 1,
                 depth: int = 1, ep: int = 1) -> tuple[Tensor, ...]:
    """The tensors a rank holds: those of its layers, and the tied table wherever the head is."""
    held = set(layers)
    return tuple(t for t in tensors(m, mode, T, depth, ep)
                 if t.layer in held or (t.name == "tok" and m.layers - 1 in held))
