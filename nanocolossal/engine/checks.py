"""What initialize refuses before it changes anything: a config the model or data cannot run."""
from __future__ import annotations

from typing import Any

from torch import nn
from torch.utils.data import DataLoader

from ..activation_checkpoint_checks import warn_if_nothing_recomputes
from ..checks import check_consistency
from ..config import ConfigError
from ..context import gpc
from ..pipeline import PipelineChunks, PipelinePart
from ..pipeline.steps import v_shaped
from ..sequence_checks import check_sequence_model
from ..tensor.checks import check_tensor_model


def check_inputs(model: nn.Module, loaders: dict[str, Any], schedule: Any) -> None:
    check_consistency(model, loaders["train"], loaders["test"])  # every rank: config, model
    if schedule is not None:
        check_batches_fill_micro_batches(schedule.num_microbatches, loaders)
    if gpc.sequence_size > 1:
        check_sequence_model(model)
    elif gpc.tensor_size > 1:
        check_tensor_parallel_model(model)
        check_tensor_model(model, loaders)  # tensor/checks.py: stray parameters, batch blocks
    warn_if_nothing_recomputes(model)


def check_tensor_parallel_model(model: nn.Module) -> None:
    """Plain torch layers would silently compute on slices as if they were whole tensors. Under
    2d, 2.5d and 3d the activations are blocks of the batch and of the features, so a plain
    LayerNorm or a BatchNorm (SyncBN too) would normalise one block as if it were the whole."""
    def plain_layer(m: nn.Module) -> bool:
        if type(m) in (nn.Linear, nn.Embedding, nn.Conv2d):
            return True
        norm = type(m) is nn.LayerNorm or isinstance(m, nn.modules.batchnorm._BatchNorm)
        return gpc.tensor_mode in ("2d", "2.5d", "3d") and norm
    plain = [name for name, m in model.named_modules() if plain_layer(m)]
    if plain:
        raise ConfigError(f"[rank {gpc.rank}] parallel.tensor={gpc.tensor_size} "
                          f"({gpc.tensor_mode}) but the model has plain torch layers "
                          f"({', '.join(plain[:4])}{', ...' if len(plain) > 4 else ''}), which "
                          f"cannot split over tensor ranks; build it with nanocolossal.nn layers "
                          f"(nc.nn.Linear, nc.nn.LayerNorm, nc.nn.PatchEmbedding, "
                          f"nc.nn.Classifier) after launch")


def check_pipeline_model(model: nn.Module, chunks: int, name: str) -> None:
    """The model is a pipeline stage built for the config's chunks and schedule `name`."""
    cfg = gpc.config
    if not isinstance(model, (PipelinePart, PipelineChunks)):
        raise ConfigError(f"[rank {gpc.rank}] parallel.pipeline={gpc.pipeline_size} but the model "
                          f"is a whole {type(model).__name__}; pass build_pipeline_model(model) "
                          f"(this rank's stage) to initialize")
    if "NUM_MICRO_BATCHES" not in cfg:
        raise ConfigError(f"[rank {gpc.rank}] parallel.pipeline={gpc.pipeline_size} needs "
                          f"NUM_MICRO_BATCHES in the config (at least {gpc.pipeline_size})")
    if cfg.get("gradient_accumulation", 1) > 1:
        raise ConfigError(f"[rank {gpc.rank}] gradient_accumulation is not combined with "
                          f"pipelines: micro-batches already accumulate; raise NUM_MICRO_BATCHES "
                          f"(and the batch size) instead")
    if cfg.get("NUM_CHUNKS", 1) != chunks:
        raise ConfigError(f"[rank {gpc.rank}] NUM_CHUNKS={cfg.get('NUM_CHUNKS', 1)} but the stage "
                          f"has {chunks} chunk(s); pass num_chunks=NUM_CHUNKS to "
                          f"build_pipeline_model")
    if name in ("zero_bubble", "zbv") and cfg.get("ACTIVATION_CHECKPOINT"):
        raise ConfigError(f"[rank {gpc.rank}] ACTIVATION_CHECKPOINT recomputes a block in a "
                          f"backward of its own, which cannot split into {name}'s input "
                          f"gradient (B) and weight gradient (W); use PIPELINE_SCHEDULE='1f1b' "
                          f"with it, or {name} without it")
    if getattr(model, "v_shape", False) != v_shaped(name):
        built = "a V (zbv)" if getattr(model, "v_shape", False) else "a loop (c * P + r)"
        raise ConfigError(f"[rank {gpc.rank}] PIPELINE_SCHEDULE={name!r} but the stage's chunks "
                          f"were placed in {built}; build it with build_pipeline_model(..., "
                          f"schedule={name!r}) (or after setting PIPELINE_SCHEDULE)")


def check_batches_fill_micro_batches(M: int, loaders: dict[str, Any]) -> None:
    """Every batch is split into M micro-batches, so it needs at least M samples. A loader whose
    last batch is shorter would fail only when it reaches it, after a whole epoch: say so now."""
    for name, loader in loaders.items():
        if not isinstance(loader, DataLoader) or loader.batch_size is None or loader.drop_last:
            continue
        try:
            n = len(loader.sampler)  # this rank's share where a DistributedSampler shards
        except TypeError:  # an iterable dataset: no length to check
            continue
        last = n % loader.batch_size or min(n, loader.batch_size)
        if 0 < last < M:
            raise ConfigError(f"[rank {gpc.rank}] the {name} dataloader's last batch has {last} "
                              f"sample(s), fewer than NUM_MICRO_BATCHES={M}, and would fail "
                              f"after a whole epoch; pass drop_last=True, or pick a batch size "
                              f"that leaves no remainder of {n} or one of at least {M}")
