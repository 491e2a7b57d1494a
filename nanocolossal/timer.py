"""Timers for the phases of training: how long an epoch, a step, an evaluation takes.

    timer = MultiTimer()
    trainer = Trainer(engine, timer=timer)      # times "train-epoch", "train-step", "test-epoch"
    trainer.fit(...)
    timer.get_timer("train-step").get_history_mean()    # seconds per training step

Each named Timer accumulates start/stop intervals; `stop(keep_in_history=True)` also records the
interval, so mean and sum over the history are available. Wall time (time.perf_counter) is what is
measured: on a GPU, work still queued when stop() is called is not waited for (the Trainer's phases
end in a loss.item() or a collective, which waits).
"""
from __future__ import annotations

import time
from typing import Iterator


class Timer:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.elapsed = 0.0
        self.history: list[float] = []
        self._started: float | None = None

    def start(self) -> None:
        """Begin an interval (a start while running -- a stop skipped by an error -- restarts)."""
        self._started = time.perf_counter()

    def stop(self, keep_in_history: bool = True) -> float:
        """End the interval; returns its length in seconds (added to `elapsed`)."""
        if self._started is None:
            raise RuntimeError("timer was not started")
        interval = time.perf_counter() - self._started
        self._started = None
        self.elapsed += interval
        if keep_in_history:
            self.history.append(interval)
        return interval

    def get_history_mean(self) -> float:
        return sum(self.history) / len(self.history) if self.history else 0.0

    def get_history_sum(self) -> float:
        return sum(self.history)


class MultiTimer:
    """Named Timers, created on first use."""

    def __init__(self, on: bool = True) -> None:
        self.on = on
        self._timers: dict[str, Timer] = {}

    def get_timer(self, name: str) -> Timer:
        return self._timers.setdefault(name, Timer())

    def has(self, name: str) -> bool:
        return name in self._timers

    def start(self, name: str) -> None:
        if self.on:
            self.get_timer(name).start()

    def stop(self, name: str, keep_in_history: bool = True) -> float:
        return self.get_timer(name).stop(keep_in_history) if self.on else 0.0

    def reset(self, name: str | None = None) -> None:
        for key, timer in self._timers.items():
            if name is None or key == name:
                timer.reset()

    def __iter__(self) -> Iterator[tuple[str, Timer]]:
        return iter(self._timers.items())
