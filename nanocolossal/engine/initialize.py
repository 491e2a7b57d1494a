"""initialize: apply gpc.config to model, optimizer and criterion, in the tutorial's order.

    engine, train_dl, test_dl, lr_scheduler = nc.initialize(model, optimizer, criterion,
                                                            train_dl, test_dl, lr_scheduler)

Each step runs only where the config (or the model) asks for it, and returns what it built
and a few words for the log line; the steps that change what the training loop does return
extensions (extensions.py), which the Engine and the pipeline executor call at their marked
places:

    check_inputs        refuse a bad config or model before anything changes (checks.py)
    broadcast_replicas  replicas start equal: each parameter and buffer from the first rank
                        holding it (replicas.py), before anything is built from them
    sync_bn             sync_bn=True: BatchNorm statistics over the whole data-parallel batch
    apply_amp           fp16=dict(...): may change parameter dtypes (O2/O3), so before DDP
    apply_zero          zero=dict(level=1|2|3): the optimizer steps only this rank's shard (zero/);
                        level 3 also keeps only the shard of the parameters between uses
    apply_moe           a model with MoE layers (moe/): experts' gradients over the ranks holding
                        them, the rest over the data ranks, after backward, in place of DDP
    wrap_data_parallel  DDP over the gradient group (data x sequence ranks), or the gradient
                        handler, after AMP: DDP must bucket the final parameters; a pipeline
                        stage wraps each chunk (ZeRO 2-3: wrap_sharded). Extensions: when
                        backward averages; buffer broadcasts
    extend_loss         extensions: counted-target weights (loss_weights.py), then MOE_AUX_WEIGHT
                        x the load-balancing loss (pipeline/moe_aux.py)
    sum_tied_weights    extensions: a weight pipeline stages share sums their gradients
                        (pipeline/tied.py), after the data-parallel average
    SplitLabels         extensions: under 2d a grid row's output holds a block of the labels
    Engine              or PipelineEngine with the schedule the config asks for
    split_loader        mode='sequence': the loaders yield this rank's share of each sequence
    training_loader     gradient_accumulation: counted targets read each group ahead (of the split)

The order matters: AMP O2 casts parameters, and DDP's buckets hold the final ones; SyncBN
replaces modules, so it comes before AMP picks which layers stay in fp32.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader

from .. import amp
from .. import cpu_half as probe
from ..amp_settings import amp_settings
from ..checkpoint.zero3_state_dict import FullStateDict
from ..config import AMP_TYPE, ConfigError
from ..config_checks import zero_settings
from ..context import gpc
from ..ddp import BroadcastBuffers, DdpSync, DistributedDataParallel
from ..extensions import Extension, training_loader
from ..gradient_handler import DataParallelGradientHandler
from ..logging import get_dist_logger
from ..loss_weights import CountedTargets, weighed_ranks, weighs_by_targets
from ..moe import MoeGradientHandler, moe_layers
from ..moe.settings import moe_aux_weight
from ..pipeline import PipelineChunks, make_schedule
from ..pipeline.moe_aux import MoeAuxLoss
from ..pipeline.steps import virtual_stage
from ..pipeline.tied import TiedGradients
from ..plain_optimizer import PlainOptimizer
from ..replicas import broadcast_replicas
from ..sequence import sequence_attention, split_loader
from ..syncbn import convert_sync_batchnorm
from ..tensor.layers_2d import SplitLabels, tensor_batch_shares
from ..zero import MixedShardedOptimizer, Offload, ShardedOptimizer, ShardKeepingDDP
from ..zero.mixed import MixedParamShardedOptimizer
from ..zero.sharded_model import HELD, ShardedModel, plan_units, release
from ..zero.sharded_params import ParamShardedOptimizer
from ..zero.tied import sum_sharded_tied_gradients
from .checks import check_inputs, check_pipeline_model
from .engine import Engine, PipelineEngine

LogNote = Optional[str]  # what a step did, for the log line (None: nothing)


def pipeline_schedule(model: nn.Module) -> Any:
    """The schedule gpc.config asks for (pipeline/schedules.py), for this stage's chunks."""
    cfg = gpc.config
    chunks = len(model) if isinstance(model, PipelineChunks) else 1
    name = cfg.get("PIPELINE_SCHEDULE", "interleaved" if chunks > 1 else "1f1b")
    check_pipeline_model(model, chunks, name)
    try:
        return make_schedule(name, cfg.NUM_MICRO_BATCHES, chunks, cfg.get("TENSOR_SHAPE"))
    except ValueError as e:  # PlanError: already names the rank
        raise ConfigError(str(e)) from None


