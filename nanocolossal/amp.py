"""Mixed precision: compute in 16 bits, keep what accumulates in 32.

fp16 halves memory traffic and runs on tensor cores, but it has a narrow range: gradients below
~6e-8 flush to zero. Loss scaling (amp_scaler.py) lifts them back into range: scale the loss by
S before backward, divide the gradients by S before the step, and skip the step (and lower S)
when a gradient overflowed. Every rank must make the same decision, so the overflow flag is
all-reduced (MAX) over the whole job before anyone steps. bfloat16 has fp32's range, so it needs
no scaling. (On a CPU, which half type is fast is read from its instruction set: cpu_half.py.)

The opt levels (as apex):
    O0  fp32 everything                                              (reference)
    O1  fp32 weights, forward under autocast (fp16/bf16 per op)      = AMP_TYPE.TORCH
    O2  fp16 model except normalisation layers, fp32 master weights  = AMP_TYPE.NAIVE
        that the optimizer updates and copies back after each step
    O3  fp16 everything, no master weights                           (speed baseline)
Model outputs come back in fp32 so the loss is computed in full precision -- except under the
Engine at O1, which runs the criterion under autocast too (torch's recipe; Colossal-AI's
TorchAMPLoss): autocast computes torch's losses (cross_entropy, nll_loss, mse_loss, ...) in fp32
anyway, and no fp32 copy of the output (GPT logits: b x s x V x 4 bytes) is held through backward
(autocast_loss). What autocast keeps in half stays half in a criterion of your own, though: a
log_softmax on a CPU (on CUDA it is an fp32 op) -- upcast there, or use torch's loss.

    from nanocolossal import amp                # apex: from apex import amp
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    optimizer.clip_grad_norm(1.0)   # optional: acts on unscaled gradients
    optimizer.step()                # skipped (and S backed off) on overflow

MixedPrecisionOptimizer is an fp32 run's optimizer (plain_optimizer.py) plus, in the order a
step meets them: (O2) fp32 masters; the loss scale S; unscale, check and agree on an overflow;
step or skip, and update S. Its checkpoint state is amp_state.py's; clipping is clip.py's.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from .amp_casts import Autocast, autocast_loss, cast_io, is_norm
from .amp_checks import check_initialize
from .amp_scaler import (
    DynamicLossScaler,
    make_scaler,
    unscale_and_check,
    unscale_and_check_fused,
    unscale_grads,
)
from .amp_state import AmpState
from .clip import SplitOver, clip_grad_norm_
from .config import AMP_TYPE  # owned by the config (it names the modes)
from .context import gpc
from .logging import get_dist_logger
from .plain_optimizer import PlainOptimizer

# nc.amp.X: this file's names, and the loss scaler's and the config's that users reach from here
__all__ = ["AMP_TYPE", "OPT_LEVELS", "DynamicLossScaler", "MixedPrecisionOptimizer",
           "autocast_loss", "initialize", "make_scaler", "scale_loss", "unscale_and_check",
           "unscale_and_check_fused", "unscale_grads"]


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

        backward   (loss * S).backward()                       half gradients, times S
        step       masters' gradients = the model's / S        unscale
                   any inf/nan? all-reduced (MAX) over the job  check, agree: all skip together
                   step the masters, round them into the model  step -- or skip
                   S backs off after an overflow, grows after   update
                   a clean stretch (amp_scaler.py)
    """

    def __init__(self, optimizer: torch.optim.Optimizer, scaler: Optional[DynamicLossScaler] = None,
                 master_weights: bool = False, check_finite: bool = False) -> None:
        super().__init__(optimizer)
        self.scaler = scaler
        # skip steps whose gradients are inf/nan on any rank: always with a scaler, else if asked
        self.check_finite = check_finite or scaler is not None
        self._master_pairs = make_masters(optimizer) if master_weights else []
        self._flag: Optional[torch.Tensor] = None  # this step's overflow flag, once unscaled
        self._loaded = False  # the model was loaded since the last step (amp_state.py)
        # bools and ints, or tensors on the device where the optimizer skips on its own (step)
        self._last_skipped: Union[bool, torch.Tensor] = False
        self._skipped: Union[int, torch.Tensor] = 0

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
        """What backward multiplies by and unscale_ divides by: the loss scale S, or S / G where
        the loss is weighed by counted targets (loss_weights.py, set by initialize): there a
        rank's piece of the loss may carry up to G x its sample share (G: the ranks the gradient
        average divides by), and dividing S by G keeps its half gradients one process's size."""
        return self.loss_scale / self.weighed_ranks if self.scaler is not None else 1.0

    def backward(self, loss: torch.Tensor) -> None:
        super().backward(loss * self.backward_scale if self.scaler is not None else loss)

    # -- unscale, check, agree ------------------------------------------------------------------
    def overflow_flag(self) -> torch.Tensor:
        """Turn scaled gradients into true fp32-master gradients (once per step) and return a
        one-element tensor on the device: 1 if any rank of the job found an inf/nan gradient.

        The check runs with or without a scaler (apex's loss_scale="dynamic": bf16 never scales,
        but a non-finite gradient must still never reach the weights). Nothing here waits for
        the device: the flag is read (step) only where the host must decide."""
        if self._flag is not None:
            return self._flag
        if self._loaded:  # model.load_state_dict since the last step (follow_loads)
            self._masters_from_model()
        self._flag = self._agreed(self._unscale_and_check())
        return self._flag

    def _unscale_and_check(self) -> torch.Tensor:
        """The masters' gradients from the model's, unscaled; this rank's flag (ZeRO offload
        checks on the device before its copy-out instead: zero/mixed.py)."""
        self._grads_to_masters()
        grads = [p.grad for p in self.params() if p.grad is not None]
        if not self.check_finite:  # the fused kernel's flag: fp32 always
            return torch.zeros(1, device=grads[0].device if grads else gpc.device,
                               dtype=torch.float32)
        return unscale_grads(grads, self.backward_scale)  # amp_scaler.py: fused where it can

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
        """Unscale, then step unless some rank found an inf/nan; returns whether a step was
        taken. The host decides: one read of the flag per step (but see the variant below)."""
        flag = self.overflow_flag()
        self.open_group = False
        if not self.check_finite:  # the check turned off: nothing to decide
            skipped: Union[bool, torch.Tensor] = False
            self._step()
        elif self.scaler is None and getattr(self.optimizer, "_step_supports_amp_scaling", False):
            skipped = self._step_deciding_on_device(flag)  # the optimised variant, below
        else:
            skipped = bool(flag.item())  # the host decides: one read of the flag
            if not skipped:
                self._step()
            if self.scaler is not None:
                self.scaler.update(skipped)
        self._flag = None
        self._count_skipped(skipped)
        return not skipped if isinstance(skipped, bool) else skipped.logical_not()

    def _step(self) -> None:
        """The optimizer's step; O2: the updated masters copied into the half model."""
        self.optimizer.step()
        if self._master_pairs:
            self._masters_to_model()

    def _count_skipped(self, skipped: Union[bool, torch.Tensor]) -> None:
        if skipped is True and self.scaler is None:  # a scaler's back-off says it; here, say it
            get_dist_logger().warning(f"non-finite gradient on some rank: this step is skipped on "
                                      f"every rank ({self.skipped_steps + 1} skipped so far)")
        self._last_skipped, self._skipped = skipped, self._skipped + skipped

    # -- the optimised variant: the skip decided on the device, nothing read --------------------
    def _step_deciding_on_device(self, flag: torch.Tensor) -> torch.Tensor:
        """Without a scaler (nothing for the host to update), torch's fused optimizers take the
        flag as their `found_inf` and skip on the device: step returns a 0-d bool tensor, and
        the skip is counted there (skipped_steps reads it when asked) and not logged."""
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
        skip = self.overflow_flag()[0] > 0
        return clip_grad_norm_(list(self.params()), max_norm, self.holders, group, split_over,
                               skip)

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
    """Prepare `model` in place for `opt_level` and wrap `optimizer` (apex's amp.initialize).
    `outputs` (per pipeline chunk; default all): is its output the model's, cast to fp32?
    `keep_batchnorm_fp32` (O2/O3; default: O2 only): normalisation layers stay fp32."""
    check_initialize(opt_level, dtype, OPT_LEVELS)  # (amp_checks.py)
    device_type = device_type or next(model.parameters()).device.type
    keep_norms = opt_level == "O2" if keep_batchnorm_fp32 is None else keep_batchnorm_fp32
    # a ModuleList (pipeline chunks) has no forward of its own: each chunk gets the hooks
    chunks = model if isinstance(model, nn.ModuleList) else [model]
    for chunk, is_output in zip(chunks, outputs or [True] * len(chunks)):
        if opt_level == "O1":
            autocast = Autocast(device_type, dtype, output_fp32=is_output)
            chunk.register_forward_pre_hook(autocast.enter)
            chunk.register_forward_hook(autocast.exit, always_call=True)
        elif opt_level in ("O2", "O3"):
            chunk.to(dtype)
            if keep_norms:  # normalisation statistics need fp32's precision
                for module in chunk.modules():
                    if is_norm(module):
                        module.float()
                        cast_io(module, torch.float32, dtype)
            cast_io(chunk, dtype, torch.float32 if is_output else None)
    mixed = opt_level != "O0"  # O0 is the fp32 reference
    needs_scaling = mixed and dtype == torch.float16  # fp32 and bf16 have the range to need none
    scaler = make_scaler(loss_scale, **scaler_kwargs) if needs_scaling else None
    # apex's loss_scale="dynamic" also means "skip non-finite steps": keep that in bf16 too
    check_finite = mixed and loss_scale == "dynamic"
    mixed_optimizer = MixedPrecisionOptimizer(optimizer, scaler, master_weights=opt_level == "O2",
                                              check_finite=check_finite)
    mixed_optimizer.follow_loads(model)
    return model, mixed_optimizer


@contextmanager
def scale_loss(loss: torch.Tensor, optimizer: MixedPrecisionOptimizer) -> Iterator[torch.Tensor]:
    """Yield loss * S for backward; gradients stay scaled until optimizer.step() / unscale_()."""
    yield loss * optimizer.backward_scale
