"""The public API exists under the documented names and defaults (the project's API contract,
DESIGN.md, is kept beside this repository in the team's shared folder, not in it)."""
import inspect

import torch

import nanocolossal as nc
from nanocolossal.context import gpc


def _defaults(fn):
    params = inspect.signature(fn).parameters.items()
    return {k: v.default for k, v in params if v.default is not inspect.Parameter.empty}


def test_design_names_exist():
    names = ["get_default_parser", "launch", "launch_from_torch", "launch_from_slurm",
             "launch_from_openmpi", "gpc", "get_dataloader", "initialize", "get_dist_logger",
             "data.DistributedSampler", "ddp.DistributedDataParallel", "syncbn.SyncBatchNorm",
             "syncbn.convert_sync_batchnorm", "amp.AMP_TYPE", "amp.initialize", "amp.scale_loss",
             "amp.DynamicLossScaler", "metrics.Accuracy", "metrics.all_reduce_mean",
             "pipeline.build_pipeline_model", "pipeline.PipelineSchedule",
             "pipeline.InterleavedPipelineSchedule", "pipeline.GPipeSchedule", "trainer.Trainer",
             "checkpoint.save_checkpoint", "checkpoint.load_checkpoint",
             "checkpoint.merge_pipeline_checkpoint"]
    names += [f"trainer.hooks.{h}" for h in ["BaseHook", "LossHook", "AccuracyHook",
                                             "LRSchedulerHook", "LogMetricByEpochHook",
                                             "LogMemoryByEpochHook", "ThroughputHook",
                                             "SaveCheckpointHook"]]
    for name in names:
        obj = nc
        for part in name.split("."):
            obj = getattr(obj, part)
    assert {m.name for m in nc.amp.AMP_TYPE} == {"TORCH", "APEX", "NAIVE"}
    for attr in ["config", "rank", "world_size", "local_rank", "device", "data_rank", "data_size",
                 "data_group",
                 "pipeline_rank", "pipeline_size", "pipeline_group", "prev_rank", "next_rank"]:
        getattr(gpc, attr)
    for method in ["is_first_stage", "is_last_stage", "destroy"]:
        assert callable(getattr(gpc, method))


def test_tensor_parallel_and_colossal_import_paths_exist():
    """DESIGN's tensor-parallel names, and the import paths the tutorials use."""
    for attr in ["tensor_rank", "tensor_size", "tensor_group", "tensor_mode", "tensor_row_group",
                 "tensor_col_group", "tensor_row_rank", "tensor_col_rank"]:
        getattr(gpc, attr)
    assert gpc.tensor_mode is None and gpc.tensor_size == 1
    for name in ["Linear", "LayerNorm", "Embedding", "PatchEmbedding", "Classifier", "Dropout",
                 "CrossEntropyLoss"]:
        assert callable(getattr(nc.nn, name))
    assert type(nc.nn.Linear(4, 2)) is torch.nn.Linear  # plain torch without tensor parallelism
    assert callable(nc.checkpoint.merge_tensor_parallel)
    assert callable(nc.checkpoint.load_plain_state_dict)
    from nanocolossal.builder import build_pipeline_model
    from nanocolossal.context import Config
    from nanocolossal.core import global_context
    from nanocolossal.engine.schedule import InterleavedPipelineSchedule, PipelineSchedule
    from nanocolossal.logging import disable_existing_loggers
    from nanocolossal.nn.lr_scheduler import CosineAnnealingLR, LinearWarmupLR
    from nanocolossal.nn.metric import Accuracy
    from nanocolossal.utils import MultiTimer, get_dataloader

    assert (
        global_context is gpc
        and Accuracy is nc.metrics.Accuracy
        and get_dataloader is nc.get_dataloader
    )
    assert build_pipeline_model is nc.pipeline.build_pipeline_model and Config is nc.Config
    assert PipelineSchedule is nc.pipeline.PipelineSchedule and InterleavedPipelineSchedule
    assert (
        callable(disable_existing_loggers) and MultiTimer and CosineAnnealingLR and LinearWarmupLR
    )


def test_design_defaults():
    assert _defaults(nc.amp.DynamicLossScaler) == dict(
        init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
        hysteresis=1, min_scale=1.0, max_scale=2.0**24, max_consecutive_overflows=32)
    assert _defaults(nc.ddp.DistributedDataParallel) == dict(process_group=None, bucket_cap_mb=25,
                                                             # DESIGN's; then ours:
                                                             broadcast_buffers=True,
                                                             gradient_as_bucket_view=False,
                                                             compress=None, reduced_elsewhere=())
    assert _defaults(nc.data.DistributedSampler) == dict(num_replicas=None, rank=None,
                                                         shuffle=True, seed=0,
                                                         drop_last=False, pad=True)
    assert (
        _defaults(nc.launch_from_torch)["seed"] == 1024 and _defaults(nc.launch)["backend"] is None
    )
    assert _defaults(nc.pipeline.build_pipeline_model)["partition"] == "parameters"
    parser_flags = {a.dest for a in nc.get_default_parser()._actions}
    assert {"config", "host", "port", "rank", "world_size", "local_rank", "backend"} <= parser_flags
