"""Data parallelism: every rank holds the whole model, sees a different share of the batch,
and averages gradients with the other ranks before the optimizer step, so all replicas take the
same step -- the step one process would take on the concatenated batch.

Averaging after backward would leave the network idle during backward and the CPU/GPU idle during
communication. Instead gradients are packed into flat buckets (~25 MB) in *reverse* parameter order,
because backward produces the last layers' gradients first. A hook on each parameter writes its
gradient / N into its bucket slot (one pass: a scaled copy) the moment it is accumulated; when a
bucket is full its all-reduce starts asynchronously while backward carries on:

    backward   | grad L4 L3 | grad L2 L1 | grad L0 |
    all-reduce              |  bucket 0  |  bucket 1  | bucket 2 |
                                                                 ^ end-of-backward callback:
                                                                   wait, write .grad back

Rules that keep every rank's collectives matched (a mismatch is a hang):
  * buckets are launched in the same fixed order everywhere: a ready bucket waits for the
    ones before it;
  * parameters that got no gradient this backward (an unused branch) are not waited for:
    at the end of backward the remaining buckets are launched. A parameter that still holds a
    gradient (accumulated under no_sync, used in an earlier micro-step) sends that; one with
    none sends zeros. Each bucket also carries one "used" flag per parameter, reduced with
    the gradients, so every rank learns which parameters have a gradient anywhere: those get
    the averaged gradient on all ranks, the others keep grad=None -- as one process would;
  * the end of backward is also caught by a hook on the module's output: a rank where no
    parameter gets a gradient (its samples all skipped them) still joins the all-reduces.

Two options, after the core: with `gradient_as_bucket_view=True` each `.grad` *is* its bucket slot:
no copy back (and with `zero_grad(set_to_none=False)` backward accumulates straight into the
bucket); `compress="bf16"` (or "fp16") all-reduces a half-precision copy of each bucket -- half the
bytes, the sum in that precision, as torch's bf16_compress_hook (bench_ddp.py measures the effect).

`no_sync()` skips the communication (gradient accumulation); gradients keep accumulating in
`.grad` and the next synchronised backward averages the accumulated sum.

Before a launch, `nanocolossal plan` computes these bytes (nanocolossal/plan/formulas.py).
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Collection, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from .collectives import broadcast_buffers, broadcast_coalesced
from .context import gpc
from .ddp_checks import check_ddp, check_first_gradient, named_failure
from .extensions import Extension
from .nest import map_tensors
from .weak import weakly


class _Bucket:
    """A flat buffer for some parameters' gradients, followed by one 'used' flag per parameter."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        sizes = [p.numel() for p in params]
        self.offsets = [sum(sizes[:i]) for i in range(len(params))]
        self.numel = sum(sizes)
        self.buffer = torch.zeros(self.numel + len(params), dtype=params[0].dtype,
                                  device=params[0].device)
        self.work: Optional[dist.Work] = None  # its all-reduce, once launched
        self.ready = 0
        self.filled = [False] * len(params)  # which slots got this iteration's gradient

    def view(self, i: int) -> torch.Tensor:
        p = self.params[i]
        return self.buffer[self.offsets[i]: self.offsets[i] + p.numel()].view_as(p)

    def flags(self) -> torch.Tensor:
        return self.buffer[self.numel:]


