"""Cutting an nn.Sequential into pipeline parts.

With P stages and V chunks there are K = P * V contiguous parts; part k = c * P + r is chunk
c of rank r (so with V = 2 and P = 2, rank 0 holds parts 0 and 2: layers 1-4 and 9-12 of a
16-layer model, as the tutorial describes). For zbv the two chunks lie in a V: part k is on
rank k for k < P and on rank 2P - 1 - k after (rank 0 holds parts 0 and 3, the first and last).
How the layers are balanced decides the pipeline's speed -- the slowest part sets the pace:

    "uniform"     the same number of layers per part
    "parameters"  balanced parameter counts (good for stacks of similar blocks)
    "profile"     balanced measured forward+backward time on `sample_input` (ResNets: early
                  layers have few parameters but large activations, so only timing balances them)
    [n0, n1, ..]  explicit layer counts per part

Balancing is the "linear partition" problem: split a sequence of costs into K contiguous
parts minimising the largest part, solved exactly by dynamic programming. Every rank must
cut identically, so profiled costs are measured on rank 0 and broadcast.

A stage keeps its layers under their *original* indices, so its state_dict keys are the
Sequential's own ("4.conv1.weight") and the stages' state_dicts merge into the plain model's.
"""
from __future__ import annotations

import copy
import time
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from ..context import gpc
from ..logging import get_dist_logger
from .steps import stage_rank, v_shaped, virtual_stage
from .tied import tie_across_stages


class PipelinePart(nn.Module):
    """One part (of the P x V cuts): consecutive layers of the original Sequential, registered
    under their original indices. A stage is one part, or V of them (PipelineChunks)."""

    def __init__(self, layers: nn.Sequential, start: int, stop: int) -> None:
        super().__init__()
        self.start, self.stop = start, stop
        for i in range(start, stop):
            self.add_module(str(i), layers[i])

    def forward(self, x):
        for layer in self.children():
            x = layer(x)
        return x


class PipelineChunks(nn.ModuleList):
    """This rank's chunks (interleaved schedule). Its state_dict merges the chunks' flat keys."""

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        out = destination if destination is not None else {}
        for chunk in self:
            chunk.state_dict(destination=out, prefix=prefix, keep_vars=keep_vars)
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        mine = set()
        for chunk in self:
            keys = set(chunk.state_dict())
            chunk.load_state_dict({k: v for k, v in state_dict.items() if k in keys},
                                  strict=strict, assign=assign)
            mine |= keys
        unexpected = sorted(set(state_dict) - mine)
        if strict and unexpected:
            raise RuntimeError(f"[rank {gpc.rank}] unexpected keys for this pipeline stage: "
                               f"{unexpected[:5]}")


