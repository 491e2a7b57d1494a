"""Mixed precision: compute in 16 bits, keep what accumulates in 32.

fp16 halves memory traffic and runs on tensor cores, but gradients below ~6e-8 flush to zero:
loss scaling (amp_scaler.py) lifts them into range, and a step whose gradients overflowed is
skipped -- on every rank alike. bfloat16 has fp32's range: no scaling. (On a CPU, which half
type is fast is read from its instruction set: cpu_half.py.)

The opt levels (as apex):
    O0  fp32 everything                                              (reference)
    O1  fp32 weights, forward under autocast (fp16/bf16 per op)      = AMP_TYPE.TORCH
    O2  fp16 model except normalisation layers, fp32 master weights  = AMP_TYPE.NAIVE
        that the optimizer updates and copies back after each step
    O3  fp16 everything, no master weights                           (speed baseline)
Model outputs come back in fp32 so the loss is computed in full precision -- except under the
Engine at O1, which runs the criterion under autocast too (torch's recipe): autocast computes
torch's losses in fp32 anyway, and no fp32 copy of the output is held through backward
(amp_casts.py: autocast_loss).

    from nanocolossal import amp                # apex: from apex import amp
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    optimizer.clip_grad_norm(1.0)   # optional: acts on unscaled gradients
    optimizer.step()                # skipped (and S backed off) on overflow

initialize's `outputs` (per pipeline chunk; default all): is its output the model's, cast to
fp32? `keep_batchnorm_fp32` (O2/O3; default: O2 only): normalisation layers stay fp32.

MixedPrecisionOptimizer is an fp32 run's optimizer (plain_optimizer.py) plus the steps of its
docstring, in that order; the optimised variant last (torch's fused optimizers skip on the
device). Checkpoint state: checkpoint/amp.py; clipping: clip.py. The check runs with or without a
scaler (apex's loss_scale="dynamic": bf16 never scales, but a non-finite gradient must never
reach the weights); nothing waits for the device but step's one read of the flag. Under
counted-target weighting (loss_weights.py) a rank's piece of the loss may carry up to G x its
sample share (G: the ranks the gradient average divides by): backward multiplies by S / G
(`backward_scale`), which keeps its half gradients one process's size.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from .amp_casts import autocast_loss, cast_to_half, hook_autocast
from .amp_checks import check_initialize, count_skipped
from .amp_scaler import DynamicLossScaler, make_scaler, unscale_and_check, unscale_grads
from .checkpoint.amp import AmpState
from .clip import SplitOver, clip_grad_norm_
from .config import AMP_TYPE  # owned by the config (it names the modes)
from .context import gpc
from .plain_optimizer import PlainOptimizer

# nc.amp.X: this file's names, and the loss scaler's and the config's that users reach from here
__all__ = ["AMP_TYPE", "OPT_LEVELS", "DynamicLossScaler", "MixedPrecisionOptimizer",
           "autocast_loss", "initialize", "make_scaler", "scale_loss", "unscale_and_check",
           "unscale_grads"]


def make_masters(optimizer: torch.optim.Optimizer) -> list[tuple[nn.Parameter, nn.Parameter]]:
    """O2: an fp32 master for each half parameter, put in its place in the optimizer's groups
    (the same group dicts, so LR schedulers keep working); returns the (half, master) pairs."""
    pairs = []
    for group in optimizer.param_groups:
        masters = []
        for p in group["params"]:
            if p.dtype == torch.float32:
                masters.append(p)
                continue
            master = nn.Parameter(p.detach().float())
            master.__dict__.update(p.__dict__)  # tensor-parallel marks (splits, ...)
            pairs.append((p, master))
            masters.append(master)
        group["params"] = masters
    return pairs


class MixedPrecisionOptimizer(AmpState, PlainOptimizer):
    """A torch optimizer with loss scaling, overflow skipping and (O2) fp32 master weights.

        backward   (loss * S/G).backward()                     half gradients, times S/G
        step       masters' gradients = the model's / (S/G)    unscale (G: the module's)
                   any inf/nan? all-reduced (MAX) over the job  check, agree: all skip together
                   step the masters, round them into the model  step -- or skip
                   S backs off after an overflow, grows after   update
                   a clean stretch (amp_scaler.py)
    """

    _flag: Optional[torch.Tensor] = None  # this step's overflow flag, once unscaled
    _loaded = False  # the model was loaded since the last step (checkpoint/amp.py)
    # step's counters (amp_checks.py): tensors on the device where the optimizer skips on its own
    _last_skipped: Union[bool, torch.Tensor] = False
    _skipped: Union[int, torch.Tensor] = 0

    def __init__(self, optimizer: torch.optim.Optimizer, scaler: Optional[DynamicLossScaler] = None,
                 master_weights: bool = False, check_finite: bool = False) -> None:
        super().__init__(optimizer)
        self.scaler = scaler
        # skip steps whose gradients are inf/nan on any rank: always with a scaler, else if asked
        self.check_finite = check_finite or scaler is not None
        self._master_pairs = make_masters(optimizer) if master_weights else []

    # -- masters (O2): gradients in, weights out ------------------------------------------------
    def _grads_to_masters(self) -> None:
        """The half model's gradients feed the fp32 masters (zero/offload.py: on the CPU)."""
        for model_param, master in self._master_pairs:
            master.grad = None if model_param.grad is None else model_param.grad.float()

    def _masters_to_model(self) -> None:
        """The updated masters rounded into the half model (zero/offload.py: from the CPU)."""
        with torch.no_grad():
            halves = [p for p, _ in self._master_pairs]
            torch._foreach_copy_(halves, [m for _, m in self._master_pairs])

    def zero_grad(self, set_to_none: bool = True) -> None:
        for model_param, _ in self._master_pairs:
            model_param.grad = None
        super().zero_grad(set_to_none)

    def drop_gradients(self) -> None:
        """Also the overflow flag of the dropped gradients, once unscaled or clipped."""
        super().drop_gradients()
        self._flag = None

    # -- scale ----------------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    @property
    def backward_scale(self) -> float:
        """What backward multiplies by: S, or S / G under counted targets (module docstring)."""
        return self.loss_scale / self.weighed_ranks if self.scaler is not None else 1.0

    def backward(self, loss: torch.Tensor) -> None:
        super().backward(loss * self.backward_scale if self.scaler is not None else loss)

    # -- unscale, check, agree ------------------------------------------------------------------
    def overflow_flag(self) -> torch.Tensor:
        """Unscale once per step; a one-element device tensor, 1 if any rank found an inf/nan."""
        if self._flag is None:
            if self._loaded:  # model.load_state_dict since the last step (follow_loads)
                self._masters_from_model()
            self._flag = self._agreed(self._unscale_and_check())
        return self._flag

    def _unscale_and_check(self) -> torch.Tensor:
        """The masters' gradients from the model's, unscaled; this rank's flag (zero/mixed.py)."""
        if self._master_pairs:
            self._grads_to_masters()
        grads = [p.grad for p in self.params() if p.grad is not None]
        if self.check_finite:  # always with a scaler; at scale 1 (bf16) unscale_grads only checks
            return unscale_grads(grads, self.backward_scale)
        return torch.zeros(1, device=grads[0].device if grads else gpc.device, dtype=torch.float32)

    def _agreed(self, found: torch.Tensor) -> torch.Tensor:
        """The flag all-reduced (MAX) over the job: every rank skips together."""
        if self.check_finite and gpc.is_initialized and gpc.world_size > 1:
            found = found.to(gpc.device)
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        return found

    def unscale_(self) -> bool:
        """overflow_flag, read: True if any rank found an inf/nan gradient."""
        return bool(self.overflow_flag().item())

    # -- step or skip, update S -----------------------------------------------------------------
    def step(self) -> Union[bool, torch.Tensor]:
        """Unscale, then step unless some rank found an inf/nan; returns whether it stepped."""
        flag = self.overflow_flag()
        self.open_group = False
        fused = getattr(self.optimizer, "_step_supports_amp_scaling", False)  # takes found_inf
        if self.check_finite and self.scaler is None and fused:  # nothing for the host to update
            skipped = self._step_deciding_on_device(flag)  # the optimised variant, below
        else:
            skipped = self.check_finite and bool(flag.item())  # the host reads the flag once
            if not skipped:
                self._step()
            if self.scaler is not None:
                self.scaler.update(skipped)
        self._flag = None
        count_skipped(self, skipped)  # (amp_checks.py: the counters, and a warning)
        return not skipped if isinstance(skipped, bool) else skipped.logical_not()

    def _step(self) -> None:
        """The optimizer's step; O2: the updated masters copied into the half model."""
        self.optimizer.step()
        if self._master_pairs:
            self._masters_to_model()

    # -- the optimised variant: the skip decided on the device, nothing read --------------------
    def _step_deciding_on_device(self, flag: torch.Tensor) -> torch.Tensor:
        """Without a scaler, torch's fused optimizers take the flag as their `found_inf` and skip
        on the device: step returns a 0-d bool tensor, and the skip is counted there
        (skipped_steps reads it when asked) and not logged."""
        self.optimizer.found_inf = flag.reshape(())
        try:
            self._step()
        finally:
            del self.optimizer.found_inf
        return flag[0] > 0

    # -- clip (clip.py), on the unscaled gradients ----------------------------------------------
    def clip_grad_norm_(self, max_norm: float, group: Optional[dist.ProcessGroup] = None,
                        split_over: Optional[SplitOver] = None) -> torch.Tensor:
        """PlainOptimizer's, after unscaling; the norm is inf where a gradient overflowed, and
        then nothing is clipped (the step is skipped with its gradients as they are)."""
        return clip_grad_norm_(list(self.params()), max_norm, self.holders, group, split_over,
                               self.overflow_flag()[0] > 0)

    # -- what ZeRO, MoE and the logs read -------------------------------------------------------
    @property
    def skipped_steps(self) -> int:
        """Steps skipped on a non-finite gradient (read from the device when asked)."""
        return int(self._skipped)

    @property
    def last_step_skipped(self) -> bool:
        return bool(self._last_skipped)

    def master_pairs(self) -> list[tuple[nn.Parameter, nn.Parameter]]:
        """O2's (half model parameter, fp32 master) pairs; empty otherwise."""
        return list(self._master_pairs)

    def drop_masters(self) -> None:
        """O2: the optimizer steps the half model parameters again and the whole-model fp32
        masters are forgotten (ZeRO makes masters of each rank's shard only: zero/mixed.py)."""
        half_of = {id(master): p for p, master in self._master_pairs}
        for group in self.optimizer.param_groups:
            group["params"] = [half_of.get(id(q), q) for q in group["params"]]
        self._master_pairs = []


OPT_LEVELS = ("O0", "O1", "O2", "O3")


def initialize(model: nn.Module, optimizer: torch.optim.Optimizer, opt_level: str = "O1",
               loss_scale: Union[str, float, None] = "dynamic", dtype: torch.dtype = torch.float16,
               device_type: Optional[str] = None, outputs: Optional[list[bool]] = None,
               keep_batchnorm_fp32: Optional[bool] = None,
               **scaler_kwargs: Any) -> tuple[nn.Module, MixedPrecisionOptimizer]:
    """Prepare `model` in place for `opt_level`, wrap `optimizer` (the module docstring)."""
    check_initialize(opt_level, dtype, OPT_LEVELS)  # (amp_checks.py)
    device_type = device_type or next(model.parameters()).device.type
    # a ModuleList (pipeline chunks) has no forward of its own: each chunk gets the hooks
    chunks = model if isinstance(model, nn.ModuleList) else [model]
    for chunk, is_output in zip(chunks, outputs or [True] * len(chunks)):
        if opt_level == "O1":
            hook_autocast(chunk, device_type, dtype, output_fp32=is_output)
        elif opt_level in ("O2", "O3"):
            keep_norms = opt_level == "O2" if keep_batchnorm_fp32 is None else keep_batchnorm_fp32
            cast_to_half(chunk, dtype, keep_norms, output_fp32=is_output)
    mixed = opt_level != "O0"  # O0 is the fp32 reference
    needs_scaling = mixed and dtype == torch.float16  # fp32 and bf16 have the range to need none
    scaler = make_scaler(loss_scale, **scaler_kwargs) if needs_scaling else None
    # apex's loss_scale="dynamic" also means "skip non-finite steps": keep that in bf16 too
    check_finite = mixed and loss_scale == "dynamic"
    mixed_optimizer = MixedPrecisionOptimizer(optimizer, scaler, opt_level == "O2", check_finite)
    if opt_level == "O2":  # (checkpoint/amp.py: only masters must follow a loaded model)
        mixed_optimizer.follow_loads(model)
    return model, mixed_optimizer


@contextmanager
def scale_loss(loss: torch.Tensor, optimizer: MixedPrecisionOptimizer) -> Iterator[torch.Tensor]:
    """Yield loss * S for backward; gradients stay scaled until optimizer.step() / unscale_()."""
    yield loss * optimizer.backward_scale
