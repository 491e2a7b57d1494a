"""The formulas the book teaches, written once: bytes a rank holds (here), elements it hands to
collectives (traffic.py) and activations at the schedule's peak (activations.py). Each term
names the file whose docstring teaches it (`--explain` prints them); tests/test_plan.py proves
them equal to live tensors and count_collectives() on the composition table's layouts.

Model states on one rank, after backward, in the step (Psi its parameters' elements, n its
tensors, e bytes per element, N the ranks a gradient is averaged over -- data x sequence --,
pad(x) = ceil(x / N) N, shard(x) = the elements of my N-th of pad(x) that are parameters):

    level  parameters   gradients        optimizer state (SGD: e, AdamW: 8 bytes per element)
    0      Psi e        Psi e            Psi         + DDP's bucket (Psi + n) e (ddp.py)
    1      pad(Psi) e   Psi e            shard(Psi)  + DDP's bucket (zero/optimizer.py)
    2      pad(Psi) e   pad(Psi)/N e     shard(Psi)  (zero/gradients.py)
    3      pad(u)/N e   pad(u)/N e       shard(u)    per unit u, + 1 element per dtype the
                                                     freed parameters share (sharded_model.py)

One flat buffer per dtype (level 3: per unit, the tied table in the root unit). AdamW adds a
4-byte step per tensor; clipping keeps the last norm (one element). O2 (amp.py, zero/mixed.py):
e = 2 for the half parameters (LayerNorms stay fp32), fp32 masters of what my optimizer steps
and, in the step, their fp32 gradients (at levels 2-3 these replace the half gradient shard).
Offload (zero/offload.py): masters, state and an fp32 copy of my gradient shard in CPU memory; at
levels 2-3 the device's shard is freed by the copy. A gradient handler or MoE's (moe/grads.py:
experts split over ranks) replaces DDP's bucket. One data rank: no DDP.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import accumulate
from typing import Optional, Union

from .model import Tensor

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "p2p", "all_to_all")
TEACHES = {  # term -> the file whose docstring teaches it
    "parameters": "nanocolossal/zero/optimizer.py (flat buffers), tensor/*.py (splits)",
    "gradients": "nanocolossal/ddp.py (buckets), zero/gradients.py (level 2's shard)",
    "optimizer": "nanocolossal/zero/optimizer.py (the shard's state), zero/sharded_model.py",
    "masters": "nanocolossal/amp.py (O2's fp32 masters), zero/mixed.py (of my shard)",
    "cpu": "nanocolossal/zero/offload.py (masters and state in CPU memory)",
    "activations": "nanocolossal/memory.py (SavedBytes), activation_checkpoint.py, "
                   "pipeline/simulate.py (micro-batches in flight)",
    "logits": "nanocolossal/tensor/vocab_parallel.py (split by vocabulary, never gathered)",
    "routing": "nanocolossal/moe/layer.py (each MoE layer's last routing), moe/router.py",
    "all_reduce": "nanocolossal/ddp.py, tensor/comm.py (1d's g), tensor/summa.py (2d's reduces), "
                  "moe/grads.py, moe/balance.py, loss_weights.py, clip.py",
    "all_gather": "nanocolossal/zero/comm.py (the updated shards), tensor/layers_1d.py, "
                  "tensor/summa.py (2d's broadcasts), tensor/cube.py (3d)",
    "reduce_scatter": "nanocolossal/zero/sharded_model.py (level 3's gradients), tensor/cube.py",
    "p2p": "nanocolossal/pipeline/p2p.py, tensor/ring_attention.py",
    "all_to_all": "nanocolossal/tensor/ulysses.py, moe/dispatch.py",
    "bubble": "nanocolossal/pipeline/simulate.py (bubble_formula)",
}


@dataclass(frozen=True)
class Layout:
    """One way to run the model on `world` ranks, as a config says it (config.py's keys)."""
    world: int = 1
    pipeline: int = 1
    tensor: int = 1
    mode: Optional[str] = None         # '1d', '2d', '2.5d', '3d', 'sequence'
    depth: int = 1                     # 2.5d's grids
    attention: str = "ring"            # sequence: 'ring' or 'all_to_all'
    zero: int = 0
    offload: bool = False
    amp: Optional[str] = None          # 'O1', 'O2', 'O3'
    checkpoint: Union[str, int, None] = None  # 'full', 'selective', N: every N-th block
    schedule: str = "1f1b"
    micro_batches: int = 1
    chunks: int = 1
    accumulation: int = 1
    ep: int = 1
    batch: int = 8                     # sequences per data rank and optimizer step
    param_bytes: int = 4               # the model's dtype: 4 (fp32) or 8 (the tests' float64)
    half_bytes: int = 2
    optimizer: str = "adamw"           # 'adamw' (2 fp32 states + a step) or 'sgd' (momentum)
    clip: bool = False
    handler: bool = False              # gradient_handler: one all-reduce after backward, no DDP
    backend: str = "nccl"              # 'gloo': zero/comm.py's stand-ins
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def data(self) -> int:
        return self.world // (self.pipeline * self.tensor)

    @property
    def replicas(self) -> int:
        """The ranks a gradient is averaged over (gpc.gradient_group): data x sequence ranks."""
        return self.data * (self.tensor if self.mode == "sequence" else 1)

    @property
    def v_shape(self) -> bool:
        return self.schedule == "zbv"

    def describe(self) -> dict:
        d = {"world": self.world, "data": self.data, "pipeline": self.pipeline,
             "tensor": self.tensor, "mode": self.mode, "zero": self.zero,
             "offload": self.offload, "amp": self.amp, "checkpoint": self.checkpoint,
             "schedule": self.schedule if self.pipeline > 1 else None,
             "micro_batches": self.micro_batches, "chunks": self.chunks, "ep": self.ep}
        if self.mode == "sequence":
            d["attention"] = self.attention
        if self.mode == "2.5d":
            d["depth"] = self.depth
        return d


def block_checkpoint(lay: Layout, layer: int) -> Optional[str]:
    """What block `layer` (1..DEPTH) recomputes: 'full' or 'selective' every block, N 'full' every
    N-th block and nothing in the others (activation_checkpoint.py's block_mode)."""
    N = lay.checkpoint
    if isinstance(N, int) and not isinstance(N, bool):
        return "full" if (layer - 1) % N == N - 1 else None
    return N


# -- model states ------------------------------------------------------------------------------

def pad(n: int, N: int) -> int:
    return math.ceil(n / N) * N


def shard_of(n: int, N: int, r: int) -> int:
    """The parameters' elements in shard r of a flat buffer of n (zero/optimizer.py)."""
    s = math.ceil(n / N)
    return max(0, min(s, n - r * s))


def _buffers(ts: tuple[Tensor, ...], lay: Layout) -> list[tuple[int, int, tuple[int, ...]]]:
    """(elements, bytes per element, each tensor's elements) of each flat buffer: one per dtype
    (and, at level 3, per unit; the tied table in the root unit): zero/optimizer.py,
    sharded_model.py."""
    return _grouped(ts, lay.zero == 3, lay.amp, lay.half_bytes, lay.param_bytes)


@lru_cache(maxsize=4096)
def _grouped(ts: tuple[Tensor, ...], by_unit: bool, amp: Optional[str], half: int,
             full: int) -> list[tuple[int, int, tuple[int, ...]]]:
    groups: dict = {}
    for t in ts:
        e = half if amp in ("O2", "O3") and not (amp == "O2" and t.fp32_under_o2) else full
        groups.setdefault((t.unit if by_unit else "", e), []).append(t.numel)
    return [(sum(sizes), e, tuple(sizes)) for (_, e), sizes in groups.items()]


def _in_shard(sizes: tuple[int, ...], N: int, r: int) -> int:
    """How many of a flat buffer's tensors overlap its shard r: ZeRO steps a segment of each."""
    s = math.ceil(sum(sizes) / N)
    ends = accumulate(sizes)
    return sum(1 for end, n in zip(ends, sizes) if n and end - n < (r + 1) * s and end > r * s)


def model_states(ts: list[Tensor], lay: Layout, data_rank: int = 0) -> dict:
    """Bytes of parameters, gradients, optimizer state, masters and CPU (offload) on one rank."""
    N, r = lay.replicas, data_rank
    adamw = lay.optimizer == "adamw"
    out = dict.fromkeys(("parameters", "gradients", "optimizer", "masters", "cpu"), 0)
    ddp = N > 1 and lay.zero in (0, 1) and not lay.handler and not m_experts(ts, lay)
    for n, e, sizes in _buffers(ts, lay):
        k = len(sizes)
        if ddp:
            out["gradients"] += (n + k) * e  # DDP's bucket: gradients + a "used" flag each
        master_e = 4 if e < 4 and lay.amp == "O2" else e  # fp32 masters of half parameters
        # AdamW: exp_avg and exp_avg_sq, SGD: momentum, in the stepped tensor's dtype
        per = 2 * master_e if adamw else master_e
        if lay.zero == 0:
            out["parameters"] += n * e
            out["gradients"] += n * e
            out["optimizer"] += n * per + 4 * k * adamw  # AdamW's step counter per tensor
            if master_e != e:  # O2: fp32 masters and their fp32 gradients (amp.py)
                out["masters"] += n * master_e
                out["gradients"] += n * master_e
            continue
        mine = shard_of(n, N, r)
        steps = 4 * _in_shard(sizes, N, r) * adamw  # a step counter per segment stepped
        out["parameters"] += (pad(n, N) // N if lay.zero == 3 else pad(n, N)) * e
        if lay.zero == 1:
            out["gradients"] += n * e
        elif not lay.offload and master_e == e:  # offload: freed by the copy-out
            out["gradients"] += mine * e
        if lay.offload:  # masters, state and a copy of my gradient shard: offload.py
            master_e = max(4, e)
            per = 2 * master_e if adamw else master_e
            out["cpu"] += mine * (master_e + per + master_e) + steps
            continue
        out["optimizer"] += mine * per + steps
        if master_e != e:  # O2: my shard's fp32 masters, and in the step their fp32
            out["masters"] += mine * master_e  # gradients (the half shard freed: mixed.py)
            out["gradients"] += mine * master_e
    if lay.zero == 3:  # the one-element storage freed parameters share, per dtype
        out["parameters"] += sum({e for _, e, _ in _buffers(ts, lay)})
    if lay.clip:
        out["optimizer"] += 4 if lay.amp else lay.param_bytes  # the last gradient norm
    return out


def m_experts(ts: list[Tensor], lay: Layout) -> bool:
    """Experts split over ranks meet in moe/grads.py's handler, not in DDP's buckets; experts
    every data rank holds (expert parallel x1) are DDP's as any parameter."""
    return lay.ep > 1 and any(t.expert for t in ts)