def balanced_split(costs: Sequence[float], parts: int) -> list[int]:
    """Layer counts of `parts` contiguous non-empty parts minimising the largest sum (exact DP)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]  # best[k][i]: first i layers in k parts
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i] - 1e-12:  # ties keep the earliest cut
                    best[k][i], cut[k][i] = value, j
    bounds, i = [], n
    for k in range(parts, 0, -1):
        bounds.append(i - cut[k][i])
        i = cut[k][i]
    return bounds[::-1]


def _profile_costs(layers: nn.Sequential, sample_input: torch.Tensor) -> list[float]:
    """Seconds for each layer's forward + backward on the sample (best of 3, after a warm-up).

    Runs on a copy, with the RNG restored afterwards: the real layers must stay exactly as
    seeded (BatchNorm statistics, no grads), and rank 0 must not draw random numbers the
    other ranks do not draw."""
    with torch.random.fork_rng(devices=[]):
        return _time_layers(copy.deepcopy(layers), sample_input)


def _time_layers(layers: nn.Sequential, sample_input: torch.Tensor) -> list[float]:
    costs, x = [], sample_input
    for layer in layers:
        times = []
        for _ in range(4):
            inp = x.detach().requires_grad_(x.is_floating_point())
            start = time.perf_counter()
            out = layer(inp)
            if out.requires_grad:
                out.backward(torch.ones_like(out))
            times.append(time.perf_counter() - start)
        layer.zero_grad(set_to_none=True)
        costs.append(min(times[1:]))
        x = out.detach()
    return costs


def uniform_sizes(n: int, parts: int) -> list[int]:
    """partition='uniform': n layers into parts, the first n % parts one layer longer."""
    return [n // parts + (1 if k < n % parts else 0) for k in range(parts)]


def partition_sizes(layers: nn.Sequential, parts: int, partition: Union[str, Sequence[int]],
                    sample_input: Optional[torch.Tensor] = None) -> tuple[list[int], list[float]]:
    """(layer counts per part, cost per layer) for the chosen method."""
    n = len(layers)
    if n < parts:
        raise ValueError(f"[rank {gpc.rank}] the model has {n} layers but the pipeline needs "
                         f"{parts} parts (pipeline size x NUM_CHUNKS); use fewer stages/chunks or "
                         f"split the model into more layers")
    params = [float(sum(p.numel() for p in layer.parameters())) for layer in layers]
    if not isinstance(partition, str):
        sizes = list(partition)
        if (
            len(sizes) != parts
            or any(not isinstance(s, int) or s < 1 for s in sizes)
            or sum(sizes) != n
        ):
            raise ValueError(f"[rank {gpc.rank}] partition {sizes} must be {parts} positive layer "
                             f"counts summing to {n}, the number of layers")
        return sizes, params
    if partition == "uniform":
        return uniform_sizes(n, parts), [1.0] * n
    if partition == "parameters":
        return balanced_split(params, parts), params
    if partition == "profile":
        if sample_input is None:
            raise ValueError(f"[rank {gpc.rank}] partition='profile' "
                             "needs sample_input=<one input batch>")
        costs = (
            [_profile_costs(layers, sample_input)]
            if gpc.rank == 0 or not gpc.is_initialized
            else [None]
        )
        if gpc.is_initialized and gpc.world_size > 1:
            # one measurement, so every rank cuts the same way
            dist.broadcast_object_list(costs, src=0)
        return balanced_split(costs[0], parts), costs[0]
    raise ValueError(f"[rank {gpc.rank}] unknown partition {partition!r}; use 'uniform', "
                     f"'parameters', 'profile' or a list of layer counts")


def build_pipeline_model(layers: nn.Sequential, num_chunks: int = 1,
                         partition: Union[str, Sequence[int]] = "parameters", verbose: bool = False,
                         sample_input: Optional[torch.Tensor] = None,
                         schedule: Optional[str] = None) -> nn.Module:
    """This rank's part of `layers`: a PipelinePart, or PipelineChunks of num_chunks parts,
    placed for `schedule` (default: the config's PIPELINE_SCHEDULE; 'zbv' places them in a V)."""
    if not isinstance(layers, nn.Sequential):
        raise TypeError(f"[rank {gpc.rank}] build_pipeline_model needs an "
                        f"nn.Sequential (got {type(layers).__name__}); write "
                        "the model as nn.Sequential(stem, block1, ..., head)")
    P, V = gpc.pipeline_size, num_chunks
    v_shape = v_shaped(schedule or gpc.config.get("PIPELINE_SCHEDULE", ""))
    sizes, costs = partition_sizes(layers, P * V, partition, sample_input)
    starts = [sum(sizes[:k]) for k in range(P * V)]
    if verbose:
        unit = "s" if partition == "profile" else ""
        lines = [f"pipeline partition ({partition if isinstance(partition, str) else 'explicit'}), "
                 f"{P} stage(s) x {V} chunk(s):",
                 "  part  rank  chunk  layers      params      cost"]
        for k in range(P * V):
            a, b = starts[k], starts[k] + sizes[k]
            n_params = sum(p.numel() for layer in layers[a:b] for p in layer.parameters())
            lines.append(f"  {k:>4}  {stage_rank(k, P, v_shape):>4}  {k // P:>5}  "
                         f"{a:>3}-{b - 1:<5} {n_params:>10,}  {sum(costs[a:b]):>8.3g}{unit}")
        get_dist_logger().info("\n".join(lines))
    parts = [virtual_stage(c, gpc.pipeline_rank, P, v_shape) for c in range(V)]
    mine = [PipelinePart(layers, starts[k], starts[k] + sizes[k]) for k in parts]
    stage = mine[0] if V == 1 else PipelineChunks(mine)
    stage.v_shape = v_shape  # the schedule checks it runs the placement it was built for
    stage.tied = tie_across_stages(layers, starts, sizes, v_shape)  # e.g. embedding = classifier
    return stage