def apply_amp(model: nn.Module, optimizer: torch.optim.Optimizer, criterion: Optional[Callable]
              ) -> tuple[nn.Module, PlainOptimizer, Optional[Callable], LogNote]:
    """fp16=dict(...): the optimizer steps fp32 masters and scales the loss (amp.py)."""
    fp16 = gpc.config.fp16
    if gpc.config.get("zero") is not None:  # Colossal-AI v0.1's optimizer_config scaler keys
        fp16 = type(fp16)({**fp16, **zero_settings(gpc.config)[1]})
    ask_cpu = gpc.device.type == "cpu" and "dtype" not in fp16 and fp16.get("enabled", True)
    cpu_half = probe.cpu_half_dtype() if ask_cpu else None
    opt_level, kwargs = amp_settings(fp16, cpu_half, gpc.device.type == "cpu")
    name = f"AMP {opt_level} ({AMP_TYPE.parse(fp16.mode).name})"
    if ask_cpu:
        get_dist_logger().info(
            f"fp16 on CPU: computing in {str(cpu_half or torch.float32).removeprefix('torch.')}: "
            f"this CPU {'has' if cpu_half else 'lacks'} bfloat16 instructions and no CPU has fast "
            f"float16 kernels (cpu_half.py); fp16=dict(..., dtype='bfloat16'|'float16') "
            f"overrides")
    if kwargs is None:
        off = "off (enabled=False)" if fp16.get("enabled") is False else "in float32 on this CPU"
        return model, PlainOptimizer(optimizer), criterion, f"{name} {off}"
    # O1 with a criterion: the loss runs under autocast, the output needs no fp32 copy (amp.py);
    # else one process casts only the model's output to fp32: here the last stage's last chunk
    # (a TENSOR_SHAPE fixes every stage boundary at fp32, skipping the dtype handshake: keep all)
    loss_in_autocast = opt_level == "O1" and criterion is not None
    chunks = len(model) if isinstance(model, nn.ModuleList) else 1
    P, v_shape = gpc.pipeline_size, getattr(model, "v_shape", False)
    last = [virtual_stage(c, gpc.pipeline_rank, P, v_shape) == P * chunks - 1
            for c in range(chunks)]
    fixed_shapes = gpc.config.get("TENSOR_SHAPE") is not None
    outputs = [(fixed_shapes and not is_last) or (is_last and not loss_in_autocast)
               for is_last in last]
    model, optimizer = amp.initialize(model, optimizer, opt_level, device_type=gpc.device.type,
                                      outputs=outputs, **kwargs)
    if loss_in_autocast:  # (after amp.initialize's checks: a refused config hooks nothing)
        dtype = kwargs.get("dtype", torch.float16)
        criterion = amp.autocast_loss(criterion, gpc.device.type, dtype)
    return model, optimizer, criterion, name


