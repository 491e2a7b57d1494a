"""`colossalai.engine.schedule`: the pipeline schedules, by the tutorials' import path (see
pipeline/schedule.py)."""
from ..pipeline.schedule import GPipeSchedule, InterleavedPipelineSchedule, PipelineSchedule

__all__ = ["GPipeSchedule", "InterleavedPipelineSchedule", "PipelineSchedule"]
