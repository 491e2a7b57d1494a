"""Data parallelism: every rank holds the whole model, sees a different slice of the batch,
and averages gradients with its peers before the optimizer step, so all replicas take the
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

With `gradient_as_bucket_view=True` each `.grad` *is* its bucket slot: no copy back (and with
`zero_grad(set_to_none=False)` backward accumulates straight into the bucket).
`compress="bf16"` (or "fp16") all-reduces a half-precision copy of each bucket -- half the bytes,
the sum in that precision, as torch's bf16_compress_hook (bench_ddp.py measures the effect).

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

from .checks import peer_failed, ready_twice
from .collectives import broadcast_buffers, broadcast_coalesced
from .context import gpc
from .ddp_checks import check_ddp
from .extensions import Extension
from .nest import map_tensors
from .weak import weakly


class _Bucket:
    """A flat buffer for some parameters' gradients, followed by one 'used' flag per parameter."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.offsets, total = [], 0
        for p in params:
            self.offsets.append(total)
            total += p.numel()
        self.numel = total
        self.buffer = torch.zeros(total + len(params), dtype=params[0].dtype,
                                  device=params[0].device)
        self.work: Optional[dist.Work] = None
        self.ready = 0
        self.filled = [False] * len(params)  # which slots got this iteration's gradient
        self.wire: Optional[torch.Tensor] = None  # what is all-reduced: buffer, or a half copy

    def view(self, i: int) -> torch.Tensor:
        p = self.params[i]
        return self.buffer[self.offsets[i]: self.offsets[i] + p.numel()].view_as(p)

    def flags(self) -> torch.Tensor:
        return self.buffer[self.numel:]


