"""Mixed precision: compute in 16 bits, keep what accumulates in 32.

fp16 halves memory traffic and runs on tensor cores, but it has a narrow range: gradients
below ~6e-8 flush to zero. Loss scaling fixes that by the chain rule -- multiply the loss by
S and every gradient is multiplied by S, lifting small gradients into range:

    loss * S --backward--> grads * S --unscale (/ S)--> true grads --> optimizer.step()

S must be as large as possible without overflowing. DynamicLossScaler searches for it: on
an inf/nan gradient it skips the step and halves S (backoff); after `growth_interval` clean
steps it doubles S. Every rank must make the same decision, so the overflow flag is
all-reduced (MAX) over the whole job before anyone steps. bfloat16 has fp32's range, so it
needs no scaling.

The opt levels (as apex):
    O0  fp32 everything                                              (reference)
    O1  fp32 weights, forward under autocast (fp16/bf16 per op)      = AMP_TYPE.TORCH
    O2  fp16 model except normalisation layers, fp32 master weights  = AMP_TYPE.NAIVE
        that the optimizer updates and copies back after each step
    O3  fp16 everything, no master weights                           (speed baseline)
Model outputs come back in fp32 so the loss is computed in full precision.

    model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    optimizer.clip_grad_norm(1.0)   # optional: acts on unscaled gradients
    optimizer.step()                # skipped (and S backed off) on overflow
"""
from __future__ import annotations

import math
import time
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from .config import AMP_TYPE  # noqa: F401 -- owned by the config (it names the modes); re-exported here
from .context import gpc
from .logging import get_dist_logger
from .nest import map_tensors
from .tensor.base import replicas


class DynamicLossScaler:
    """The loss scale S and its update rule.

    With hysteresis=1 the sequence is torch.amp.GradScaler's as long as S stays inside
    [min_scale, max_scale] (tested); GradScaler has no such clamps, so outside them they differ.

    hysteresis: overflows tolerated before backing off (refilled at each growth).
    max_consecutive_overflows: at min_scale, this many overflowing steps in a row raise an
    error -- the loss itself is then inf/nan, which no scale can fix.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, hysteresis: int = 1,
                 min_scale: float = 1.0, max_scale: float = 2.0**24,
                 max_consecutive_overflows: int = 32) -> None:
        if not (
            growth_factor > 1
            and 0 < backoff_factor < 1
            and growth_interval >= 1
            and hysteresis >= 1
            and 0 < min_scale <= init_scale <= max_scale
        ):
            raise ValueError("DynamicLossScaler needs growth_factor > 1, 0 < backoff_factor < 1, "
                             f"growth_interval >= 1, hysteresis >= 1 and 0 < min_scale <= "
                             f"init_scale <= max_scale; got {locals()}")
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.hysteresis, self.min_scale, self.max_scale = hysteresis, min_scale, max_scale
        self.max_consecutive_overflows = max_consecutive_overflows
        self.growth_tracker, self.hysteresis_tracker = 0, hysteresis
        self.consecutive_overflows, self.steps = 0, 0

    def update(self, found_inf: bool) -> None:
        self.steps += 1
        if found_inf:
            self.growth_tracker = 0
            self.consecutive_overflows += 1
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            if (
                self.scale <= self.min_scale
                and self.consecutive_overflows >= self.max_consecutive_overflows
            ):
                raise FloatingPointError(
                    f"[rank {gpc.rank}] step {self.steps}: gradients overflowed "
                    f"{self.consecutive_overflows} steps in a row and the loss scale is down to "
                    f"min_scale={self.min_scale:g}; the loss is probably NaN/inf (check the "
                    f"inputs, the learning rate, or a division by zero in the loss)")
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


def _cast_floats(obj: Any, dtype: torch.dtype) -> Any:
    """Cast every floating-point tensor in a (nested) tensor/list/tuple/dict."""
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, obj)


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm))


def _cast_io(module: nn.Module, input_dtype: torch.dtype, output_dtype: torch.dtype) -> None:
    """Hooks that cast a module's floating inputs and outputs (state_dict is untouched)."""
    module.register_forward_pre_hook(lambda m, args: _cast_floats(args, input_dtype))
    module.register_forward_hook(lambda m, args, out: _cast_floats(out, output_dtype))


class _Autocast:
    """Enter autocast before the model's forward and leave it after (even if forward raises)."""

    def __init__(self, device_type: str, dtype: torch.dtype) -> None:
        self.device_type, self.dtype, self.active = device_type, dtype, []

    def enter(self, module, args) -> None:
        ctx = torch.autocast(self.device_type, dtype=self.dtype)
        ctx.__enter__()
        self.active.append(ctx)

    def exit(self, module, args, output) -> Any:
        self.active.pop().__exit__(None, None, None)
        return _cast_floats(output, torch.float32)


