"""A mean loss cut into pieces: weigh each piece by the targets it counts, not by its samples.

One process on the whole batch computes a cross entropy's mean as torch does:

    loss = S / W,   S = sum_t w_t l_t,   W = sum_t w_t

where w_t is 0 for a target equal to `ignore_index` (padding, a masked prompt) and the class
weight (1 without `weight=`) otherwise. Distributed training cuts the batch into pieces p -- data
ranks, pipeline micro-batches -- and each piece's criterion returns its own mean S_p / W_p. The
naive way to put them together weighs each piece by its share of the *samples*:

    sum_p (n_p / n) * S_p / W_p           (DDP's average over ranks, a micro-batch's n_m / n)

That is S / W only when every piece counts targets in proportion to its samples. With padding
spread unevenly it is not: a rank holding 3 real tokens weighs as much as one holding 300, and
each of its 3 tokens 100 times more than one process would (Hugging Face's gradient accumulation
bug of 2024 was this one). Exact: weigh each piece by its share of the counted targets,

    sum_p (W_p / W) * S_p / W_p  =  sum_p S_p / W  =  S / W.

W is known before any backward, at the price of one all-reduce of a number: the counts come from
the labels alone. The engine (and a pipeline's last stage) multiplies each piece's loss by

    weight_p = W_p * G / W

where G is the number of pieces an average divides by (the G ranks DDP averages over; a
pipeline's micro-batches are summed, so there G counts ranks and weight_m = W_m * G / W). When
every piece counts in proportion to its samples the weight is the sample share exactly (integers
divided in float64), so nothing moves by a bit. A piece that counts nothing (all padding) adds 0
and no gradient, where its own mean would be NaN.

Half precision: a piece's weight reaches G when it holds most of the targets, so its half
gradients would be up to G x one process's and overflow at a loss scale one process survives.
The optimizer's backward therefore scales by loss_scale / G (and unscales by the same): per
token, the half gradient is exactly one process's, S / W (amp.py: backward_scale).

Who counts: criteria whose mean divides by counted targets -- torch's CrossEntropyLoss and
NLLLoss, the vocab-parallel and 2d losses. Any other criterion (MSELoss, your own) is weighted
by samples, as before. Under sequence parallelism the token loss already divides by its whole
sequences' count (nn/layers.py), so there a piece is a sequence group, not a rank.

Gradient accumulation makes the N micro-steps of a group pieces too, but the engine meets them
one at a time and cannot count the targets of those it has not seen. So the loader that
initialize returns (and any that Trainer.fit is given) reads each group ahead and hands its
labels over (GroupsAhead), counted at the group's first loss: one all-reduce per group. Then
micro-step i's gradient weighs W_i * G * k / W for a group of k (backward's 1 / N undone, but
for k / N: an epoch's short last group weighs k / N of its mean, as without counts). A loop of
your own over that loader needs only to close an epoch's short last group (engine.close_group()
before its last batch; a stream without a length: the Trainer, which reads one batch ahead); over
another loader each micro-step weighs 1 / N, as Accelerate does unless told the group's count.
The group's losses must count the targets read for it (one iterator, labels not changed after
the loader): compared on the device, refused when the next group is read.

Evaluation communicates nothing (ranks may run different numbers of batches): each rank's loss
is its batch's own mean -- a pipeline's micro-batches weigh W_m / W within the batch.
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from .checks import peer_failed, same_everywhere
from .context import gpc
from .data import WrappedLoader
from .extensions import Extension, MicroBatchLoss
from .loss_weights_checks import check_group_ended
from .nest import map_tensors


def counted_targets(target: torch.Tensor, ignore_index: int = -100,
                    weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """W: the denominator of F.cross_entropy's mean -- targets not ignored, or the sum of their
    class weights; class probabilities (float targets) count every sample and position."""
    if target.is_floating_point():
        return torch.tensor(float(target.numel() // target.shape[1] if target.dim() > 1 else 1))
    counted = target != ignore_index
    if weight is None:
        return counted.sum()
    return (weight.to(target.device)[target.masked_fill(~counted, 0)] * counted).sum()


def weighs_by_targets(criterion: Any) -> bool:
    """Does this criterion's mean divide by counted targets (so its pieces need weights)?"""
    mean = getattr(criterion, "reduction", None) in ("mean", True)
    return mean and hasattr(criterion, "ignore_index")


