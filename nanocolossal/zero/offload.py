"""ZeRO offload: this rank's fp32 master shard and its optimizer state live in CPU memory, and the
optimizer steps there -- ZeRO-Offload's split: the accelerator keeps what forward and backward
touch, the CPU what only the step touches.

    zero = dict(level=1|2|3, offload='cpu')      (v0.1: tensor_placement_policy='cpu')

Who holds what, per rank (Psi parameters, N data ranks, AdamW; mixed.py's table without offload):

                      model's device (gpc.device)     offload_device (CPU)
    parameters        as the level keeps them         -
    gradients         as the level keeps them; my     4 Psi/N  fp32 copy of my shard,
                      shard freed by the copy-out     from copy-out to the next zero_grad
    fp32 masters      -                               4 Psi/N  (pinned on CUDA)
    optimizer state   -                               8 Psi/N  (AdamW's two states)

In the step, after the copy-out (bytes; fp32 -- under O2 the device's are half, 2 per element):
    level 1   device 4 Psi + 4 Psi (DDP's averages, kept to zero_grad)   CPU 16 Psi/N
    level 2   device 4 Psi                                               CPU 16 Psi/N
    level 3   device 4 Psi/N (my parameter shard)                        CPU 16 Psi/N
against 8 Psi + 8 Psi/N, 4 Psi + 12 Psi/N and 16 Psi/N on the device without offload: the
12 Psi/N of masters and state have left the device. Every segment gets a master here, an fp32
one too: the step writes the master, and the model's segment (`view`) is a copy of it.

One step, on CUDA (one stream; "H2D" / "D2H" the copies over PCIe):

    backward   gradients reduced into my shard on the device, as without offload
    check      the inf/nan check (and the unscale, fp32 gradients) in one fused pass on the
               device: on the CPU it takes about as long as the step (mixed.py; half gradients
               with a loss scale are unscaled after the copy-out, as without offload)
    copy-out   D2H every segment's gradient into a pinned fp32 buffer (non_blocking, queued in
               one go), then the host waits for the stream once; my device shard is freed
    step       on the CPU: clipping's squares, the user's optimizer on the masters and state
               (fused=True: torch's fused CPU kernel, some 4.5x faster than foreach=True)
    copy-in    H2D each master into its segment of the model (non_blocking, from pinned memory);
               the all-gather (levels 1-2) and the next forward queue behind them on the stream

The CPU step does not overlap device compute; a master is written again only after the next
copy-out's wait, so no copy-in still reads it. Off CUDA (and in the tests) both devices are the CPU:
the copies are plain copies, and training is bit for bit the run without offload.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Offload:
    """The CPU side of a ZeRO optimizer: masters of its segments and the copies to and fro."""

    def __init__(self, device: Any = "cpu") -> None:
        self.device = torch.device(device)  # offload_device: where masters and state live
        self.pin = torch.cuda.is_available()  # pinned pages: the DMA engine copies them async

    def master(self, view: torch.Tensor) -> nn.Parameter:
        """The master of the model's segment `view`: fp32 (float64 stays float64), on the CPU."""
        dtype = torch.float64 if view.dtype == torch.float64 else torch.float32
        master = torch.empty(view.shape, dtype=dtype, device=self.device, pin_memory=self.pin)
        return nn.Parameter(master.copy_(view.detach()))

    def copy_out(self, pairs: list[tuple[nn.Parameter, nn.Parameter]]) -> None:
        """(view, master) pairs: each view's gradient into its master's, then wait once."""
        has = [(v, m) for v, m in pairs if v.grad is not None]
        for v, m in pairs:
            m.grad = None
        if not has:
            return
        grads = [torch.empty(m.shape, dtype=m.dtype, device=self.device, pin_memory=self.pin)
                 for _, m in has]
        torch._foreach_copy_(grads, [v.grad for v, _ in has], non_blocking=True)
        if any(v.is_cuda for v, _ in has):  # the host waits for the device's queued copies
            torch.cuda.current_stream(has[0][0].device).synchronize()
        for (v, m), grad in zip(has, grads):
            m.grad, v.grad = grad, None  # the device shard is freed: the CPU has it now

    def copy_in(self, pairs: list[tuple[nn.Parameter, nn.Parameter]]) -> None:
        """Each updated master into the model's segment (non_blocking: the host does not wait)."""
        with torch.no_grad():
            torch._foreach_copy_([v for v, _ in pairs], [m for _, m in pairs], non_blocking=True)
