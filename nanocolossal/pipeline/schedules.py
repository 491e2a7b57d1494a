"""The schedules by name: each is the executor (executor.py) with a plan (plan.py), so a class
here says only which plan and how many chunks per rank.

    gpipe        GPipeSchedule                all forwards, then all backwards        1 chunk
    1f1b         PipelineSchedule             warm-up F's, then one F, one B           1 chunk
    interleaved  InterleavedPipelineSchedule  1F1B over V chunks (Megatron's virtual)  V chunks
    zero_bubble  ZeroBubbleSchedule           1F1B, backwards split in B, W (ZB-H1)    1 chunk
    zbv          ZBVSchedule                  two chunks in a V, backwards split       2 chunks

`make_schedule(name, M, V)` picks one (initialize does, from the config's PIPELINE_SCHEDULE);
`check_pipeline_config` (plan_checks.py) checks the config's pipeline keys when it is loaded.
"""
from __future__ import annotations

from typing import Optional, Sequence

from .executor_checks import check_schedule
from .executor_features import Schedule


class GPipeSchedule(Schedule):
    name = "gpipe"


class PipelineSchedule(Schedule):
    name = "1f1b"


class ZeroBubbleSchedule(Schedule):
    name = "zero_bubble"


class ZBVSchedule(Schedule):
    name = "zbv"

    def __init__(self, num_microbatches: int, tensor_shape: Optional[Sequence[int]] = None,
                 num_chunks: int = 2):
        super().__init__(num_microbatches, tensor_shape, num_chunks)


class InterleavedPipelineSchedule(Schedule):
    name = "interleaved"

    def __init__(self, num_microbatches: int, num_chunks: int,
                 tensor_shape: Optional[Sequence[int]] = None):
        super().__init__(num_microbatches, tensor_shape, num_chunks)


SCHEDULE_CLASSES = {s.name: s for s in (GPipeSchedule, PipelineSchedule, ZeroBubbleSchedule,
                                         ZBVSchedule, InterleavedPipelineSchedule)}


def make_schedule(name: str, num_microbatches: int, num_chunks: int = 1,
                  tensor_shape: Optional[Sequence[int]] = None) -> Schedule:
    """A schedule by name: 'gpipe', '1f1b', 'interleaved', 'zero_bubble' or 'zbv'."""
    check_schedule(name, num_microbatches, num_chunks)  # launched: on the real pipeline, now
    chunks = num_chunks if name in ("interleaved", "zbv") else 1
    return SCHEDULE_CLASSES[name](num_microbatches, tensor_shape=tensor_shape, num_chunks=chunks)
