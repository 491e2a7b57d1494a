"""Mixture of experts with expert parallelism, on plain torch.distributed.

Reading order: placement.py (which rank holds which expert), balance.py (the load-balancing
loss over the global batch), router.py (who goes where, capacity), dispatch.py (the two
all-to-alls), experts.py, layer.py (MoeLayer puts them together), grads.py (which ranks sum
which gradients; MoeGradientHandler does it for the Engine), ../pipeline/moe_aux.py (the
load-balancing loss in the training loss, with or without a pipeline), settings.py (the config:
parallel=dict(moe=dict(size=EP)), NUM_EXPERTS, MOE_TOP_K, MOE_CAPACITY_FACTOR, MOE_AUX_WEIGHT).
A transformer Block takes an MoE layer in its MLP's place with `Block(..., moe=dict(...))`.
"""
from ..lazy import lazy

__getattr__, __dir__ = lazy(__name__, {  # imported when first used: capacity.py needs no torch
    "balance": ["load_balancing_loss"], "capacity": ["expert_capacity"],
    "experts": ["ExpertMLP", "LocalExperts", "expert_parameters"], "placement": ["Placement"],
    "grads": ["MoeGradientHandler", "MoeGroups", "allreduce_expert_gradients",
              "allreduce_moe_gradients", "build_moe_groups", "split_parameters"],
    "layer": ["MoeLayer", "moe_aux_loss", "moe_layers"],
    "router": ["Router", "Routing", "assign_slots"]})
