"""The schedules by name: each is the executor (executor.py) with a plan (plan.py), so a class
here says only which plan and how many chunks per rank.

    gpipe         all forwards, then all backwards                    1 chunk
    1f1b          warm-up forwards, then one forward, one backward   1 chunk
    interleaved   1F1B over V chunks per rank (Megatron's virtual)   V chunks
    zero_bubble   1F1B, each backward split into B and W (ZB-H1)     1 chunk
    zbv           two chunks in a V, backwards split (ZB-V)          2 chunks

`make_schedule(name, M, V)` picks one (initialize does, from the config's PIPELINE_SCHEDULE);
`check_pipeline_config` checks the config's pipeline keys when it is loaded.
"""
from __future__ import annotations

from typing import Optional, Sequence

from ..config import Config, ConfigError, is_positive_int
from ..context import gpc
from .executor_checks import check_on_this_pipeline
from .executor_features import Schedule
from .plan import SCHEDULES
from .steps import PlanError


class GPipeSchedule(Schedule):
    """All forwards, then all backwards (GPipe): the memory baseline."""
    name = "gpipe"


class PipelineSchedule(Schedule):
    """Non-interleaved 1F1B: warm-up forwards, one-forward-one-backward, cool-down backwards."""
    name = "1f1b"


class ZeroBubbleSchedule(Schedule):
    """ZB-H1: 1F1B with each backward split into B (the input's gradient, sent on at once) and
    W (the weights' gradient, deferred into the bubble); see zero_bubble.py."""
    name = "zero_bubble"


class ZBVSchedule(Schedule):
    """ZB-V: two chunks per rank placed in a V (chunk 0 down the ranks, chunk 1 back up), each
    backward split into B and W; see zero_bubble.py."""
    name = "zbv"

    def __init__(self, num_microbatches: int, tensor_shape: Optional[Sequence[int]] = None,
                 num_chunks: int = 2):
        super().__init__(num_microbatches, tensor_shape, num_chunks)


class InterleavedPipelineSchedule(Schedule):
    """Interleaved 1F1B over `num_chunks` model chunks per rank (Megatron's virtual pipeline)."""
    name = "interleaved"

    def __init__(self, num_microbatches: int, num_chunks: int,
                 tensor_shape: Optional[Sequence[int]] = None):
        super().__init__(num_microbatches, tensor_shape, num_chunks)


def make_schedule(name: str, num_microbatches: int, num_chunks: int = 1,
                  tensor_shape: Optional[Sequence[int]] = None) -> Schedule:
    """A schedule by name: 'gpipe', '1f1b', 'interleaved', 'zero_bubble' or 'zbv'."""
    # launched: check against the real pipeline now, not at the first batch
    if gpc.pipeline_size > 1:
        check_on_this_pipeline(name, num_microbatches, num_chunks)
    elif name not in SCHEDULES:
        raise PlanError(f"unknown schedule {name!r}; use one of {', '.join(SCHEDULES)}")
    if name in ("interleaved", "zbv"):
        chunked = InterleavedPipelineSchedule if name == "interleaved" else ZBVSchedule
        return chunked(num_microbatches, tensor_shape=tensor_shape, num_chunks=num_chunks)
    schedules = {"gpipe": GPipeSchedule, "1f1b": PipelineSchedule,
                 "zero_bubble": ZeroBubbleSchedule}
    return schedules[name](num_microbatches, tensor_shape)


# -- the config's pipeline keys, checked when a config is loaded (config.py) ----------------------

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
