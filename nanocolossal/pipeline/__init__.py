"""Pipeline parallelism: cut an nn.Sequential into stages and stream micro-batches through them.

    partition.py  build_pipeline_model: which layers live on which rank
    steps.py      what a plan is made of: compute steps, messages, which rank holds which part
    plan.py       GPipe / 1F1B / interleaved 1F1B as per-rank step lists; picks a schedule's plan
    zero_bubble.py  ZB-H1 and ZB-V: the backward split into B and W, W's filling the bubble
    simulate.py   run plans without processes (deadlocks, memory) and draw their timelines
    p2p.py        batched sends/receives between neighbouring stages, with a shape handshake
    executor.py   the executor that runs a plan: forward_backward_step (Executor, Run)
    executor_features.py  what it leaves out: split backwards, own losses, counted weights, tracing
    split_backward.py  zero-bubble's backward in two: B (the input's gradient), W (the weights')

    python -m nanocolossal.pipeline --show --stages 4 --microbatches 8 [--chunks 2] [--schedule S]
"""
from ..lazy import lazy
from .plan import all_plans, build_plan, compute_order, one_f_one_b, warmup_count
from .simulate import render, simulate
from .steps import PlanError

__getattr__, __dir__ = lazy(__name__, {  # torch's parts, imported when first used
    "executor": ["Executor"],
    "partition": ["PipelineChunks", "PipelinePart", "balanced_split", "build_pipeline_model"],
    "schedules": ["GPipeSchedule", "InterleavedPipelineSchedule", "PipelineSchedule",
                  "ZBVSchedule", "ZeroBubbleSchedule", "make_schedule"],
})

__all__ = ["Executor", "GPipeSchedule", "InterleavedPipelineSchedule", "PipelineChunks",
           "PipelineSchedule", "PipelinePart", "PlanError", "ZBVSchedule", "ZeroBubbleSchedule",
           "all_plans", "balanced_split", "build_pipeline_model", "build_plan", "compute_order",
           "make_schedule", "one_f_one_b", "render", "simulate", "warmup_count"]
