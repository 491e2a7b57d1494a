"""The Engine and `initialize` (Colossal-AI's `colossalai.initialize`).

    engine.py      Engine / PipelineEngine: the five calls of a training loop
    initialize.py  apply gpc.config in named steps: replicas equal -> SyncBN -> AMP -> ZeRO ->
                   MoE -> DDP or its stand-in -> Engine, with its extensions (../extensions.py)
    checks.py      what initialize refuses before changing anything
    engine_checks.py  what the Engine refuses (a batch not a pair, a backward past it, ...)
    schedule.py    `colossalai.engine.schedule`: the pipeline schedules at the tutorials' path
"""
from .engine import Engine, PipelineEngine
from .initialize import initialize

__all__ = ["Engine", "PipelineEngine", "initialize"]