class DistributedDataParallel(nn.Module):
    """Wrap `module` so that backward averages gradients over `process_group` (default: gpc's
    gradient group: the data-parallel ranks, times the sequence ranks if any).

    `reduced_elsewhere`: parameters this wrapper leaves alone because another wrapper averages
    them -- a weight two pipeline chunks of one rank share is averaged by the first chunk's.
    `bucket_class`, `name` and `other_way` are what ZeRO level 2's subclass changes."""

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
        if process_group is None:
            process_group = gpc.gradient_group or dist.group.WORLD  # data (x sequence) ranks
        self.process_group = process_group
        check_ddp(self, compress)  # a launched job, one model on every rank, none unfrozen later
        self.world_size = dist.get_world_size(self.process_group)
        self.src_rank = dist.get_global_rank(self.process_group, 0)
        self.broadcast_buffers = broadcast_buffers
        self.gradient_as_bucket_view = gradient_as_bucket_view  # .grad *is* its bucket slot
        # all-reduce a half-precision copy of each bucket: half the bytes, a half-precision sum
        self.wire_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(compress)
        self.require_sync = True

        broadcast_coalesced(list(module.parameters()) + list(module.buffers()), self.src_rank,
                             self.process_group)

        skip = {id(q) for q in reduced_elsewhere}  # another pipeline chunk's DDP reduces them
        params = [p for p in module.parameters() if p.requires_grad and id(p) not in skip]
        self.buckets = self._make_buckets(list(reversed(params)), int(bucket_cap_mb * 2**20))
        self._where = {p: (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._next_launch = 0           # buckets are launched strictly in order
        self._callback_queued = False
        for p in params:
            p.register_post_accumulate_grad_hook(weakly(self._grad_ready))

    def _make_buckets(self, params: list[nn.Parameter], cap_bytes: int) -> list[_Bucket]:
        buckets, current, size = [], [], 0
        for p in params:
            if current and (size + p.numel() * p.element_size() > cap_bytes
                            or p.dtype != current[0].dtype or p.device != current[0].device):
                buckets.append(self.bucket_class(current))
                current, size = [], 0
            current.append(p)
            size += p.numel() * p.element_size()
        if current:
            buckets.append(self.bucket_class(current))
        return buckets

    # -- forward / backward ---------------------------------------------------------------
    def forward(self, *args, **kwargs):
        # only training syncs buffers: in eval (uneven shards) a broadcast has no partner
        training = self.training and torch.is_grad_enabled()
        if self.broadcast_buffers and training and self.require_sync:
            self.sync_buffers()
        out = self.module(*args, **kwargs)
        if torch.is_grad_enabled():  # the all-reduce even if no parameter here gets a gradient
            # (a stage whose samples all skipped its layers: the others wait for it)
            finish = weakly(self._queue_finish)
            map_tensors(lambda t: t.register_hook(finish) if t.requires_grad else t, out)
        return out

    def _grad_ready(self, param: nn.Parameter) -> None:
        if not self.require_sync:
            return
        self._queue_finish()
        bucket, i = self._where[param]
        if bucket.filled[i]:
            raise ready_twice(self.module, param, self.name, self.other_way)
        self._write_slot(bucket, i)
        bucket.filled[i] = True
        bucket.ready += 1
        self._launch_ready()

    def _write_slot(self, bucket: _Bucket, i: int) -> None:
        """slot = .grad / N, and flag the parameter as used."""
        param, slot = bucket.params[i], bucket.view(i)
        if param.grad.data_ptr() == slot.data_ptr():  # already the slot (gradient_as_bucket_view)
            slot.div_(self.world_size)
        else:  # one pass: scaled copy (average = sum of grad / N, no overflow in low precision)
            torch.div(param.grad, self.world_size, out=slot)
            if self.gradient_as_bucket_view:
                param.grad = slot
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
        wire_dtype = self.wire_dtype or bucket.buffer.dtype
        bucket.wire = bucket.buffer.to(wire_dtype)  # the buffer itself when no compression
        bucket.work = self._all_reduce(bucket)

    def _fill_unused(self, bucket: _Bucket, i: int) -> None:
        """A parameter whose hook did not fire in this backward. If it still holds a gradient --
        accumulated under no_sync in an earlier micro-step -- that gradient is its contribution
        and is averaged like any other; only a parameter with no gradient adds zeros."""
        if bucket.params[i].grad is None:
            bucket.view(i).zero_()
        else:
            self._write_slot(bucket, i)

    def _reduced_buckets(self) -> Iterator[_Bucket]:
        """End of backward: launch the buckets still waiting (their unused slots written), then
        each bucket in order once its all-reduce is done."""
        for bucket in self.buckets[self._next_launch:]:
            self._launch(bucket)
        for bucket in self.buckets:
            self._wait(bucket)
            yield bucket
        self._next_launch, self._callback_queued = 0, False

    def _finish(self) -> None:
        """End of backward: every bucket reduced, write the averaged gradients back."""
        for bucket in self._reduced_buckets():
            if bucket.wire is not bucket.buffer:  # decompress into the full-precision bucket
                bucket.buffer.copy_(bucket.wire)
            used = (bucket.flags() > 0).tolist()  # one read per bucket, not per parameter
            for i, p in enumerate(bucket.params):
                if not used[i]:  # no rank computed one: keep grad=None, as one process would
                    continue
                slot = bucket.view(i)
                if self.gradient_as_bucket_view:
                    p.grad = slot
                elif p.grad is None:
                    p.grad = slot.clone()
                else:
                    p.grad.copy_(slot)
            bucket.flags().zero_()
            bucket.filled = [False] * len(bucket.params)
            bucket.work, bucket.ready = None, 0

    # -- around the core: when to sync, buffers, accumulation, a failed peer --------------
    def _queue_finish(self, *_) -> None:
        if self.require_sync and not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._callback_queued = True

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
        """Give every replica the first rank's buffers (BatchNorm statistics), as one message per
        dtype."""
        broadcast_buffers(self.module, self.process_group)

    def _all_reduce(self, bucket: _Bucket) -> dist.Work:
        try:
            return dist.all_reduce(bucket.wire, group=self.process_group, async_op=True)
        except RuntimeError as e:
            self._fail(bucket, e)

    def _wait(self, bucket: _Bucket) -> None:
        try:
            bucket.work.wait()
        except RuntimeError as e:
            self._fail(bucket, e)

    def _fail(self, bucket: _Bucket, error: Exception) -> None:
        raise peer_failed(f"DDP gradient all-reduce of bucket {self.buckets.index(bucket) + 1} "
                          f"of {len(self.buckets)}", self.process_group, error) from error


class DdpSync(Extension):
    """DDP's part in the Engine and the pipeline executor (extensions.py): of the backwards
    before a step only the last averages -- a group's last micro-step, or a pipeline chunk's
    last micro-batch, while the stage's other chunks wait (a weight two chunks share is reduced
    by the first, whose last backward is the stage's last: initialize.py). A pipeline stage's
    chunks do not broadcast buffers in every micro-batch's forward: the engine asks per batch."""

    def __init__(self, chunks: list[DistributedDataParallel], pipelined: bool) -> None:
        self.chunks, self.pipelined = chunks, pipelined

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


# -- the config's ddp=dict(...) keys (config_checks.py checks them) ---------------------------

DDP_OPTIONS = ("bucket_cap_mb", "gradient_as_bucket_view", "compress")  # DDP's, by config
