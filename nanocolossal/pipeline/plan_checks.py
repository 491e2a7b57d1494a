"""The combinations of schedule, stages P, micro-batches M and chunks V that no plan can run
(plan.py calls `check_sizes` by one line before building a plan), and the config's pipeline
keys (`check_pipeline_config`, from config_checks.py's list)."""
from __future__ import annotations

from ..config import Config, ConfigError, is_positive_int
from .steps import PlanError

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble", "zbv")


def check_sizes(schedule: str, P: int, M: int, V: int) -> None:
    """Raise PlanError for a combination no schedule can run."""
    if schedule not in SCHEDULES:
        raise PlanError(f"unknown schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
    if P < 1 or M < 1 or V < 1:
        raise PlanError(f"stages, micro-batches and chunks must be >= 1, got P={P}, M={M}, V={V}")
    if schedule == "zbv" and V != 2:
        raise PlanError(f"zbv runs two chunks per rank (a V), got NUM_CHUNKS={V}; set "
                        f"NUM_CHUNKS=2")
    if schedule not in ("interleaved", "zbv") and V != 1:
        raise PlanError(f"{schedule} runs one chunk per rank; use the interleaved schedule for "
                        f"NUM_CHUNKS={V}")
    if schedule == "interleaved" and P < 2:
        raise PlanError("the interleaved schedule needs at least 2 pipeline stages")
    if schedule == "zbv" and M < 2 * P - 1:
        raise PlanError(f"zbv needs NUM_MICRO_BATCHES >= 2 x pipeline size - 1 = {2 * P - 1} "
                        f"(rank 0's forwards before micro-batch 0 comes back up the V), got {M}")
    if schedule == "interleaved" and M % P != 0:
        raise PlanError(f"the interleaved schedule needs NUM_MICRO_BATCHES a multiple of the "
                        f"pipeline size: M={M}, P={P}; use M={((M + P - 1) // P) * P}")
    if M < P:
        raise PlanError(f"NUM_MICRO_BATCHES={M} is smaller than the pipeline size {P}: stages "
                        f"would idle most of the time; use at least {P} micro-batches")


def check_pipeline_config(cfg: Config) -> None:
    """PIPELINE_SCHEDULE names one of plan.py's schedules; NUM_MICRO_BATCHES and NUM_CHUNKS are
    counts; TENSOR_SHAPE is one micro-batch's activation shape (p2p.py)."""
    schedule = cfg.get("PIPELINE_SCHEDULE")
    if schedule is not None and schedule not in SCHEDULES:
        raise ConfigError(f"PIPELINE_SCHEDULE must be one of {', '.join(map(repr, SCHEDULES))}, "
                          f"got {schedule!r}")
    for key in ("NUM_MICRO_BATCHES", "NUM_CHUNKS"):
        value = cfg.get(key)
        if value is not None and not is_positive_int(value):
            raise ConfigError(f"{key} must be a positive integer, got {value!r}")
    shape = cfg.get("TENSOR_SHAPE")
    if shape is not None and not (isinstance(shape, (list, tuple)) and shape
                                  and all(map(is_positive_int, shape))):
        raise ConfigError(f"TENSOR_SHAPE must be a non-empty list of positive ints (one "
                          f"micro-batch's activation), got {shape!r}")
