"""Replicas start equal: every parameter and buffer comes from the first rank that holds it.

Data parallelism of every kind -- DDP, the gradient handler, ZeRO 1-3, experts over the ranks
that hold them -- keeps its copies equal by giving them equal gradients, so they must also start
equal. A model built under a per-rank seed (nanoGPT seeds 1337 + rank) differs between ranks
until this broadcast. `initialize` runs it first, before AMP copies fp32 master weights out of
the parameters and before ZeRO cuts them into shards, so everything built from the parameters
afterwards is the same on every replica:

    parameters and buffers   from the first rank of the gradient group (data x sequence ranks)
    experts (parallel.moe)   from the first of the data ranks holding the same experts
                             (moe/grads.py); a rank holding different experts keeps its own
    tied weights             a weight pipeline stages share (pipeline/tied.py: the embedding
                             and the classifier): the last stage's copy from the first stage's
"""
from __future__ import annotations

import torch.distributed as dist
from torch import nn

from .collectives import broadcast_coalesced
from .context import gpc
from .moe import moe_layers


def broadcast_replicas(model: nn.Module) -> None:
    """Give every replica of `model` the same starting values (collective over the gradient
    group, each expert holders' group and each tied weight's stages)."""
    experts: dict[int, list[nn.Parameter]] = {}  # by exchange block: held by other groups
    if gpc.ep_size > 1:
        for layer in moe_layers(model):
            experts.setdefault(layer.placement.peers, []).extend(layer.experts.parameters())
    held = {id(p) for params in experts.values() for p in params}
    replicated = [t for t in (*model.parameters(), *model.buffers()) if id(t) not in held]
    if gpc.gradient_size > 1:
        broadcast_coalesced(replicated, gpc.gradient_ranks[0], gpc.gradient_group)
    for block, params in sorted(experts.items()):
        group, ranks = gpc.expert_data_groups[block]
        if group is not None:  # (a group of one: nobody else holds these experts)
            broadcast_coalesced(params, ranks[0], group)
    for param, group in getattr(model, "tied", []):  # (the first stage: each group's lowest rank)
        if group is not None:
            broadcast_coalesced([param], dist.get_global_rank(group, 0), group)