def apply_zero(model: nn.Module, optimizer: PlainOptimizer) -> tuple[ShardedOptimizer, str]:
    """zero=dict(level=1|2|3, ...); level 3 cuts the parameters per unit and installs the gather /
    free / reduce-scatter hooks on the model."""
    zero, _, notes = zero_settings(gpc.config)
    for note in notes:
        get_dist_logger().info(note)
    # offload: every shard has a master, on the CPU (zero/offload.py), as O2's half ones have
    offload = zero.get("offload")
    mastered = bool(optimizer.master_pairs()) or offload is not None
    options = dict(offload=Offload(offload)) if offload is not None else {}
    if zero["level"] == 3:
        # O2: the optimizer steps fp32 masters of the half parameters, which are what is sharded
        half_of = {id(master): p for p, master in optimizer.master_pairs()}
        children, unit_of = plan_units(model, [half_of.get(id(p), p) for p in optimizer.params()])
        kind = MixedParamShardedOptimizer if mastered else ParamShardedOptimizer
        sharded = kind(optimizer, model, 3, gpc.gradient_group, unit_of, **options)
        timeline = ShardedModel(model, sharded, children, zero.get("overlap_communication", True))
        FullStateDict(timeline)  # model.state_dict() whole (checkpoint/zero3_state_dict.py)
    else:  # O2: the fp32 masters are sharded too (zero/mixed.py)
        kind = MixedShardedOptimizer if mastered else ShardedOptimizer
        sharded = kind(optimizer, model, zero["level"], gpc.gradient_group, **options)
    return sharded, describe_zero(sharded)


def describe_zero(sharded: ShardedOptimizer) -> str:
    """The log line: how much of each sharded thing this rank keeps, in bytes."""
    total = sum(p.numel() for p in sharded.model_params)
    mine = sum(s.hi - s.lo for b in sharded.buffers for s in b.segments)
    whole = sum(p.numel() * p.element_size() for p in sharded.model_params) / 2**20
    kept = {1: "optimizer state", 2: "optimizer state and gradients",
            3: "optimizer state, gradients and parameters"}[sharded.level]
    offload = getattr(sharded, "offload", None)
    there = (f"; masters and optimizer state on {offload.device}, the step there"
             if offload is not None else "")
    return (f"ZeRO level {sharded.level} x{sharded.size}: this rank keeps the {kept} of {mine} of "
            f"{total} elements: {whole * mine / total:.2f} MiB instead of {whole:.2f} MiB for "
            f"each (at the parameters' precision){there}")


def apply_moe(model: nn.Module, optimizer: PlainOptimizer, layers: list[nn.Module]
              ) -> tuple[Optional[MoeGradientHandler], float, str]:
    """MoE layers: (the gradient handler that reduces experts over their holders, or None on
    one rank; MOE_AUX_WEIGHT for the Engine's loss; what was done)."""
    weight = moe_aux_weight(gpc.config)
    experts = sorted({m.num_experts for m in layers})
    did = (f"MoE: {len(layers)} layer(s) of {'/'.join(map(str, experts))} experts, expert "
           f"parallel x{gpc.ep_size}, + {weight:g} x load-balancing loss")
    if gpc.gradient_size == 1 or gpc.ep_size == 1:  # experts replicated: DDP or ZeRO as ever
        return None, weight, did
    did += (f"; gradients after backward: experts over their holders, the rest over "
            f"x{gpc.gradient_size} data ranks, both / {gpc.gradient_size}")
    return MoeGradientHandler(model, optimizer.master_pairs()), weight, did


def wrap_data_parallel(model: nn.Module, chunks: list[nn.Module], pipelined: bool,
                       optimizer: PlainOptimizer, moe: Any = None
                       ) -> tuple[list[nn.Module], list[Extension], LogNote]:
    """What forward runs through (DDP around each chunk) and the extensions that synchronise:
    DDP's no_sync but on the last backward, or the gradient handler after it."""
    if moe is not None:  # experts are not replicated over the data ranks: apply_moe's handler
        return chunks, [moe, BroadcastBuffers(chunks)], None
    if gpc.config.get("gradient_handler"):  # Colossal-AI's all-reduce after backward
        did = f"gradient handler x{gpc.gradient_size}"
        return chunks, [DataParallelGradientHandler(model), BroadcastBuffers(chunks)], did
    zero = gpc.config.get("zero", {})  # level 1: DDP with zero's bucket size
    options = dict(gpc.config.get("ddp", {}))  # bucket_cap_mb, gradient_as_bucket_view, compress
    if "reduce_bucket_size_mb" in zero:
        options.setdefault("bucket_cap_mb", zero.reduce_bucket_size_mb)
    if pipelined:  # the engine syncs buffers once per batch, not on every micro-batch's forward
        options["broadcast_buffers"] = False
    shown = "".join(f", {k}={v}" for k, v in options.items() if k != "broadcast_buffers")
    wrapped = [DistributedDataParallel(chunk, reduced_elsewhere=skip, **options)
               for chunk, skip in zip(chunks, reduced_earlier(chunks))]
    if isinstance(optimizer, ShardedOptimizer):  # level 1: DDP, named in errors as zero
        for ddp in wrapped:
            ddp.name, ddp.other_way = "zero", ""
    did = f"{'data parallel' if pipelined else 'DDP'} x{gpc.gradient_size}{shown}"
    return wrapped, [DdpSync(wrapped, pipelined)], did