def unscale_and_check(grads: list[torch.Tensor], found: torch.Tensor,
                      inv_scale: torch.Tensor) -> None:
    """What torch's fused `_amp_foreach_non_finite_check_and_unscale_` does, in two steps:
    found += 1 if any gradient holds an inf or NaN; every gradient *= inv_scale."""
    largest = torch.stack(torch._foreach_norm(grads, float("inf")))  # inf and NaN survive the max
    found += largest.isfinite().logical_not().any()
    torch._foreach_mul_(grads, inv_scale.reshape(()))  # foreach takes a 0-d tensor as the scalar


class MixedPrecisionOptimizer:
    """Wraps a torch optimizer with loss scaling, overflow skipping and (O2) fp32 master weights."""

    def __init__(self, optimizer: torch.optim.Optimizer, scaler: Optional[DynamicLossScaler] = None,
                 master_weights: bool = False, check_finite: Optional[bool] = None) -> None:
        self.optimizer, self.scaler = optimizer, scaler
        # skip steps whose gradients are inf/nan on any rank; always on with a scaler
        self.check_finite = (
            scaler is not None if check_finite is None else (check_finite or scaler is not None)
        )
        # (model half param, fp32 master)
        self._copies: list[tuple[nn.Parameter, nn.Parameter]] = []
        if master_weights:
            for group in optimizer.param_groups:  # same group dicts, so LR schedulers keep working
                masters = []
                for p in group["params"]:
                    if p.dtype == torch.float32:
                        masters.append(p)
                    else:
                        master = nn.Parameter(p.detach().float())
                        # tensor-parallel marks (splits, replicas)
                        master.__dict__.update(p.__dict__)
                        self._copies.append((p, master))
                        masters.append(master)
                group["params"] = masters
        self._unscaled, self._found_inf = False, False
        self.last_step_skipped = False
        self.skipped_steps = 0

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def master_pairs(self) -> list[tuple[nn.Parameter, nn.Parameter]]:
        """O2's (half model parameter, fp32 master) pairs; empty otherwise."""
        return list(self._copies)

    def params(self) -> Iterator[nn.Parameter]:
        """The parameters the optimizer updates (fp32 masters under O2)."""
        for group in self.optimizer.param_groups:
            yield from group["params"]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for model_param, _ in self._copies:
            model_param.grad = None
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def backward(self, loss: torch.Tensor) -> None:
        if self.scaler is not None:
            loss = loss * self.scaler.scale
        loss.backward()

    def unscale_(self) -> bool:
        """Turn scaled gradients into true fp32-master gradients (once per step).

        Returns True if any rank of the job found an inf/nan gradient. The check runs with or
        without a scaler (apex's loss_scale="dynamic": bf16 never scales, but a non-finite
        gradient must still never reach the weights)."""
        if self._unscaled:
            return self._found_inf
        for model_param, master in self._copies:  # O2: the half model's grads feed the fp32 masters
            master.grad = None if model_param.grad is None else model_param.grad.float()
        if self.check_finite:
            grads = [p.grad for p in self.params() if p.grad is not None]
            found = torch.zeros(1, device=grads[0].device if grads else gpc.device)
            inv_scale = torch.full((1,), 1.0 / self.loss_scale, device=found.device)
            by_device: dict[tuple, list[torch.Tensor]] = {}
            for g in grads:
                by_device.setdefault((g.device, g.dtype), []).append(g)
            for (device, dtype), group in by_device.items():
                # the fused kernel has no bf16 CUDA version
                if device.type == "cuda" and dtype == torch.bfloat16:
                    unscale_and_check(group, found, inv_scale)
                else:  # fused: one kernel per (device, dtype) unscales and checks
                    torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv_scale)
            # data, pipeline and tensor ranks skip together
            if gpc.is_initialized and gpc.world_size > 1:
                found = found.to(gpc.device)
                dist.all_reduce(found, op=dist.ReduceOp.MAX)
            self._found_inf = bool(found.item())
        self._unscaled = True
        return self._found_inf

    def clip_grad_norm(self, max_norm: float, group: Optional[dist.ProcessGroup] = None) -> float:
        """Clip unscaled gradients to the global norm of the whole model.

        `group`: the ranks holding the *other* parts of the model (pipeline stages, tensor
        shards). A parameter held identically by k tensor ranks adds its squares / k, so each
        element counts once."""
        if self.unscale_():
            return math.inf
        params = [p for p in self.params() if p.grad is not None]
        device = params[0].grad.device if params else gpc.device
        sq = torch.zeros((), device=device)
        if params:
            norms = torch._foreach_norm([p.grad for p in params])
            weights = torch.tensor([1.0 / replicas(p) for p in params], device=device)
            sq = (torch.stack(norms).float() ** 2 * weights).sum()
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(sq, group=group)
        total = sq.sqrt()
        # same formula as torch.nn.utils.clip_grad_norm_
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        if params:
            torch._foreach_mul_([p.grad for p in params], coef.to(device))
        return total.item()

    def step(self) -> bool:
        """Unscale, then step unless some rank overflowed; returns whether a step was taken."""
        found_inf = self.unscale_()
        if found_inf and self.scaler is None:  # a scaler's back-off says it all; here, say it
            get_dist_logger().warning(f"non-finite gradient on some rank: step "
                                      f"{self.skipped_steps + 1} skipped on every rank")
        self.skipped_steps += found_inf
        if not found_inf:
            self.optimizer.step()
            with torch.no_grad():
                for model_param, master in self._copies:
                    model_param.copy_(master)
        if self.scaler is not None:
            self.scaler.update(found_inf)
        self._unscaled, self._found_inf = False, False
        self.last_step_skipped = found_inf
        return not found_inf

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "masters": [master.detach().clone() for _, master in self._copies]}

    def load_state_dict(self, state: dict) -> None:
        if "optimizer" not in state:  # a plain torch optimizer's state
            self.optimizer.load_state_dict(state)
            return
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        with torch.no_grad():
            for (model_param, master), saved in zip(self._copies, state.get("masters", [])):
                master.copy_(saved)
                model_param.copy_(saved)


