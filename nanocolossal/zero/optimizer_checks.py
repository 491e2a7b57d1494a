"""What ZeRO refuses, each called by one line: check_optimizer at initialize, and at each step
refuse_new_parameters and (level 3 without AMP) refuse_non_finite; gathers_in_forward: level 3's
forward talks, so uneven evaluation batches are refused (checks.py).
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..checks import forward_talks
from ..config import ConfigError
from ..config_checks import zero_settings
from ..context import gpc

# optimizers whose update of an element depends only on that element's gradient and state
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop,
               torch.optim.Adagrad)


def check_optimizer(optimizer: torch.optim.Optimizer, mixed: Any, model: nn.Module) -> None:
    """What ZeRO can shard: an element-wise optimizer, fresh, over every trainable parameter."""
    if type(optimizer) not in ELEMENTWISE:
        raise ConfigError(
            f"[rank {gpc.rank}] zero: {type(optimizer).__name__} is not an element-wise optimizer "
            f"we can step segment by segment (each rank steps only parts of parameters, so an "
            f"update that needs a whole parameter -- LAMB's or LARS's trust ratio -- would be "
            f"wrong); use one of {', '.join(c.__name__ for c in ELEMENTWISE)}, or remove zero")
    if mixed.master_pairs():  # (whole-model masters: mixed.py's classes make shards of them)
        raise TypeError(f"[rank {gpc.rank}] {type(mixed).__name__} holds O2's fp32 masters of "
                        f"the whole model; shard it with zero.mixed's MixedShardedOptimizer "
                        f"(levels 1-2) or MixedParamShardedOptimizer (level 3)")
    # (Adagrad fills its state, step 0, in its constructor: that is not a step)
    if any(float(state.get("step", 1)) > 0 for state in optimizer.state.values()):
        raise ConfigError(f"[rank {gpc.rank}] zero: the optimizer has already stepped; pass a "
                          f"fresh optimizer to initialize (load its state after, with "
                          f"engine.optimizer.load_state_dict)")
    stepped = {id(p) for g in optimizer.param_groups for p in g["params"]}
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in stepped]
    if missing:
        raise ConfigError(f"[rank {gpc.rank}] zero: trainable parameter(s) {', '.join(missing[:4])}"
                          f" are not in the optimizer; ZeRO shards what the optimizer steps: pass "
                          f"all of model.parameters(), or set requires_grad=False on them")


def refuse_new_parameters(model: nn.Module, sharded: dict) -> None:
    """A parameter added after initialize is in no flat buffer (`sharded`): none would step it."""
    new = [n for n, p in model.named_parameters() if p.requires_grad and p not in sharded]
    if new:
        raise ConfigError(f"[rank {gpc.rank}] zero: parameter(s) {', '.join(new[:4])} were "
                          f"added to the model after nc.initialize, which cut the parameters "
                          f"it was given into shards; build the whole model (and an optimizer "
                          f"over all its parameters) before nc.initialize")


def refuse_non_finite(opt: Any) -> None:
    """Level 3 without AMP: a read of a freed (NaN) parameter outside the forward gives NaN
    gradients; one flag all-reduced over the job refuses the step on every rank, before it runs."""
    segments = [s for b in opt.buffers for s in b.segments]
    grads = [g for g in (opt.grad_target(s).grad for s in segments) if g is not None and g.numel()]
    found = torch.zeros(1, device=gpc.device)
    if grads:  # the largest |g| of each: one launch, and a few on its results
        largest = [m.to(gpc.device, torch.float64) for m in torch._foreach_norm(grads, math.inf)]
        found = torch.stack(largest).isfinite().all().logical_not().reshape(1).float()
    if gpc.is_initialized and gpc.world_size > 1:
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
    if not found.item():
        return
    names = opt.param_names()
    bad = [names[s.index][0] for s in segments if opt.grad_target(s).grad is not None
           and not torch.isfinite(opt.grad_target(s).grad).all()]
    raise RuntimeError(
        f"[rank {gpc.rank}] zero level 3: non-finite gradients "
        f"({', '.join(dict.fromkeys(bad[:4])) or 'on another rank'}); the step was not "
        f"taken. Between uses each rank holds only its shard and a parameter reads NaN: "
        f"compute anything that reads parameters (a penalty over model.parameters()) inside "
        f"the model's forward, or use the optimizer's weight_decay; if the training itself "
        f"diverged, lower the learning rate")


def gathers_in_forward(model: nn.Module) -> Optional[str]:
    zero = zero_settings(gpc.config)[0] if "zero" in gpc.config else {}
    return "ZeRO level 3 gathers the parameters" if zero.get("level") == 3 else None


forward_talks(gathers_in_forward)  # (checks.py: uneven evaluation batches refused)