def reduced_earlier(chunks: list[nn.Module]) -> list[list]:
    """A weight two chunks of a stage share is reduced by the first: its last backward is the
    stage's last (DdpSync keeps every other chunk's DDP in no_sync meanwhile)."""
    return [[p for q in chunks[:i] for p in q.parameters()] for i in range(len(chunks))]


def wrap_sharded(model: nn.Module, chunks: list[nn.Module], pipelined: bool,
                 optimizer: ShardedOptimizer) -> tuple[list[nn.Module], list[Extension], LogNote]:
    """ZeRO 3: its hooks reduce the gradients, and the replicas broadcast their buffers. ZeRO 2:
    DDP's buckets, each rank keeping its shard (a pipeline stage syncs buffers per batch)."""
    if isinstance(optimizer, ParamShardedOptimizer):
        return [model], ([BroadcastBuffers(chunks)] if gpc.gradient_size > 1 else []), None
    zero = gpc.config.get("zero", {})
    wrapped = [ShardKeepingDDP(chunk, optimizer, zero.get("reduce_bucket_size_mb", 25),
                               zero.get("overlap_communication", True), not pipelined, skip)
               for chunk, skip in zip(chunks, reduced_earlier(chunks))]
    return wrapped, [DdpSync(wrapped, pipelined)], "bucketed gradients, my shard kept"


def extend_loss(model: nn.Module, forward_module: nn.Module, criterion: Any,
                optimizer: PlainOptimizer, aux_weight: float) -> list[Extension]:
    """What the loss weighs, then adds (in this order: the aux loss is not weighed)."""
    extensions: list[Extension] = []
    if weighs_by_targets(criterion):
        # fp16: the G of the weights (amp.py)
        optimizer.weighed_ranks = weighed_ranks(getattr(criterion, "spans_sequence", False))
        extensions.append(CountedTargets(criterion, (forward_module, model)))
    if aux_weight:
        extensions.append(MoeAuxLoss(model, aux_weight, forward_module))
    return extensions


def layout_note(schedule: Any) -> LogNote:
    """The parallel layout, first in the log line."""
    described = []
    if gpc.sequence_size > 1:
        kind = {"ring": "ring attention", "all_to_all": "all-to-all attention, Ulysses"}
        described.append(f"sequence parallel x{gpc.sequence_size} ({kind[sequence_attention()]})")
    elif gpc.tensor_size > 1:
        described.append(f"tensor parallel {gpc.tensor_mode} x{gpc.tensor_size}")
    if schedule is not None:
        described.append(f"pipeline {schedule.name} x{gpc.pipeline_size} stages, "
                     f"{schedule.num_microbatches} micro-batches, {schedule.num_chunks} chunk(s)")
    return ", ".join(described) or None


