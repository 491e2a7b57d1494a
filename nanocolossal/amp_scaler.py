"""Loss scaling: how fp16 training keeps small gradients from flushing to zero.

fp16 has a narrow range: gradients below ~6e-8 round to zero. Loss scaling fixes that by the
chain rule -- multiply the loss by S and every gradient is multiplied by S, lifting small
gradients into range; divide them by S again before the optimizer sees them:

    loss * S --backward--> grads * S --unscale (* 1/S)--> true grads --> optimizer.step()

S must be as large as possible without overflowing. DynamicLossScaler searches for it: on an
inf/NaN gradient the step is skipped and S halves (backoff); after `growth_interval` clean steps
S doubles. So unscaling also *checks*: it reports whether any gradient holds an inf or a NaN.
With hysteresis=1 the sequence of S is torch.amp.GradScaler's as long as S stays inside
[min_scale, max_scale] (tested); GradScaler has no such clamps.

Unscaling is shown twice: first the plain loop (one gradient at a time, a few kernel launches
each; the flag set by a tensor op, not an `if`, so a GPU never stops to tell the CPU what it
found), then the optimised variant: torch's fused kernel, one launch for a whole list (tested
equal). bfloat16 has fp32's range and needs no scaling (amp.py decides when a scaler is used),
only the check (find_non_finite): it reads the gradients and writes none.
"""
from __future__ import annotations

from typing import Any, Optional, Union

import torch

from .amp_checks import check_not_stuck, check_scaler_settings
from .context import gpc


class DynamicLossScaler:
    """The loss scale S and its update rule (the module docstring). hysteresis: overflows
    tolerated before backing off (refilled at each growth); max_consecutive_overflows: at
    min_scale, this many overflowing steps in a row raise an error (the loss itself is inf/nan)."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, hysteresis: int = 1,
                 min_scale: float = 1.0, max_scale: float = 2.0**24,
                 max_consecutive_overflows: int = 32) -> None:
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.min_scale = min_scale
        self.max_scale = max_scale
        self.max_consecutive_overflows = max_consecutive_overflows
        check_scaler_settings(self)  # one that can grow, back off, and stay in its range
        self.growth_tracker = 0  # clean steps since the last growth or overflow
        self.hysteresis_tracker = hysteresis  # overflows left before backing off
        self.consecutive_overflows = 0
        self.steps = 0

    def update(self, found_inf: bool) -> None:
        """Back off after an overflow (once hysteresis runs out), grow after a clean stretch."""
        self.steps += 1
        if found_inf:
            self.growth_tracker = 0
            self.consecutive_overflows += 1
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            check_not_stuck(self)  # (amp_checks.py)
            return
        self.consecutive_overflows = 0
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.growth_tracker = 0
            self.hysteresis_tracker = self.hysteresis
            self.scale = min(self.scale * self.growth_factor, self.max_scale)

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("scale", "growth_tracker", "hysteresis_tracker",
                                              "consecutive_overflows", "steps")}

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


def unscale_and_check(grads: list[torch.Tensor], found_inf: torch.Tensor,
                      inv_scale: torch.Tensor) -> None:
    """The plain loop: for each gradient, note an inf/NaN in `found_inf` (set to 1), then
    multiply it by `inv_scale` = 1/S (both one-element tensors)."""
    for grad in grads:
        found_inf.masked_fill_(torch.isfinite(grad).all().logical_not(), 1.0)
        grad.mul_(inv_scale.reshape(()))  # 0-d: multiplies a 0-d gradient too


def unscale_and_check_fused(grads: list[torch.Tensor], found_inf: torch.Tensor,
                            inv_scale: torch.Tensor) -> None:
    """The same in one kernel launch for the whole list (torch.amp.GradScaler uses it). The
    gradients must share a device and a dtype, and on CUDA there is no bfloat16 version."""
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


def find_non_finite(grads: list[torch.Tensor], found_inf: torch.Tensor) -> None:
    """Only the check (bf16): `found_inf` = 1 if some gradient's largest |g| is inf or NaN."""
    grads = [g for g in grads if g.numel()]  # (an empty tensor has no largest element)
    if not grads:  # a rank whose shard holds no gradient this step has nothing to find
        return
    largest = torch._foreach_norm(grads, float("inf"))
    if len({(m.device, m.dtype) for m in largest}) > 1:  # mixed types or devices: to one
        # float64 holds every half and fp32 value exactly, and a float64 one beyond fp32's range
        largest = [m.to(found_inf.device, torch.float64) for m in largest]
    # no per-gradient op on the host: a step's check is one norm launch and five on its result
    found_inf.copy_(torch.stack(largest).isfinite().all().logical_not().reshape(1))


def unscale_grads(grads: list[torch.Tensor], loss_scale: float) -> torch.Tensor:
    """Multiply every gradient by 1/loss_scale in place (fused per device and dtype, the plain
    loop where no fused kernel exists); returns a one-element tensor, 1 if any held an inf or a
    NaN. A scale of 1 has nothing to undo: the check alone, which writes no gradient."""
    device = grads[0].device if grads else gpc.device
    # fp32 whatever the default dtype: torch's fused kernel takes no other
    found_inf = torch.zeros(1, device=device, dtype=torch.float32)
    if loss_scale == 1.0:
        find_non_finite(grads, found_inf)
        return found_inf
    inv_scale = torch.full((1,), 1.0 / loss_scale, device=device, dtype=torch.float32)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad in grads:
        groups.setdefault((grad.device, grad.dtype), []).append(grad)
    for (group_device, dtype), group in groups.items():
        if group_device.type == "cuda" and dtype == torch.bfloat16:  # no fused kernel for it
            unscale_and_check(group, found_inf, inv_scale)
        else:
            unscale_and_check_fused(group, found_inf, inv_scale)
    return found_inf


def make_scaler(loss_scale: Union[str, float, None], **kwargs: Any) -> Optional[DynamicLossScaler]:
    """apex's loss_scale: "dynamic" searches for S, a number fixes S (it never grows or backs
    off), None turns scaling off."""
    if loss_scale is None:
        return None
    if loss_scale == "dynamic":
        return DynamicLossScaler(**kwargs)
    fixed = float(loss_scale)
    return DynamicLossScaler(init_scale=fixed, min_scale=fixed, max_scale=fixed,
                             growth_interval=2**62)
