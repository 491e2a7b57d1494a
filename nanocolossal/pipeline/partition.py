"""Cutting an nn.Sequential into pipeline parts.

With P stages and V chunks there are K = P * V contiguous parts, placed on the ranks as steps.py
draws (V = 2, P = 2: rank 0 holds parts 0 and 2, layers 1-4 and 9-12 of a 16-layer model, as
the tutorial describes; under zbv parts 0 and 3). How the layers are balanced decides the
pipeline's speed -- the slowest part sets the pace:

    "uniform"     the same number of layers per part
    "parameters"  balanced parameter counts (good for stacks of similar blocks)
    "profile"     balanced measured forward+backward time on `sample_input` (ResNets: early
                  layers have few parameters but large activations, so only timing balances them)
    [n0, n1, ..]  explicit layer counts per part

Balancing is the "linear partition" problem: split a sequence of costs into K contiguous
parts minimising the largest part, solved exactly by dynamic programming. Every rank must
cut identically, so profiled costs are measured on rank 0 and broadcast.

A stage keeps its layers under their *original* indices, so its state_dict keys are the Sequential's
own ("4.conv1.weight") and the stages' state_dicts merge into the plain model's.
"""
from __future__ import annotations

import copy
import time
from itertools import accumulate
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from ..context import gpc
from ..logging import get_dist_logger
from .partition_checks import check_partition
from .steps import stage_rank, uniform_sizes, v_shaped, virtual_stage
from .tied import tie_across_stages


class PipelinePart(nn.Module):
    """One of the P x V parts: consecutive layers under their original indices (a stage: 1 or V)."""

    def __init__(self, layers: nn.Sequential, start: int, stop: int) -> None:
        super().__init__()
        self.start = start
        self.stop = stop
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
    prefix = [0.0, *accumulate(costs)]
    best = [[float("inf")] * (n + 1) for _ in range(parts + 1)]  # best[k][i]: i layers, k parts
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i] - 1e-12:  # ties keep the earliest cut
                    best[k][i] = value
                    cut[k][i] = j
    sizes = []
    i = n
    for k in range(parts, 0, -1):
        sizes.append(i - cut[k][i])
        i = cut[k][i]
    return sizes[::-1]


def profile_costs(layers: nn.Sequential, sample_input: torch.Tensor) -> list[float]:
    """Seconds for each layer's forward + backward on the sample (best of 3, after a warm-up),
    timed on rank 0 and broadcast. A copy runs, with the RNG restored: the real layers stay as
    seeded (BatchNorm statistics, no grads), and rank 0 draws no numbers the others do not."""
    costs: list = [[]]
    if gpc.rank == 0 or not gpc.is_initialized:
        x = sample_input
        with torch.random.fork_rng(devices=[]):
            for layer in copy.deepcopy(layers):
                times = []
                for _ in range(4):
                    inp = x.detach().requires_grad_(x.is_floating_point())
                    start = time.perf_counter()
                    out = layer(inp)
                    if out.requires_grad:
                        out.backward(torch.ones_like(out))
                    times.append(time.perf_counter() - start)
                layer.zero_grad(set_to_none=True)
                costs[0].append(min(times[1:]))
                x = out.detach()
    if gpc.is_initialized and gpc.world_size > 1:  # one measurement: every rank cuts alike
        dist.broadcast_object_list(costs, src=0)
    return costs[0]


def parameter_costs(layers: nn.Sequential) -> list[float]:
    return [float(sum(p.numel() for p in layer.parameters())) for layer in layers]


def build_pipeline_model(layers: nn.Sequential, num_chunks: int = 1,
                         partition: Union[str, Sequence[int]] = "parameters", verbose: bool = False,
                         sample_input: Optional[torch.Tensor] = None,
                         schedule: Optional[str] = None) -> nn.Module:
    """This rank's part of `layers`: a PipelinePart, or PipelineChunks of num_chunks parts,
    placed for `schedule` (default: the config's PIPELINE_SCHEDULE; 'zbv' places them in a V)."""
    P = gpc.pipeline_size
    V = num_chunks
    check_partition(layers, P * V, partition, sample_input)
    v_shape = v_shaped(schedule or gpc.config.get("PIPELINE_SCHEDULE", ""))
    if partition == "uniform":
        costs = [1.0] * len(layers)
        sizes = uniform_sizes(len(layers), P * V)
    elif partition == "profile":
        costs = profile_costs(layers, sample_input)
        sizes = balanced_split(costs, P * V)
    else:  # "parameters", or explicit layer counts (logged with their parameters)
        costs = parameter_costs(layers)
        sizes = balanced_split(costs, P * V) if partition == "parameters" else list(partition)
    starts = [sum(sizes[:k]) for k in range(P * V)]
    if verbose:
        log_partition(layers, partition, starts, sizes, costs, P, v_shape)
    parts = [virtual_stage(c, gpc.pipeline_rank, P, v_shape) for c in range(V)]
    mine = [PipelinePart(layers, starts[k], starts[k] + sizes[k]) for k in parts]
    stage = mine[0] if V == 1 else PipelineChunks(mine)
    stage.v_shape = v_shape  # the schedule checks it runs the placement it was built for
    stage.tied = []  # weights two layers share (embedding = classifier), summed across stages
    if len(list(layers.parameters())) < sum(len(list(layer.parameters())) for layer in layers):
        stage.tied = tie_across_stages(layers, starts, sizes, v_shape)
    return stage


def log_partition(layers: nn.Sequential, partition: Union[str, Sequence[int]], starts: list,
                  sizes: list, costs: list, P: int, v_shape: bool) -> None:
    """verbose=True: each part's rank, chunk, layers, parameters and cost, logged."""
    unit = "s" if partition == "profile" else ""
    name = partition if isinstance(partition, str) else "explicit"
    lines = [f"pipeline partition ({name}), {P} stage(s) x {len(sizes) // P} chunk(s):",
             "  part  rank  chunk  layers      params      cost"]
    for k, (a, size) in enumerate(zip(starts, sizes)):
        b = a + size
        n_params = sum(parameter_costs(layers[a:b]))
        lines.append(f"  {k:>4}  {stage_rank(k, P, v_shape):>4}  {k // P:>5}  "
                     f"{a:>3}-{b - 1:<5} {n_params:>10,.0f}  {sum(costs[a:b]):>8.3g}{unit}")
    get_dist_logger().info("\n".join(lines))
