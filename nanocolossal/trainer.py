"""Trainer: the epoch/iteration loop around an Engine, extended by hooks (see hooks.py).

    trainer = Trainer(engine, logger=logger)
    trainer.fit(train_dataloader, epochs=NUM_EPOCHS, test_dataloader=test_dataloader,
                hooks=[hooks.LossHook(), hooks.AccuracyHook(Accuracy()),
                       hooks.LRSchedulerHook(lr_scheduler, by_epoch=True), hooks.LogMetricByEpochHook(logger)],
                display_progress=True)

Each training iteration is zero_grad -> engine.execute_schedule(batch) (forward, loss,
backward) -> engine.step(). The sampler's epoch is set before every epoch, so shuffling
differs between epochs and agrees between ranks. `max_steps` ends training early (after the
current iteration) and still runs the after_train_epoch / after_train hooks. `resume(path)`
loads a SaveCheckpointHook checkpoint and continues after the epochs it completed.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from tqdm import tqdm

from . import checkpoint, hooks
from .checks import check_consistency, debug_barrier, maybe_fail
from .context import gpc
from .engine import Engine, PipelineEngine
from .logging import get_dist_logger
from .timer import MultiTimer

__all__ = ["Trainer", "hooks"]


class Trainer:
    def __init__(self, engine: Engine, schedule: Any = None, timer: Optional[MultiTimer] = None, logger=None) -> None:
        if schedule is not None:  # a schedule other than the one initialize chose from the config
            if not isinstance(engine, PipelineEngine):
                raise ValueError(f"[rank {gpc.rank}] Trainer(schedule=...) needs a pipeline engine: set "
                                 f"parallel=dict(pipeline=P) and pass build_pipeline_model(model) to initialize")
            engine.set_schedule(schedule)
        self.engine = engine
        self.schedule = getattr(engine, "schedule", None)
        self.timer = timer if timer is not None else MultiTimer()  # train-epoch, train-step, test-epoch
        self.logger = logger or get_dist_logger()
        self.cur_epoch, self.cur_step, self.step_in_epoch = 0, 0, 0
        self._resume_at: tuple[int, Optional[dict]] = (0, None)  # (batches to skip, RNG to restore then)
        self.last_step_taken, self.last_batch_size = False, 0
        self.epoch_finished = False  # did the last training epoch run to its end (not cut by max_steps)?
        self.states: dict = {"metrics": {"train": {}, "test": {}}}
        self._hooks: list[hooks.BaseHook] = []

    # -- plumbing --------------------------------------------------------------------------
    def _call(self, point: str, *args: Any) -> None:
        for hook in self._hooks:
            getattr(hook, point)(self, *args)

    def _set_hooks(self, hook_list: Optional[Iterable[hooks.BaseHook]]) -> None:
        if hook_list is not None:
            self._hooks = sorted(hook_list, key=lambda h: h.priority)  # stable: ties keep list order

    def _execute(self, batch: Any, forward_only: bool):
        self.last_batch_size = len(batch[1]) if isinstance(batch, (list, tuple)) and len(batch) > 1 else 0
        return self.engine.execute_schedule(batch, forward_only=forward_only)

    def _progress(self, loader: Iterable, desc: str, show: bool, total: Optional[int] = None):
        return tqdm(loader, desc=desc, total=total, leave=False, disable=not show or gpc.rank != 0)

    def resume(self, path: str, lr_scheduler: Any = None) -> dict:
        """Load a checkpoint into the engine (and scheduler) and continue where it was taken,
        in the middle of an epoch if need be (see checkpoint.skip_batches)."""
        info = checkpoint.load_checkpoint(path, self.engine.model, self.engine.optimizer, lr_scheduler,
                                          restore_rng=False)
        self.cur_epoch, self.cur_step = info["epoch"], info.get("step", 0)
        self._resume_at = (info.get("step_in_epoch", 0), info.get("rng"))
        if self._resume_at[0] == 0 and info.get("rng") is not None:
            checkpoint.set_rng_state(info["rng"])
        return info

    # -- loops -----------------------------------------------------------------------------
    def fit(self, train_dataloader: Iterable, epochs: int, test_dataloader: Optional[Iterable] = None,
            test_interval: int = 1, hooks: Optional[list] = None, display_progress: bool = False,
            max_steps: Optional[int] = None) -> None:
        """Train from `cur_epoch` to `epochs`, testing every `test_interval` epochs."""
        self._set_hooks(hooks)
        check_consistency(self.engine.model, train_dataloader)  # disagreeing ranks fail here, not hang later
        self._call("before_train")
        while self.cur_epoch < epochs:
            sampler = getattr(train_dataloader, "sampler", None)
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(self.cur_epoch)
            stopped = self._train_epoch(train_dataloader, epochs, display_progress, max_steps)
            if test_dataloader is not None and (self.cur_epoch + 1) % test_interval == 0:
                self._test_epoch(test_dataloader, display_progress)
            debug_barrier(f"the end of epoch {self.cur_epoch + 1}")
            if self.epoch_finished:  # max_steps may stop mid-epoch: that epoch is not done
                self.cur_epoch += 1
            if stopped:
                break
        self._call("after_train")

    def _train_epoch(self, loader: Iterable, epochs: int, show: bool, max_steps: Optional[int]) -> bool:
        self.engine.train()
        self._call("before_train_epoch")
        self.timer.start("train-epoch")
        skip, rng = self._resume_at
        self._resume_at, self.step_in_epoch = (0, None), skip
        batches = checkpoint.skip_batches(loader, skip, rng) if skip else loader
        total = len(loader) - skip if hasattr(loader, "__len__") else None
        progress = self._progress(batches, f"epoch {self.cur_epoch + 1}/{epochs}", show, total)
        stopped = False
        for batch in progress:
            self._call("before_train_iter")
            self.timer.start("train-step")
            self.engine.zero_grad()
            output, label, loss = self._execute(batch, forward_only=False)
            self.last_step_taken = self.engine.step()
            self.timer.stop("train-step")
            self.cur_step += 1
            self.step_in_epoch += 1
            self._call("after_train_iter", output, label, loss)
            maybe_fail(self.cur_step)
            if loss is not None:
                progress.set_postfix(loss=f"{loss.item():.4f}")
            if max_steps is not None and self.cur_step >= max_steps:
                stopped = True
                break
        self.timer.stop("train-epoch")
        self.epoch_finished = not stopped or total is not None and self.step_in_epoch == total + skip
        self._call("after_train_epoch")
        return stopped

    @torch.no_grad()
    def _test_epoch(self, loader: Iterable, show: bool) -> None:
        self.engine.eval()
        self._call("before_test_epoch")
        self.timer.start("test-epoch")
        for batch in self._progress(loader, "test", show):
            self._call("before_test_iter")
            output, label, loss = self._execute(batch, forward_only=True)
            self._call("after_test_iter", output, label, loss)
        self.timer.stop("test-epoch")
        self._call("after_test_epoch")

    def evaluate(self, test_dataloader: Iterable, hooks: Optional[list] = None,
                 display_progress: bool = False) -> dict:
        """One pass over `test_dataloader`; returns the test metrics the hooks computed."""
        self._set_hooks(hooks)
        self._test_epoch(test_dataloader, display_progress)
        return dict(self.states["metrics"]["test"])
