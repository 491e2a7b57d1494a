"""Progress: where training is, saved in every checkpoint and restored by one resume path.

A run is at (epoch, step, batch_in_epoch): `epoch` epochs are complete, `step` optimizer steps
taken in all, `batch_in_epoch` batches of the current epoch trained on. Without gradient
accumulation a batch is a step; with accumulation N a step takes N batches. Every loop of
nanocolossal -- the Trainer's and the hand-written ones of train_ddp.py and train_amp.py --
keeps those three numbers in a Progress, writes them with each checkpoint and continues from
them:

    progress = Progress()
    if args.resume:
        progress.resume(path, model, optimizer, lr_scheduler)   # False when there is no file yet
    while progress.epoch < epochs:
        for batch in progress.batches(train_loader):            # the rest of this epoch
            ...one training step...
            progress.batch_done()                               # (stepped=False mid-accumulation)
            if progress.step % every == 0:
                progress.save(path, model, optimizer, lr_scheduler)
        progress.epoch_done()
        progress.save(path, model, optimizer, lr_scheduler)

A checkpoint is taken between optimizer steps, never inside an accumulation group: the group's
gradients live only in memory (and differ per data-parallel rank), so a save there could not
be resumed exactly. `save(..., accumulating=True)` refuses.

Resuming mid-epoch must give the batches the uninterrupted run would have had. The sampler's
epoch is set as before (its shuffle is seeded by epoch, not by the global RNG); the batches
already trained on are drawn again and dropped, so the sampler and any random augmentation
advance exactly as they did; then every RNG is put back as it was at the save. The rest of the
run is bit-identical (with num_workers=0: worker processes are seeded when the iterator starts).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import torch.nn as nn

from ..checks import loader_length
from ..context import gpc
from .files import PathLike, rank_files
from .save_load import load_checkpoint, save_checkpoint, set_rng_state


def skip_batches(loader: Iterable, skip: int, rng_state: Optional[dict] = None) -> Iterator:
    """An iterator over `loader` from batch `skip` on; the RNG is then set to `rng_state`."""
    batches = iter(loader)
    for _ in range(skip):
        next(batches)
    if rng_state is not None:
        set_rng_state(rng_state)
    return batches


class Progress:
    """(epoch, step, batch_in_epoch) of a run, and the RNG state to restore on a resume."""

    def __init__(self) -> None:
        self.epoch, self.step, self.batch_in_epoch = 0, 0, 0
        self._rng: Optional[dict] = None  # restored once a resumed epoch's done batches are drawn
        self.hook_states: dict = {}  # by hook class: restored after before_train_epoch

    def resume(self, path: PathLike, model: nn.Module, optimizer: Any = None,
               lr_scheduler: Any = None) -> bool:
        """Load `path` into model/optimizer/scheduler and continue where it was saved.
        Returns False, changing nothing, when nothing was saved there (yet). Files that another
        layout saved there are an error naming both layouts, never a silent fresh start."""
        if not Path(path).is_file() and not rank_files(path):  # (this rank's file is one of them)
            return False
        info = load_checkpoint(path, model, optimizer, lr_scheduler, restore_rng=False)
        self.epoch, self.step = info["epoch"], info.get("step", 0)
        self.batch_in_epoch = info.get("batch_in_epoch", info.get("step_in_epoch", 0))
        self._rng = info.get("rng")
        # the hooks' state in the middle of the resumed epoch (LossHook's sums so far)
        self.hook_states = info.get("hooks", {}) if self.batch_in_epoch else {}
        if self.batch_in_epoch == 0 and self._rng is not None:  # between epochs: nothing to skip
            set_rng_state(self._rng)
            self._rng = None
        return True

    def batches(self, loader: Iterable) -> Iterator:
        """This epoch's batches still to train on, shuffled by epoch alike on every rank."""
        # the sampler's epoch, or an iterable dataset's (a DataLoader over one has no sampler)
        for owner in (getattr(loader, "sampler", None), getattr(loader, "dataset", None)):
            if hasattr(owner, "set_epoch"):
                owner.set_epoch(self.epoch)
        if not self.batch_in_epoch:
            return iter(loader)
        rng, self._rng = self._rng, None  # a resumed epoch: the RNG is put back only once
        return skip_batches(loader, self.batch_in_epoch, rng)

    def remaining(self, loader: Iterable) -> Optional[int]:
        """How many batches `batches(loader)` yields (for progress bars), if known."""
        n = loader_length(loader)
        return None if n is None else n - self.batch_in_epoch

    def is_last_batch(self, loader: Iterable) -> bool:
        """Is the batch about to be trained on the last of this epoch? (False without a length.)"""
        n = loader_length(loader)
        return n is not None and self.batch_in_epoch == n - 1

    def batch_done(self, stepped: bool = True) -> None:
        """A batch was trained on; `stepped`: it ended an optimizer step (not mid-accumulation)."""
        self.batch_in_epoch += 1
        self.step += int(stepped)

    def epoch_done(self) -> None:
        self.epoch += 1
        self.batch_in_epoch = 0

    def save(self, path: PathLike, model: nn.Module, optimizer: Any = None,
             lr_scheduler: Any = None, epoch_end: bool = False,
             accumulating: bool = False, hooks: Optional[dict] = None) -> None:
        """Save a checkpoint at this point (a collective: every rank calls it). `epoch_end=True`
        saves the current epoch as complete, for callers that count it done only afterwards."""
        if accumulating:
            raise RuntimeError(
                f"[rank {gpc.rank}] checkpoint requested in the middle of a gradient accumulation "
                f"group (batch {self.batch_in_epoch} of epoch {self.epoch + 1}); its gradients "
                f"cannot be saved, so the resumed run would differ. Save after an optimizer step "
                f"(engine.accumulating is False); a loop of your own can end each epoch with "
                f"one by calling engine.close_group() before its last batch, as the Trainer does")
        epoch, in_epoch = (self.epoch + 1, 0) if epoch_end else (self.epoch, self.batch_in_epoch)
        extra = {"hooks": hooks} if hooks and in_epoch else {}  # (needed mid-epoch only)
        save_checkpoint(path, epoch, model, optimizer, lr_scheduler, step=self.step,
                        batch_in_epoch=in_epoch, **extra)
