"""`colossalai.engine.schedule`: the pipeline schedules, by the tutorials' import path (see
pipeline/schedules.py)."""
from ..pipeline.schedules import GPipeSchedule, InterleavedPipelineSchedule, PipelineSchedule

__all__ = ["GPipeSchedule", "InterleavedPipelineSchedule", "PipelineSchedule"]
