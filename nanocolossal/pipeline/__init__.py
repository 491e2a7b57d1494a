"""Pipeline parallelism: cut an nn.Sequential into stages and stream micro-batches through them.

    partition.py  build_pipeline_model: which layers live on which rank
    steps.py      what a plan is made of: compute steps, messages, which rank holds which part
    plan.py       GPipe / 1F1B / interleaved 1F1B as per-rank step lists; picks a schedule's plan
    zero_bubble.py  ZB-H1 and ZB-V: the backward split into B and W, W's filling the bubble
    simulate.py   run plans without processes (deadlocks, memory) and draw their timelines
    p2p.py        batched sends/receives between neighbouring stages, with a shape handshake
    schedule.py   the executor that runs a plan: forward_backward_step
    split_backward.py  zero-bubble's backward in two: B (the input's gradient), W (the weights')

    python -m nanocolossal.pipeline --show --stages 4 --microbatches 8 [--chunks 2] [--schedule S]
"""
from ..config import Config, ConfigError, is_positive_int, register_check
from .partition import PipelineChunks, PipelineStage, balanced_split, build_pipeline_model
from .plan import SCHEDULES, all_plans, build_plan, compute_order, one_f_one_b, warmup_count
from .schedules import (
    GPipeSchedule,
    InterleavedPipelineSchedule,
    PipelineSchedule,
    ZBVSchedule,
    ZeroBubbleSchedule,
    make_schedule,
)
from .simulate import render, simulate
from .steps import PlanError

__all__ = ["GPipeSchedule", "InterleavedPipelineSchedule", "PipelineChunks", "PipelineSchedule",
           "PipelineStage", "PlanError", "ZBVSchedule", "ZeroBubbleSchedule", "all_plans",
           "balanced_split", "build_pipeline_model", "build_plan", "compute_order",
           "make_schedule", "one_f_one_b", "render", "simulate", "warmup_count"]


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
    if shape is not None and not (isinstance(shape, (list, tuple))
                                  and all(map(is_positive_int, shape))):
        raise ConfigError(f"TENSOR_SHAPE must be a list of positive ints (one micro-batch's "
                          f"activation), got {shape!r}")


register_check(check_pipeline_config)  # validate_config runs it when a config is loaded