class DistributedDataParallel(nn.Module):
    """Wrap `module` so that backward averages gradients over `process_group` (default: gpc's
    gradient group: the data-parallel ranks, times the sequence ranks if any).

    `reduced_elsewhere`: parameters this wrapper leaves alone because another wrapper averages
    them -- a weight two pipeline chunks of one rank share is averaged by the first chunk's."""

    # what ZeRO changes (zero/gradients.py): level 2's buckets come and go; errors name it
    bucket_class = _Bucket
    name = "DistributedDataParallel"
    other_way = ", or the gradient_handler, which averages after backward"  # offered in errors

    def __init__(self, module: nn.Module, process_group: Optional[dist.ProcessGroup] = None,
                 bucket_cap_mb: float = 25, broadcast_buffers: bool = True,
                 gradient_as_bucket_view: bool = False, compress: Optional[str] = None,
                 reduced_elsewhere: Collection[nn.Parameter] = ()) -> None:
        super().__init__()
        self.module = module
        # by default the data (x sequence) ranks
        self.process_group = process_group or gpc.gradient_group or dist.group.WORLD
        check_ddp(self, compress)  # a launched job, one model on every rank, none unfrozen later
        self.world_size = dist.get_world_size(self.process_group)
        self.broadcast_buffers = broadcast_buffers
        self.require_sync = True
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.wire_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(compress)
        broadcast_coalesced(list(module.parameters()) + list(module.buffers()),
                             dist.get_global_rank(self.process_group, 0), self.process_group)
        skip = {id(q) for q in reduced_elsewhere}  # another pipeline chunk's DDP reduces them
        params = [p for p in module.parameters() if p.requires_grad and id(p) not in skip]
        self.buckets = self._make_buckets(list(reversed(params)), int(bucket_cap_mb * 2**20))
        self._where = {p: (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._next_launch = 0  # buckets are launched strictly in order
        self._callback_queued = False
        for p in params:
            p.register_post_accumulate_grad_hook(weakly(self._grad_ready))

    def _make_buckets(self, params: list[nn.Parameter], cap_bytes: int) -> list[_Bucket]:
        """Consecutive parameters of one dtype and device, up to cap_bytes a bucket."""
        groups: list[list[nn.Parameter]] = []
        size = 0  # bytes in the last group
        for p in params:
            like = groups and (p.dtype, p.device) == (groups[-1][0].dtype, groups[-1][0].device)
            if not like or size + p.numel() * p.element_size() > cap_bytes:
                groups.append([])
                size = 0
            groups[-1].append(p)
            size += p.numel() * p.element_size()
        return [self.bucket_class(group) for group in groups]

    # -- forward / backward ---------------------------------------------------------------
    def forward(self, *args, **kwargs):
        # only training syncs buffers: in eval (uneven shares) a broadcast has no partner
        training = self.training and torch.is_grad_enabled()
        if self.broadcast_buffers and training and self.require_sync:
            self.sync_buffers()
        out = self.module(*args, **kwargs)
        if torch.is_grad_enabled():  # the all-reduce even if no parameter here gets a gradient
            finish = weakly(self._queue_finish)  # (a stage whose samples all skipped its layers)
            map_tensors(lambda t: t.register_hook(finish) if t.requires_grad else t, out)
        return out

    def _grad_ready(self, param: nn.Parameter) -> None:
        if not self.require_sync:
            return
        self._queue_finish()
        bucket, i = self._where[param]
        check_first_gradient(self, bucket, i)  # (ddp_checks.py: a layer used twice, checkpointed)
        self._write_slot(bucket, i)
        bucket.filled[i] = True
        bucket.ready += 1
        self._launch_ready()

    def _write_slot(self, bucket: _Bucket, i: int) -> None:
        """slot = .grad / N in one pass (no overflow in low precision); the parameter is used."""
        if self.gradient_as_bucket_view:
            return self._write_view(bucket, i)  # the option, below
        torch.div(bucket.params[i].grad, self.world_size, out=bucket.view(i))
        bucket.flags()[i] = 1

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if bucket.ready < len(bucket.params):
                return
            self._launch(bucket)
            self._next_launch += 1

    def _launch(self, bucket: _Bucket) -> None:
        for i, filled in enumerate(bucket.filled):
            if not filled:
                self._fill_unused(bucket, i)
        wire = bucket.buffer if self.wire_dtype is None else self._compressed(bucket)
        with named_failure(self, bucket):  # (ddp_checks.py: which bucket, which group)
            bucket.work = dist.all_reduce(wire, group=self.process_group, async_op=True)

    def _fill_unused(self, bucket: _Bucket, i: int) -> None:
        """No hook fired: the gradient of an earlier no_sync micro-step if any, else zeros."""
        if bucket.params[i].grad is None:
            bucket.view(i).zero_()
        else:
            self._write_slot(bucket, i)

    def _reduced_buckets(self) -> Iterator[_Bucket]:
        """End of backward: launch the buckets still waiting; yield each once it is reduced."""
        for bucket in self.buckets[self._next_launch:]:
            self._launch(bucket)
        for bucket in self.buckets:
            with named_failure(self, bucket):
                bucket.work.wait()
            yield bucket
        self._next_launch = 0
        self._callback_queued = False

    def _finish(self) -> None:
        """End of backward: every bucket reduced, write the averaged gradients back."""
        for bucket in self._reduced_buckets():
            if self.wire_dtype is not None:
                bucket.buffer.copy_(bucket.wire)  # decompress (the option, below)
            used = (bucket.flags() > 0).tolist()  # one read per bucket, not per parameter
            for i, p in enumerate(bucket.params):
                if not used[i]:  # no rank computed one: keep grad=None, as one process would
                    continue
                if self.gradient_as_bucket_view:
                    p.grad = bucket.view(i)
                elif p.grad is None:
                    p.grad = bucket.view(i).clone()
                else:
                    p.grad.copy_(bucket.view(i))
            bucket.flags().zero_()
            bucket.filled = [False] * len(bucket.params)
            bucket.work = None
            bucket.ready = 0

    def _queue_finish(self, *_) -> None:
        if self.require_sync and not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._callback_queued = True

    # -- around the core: accumulation, buffers -------------------------------------------
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate; the next one outside averages the sum."""
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous

    def train(self, mode: bool = True) -> "DistributedDataParallel":
        # leaving training: every replica evaluates with rank 0's BatchNorm statistics
        if self.training and not mode and self.broadcast_buffers:
            self.sync_buffers()
        return super().train(mode)

    def sync_buffers(self) -> None:
        """The first rank's buffers (BatchNorm statistics) to every replica, one message a dtype."""
        broadcast_buffers(self.module, self.process_group)

    # -- the options: gradients as bucket views, a compressed wire ------------------------
    def _write_view(self, bucket: _Bucket, i: int) -> None:
        """gradient_as_bucket_view: .grad becomes its slot, so _finish copies nothing back."""
        param = bucket.params[i]
        slot = bucket.view(i)
        if param.grad.data_ptr() == slot.data_ptr():  # already the slot
            slot.div_(self.world_size)
        else:
            torch.div(param.grad, self.world_size, out=slot)
            param.grad = slot
        bucket.flags()[i] = 1

    def _compressed(self, bucket: _Bucket) -> torch.Tensor:
        """compress: a half-precision copy, reduced in the bucket's place; _finish copies back."""
        bucket.wire = bucket.buffer.to(self.wire_dtype)
        return bucket.wire


class DdpSync(Extension):
    """DDP's part in the Engine and the pipeline executor (extensions.py): of the backwards before
    a step only the last averages -- a group's last micro-step, or a chunk's last micro-batch
    (a weight two chunks share is reduced by the first: initialize.py). A pipeline stage's chunks
    broadcast buffers once per batch, when the engine asks, not in every micro-batch's forward."""

    def __init__(self, chunks: list[DistributedDataParallel], pipelined: bool) -> None:
        self.chunks = chunks
        self.pipelined = pipelined

    @contextmanager
    def sync(self, chunk: int, last: bool) -> Iterator[None]:
        with ExitStack() as waiting:
            for i, ddp in enumerate(self.chunks):
                if not (last and i == chunk):
                    waiting.enter_context(ddp.no_sync())
            yield

    def sync_buffers(self) -> None:
        if self.pipelined:  # (unpipelined, DDP broadcasts them itself: forward and eval())
            for ddp in self.chunks:
                ddp.sync_buffers()


class BroadcastBuffers(Extension):
    """Replicas without a DDP wrapper (the gradient handlers, ZeRO level 3) take the group's
    first rank's buffers when the engine asks: before evaluating, and each pipeline batch."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.modules = modules

    def sync_buffers(self) -> None:
        for module in self.modules:
            broadcast_buffers(module)