def initialize(model: nn.Module, optimizer: torch.optim.Optimizer,
               criterion: Optional[Callable] = None, train_dataloader: Optional[DataLoader] = None,
               test_dataloader: Optional[DataLoader] = None,
               lr_scheduler: Any = None, verbose: bool = True):
    """Apply gpc.config to the training components; returns (engine, train_dl, test_dl,
    lr_scheduler)."""
    cfg = gpc.config
    if model in HELD:  # a second initialize of a model ZeRO 3 holds: whole again, hooks off
        release(model)
    schedule = pipeline_schedule(model) if gpc.pipeline_size > 1 else None
    check_inputs(model, {"train": train_dataloader, "test": test_dataloader}, schedule)
    model = model.to(gpc.device)
    pipelined = schedule is not None
    tied = getattr(model, "tied", []) if pipelined else []  # weights stages share
    if gpc.gradient_size > 1 or tied:
        broadcast_replicas(model)  # before AMP's masters and ZeRO's shards are made from it
    notes = []  # what each step did, for the log line: first the layout beyond data parallel
    if schedule is not None or gpc.tensor_size > 1 or gpc.sequence_size > 1:
        notes.append(layout_note(schedule))
    if cfg.get("sync_bn"):
        model = convert_sync_batchnorm(model)
        notes.append("SyncBN")
    if cfg.get("fp16") is None:  # fp32: the plain optimizer and the global-norm clip
        optimizer = PlainOptimizer(optimizer)
    else:
        model, optimizer, criterion, mixed = apply_amp(model, optimizer, criterion)
        notes.append(mixed)
    if cfg.get("zero") is not None:
        optimizer, zero = apply_zero(model, optimizer)
        notes.append(zero)
    layers = moe_layers(model)  # moe: the experts' gradient handler, in DDP's place
    moe, aux_weight, moe_did = apply_moe(model, optimizer, layers) if layers else (None, 0.0, None)
    notes.append(moe_did)
    chunks = list(model) if pipelined and isinstance(model, nn.ModuleList) else [model]
    synchronising: list[Extension] = []
    if isinstance(optimizer, ShardedOptimizer) and optimizer.level >= 2:
        chunks, synchronising, data = wrap_sharded(model, chunks, pipelined, optimizer)
        notes.append(data)
    elif gpc.gradient_size > 1:
        chunks, synchronising, data = wrap_data_parallel(model, chunks, pipelined, optimizer, moe)
        notes.append(data)
    # in the order the loop calls them (extensions.py): data-parallel averages before tied sums
    front = model if pipelined else chunks[0]  # what the engine's forward runs through
    extensions = [*extend_loss(model, front, criterion, optimizer, aux_weight), *synchronising]
    if tied:  # a weight stages share steps with the sum of its gradients
        extensions.append(sum_tied_weights(tied, optimizer))
    if gpc.tensor_mode in ("2d", "2.5d", "3d") and tensor_batch_shares() > 1:
        # the engine returns this rank's share's labels
        extensions.append(SplitLabels(criterion))
    clip = cfg.get("clip_grad_norm", 0.0)
    accumulation = cfg.get("gradient_accumulation", 1)
    if pipelined:
        engine: Engine = PipelineEngine(model, optimizer, criterion, schedule, chunks, clip,
                                        extensions)
    else:
        engine = Engine(model, optimizer, criterion, chunks[0], accumulation, clip, extensions)
    notes += [f"gradient accumulation x{accumulation}" if accumulation > 1 else None,
              f"clip_grad_norm={clip}" if clip else None]
    if verbose:
        did = ", ".join(n for n in notes if n) or "plain fp32, single process"
        get_dist_logger().info(f"initialize: {did}")
    if gpc.sequence_size > 1:  # each rank its share of every sequence
        train_dataloader = split_loader(train_dataloader)
        test_dataloader = split_loader(test_dataloader)
    if accumulation > 1:  # extensions: each group read ahead (counted targets, loss_weights.py)
        train_dataloader = training_loader(extensions, train_dataloader)
    return engine, train_dataloader, test_dataloader, lr_scheduler


def sum_tied_weights(tied: list, optimizer: PlainOptimizer) -> Extension:
    """The tied weights' sums (a GPT's embedding and classifier); under ZeRO level 2-3 from the
    ranks' segments (zero/tied.py)."""
    sharded = isinstance(optimizer, ShardedOptimizer) and optimizer.level >= 2
    return TiedGradients(tied, partial(sum_sharded_tied_gradients, optimizer) if sharded else None)
