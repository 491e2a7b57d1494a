"""Trainer: the epoch/iteration loop around an Engine, extended by hooks (see hooks.py).

    trainer = Trainer(engine, logger=logger)
    trainer.fit(train_dataloader, epochs=NUM_EPOCHS, test_dataloader=test_dataloader,
                hooks=[hooks.LossHook(), hooks.AccuracyHook(Accuracy()),
                       hooks.LRSchedulerHook(lr_scheduler, by_epoch=True),
                       hooks.LogMetricByEpochHook(logger)],
                display_progress=True)

Each training iteration is zero_grad -> engine.execute_schedule(batch) (forward, loss,
backward) -> engine.step(). The sampler's epoch is set before every epoch, so shuffling
differs between epochs and agrees between ranks. `max_steps` counts optimizer steps (N batches
each under gradient_accumulation=N; every epoch ends with one) and ends training after that
step, still running the after_train_epoch / after_train hooks. `resume(path)` loads a
SaveCheckpointHook checkpoint and continues where it was taken, mid-epoch if need be: the
loop's position is a Progress (checkpoint/progress.py), the same one the scripts' own loops use.
"""
from __future__ import annotations

import itertools
from typing import Any, Iterable, Iterator, Optional

import torch
from tqdm import tqdm

from . import hooks
from .checkpoint import PathLike, Progress
from .checks import check_consistency, check_evaluation, debug_barrier, loader_length
from .context import gpc
from .data import agreed_stream
from .engine import Engine
from .extensions import training_loader
from .logging import get_dist_logger
from .timer import MultiTimer

__all__ = ["Trainer", "hooks"]


