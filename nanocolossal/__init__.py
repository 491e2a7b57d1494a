"""nanocolossal: the ideas of the Colossal-AI tutorials, in plain PyTorch.

    import nanocolossal as nc
    nc.launch_from_torch(config="config.py")       # torchrun --nproc_per_node 2 train.py
    nc.gpc.config.BATCH_SIZE, nc.gpc.rank, nc.gpc.data_group
    loader = nc.get_dataloader(dataset, shuffle=True, batch_size=nc.gpc.config.BATCH_SIZE)

One module per idea: config, context (gpc), launch, logging, data, metrics, ddp,
gradient_handler, syncbn, amp (amp_scaler, cpu_half), engine, trainer, hooks, timer, checkpoint,
progress, checks, pipeline/, tensor/, nn/, run. And by Colossal-AI's import paths: core, utils,
builder, engine.schedule, nn.lr_scheduler, nn.metric; by apex's: amp, parallel.
"""
from . import (
    amp,
    builder,
    checkpoint,
    checks,
    config,
    config_checks,
    core,
    cpu_half,
    data,
    ddp,
    hooks,
    metrics,
    nn,
    parallel,
    pipeline,
    progress,
    syncbn,
    tensor,
    trainer,
    utils,
)
from .config import AMP_TYPE, Config, ConfigError, load_config
from .context import gpc
from .data import DistributedSampler, get_dataloader
from .engine import Engine, PipelineEngine, initialize
from .launch import (
    LaunchError,
    get_default_parser,
    launch,
    launch_from_openmpi,
    launch_from_slurm,
    launch_from_torch,
)
from .logging import get_dist_logger
from .progress import Progress

config.CHECKS.append(config_checks.validate_config)  # every config loaded: config_checks' list

__all__ = [
    "AMP_TYPE", "Config", "ConfigError", "DistributedSampler", "Engine", "LaunchError",
    "PipelineEngine", "Progress",
    "amp", "builder", "checkpoint", "checks", "config", "config_checks", "core", "cpu_half",
    "data", "ddp", "hooks", "metrics", "nn", "parallel", "pipeline", "progress", "syncbn",
    "tensor", "trainer", "utils",
    "get_dataloader", "get_default_parser", "get_dist_logger", "gpc", "initialize", "launch",
    "launch_from_openmpi", "launch_from_slurm", "launch_from_torch", "load_config",
]