def target_counts(criterion: Any, targets: Sequence[torch.Tensor]) -> torch.Tensor:
    """W_p for each piece's targets (float64: integer counts stay exact)."""
    weight = getattr(criterion, "weight", None)
    return torch.stack([counted_targets(t, criterion.ignore_index, weight).to(torch.float64)
                        for t in targets]).to(gpc.device)


def total_count(counts: torch.Tensor) -> torch.Tensor:
    """W: the counts summed over this rank's pieces and the ranks that average gradients
    (gpc.gradient_group): one all-reduce of one number. debug=True first checks that every data
    rank is here, not in another collective (ZeRO 3 checks its gathers the same way); a peer that
    stopped is named with this collective."""
    total = counts.sum()
    if gpc.gradient_size == 1:
        return total
    if gpc.config.get("debug") and not same_everywhere(-1, gpc.gradient_group, gpc.device):
        raise RuntimeError(f"[rank {gpc.rank}] the loss's target count (loss_weights.py) is "
                           f"all-reduced here while another data rank runs another collective: "
                           f"every data rank must call engine.criterion alike")
    try:
        dist.all_reduce(total, group=gpc.gradient_group)
    except RuntimeError as e:  # a peer stopped: say which collective, and where to look
        raise peer_failed("the all-reduce of the loss's target count (loss_weights.py)",
                          gpc.gradient_group, e) from e
    return total


def weighed_ranks(spans_sequence: bool) -> int:
    """G: the ranks averaging gradients, or their sequence groups where the mean spans one."""
    return gpc.gradient_size // (gpc.sequence_size if spans_sequence else 1)


def _piece_counts(counts: torch.Tensor, spans_sequence: bool) -> torch.Tensor:
    """W_p: where the criterion's mean already spans the sequence group, the group's count."""
    if not spans_sequence:
        return counts
    counts = counts.clone()
    dist.all_reduce(counts, group=gpc.sequence_group)
    return counts


def piece_weights(counts: torch.Tensor, spans_sequence: bool = False,
                  total: Optional[torch.Tensor] = None) -> torch.Tensor:
    """weight_p = W_p * G / W for this rank's pieces; W counted now, unless given (an
    accumulation group's, counted ahead)."""
    total = total_count(counts) if total is None else total
    return _piece_counts(counts, spans_sequence) * weighed_ranks(spans_sequence) / total


def batch_shares(counts: torch.Tensor, spans_sequence: bool = False) -> torch.Tensor:
    """W_m / W over this rank's batch alone (evaluating a pipeline: ranks may run different
    numbers of batches, so nothing crosses data ranks; a sequence group holds the same batch)."""
    counts = _piece_counts(counts, spans_sequence)
    return counts / counts.sum()


