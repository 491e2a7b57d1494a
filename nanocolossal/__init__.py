"""nanocolossal: the ideas of the Colossal-AI tutorials, in plain PyTorch.

    import nanocolossal as nc
    nc.launch_from_torch(config="config.py")       # torchrun --nproc_per_node 2 train.py
    nc.gpc.config.BATCH_SIZE, nc.gpc.rank, nc.gpc.data_group
    loader = nc.get_dataloader(dataset, shuffle=True, batch_size=nc.gpc.config.BATCH_SIZE)

One module per idea: config, context (gpc), launch, logging, data, metrics, ddp,
gradient_handler, syncbn, amp (amp_scaler, cpu_half), engine, trainer, hooks, timer,
checkpoint/, checks, pipeline/, tensor/, nn/, run. And by Colossal-AI's import paths: core, utils,
builder, engine.schedule, nn.lr_scheduler, nn.metric; by apex's: amp, parallel. Each is imported
at its first use (lazy.py): `import nanocolossal` imports no torch.
"""
from . import config
from .config import AMP_TYPE, Config, ConfigError, load_config
from .lazy import lazy

__getattr__, __dir__ = lazy(__name__, {  # submodule: its names (any submodule: nc.amp)
    "context": ["gpc"], "data": ["DistributedSampler", "get_dataloader"],
    "engine": ["Engine", "PipelineEngine", "initialize"], "logging": ["get_dist_logger"],
    "launch": ["LaunchError", "get_default_parser", "launch", "launch_from_openmpi",
               "launch_from_slurm", "launch_from_torch"], "checkpoint": ["Progress"]})


def _checks_on_load() -> None:  # load_config's checks import every feature: at the first load
    from . import config_checks, launch_checks
    launch_checks.install_user_error_hook()
    if config_checks.validate_config not in config.CHECKS:
        config.CHECKS.append(config_checks.validate_config)


config.ON_LOAD.append(_checks_on_load)

__all__ = [
    "AMP_TYPE", "Config", "ConfigError", "DistributedSampler", "Engine", "LaunchError",
    "PipelineEngine", "Progress",
    "amp", "builder", "checkpoint", "checks", "config", "config_checks", "core", "cpu_half",
    "data", "ddp", "hooks", "metrics", "nn", "parallel", "pipeline", "syncbn",
    "tensor", "trainer", "utils",
    "get_dataloader", "get_default_parser", "get_dist_logger", "gpc", "initialize", "launch",
    "launch_from_openmpi", "launch_from_slurm", "launch_from_torch", "load_config",
]
