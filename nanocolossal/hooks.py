"""Trainer hooks: small objects called at fixed points of the training loop.

    before_train
      before_train_epoch
        before_train_iter -> [zero_grad, forward, loss, backward, step] -> after_train_iter(...)
      after_train_epoch
      before_test_epoch
        before_test_iter  -> [forward, loss]                            -> after_test_iter(...)
      after_test_epoch
    after_train

At every point hooks run in ascending `priority`, so metric hooks (0) have filled
`trainer.states["metrics"]` before the logging hooks (10) print it and the checkpoint hook
(20) saves. Metrics are all-reduced over the data ranks (the whole world under a pipeline or
tensor parallelism: metrics.py): the numbers logged are those of the whole dataset, identical on
every rank.
"""
from __future__ import annotations

import json
import resource
import time
from functools import partialmethod
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from .context import gpc
from .metrics import Accuracy, all_reduce_mean, all_reduce_sum


class BaseHook:
    """Override any of the hook points; `trainer.states` is shared state between hooks."""

    def __init__(self, priority: int = 10) -> None:
        self.priority = priority

    def before_train(self, trainer) -> None: ...
    def after_train(self, trainer) -> None: ...
    def before_train_epoch(self, trainer) -> None: ...
    def after_train_epoch(self, trainer) -> None: ...
    def before_train_iter(self, trainer) -> None: ...
    def after_train_iter(self, trainer, output: Any, label: Any,
                         loss: Optional[torch.Tensor]) -> None: ...
    def before_test_epoch(self, trainer) -> None: ...
    def after_test_epoch(self, trainer) -> None: ...
    def before_test_iter(self, trainer) -> None: ...
    def after_test_iter(self, trainer, output: Any, label: Any,
                        loss: Optional[torch.Tensor]) -> None: ...

    def state_dict(self) -> Optional[dict]:
        """What a run resumed mid-epoch needs to continue this hook (None: nothing); called on
        every rank, it may be a collective."""
        return None

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state`: called after the resumed epoch's before_train_epoch."""


class LossHook(BaseHook):
    """Mean loss per sample over the epoch and all ranks -> metrics['train'|'test']['loss']:
    each batch mean weighted by its size, exact with uneven last batches and shards."""

    def __init__(self, priority: int = 0) -> None:
        super().__init__(priority)
        self._reset(None)

    def _reset(self, trainer) -> None:
        self._sum, self._count = 0.0, 0
        self._carried = (0.0, 0.0)  # the epoch's sums before a resume, over all ranks

    def _add(self, trainer, output, label, loss) -> None:
        if loss is not None:
            self._sum += loss.item() * trainer.last_batch_size
            self._count += trainer.last_batch_size

    def _publish(self, split: str, trainer) -> None:
        total, count = self._totals()
        trainer.states["metrics"][split]["loss"] = total / count if count else float("nan")

    def _totals(self) -> tuple[float, float]:
        """(sum of loss x samples, samples) of this epoch so far, over all ranks."""
        total, count = all_reduce_sum([self._sum, self._count])
        return total + self._carried[0], count + self._carried[1]

    def state_dict(self) -> dict:
        total, count = self._totals()
        return {"sum": total, "count": count}

    def load_state_dict(self, state: dict) -> None:
        self._carried = (state["sum"], state["count"])

    before_train_epoch = before_test_epoch = _reset
    after_train_iter = after_test_iter = _add
    after_train_epoch = partialmethod(_publish, "train")
    after_test_epoch = partialmethod(_publish, "test")


class AccuracyHook(BaseHook):
    """Exact test accuracy (summed counts over ranks) -> metrics['test']['accuracy']. Logits
    split by vocabulary (a vocab-parallel classifier: each rank holds some classes) are turned
    into predictions by that classifier, whose argmax spans its group."""

    def __init__(self, accuracy_func: Optional[Accuracy] = None, priority: int = 0) -> None:
        super().__init__(priority)
        self.accuracy = accuracy_func if accuracy_func is not None else Accuracy()
        self.split: Optional[nn.Module] = None

    def before_test_epoch(self, trainer) -> None:
        self.accuracy.reset()
        self.split = next((m for m in trainer.engine.model.modules()
                           if callable(getattr(m, "predictions", None))), None)

    def after_test_iter(self, trainer, output, label, loss) -> None:
        if output is None:  # pipelines: only the last stage has outputs
            return
        if self.split is not None and output.dim() == label.dim() + 1 and \
                output.shape[-1] == self.split.weight.shape[0]:  # this rank's classes only
            output = self.split.predictions(output)
        self.accuracy.update(output, label)

    def after_test_epoch(self, trainer) -> None:
        trainer.states["metrics"]["test"]["accuracy"] = self.accuracy.compute()


class LRSchedulerHook(BaseHook):
    """Step the scheduler per epoch, or per optimizer step taken (not per accumulation micro-step;
    an fp16 step skipped for overflow does not advance it, as in Accelerate, where torch's
    GradScaler recipe does: tests/test_timer_and_schedulers.py pins both loops)."""

    def __init__(self, lr_scheduler: Any, by_epoch: bool = True, store_lr_in_state: bool = True,
                 priority: int = 1) -> None:
        super().__init__(priority)
        self.lr_scheduler, self.by_epoch, self.store_lr = lr_scheduler, by_epoch, store_lr_in_state

    def before_train_epoch(self, trainer) -> None:
        if self.store_lr:
            trainer.states["metrics"]["train"]["lr"] = self.lr_scheduler.get_last_lr()[0]

    def after_train_iter(self, trainer, output, label, loss) -> None:
        if not self.by_epoch and trainer.last_step_taken:
            self.lr_scheduler.step()

    def after_train_epoch(self, trainer) -> None:
        if self.by_epoch and trainer.epoch_finished:  # an epoch cut by max_steps resumes at this LR
            self.lr_scheduler.step()


class LastLossHook(BaseHook):
    """The last training iteration's loss over the whole global batch (a sample-weighted mean over
    the data-parallel ranks) -> `value`: what a script reports as its final train loss."""

    def __init__(self, priority: int = 0) -> None:
        super().__init__(priority)
        self.value, self._last = float("nan"), (float("nan"), 0)

    def after_train_iter(self, trainer, output, label, loss) -> None:
        if loss is not None:
            self._last = (loss.item(), trainer.last_batch_size)

    def after_train(self, trainer) -> None:
        loss, n = self._last
        self.value = all_reduce_mean(loss, weight=n)


class ThroughputHook(BaseHook):
    """Samples per second over all data-parallel ranks -> metrics['train']['throughput']."""

    def __init__(self, priority: int = 2) -> None:
        super().__init__(priority)
        self._start, self._samples = 0.0, 0

    def before_train_epoch(self, trainer) -> None:
        self._start, self._samples = time.perf_counter(), 0

    def after_train_iter(self, trainer, output, label, loss) -> None:
        self._samples += trainer.last_batch_size

    def after_train_epoch(self, trainer) -> None:
        elapsed = time.perf_counter() - self._start
        samples = all_reduce_mean(float(self._samples)) * gpc.data_size  # over all data ranks
        trainer.states["metrics"]["train"]["throughput"] = samples / max(elapsed, 1e-9)


def _format(metrics: dict) -> str:
    return ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                     for k, v in metrics.items())


def _timing(timer) -> str:
    """', time: epoch 12.3 s, step 0.125 s' from the Trainer's MultiTimer: last epoch, mean step."""
    if timer is None or not getattr(timer, "on", False) or not timer.has("train-step"):
        return ""
    step = timer.get_timer("train-step").get_history_mean()
    epochs = timer.get_timer("train-epoch").history
    epoch = f" epoch {epochs[-1]:.3g} s," if epochs else ""
    return f", time:{epoch} step {step:.3g} s"


class LogMetricByEpochHook(BaseHook):
    """Log the epoch's metrics on rank 0 every `interval` epochs."""

    def __init__(self, logger, interval: int = 1, priority: int = 10) -> None:
        super().__init__(priority)
        self.logger, self.interval = logger, interval

    def _due(self, trainer) -> bool:
        return (trainer.cur_epoch + 1) % self.interval == 0

    def after_train_epoch(self, trainer) -> None:
        if self._due(trainer):
            metrics = _format(trainer.states["metrics"]["train"])
            self.logger.info(f"epoch {trainer.cur_epoch + 1} train: {metrics}"
                             f"{_timing(trainer.timer)}")

    def after_test_epoch(self, trainer) -> None:
        if self._due(trainer):
            self.logger.info(f"epoch {trainer.cur_epoch + 1} test: "
                             f"{_format(trainer.states['metrics']['test'])}")


class LogMemoryByEpochHook(BaseHook):
    """Log peak memory: CUDA allocator's peak on GPUs, the process's peak RSS on CPU."""

    def __init__(self, logger, priority: int = 10) -> None:
        super().__init__(priority)
        self.logger = logger

    def after_train_epoch(self, trainer) -> None:
        if gpc.device.type == "cuda":
            used = f"peak CUDA memory {torch.cuda.max_memory_allocated(gpc.device) / 2**20:.0f} MiB"
        else:  # ru_maxrss is in KiB on Linux
            used = f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB"
        self.logger.info(f"epoch {trainer.cur_epoch + 1} memory: {used}", ranks=None)


class SaveCheckpointHook(BaseHook):
    """Save model, optimizer (and scheduler) every `interval` epochs and, with `every_steps`, also
    every that many optimizer steps, so that `Trainer.resume` continues mid-epoch."""

    def __init__(self, checkpoint_path: str, interval: int = 1, lr_scheduler: Any = None,
                 every_steps: Optional[int] = None, priority: int = 20) -> None:
        super().__init__(priority)
        self.path, self.interval, self.lr_scheduler = checkpoint_path, interval, lr_scheduler
        self.every_steps = every_steps

    def _save(self, trainer, epoch_end: bool = False) -> None:
        trainer.progress.save(self.path, trainer.engine.model, trainer.engine.optimizer,
                              self.lr_scheduler, epoch_end, trainer.engine.accumulating,
                              hooks=None if epoch_end else trainer.hook_states())

    def after_train_iter(self, trainer, output, label, loss) -> None:
        if self.every_steps and trainer.step_ended and trainer.cur_step % self.every_steps == 0:
            self._save(trainer)

    def after_train_epoch(self, trainer) -> None:
        if not trainer.epoch_finished:  # stopped by max_steps: save there, to resume there
            self._save(trainer)
        elif (trainer.cur_epoch + 1) % self.interval == 0:  # (counted done by the Trainer after)
            self._save(trainer, epoch_end=True)


class PipelineTraceHook(BaseHook):
    """Record a pipeline engine's schedule steps in training iterations `skip` to `skip + keep`
    (excluded; the first also exchanges shapes), then write one Chrome trace of every rank: open
    it at ui.perfetto.dev or chrome://tracing to see the real timeline beside plan.py's."""

    def __init__(self, path: str, skip: int = 1, keep: int = 3, priority: int = 0) -> None:
        super().__init__(priority)
        self.path, self.skip, self.keep, self.events = path, skip, keep, []

    def __call__(self, name: str, start: float, end: float) -> None:
        self.events.append({"name": name, "ph": "X", "ts": start * 1e6, "dur": (end - start) * 1e6,
                            "pid": gpc.rank, "tid": 0,
                            "cat": "comm" if name.startswith("send") else "compute"})

    def before_train_iter(self, trainer) -> None:
        recording = self.skip <= trainer.cur_step < self.skip + self.keep
        trainer.engine.trace(self if recording else None)

    def after_train_iter(self, trainer, output, label, loss) -> None:
        trainer.engine.trace(None)  # evaluation is not traced

    def after_train(self, trainer) -> None:
        everyone: list = [None] * gpc.world_size
        dist.all_gather_object(everyone, self.events)
        if gpc.rank == 0:
            meta = [{"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}}
                    for r in range(gpc.world_size)]
            with open(self.path, "w") as f:
                json.dump({"traceEvents": meta + [e for events in everyone for e in events]}, f)
