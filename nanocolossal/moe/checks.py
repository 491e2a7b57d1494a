"""What the MoE layer refuses: expert and EP sizes that do not nest, router options out of range,
data ranks routing different numbers of tokens, and the config's MoE keys (each called in one
line: placement.py, router.py, balance.py, settings.py)."""
from __future__ import annotations

import math
import numbers
from typing import Mapping

from ..config import ConfigError, is_positive_int


def rank_prefix() -> str:
    """'[rank r]' for messages (rank 0 without torch.distributed)."""
    import torch.distributed as dist  # (at run time only: the config's checks need no torch)
    return f"[rank {dist.get_rank() if dist.is_initialized() else 0}]"


def check_expert_sizes(num_experts: int, ep_size: int) -> None:
    """E and EP must nest: one divides the other."""
    if num_experts < 1 or ep_size < 1:
        raise ValueError(f"{rank_prefix()} num_experts={num_experts} and expert-parallel size "
                         f"{ep_size} must be at least 1")
    if num_experts % ep_size and ep_size % num_experts:
        lower = [n for n in range(1, num_experts + 1) if num_experts % n == 0]
        raise ValueError(
            f"{rank_prefix()} num_experts={num_experts} does not fit an expert-parallel size of "
            f"{ep_size}: one must divide the other (E/EP experts per rank, or each expert on EP/E "
            f"ranks); use an expert-parallel size in {lower} or a multiple of {num_experts}, or a "
            f"number of experts that is a multiple or divisor of {ep_size}")


def check_router_args(num_experts: int, top_k: int, capacity_factor_train: float,
                      capacity_factor_eval: float, min_capacity: int, jitter_eps: float) -> None:
    where = rank_prefix()
    if top_k not in (1, 2):
        raise ValueError(f"{where} top_k={top_k}: the router does top-1 (Switch) or top-2 "
                         f"(GShard); use MOE_TOP_K=1 or 2")
    if top_k > num_experts:
        raise ValueError(f"{where} top_k={top_k} needs at least {top_k} experts, got "
                         f"num_experts={num_experts}")
    for name, value in (("capacity_factor_train", capacity_factor_train),
                        ("capacity_factor_eval", capacity_factor_eval)):
        if not value > 0:
            raise ValueError(f"{where} {name}={value}: the capacity factor must be > 0 (1.25 "
                             f"is usual; >= num_experts={num_experts} never drops a token)")
    if min_capacity < 1:
        raise ValueError(f"{where} min_capacity={min_capacity} must be at least 1")
    if not 0 <= jitter_eps < 1:
        raise ValueError(f"{where} jitter_eps={jitter_eps} must be in [0, 1) (Switch uses 0.01)")


def check_equal_tokens(sum_t: float, sum_t2: float, tokens: int, ranks: int) -> None:
    if ranks * sum_t2 != sum_t * sum_t:
        raise ValueError(
            f"{rank_prefix()} MoE layer: the data-parallel ranks route different numbers of "
            f"tokens (this rank {tokens}, mean {sum_t / ranks:g}); capacity is counted per rank's "
            f"tokens, and the all-to-all needs the same capacity on every rank: give every rank "
            f"the same batch size and sequence length (DistributedSampler pads the last batch)")


def check_forward_ran(layers: list) -> None:
    """moe_aux_loss reads each layer's aux loss of its last forward: there must be one."""
    if any(m.aux_loss is None for m in layers):
        raise ValueError("moe_aux_loss: an MoE layer of the model has not run a forward yet")


def _number(cfg: Mapping, key: str, default: float, positive: bool) -> float:
    value = cfg.get(key, default)
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (value <= 0 if positive else value < 0):
        raise ConfigError(f"{key} must be a number {'> 0' if positive else '>= 0'}, got {value!r}"
                          + (" (1.25 is usual; >= NUM_EXPERTS never drops a token)"
                             if "CAPACITY" in key else ""))
    return float(value)


def check_moe_settings(cfg: Mapping) -> None:
    """NUM_EXPERTS a positive integer, MOE_TOP_K 1 or 2, the factors and the aux weight numbers."""
    _number(cfg, "MOE_AUX_WEIGHT", 0.0, positive=False)
    if "NUM_EXPERTS" not in cfg:
        return
    experts, top_k = cfg["NUM_EXPERTS"], cfg.get("MOE_TOP_K", 1)
    if not is_positive_int(experts):
        raise ConfigError(f"NUM_EXPERTS must be a positive integer, got {experts!r}")
    if top_k not in (1, 2) or isinstance(top_k, bool) or top_k > experts:
        raise ConfigError(f"MOE_TOP_K must be 1 (Switch) or 2 (GShard) and at most NUM_EXPERTS="
                          f"{experts}, got {top_k!r}")
    _number(cfg, "MOE_CAPACITY_FACTOR", 1.25, positive=True)
    _number(cfg, "MOE_EVAL_CAPACITY_FACTOR", 1.0, positive=True)