def mean_over(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """total / count; no target counted: NaN, as torch's mean, with zero gradients (a plain
    0 / 0 would send NaN back into every weight)."""
    return torch.where(count > 0, total / count.clamp(min=1e-12),
                       torch.full_like(total, float("nan")))


class _GradientIfCounted(torch.autograd.Function):
    """Identity on a piece's output; its gradient is zeroed where the piece counts no target.
    torch's mean over targets whose class weights are all 0 is 0 / 0, and its backward divides
    by that 0 too: NaN gradients, which the average over ranks would spread to every replica."""

    @staticmethod
    def forward(ctx: Any, count: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(count)
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        (count,) = ctx.saved_tensors
        return None, torch.where(count > 0, grad, torch.zeros_like(grad))


def gradient_if_counted(output: Any, count: torch.Tensor) -> Any:
    """The criterion's input, each tensor needing a gradient through _GradientIfCounted."""
    return map_tensors(lambda t: _GradientIfCounted.apply(count, t)
                       if t.requires_grad and t.is_floating_point() else t, output)


def weigh(loss: torch.Tensor, weight: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """loss * weight; a piece that counts nothing gives 0 and no gradient (its mean is NaN),
    unless nothing counts anywhere (then NaN, as one process's mean)."""
    weight = weight.to(loss.dtype)
    return torch.where(count > 0, loss * weight, weight * 0)


class CountedTargets(Extension):
    """The weights above in the loop (extensions.py): initialize adds it for a criterion that
    counts targets; it weighs engine.criterion's loss and the pipeline's micro-batches. In a
    counted group the gradient weighs by the group's count, and the value stays the micro-step's,
    for logging (x + (y - y.detach()) is x, with y's gradient). engine.criterion weighs nothing in
    evaluation, the model in eval mode or gradients off (an all-reduce would wait for a partner):
    to train with BatchNorm's statistics frozen, put those modules in eval mode, not the model."""

    group: Optional[list] = None  # the labels of the accumulation group read last (GroupsAhead)
    total: Optional[torch.Tensor] = None  # its W, counted at its first weighed loss
    read: Any = 0  # this rank's part of W, as read, and as its losses then counted it
    seen: Any = 0
    differs: Optional[torch.Tensor] = None  # the two differed (on the device, read when due)

    def __init__(self, criterion: Any, modules: Sequence[Any]) -> None:
        self.criterion = criterion
        self.spans = getattr(criterion, "spans_sequence", False)
        self.modules = modules  # whose training flags say training (either may say eval)
        self.accumulation = gpc.config.get("gradient_accumulation", 1)  # N, as initialize read it

    def _weighs(self) -> bool:
        return ((gpc.gradient_size > 1 or self.group is not None)
                and all(m.training for m in self.modules) and torch.is_grad_enabled())

    def loss(self, compute: Callable, output: Any, label: Any) -> torch.Tensor:
        if not self._weighs():
            return compute(output, label)
        count = target_counts(self.criterion, [label])
        loss = compute(gradient_if_counted(output, count[0]), label)
        step = weigh(loss, piece_weights(count, self.spans)[0], count[0])
        if self.group is None:
            return step
        k = len(self.group)
        group = weigh(loss, piece_weights(count, self.spans, self._counted())[0] * k, count[0])
        self.seen = self.seen + count[0]
        return step.detach() + (group - group.detach())

    def _counted(self) -> torch.Tensor:
        """W of the group, over its micro-steps and data ranks, counted when it is trained."""
        if self.total is None:
            counts = target_counts(self.criterion, [y.to(gpc.device, non_blocking=True)
                                                    for y in self.group])
            self.read = counts.sum()
            self.seen = 0
            self.total = total_count(counts)
        return self.total

    def train_loader(self, loader: Any) -> Any:
        if self.accumulation == 1 or loader is None or getattr(loader, "counting", None) is self:
            return loader  # (initialize's loader, given to Trainer.fit, is read ahead already)
        return GroupsAhead(loader, self)

    def read_group(self, labels: Optional[list]) -> None:
        """GroupsAhead: the labels of the group whose first batch comes next (or None)."""
        check_group_ended(self.group is not None and self.total is not None, self.differs)
        self.group = labels
        self.total = self.differs = None

    def end_group(self) -> None:
        if self.total is not None:  # its losses counted what was read (no host read here)
            self.differs = (self.seen - self.read).abs() > 1e-9 * self.read.abs()
        self.group = None  # the next group is counted when read; another loader weighs 1 / N

    def weigh_micro_batches(self, criterion: Any, labels: list,
                            training: bool) -> Optional[MicroBatchLoss]:
        if not weighs_by_targets(criterion):
            return None
        spans = getattr(criterion, "spans_sequence", False)
        counts = target_counts(criterion, labels)
        weights = piece_weights(counts, spans) if training else batch_shares(counts, spans)

        def loss(output: Any, m: int) -> torch.Tensor:
            counted = gradient_if_counted(output, counts[m])
            return weigh(criterion(counted, labels[m]), weights[m], counts[m])
        return loss


class GroupsAhead(WrappedLoader):
    """A training loader read a group ahead (CountedTargets.train_loader); its length is the
    loader's (a stream's raises TypeError: checks.loader_length)."""

    def __init__(self, loader: Any, counting: CountedTargets) -> None:
        super().__init__(loader)
        self.counting = counting

    def __iter__(self) -> Iterator[Any]:
        batches = iter(self.loader)
        for batch in batches:
            group = [batch, *itertools.islice(batches, self.counting.accumulation - 1)]
            labelled = all(isinstance(b, (list, tuple)) and len(b) == 2 and b[1] is not None
                           for b in group)
            self.counting.read_group([b[1] for b in group] if labelled else None)
            yield from group

    def __len__(self) -> int:
        return len(self.loader)