class Trainer:
    def __init__(self, engine: Engine, schedule: Any = None, timer: Optional[MultiTimer] = None,
                 logger=None) -> None:
        if schedule is not None:  # a schedule other than the one initialize chose from the config
            engine.set_schedule(schedule)  # (a pipeline engine's; the Engine's refuses)
        self.engine = engine
        self.schedule = getattr(engine, "schedule", None)
        self.timer = timer if timer is not None else MultiTimer()  # train-epoch/-step, test-epoch
        self.logger = logger or get_dist_logger()
        self.progress = Progress()  # epoch, step, batch in epoch: saved, and read by resume
        self.last_step_taken = False
        self.last_batch_size = 0
        self.step_ended = False  # the last iteration ended an optimizer step (not mid-group)
        self.epoch_finished = False  # the last training epoch ran to its end (not cut by max_steps)
        self.states: dict = {"metrics": {"train": {}, "test": {}}}
        self._hooks: list[hooks.BaseHook] = []

    # -- plumbing --------------------------------------------------------------------------
    def _call(self, point: str, *args: Any) -> None:
        """Every hook's `point`, in priority order (BaseHook's own are no-ops: skipped)."""
        for hook in self._hooks:
            method = getattr(hook, point)
            if getattr(method, "__func__", None) is not getattr(hooks.BaseHook, point):
                method(self, *args)

    def hook_states(self) -> dict:
        """Each hook's state_dict, by class, for a checkpoint (a collective: every rank)."""
        states = {type(hook).__name__: hook.state_dict() for hook in self._hooks}
        return {name: state for name, state in states.items() if state is not None}

    def _set_hooks(self, hook_list: Optional[Iterable[hooks.BaseHook]]) -> None:
        if hook_list is not None:
            self._hooks = sorted(hook_list, key=lambda h: h.priority)  # stable: ties keep order

    def _execute(self, batch: Any, forward_only: bool):
        result = self.engine.execute_schedule(batch, forward_only=forward_only)
        self.last_batch_size = len(batch[1])  # (a pair with labels: the engine checked)
        return result

    def _bar(self, loader: Iterable, desc: str, show: bool, total: Optional[int] = None):
        return tqdm(loader, desc=desc, total=total, leave=False, disable=not show or gpc.rank != 0)

    # the hooks' names for the Progress: epochs done, optimizer steps in all, batches this epoch
    cur_epoch = property(lambda self: self.progress.epoch)
    cur_step = property(lambda self: self.progress.step)
    batch_in_epoch = property(lambda self: self.progress.batch_in_epoch)

    def resume(self, path: PathLike, lr_scheduler: Any = None) -> bool:
        """Load a checkpoint into the engine (and scheduler) and continue where it was taken, in
        the middle of an epoch if need be (checkpoint/progress.py). False if no file is there."""
        return self.progress.resume(path, self.engine.model, self.engine.optimizer, lr_scheduler)

    # -- loops -----------------------------------------------------------------------------
    def fit(self, train_dataloader: Iterable, epochs: int,
            test_dataloader: Optional[Iterable] = None,
            test_interval: int = 1, hooks: Optional[list] = None, display_progress: bool = False,
            max_steps: Optional[int] = None) -> None:
        """Train from `cur_epoch` to `epochs`, testing every `test_interval` epochs."""
        self._set_hooks(hooks)
        # disagreeing ranks fail here, not hang later
        check_consistency(self.engine.model, train_dataloader, test_dataloader)
        train_dataloader = agreed_stream(train_dataloader)  # a stream's end: all ranks at once
        self._call("before_train")
        while self.cur_epoch < epochs:
            stopped = self._train_epoch(train_dataloader, epochs, display_progress, max_steps)
            if test_dataloader is not None and (self.cur_epoch + 1) % test_interval == 0:
                self._test_epoch(test_dataloader, display_progress)
            debug_barrier(f"the end of epoch {self.cur_epoch + 1}")
            if self.epoch_finished:  # max_steps may stop mid-epoch: that epoch is not done
                self.progress.epoch_done()
            if stopped:
                break
        self._call("after_train")

    def _train_epoch(self, loader: Iterable, epochs: int, show: bool,
                     max_steps: Optional[int]) -> bool:
        self.engine.train()
        self._call("before_train_epoch")
        saved = self.progress.hook_states  # a resumed epoch: what the hooks had counted before
        for hook in self._hooks:
            if type(hook).__name__ in saved:
                hook.load_state_dict(saved[type(hook).__name__])
        self.progress.hook_states = {}
        self.timer.start("train-epoch")
        batches = (self._read_groups_ahead(loader) if self.engine.gradient_accumulation > 1
                   else self.progress.batches(loader))
        bar = self._bar(batches, f"epoch {self.cur_epoch + 1}/{epochs}", show,
                        self.progress.remaining(loader))
        stopped = False
        for batch in bar:
            self._call("before_train_iter")
            self.timer.start("train-step")
            self.engine.zero_grad()
            output, label, loss = self._execute(batch, forward_only=False)
            self.last_step_taken = self.engine.step()
            self.step_ended = not self.engine.accumulating  # (taken, or skipped on overflow)
            self.timer.stop("train-step")
            self.progress.batch_done(stepped=self.step_ended)
            self._call("after_train_iter", output, label, loss)
            if loss is not None:
                bar.set_postfix(loss=f"{loss.item():.4f}")
            if max_steps is not None and self.step_ended and self.cur_step >= max_steps:
                stopped = True
                break
        self.timer.stop("train-epoch")
        self.epoch_finished = not stopped or self.batch_in_epoch == loader_length(loader)
        self._call("after_train_epoch")
        return stopped

    def _read_groups_ahead(self, loader: Iterable) -> Iterator:
        """Gradient accumulation: each group's batches read before its first backward, so the
        epoch's last group, short of N with or without a loader length, is closed: every epoch
        ends with a step. A loader not from initialize gets its extensions' wrapper here too."""
        n = self.engine.gradient_accumulation
        batches = self.progress.batches(training_loader(self.engine.extensions, loader))
        for batch in batches:
            group = [batch, *itertools.islice(batches, n - 1)]
            yield from group[:-1]
            if len(group) < n:
                self.engine.close_group()
            yield group[-1]

    @torch.no_grad()
    def _test_epoch(self, loader: Iterable, show: bool) -> None:
        self.engine.eval()
        self._call("before_test_epoch")
        self.timer.start("test-epoch")
        for batch in self._bar(loader, "test", show):
            self._call("before_test_iter")
            output, label, loss = self._execute(batch, forward_only=True)
            self._call("after_test_iter", output, label, loss)
        self.timer.stop("test-epoch")
        self._call("after_test_epoch")

    def evaluate(self, test_dataloader: Iterable, hooks: Optional[list] = None,
                 display_progress: bool = False) -> dict:
        """One pass over `test_dataloader`; returns the test metrics the hooks computed."""
        self._set_hooks(hooks)
        check_evaluation(self.engine.model, test_dataloader)  # uneven shards that would hang
        self._test_epoch(test_dataloader, display_progress)
        return dict(self.states["metrics"]["test"])