_CPU_HALF: list = []  # the measured answer of cpu_half_dtype, once per process


def cpu_half_dtype() -> Optional[torch.dtype]:
    """bfloat16 if this CPU runs it at least as fast as float32, else None (compute in float32).

    CPUs have no fast float16 kernels (a ResNet-34 step measured 75x slower than bf16), and
    only some have bf16 ones: on CPUs without them a bf16 ResNet-34 step measured 40x slower
    than fp32. A small conv + matmul is timed both ways (a few ms); rank 0's answer is used
    by every rank, so the whole job computes alike."""
    if not _CPU_HALF:
        def step(dtype: Optional[torch.dtype]) -> float:
            conv, lin = nn.Conv2d(16, 16, 3, padding=1), nn.Linear(256, 256)
            x = torch.randn(8, 16, 16, 16)
            best = math.inf
            for _ in range(3):
                start = time.perf_counter()
                with torch.autocast("cpu", dtype=dtype or torch.bfloat16,
                                    enabled=dtype is not None):
                    y = lin(conv(x).flatten(1)[:, :256])
                y.float().sum().backward()
                best = min(best, time.perf_counter() - start)
            return best
        with torch.random.fork_rng(devices=[]):  # the RNG stays as seeded
            answer = [torch.bfloat16 if step(torch.bfloat16) <= step(None) else None]
        if gpc.is_initialized and gpc.world_size > 1:
            dist.broadcast_object_list(answer, src=0)
        _CPU_HALF.append(answer[0])
    return _CPU_HALF[0]


OPT_LEVELS = ("O0", "O1", "O2", "O3")


def initialize(model: nn.Module, optimizer: torch.optim.Optimizer, opt_level: str = "O1",
               loss_scale: Union[str, float, None] = "dynamic", dtype: torch.dtype = torch.float16,
               device_type: Optional[str] = None,
               **scaler_kwargs: Any) -> tuple[nn.Module, MixedPrecisionOptimizer]:
    """Prepare `model` in place for `opt_level` and wrap `optimizer` (apex's amp.initialize)."""
    if opt_level not in OPT_LEVELS:
        raise ValueError(f"[rank {gpc.rank}] unknown opt_level {opt_level!r}; use one of "
                         f"{', '.join(OPT_LEVELS)}")
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"[rank {gpc.rank}] amp dtype must be "
                         f"torch.float16 or torch.bfloat16, got {dtype}")
    device_type = device_type or next(model.parameters()).device.type
    # a ModuleList (pipeline chunks) has no forward of its own: each chunk gets the hooks
    for part in (model if isinstance(model, nn.ModuleList) else [model]):
        if opt_level == "O1":
            autocast = _Autocast(device_type, dtype)
            part.register_forward_pre_hook(autocast.enter)
            part.register_forward_hook(autocast.exit, always_call=True)
        elif opt_level in ("O2", "O3"):
            part.to(dtype)
            if opt_level == "O2":  # normalisation statistics need fp32's precision
                for module in part.modules():
                    if _is_norm(module):
                        module.float()
                        _cast_io(module, torch.float32, dtype)
            _cast_io(part, dtype, torch.float32)
    # Scaling is for fp16's narrow range only; fp32 and bf16 don't need it.
    use_scaler = opt_level != "O0" and dtype == torch.float16 and loss_scale is not None
    # apex's loss_scale="dynamic" also means "skip non-finite steps": keep that in bf16 too
    check_finite = opt_level != "O0" and loss_scale == "dynamic"
    if use_scaler and loss_scale != "dynamic":  # a fixed scale: never grows, never backs off
        scaler_kwargs = dict(init_scale=float(loss_scale), min_scale=float(loss_scale),
                             max_scale=float(loss_scale), growth_interval=2**62)
    scaler = DynamicLossScaler(**scaler_kwargs) if use_scaler else None
    return model, MixedPrecisionOptimizer(optimizer, scaler, master_weights=opt_level == "O2",
                                          check_finite=check_finite)


@contextmanager
def scale_loss(loss: torch.Tensor, optimizer: MixedPrecisionOptimizer) -> Iterator[torch.Tensor]:
    """Yield loss * S for backward; gradients stay scaled until optimizer.step() / unscale_()."""
    yield loss * optimizer.loss_scale
