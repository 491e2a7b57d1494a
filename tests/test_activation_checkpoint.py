"""Activation checkpointing (nanocolossal/activation_checkpoint.py): a block keeps its input and
recomputes its activations in backward, under the forward's random state -- the same dropout
masks, so training is exactly the same, only lighter."""
import logging
import sys

import pytest
import torch
from dist_helpers import ROOT, run_ranks
from run_records import compare_runs, record_steps
from torch import nn
from torch.testing import assert_close

import nanocolossal as nc
import nanocolossal.nn as col_nn
from nanocolossal.checkpoint import strip_prefixes
from nanocolossal.config import AMP_TYPE, ConfigError, load_config
from nanocolossal.context import gpc
from nanocolossal.memory import SavedBytes
from nanocolossal.moe.settings import moe_model_settings
from nanocolossal.nn.transformer import Block
from nanocolossal.pipeline import build_pipeline_model
from nanocolossal.tensor.base import slice_of
from nanocolossal.utils import checkpoint

sys.path.insert(0, str(ROOT))
from train_gpt import gpt  # noqa: E402


class Net(nn.Module):
    """Two residual blocks with dropout; `ckpt`: each one's activations recomputed in backward."""

    def __init__(self, ckpt: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.5),
                                                  nn.Linear(16, 8)) for _ in range(2))
        self.ckpt = ckpt

    def forward(self, x):
        for block in self.blocks:
            x = x + (checkpoint(block, x) if self.ckpt else block(x))
        return x


def train(ckpt: bool):
    """Three SGD steps in float64; every step's gradients and the final parameters."""
    model = Net(ckpt).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(1)  # data and dropout masks from here on
    grads = []
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 8, dtype=torch.float64)).pow(2).mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return grads, model.state_dict()


def test_gloo_training_with_checkpointing_equals_training_without_exactly():
    assert_close(train(ckpt=True), train(ckpt=False), rtol=0, atol=0)


# -- composing: the GPT of train_gpt.py with ACTIVATION_CHECKPOINT, against one process ---------

V, SEQ, DIM, BATCH, STEPS = 32, 8, 16, 4, 2
SEQ2 = {"tensor": {"size": 2, "mode": "sequence"}}
T1D = {"tensor": {"size": 2, "mode": "1d"}}
BF16 = {"mode": AMP_TYPE.TORCH, "dtype": "bfloat16"}


class Outside(nn.Sequential):
    """The GPT's layers, each block checkpointed by the model's forward (not by itself)."""

    def forward(self, ids):
        x = self[0](ids)
        for block in self[1:-1]:
            x = checkpoint(block, x)
        return self[-1](x)


def _model(dtype=torch.float64, outside=False, **kwargs):
    torch.manual_seed(0)
    model = gpt(vocab=V, seq_len=SEQ, dim=DIM, depth=2, heads=2, mlp_ratio=2, **kwargs).to(dtype)
    if gpc.pipeline_size > 1:
        model = build_pipeline_model(model, num_chunks=gpc.config.get("NUM_CHUNKS", 1),
                                     partition="uniform")
    return Outside(*model) if outside else model


def _train(rank, world, port, config, model=None, reference=None):
    """STEPS batches through initialize's engine (SGD with momentum): the record compare_runs
    compares, what each block recomputed, and `reference` (a plain state) cut as this rank
    holds its parameters."""
    nc.launch(config, rank=rank, world_size=world, host="127.0.0.1", port=port)
    net = _model(**(model or {}))
    g = torch.Generator().manual_seed(7)
    batches = [tuple(torch.randint(0, V, (2, BATCH, SEQ), generator=g).unbind(0))
               for _ in range(STEPS)]
    per = BATCH // gpc.data_size
    mine = [(x[gpc.data_rank * per:][:per], y[gpc.data_rank * per:][:per]) for x, y in batches]
    engine, loader, *_ = nc.initialize(net, torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9),
                                       col_nn.VocabParallelCrossEntropyLoss(), mine, verbose=False)
    out = record_steps(engine, loader)
    out["state"] = {k: v.detach().double().clone()
                    for k, v in strip_prefixes(engine.model.state_dict()).items()}
    out["modes"] = [m.recompute for m in net.modules() if isinstance(m, Block)]
    if reference is not None:  # (tensor parallelism: my slice of each parameter)
        splits = {k: getattr(p, "tensor_splits", [])
                  for k, p in strip_prefixes(dict(engine.model.named_parameters(
                      remove_duplicate=False))).items()}
        out["reference"] = {k: slice_of(reference[k], splits.get(k, [])) for k in out["state"]}
    return out


def _equals_one_process(ac, world, config, model=None, **tolerance):
    """ACTIVATION_CHECKPOINT=ac (None: `model` checkpoints itself) on `world` ranks under
    `config` trains as one process without it (with `config`'s fp16, not its parallel or zero)."""
    one = {k: v for k, v in config.items() if k not in ("parallel", "zero", "debug")}
    plain = {k: v for k, v in (model or {}).items() if k != "outside"}
    ref = run_ranks(_train, 1, one, plain)[0]
    assert set(ref["modes"]) == {None}
    layout = {**config, **({"ACTIVATION_CHECKPOINT": ac} if ac else {})}
    runs = run_ranks(_train, world, layout, model, ref["state"])
    assert ac is None or any(set(run["modes"]) - {None} for run in runs), "something recomputes"
    for run in runs:
        compare_runs({**ref, "state": run["reference"]}, [run], **tolerance)


def test_deep_pipeline_with_full_checkpointing_equals_one_process_without():
    _equals_one_process("full", 2, dict(parallel=dict(pipeline=2), NUM_MICRO_BATCHES=2))


COMPOSED = {  # name: (ACTIVATION_CHECKPOINT, ranks, config, model arguments)
    "interleaved pipeline 2 x 2 chunks, full":
        ("full", 2, dict(parallel=dict(pipeline=2), NUM_MICRO_BATCHES=2, NUM_CHUNKS=2), None),
    "data 2 x pipeline 2, every 2nd block":
        (2, 4, dict(parallel=dict(pipeline=2), NUM_MICRO_BATCHES=2, clip_grad_norm=0.1), None),
    "tensor 1d x2, full": ("full", 2, dict(parallel=T1D), None),
    "tensor 1d x2, selective, explicit attention":
        ("selective", 2, dict(parallel=T1D), dict(attention="explicit")),
    "tensor 2d x4, full": ("full", 4, dict(parallel={"tensor": {"size": 4, "mode": "2d"}}), None),
    "pipeline 2 x tensor 1d 2, every 2nd block":
        (2, 4, dict(parallel=dict(pipeline=2, **T1D), NUM_MICRO_BATCHES=2), None),
    "sequence x2, full": ("full", 2, dict(parallel=SEQ2), None),
    "pipeline 2 x sequence 2, full":
        ("full", 4, dict(parallel=dict(pipeline=2, **SEQ2), NUM_MICRO_BATCHES=2), None),
    "ZeRO 3 x data 2, full, every gather checked":
        ("full", 2, dict(zero=dict(level=3), debug=True), None),
    "ZeRO 3 x data 2, blocks checkpointed from outside, every gather checked":
        (None, 2, dict(zero=dict(level=3), debug=True), dict(outside=True)),
    "ZeRO 3 x data 2, selective, explicit attention":
        ("selective", 2, dict(zero=dict(level=3)), dict(attention="explicit")),
    "ZeRO 3 x sequence 2, full": ("full", 2, dict(zero=dict(level=3), parallel=SEQ2), None),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", COMPOSED)
def test_deep_checkpointing_composed_equals_one_process_without(name):
    _equals_one_process(*COMPOSED[name])


def test_deep_amp_with_checkpointing_equals_amp_without():
    """The recomputation runs under the forward's autocast (bf16 matmuls): bit for bit on one
    process; on 2 data ranks to bf16 rounding of the other batch split."""
    model = dict(dtype=torch.float32)
    _equals_one_process("full", 1, dict(fp16=BF16), model, rtol=0, atol=0)
    _equals_one_process("selective", 2, dict(fp16=BF16), model, rtol=0, atol=1e-2)


SAME_LAYOUT = {  # dropout on: each layout's masks are its own, so against itself without
    "pipeline 2 (1F1B: later forwards run before a backward), full":
        ("full", 2, dict(parallel=dict(pipeline=2), NUM_MICRO_BATCHES=2), dict(dropout=0.2)),
    "tensor 1d x2 (a per-rank dropout generator), full":
        ("full", 2, dict(parallel=T1D), dict(dropout=0.2)),
    "tensor 1d x2, sharded attention dropout, selective":
        ("selective", 2, dict(parallel=T1D), dict(dropout=0.2, attention="explicit")),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", SAME_LAYOUT)
def test_deep_dropout_masks_are_replayed_in_every_layout(name):
    ac, world, config, model = SAME_LAYOUT[name]
    without = run_ranks(_train, world, config, model)
    runs = run_ranks(_train, world, {**config, "ACTIVATION_CHECKPOINT": ac}, model)
    for ref, run in zip(without, runs):
        compare_runs(ref, [run], rtol=0, atol=0)


# -- the bytes: a pipeline stage holds what the module docstring's formula says -----------------

M, B, S, D, H = 4, 2, 8, 16, 2  # micro-batches, their rows, tokens, width, heads


def _held(rank, world, port, ac, schedule="1f1b"):
    """Peak saved bytes of each stage of 4 Blocks on 2 stages (2 each), M micro-batches."""
    nc.launch({"parallel": dict(pipeline=2), "NUM_MICRO_BATCHES": M, "PIPELINE_SCHEDULE": schedule,
               **({"ACTIVATION_CHECKPOINT": ac} if ac else {})},
              rank=rank, world_size=world, host="127.0.0.1", port=port)
    torch.manual_seed(0)
    blocks = nn.Sequential(*[Block(D, H, mlp_ratio=4, causal=True) for _ in range(4)]).double()
    stage = build_pipeline_model(blocks, partition="uniform")
    engine, *_ = nc.initialize(stage, torch.optim.SGD(stage.parameters(), lr=0.1),
                               lambda out, y: out.mean(), verbose=False)
    x = torch.randn(M * B, S, D, dtype=torch.float64)
    with SavedBytes(stage.parameters()) as saved:
        engine.execute_schedule((x, torch.zeros(M * B)))
    return saved.peak, saved.now


def test_deep_a_pipeline_stage_holds_what_the_formula_says():
    """Stage r has k = P - r micro-batches in flight (1F1B) of L = 2 blocks. Without
    checkpointing it holds k·L·A, with 'full' k·L·x + A - x (A: a Block's saved tensors, the
    docstring's 8·(16·b·s·d + 4·b·s + b·h·s) in float64; x: its input, 8·b·s·d). ZB-H1 holds
    each until its deferred W: P = 2 on both stages, all released by the end of the batch."""
    A, x, L = 8 * (16 * B * S * D + 4 * B * S + B * H * S), 8 * B * S * D, 2
    without = run_ranks(_held, 2, None)
    full = run_ranks(_held, 2, "full")
    for r, k in enumerate((2, 1)):
        assert without[r] == (k * L * A, 0)
        assert full[r] == (k * L * x + A - x, 0)
    assert run_ranks(_held, 2, None, "zero_bubble") == [(2 * L * A, 0)] * 2


# -- what it refuses ------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["partial", "Full", True, 0, -2, 1.5, ["full"]])
def test_an_unknown_mode_is_a_config_error_that_lists_the_modes(mode):
    with pytest.raises(ConfigError, match=r"ACTIVATION_CHECKPOINT=.*use 'full'.*'selective'"):
        load_config({"ACTIVATION_CHECKPOINT": mode})


@pytest.mark.parametrize("mode", ["full", "selective", 3, None])
def test_the_modes_load(mode):
    assert load_config({"ACTIVATION_CHECKPOINT": mode}).ACTIVATION_CHECKPOINT == mode


def test_torch_autograd_grad_through_a_checkpoint_is_refused():
    """The recomputation's own backward leaves parameter gradients in .grad, where
    autograd.grad would never look: refused, not silently wrong."""
    layer = nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"\[rank 0\] .*call loss.backward\(\)"):
        torch.autograd.grad(checkpoint(layer, x).sum(), [x, *layer.parameters()])


def _refusals(rank, world, port):
    nc.launch({"ACTIVATION_CHECKPOINT": 2, "NUM_EXPERTS": 2}, rank=rank, world_size=world,
              host="127.0.0.1", port=port)
    said = {}
    with pytest.raises(ValueError) as err:
        Block(DIM, 2)  # every 2nd block: which one is this?
    said["no index"] = str(err.value)
    with pytest.raises(ValueError) as err:  # block 1 (the 2nd) is an MoE block
        gpt(vocab=V, seq_len=SEQ, dim=DIM, depth=2, heads=2, moe=moe_model_settings(gpc.config))
    said["moe"] = str(err.value)
    return said


def test_gloo_blocks_refuse_what_they_cannot_recompute():
    said = run_ranks(_refusals, 1)[0]
    assert said["no index"].startswith("[rank 0] ACTIVATION_CHECKPOINT=2 recomputes one block in 2")
    assert "build each Block with index=i" in said["no index"]
    assert said["moe"].startswith("[rank 0] ACTIVATION_CHECKPOINT would recompute an MoE block")
    assert "use ACTIVATION_CHECKPOINT='selective'" in said["moe"]


class Twice(nn.Module):
    """One block applied twice in a forward (shared weights): `ckpt` 'each' checkpoints each use,
    'together' both uses in one call."""

    def __init__(self, ckpt=None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = nn.Linear(8, 8), nn.Linear(8, 4)
        self.block = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        self.ckpt = ckpt

    def twice(self, x):
        for _ in range(2):
            x = x + (checkpoint(self.block, x) if self.ckpt == "each" else self.block(x))
        return x

    def forward(self, x):
        x = self.inp(x)
        return self.out(checkpoint(self.twice, x) if self.ckpt == "together" else self.twice(x))


def _twice(rank, world, port, config, ckpt):
    nc.launch(dict(config), rank=rank, world_size=world, host="127.0.0.1", port=port)
    model = Twice(ckpt).double()
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(4, 8, generator=g, dtype=torch.float64),
                torch.randint(0, 4, (4,), generator=g)) for _ in range(3)]
    mine = [(x.chunk(world)[rank], y.chunk(world)[rank]) for x, y in batches]
    engine, loader, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.5,
                                                              momentum=0.9),
                                       nn.CrossEntropyLoss(), mine, verbose=False)
    try:
        out = record_steps(engine, loader)
    except RuntimeError as e:
        return str(e)
    out["state"] = {k: v.detach().clone() for k, v in strip_prefixes(
        engine.model.state_dict()).items()}
    return out


@pytest.mark.timeout(60)
def test_deep_a_layer_used_twice_checkpoints_its_uses_together_under_data_parallel():
    """DDP and ZeRO 1/2 reduce a gradient the moment it is complete, so a parameter used by two
    checkpoint calls (two backwards of their own, two gradients) is refused, naming the remedy;
    the two uses checkpointed in one call train as one process without checkpointing."""
    ref = run_ranks(_twice, 1, {}, None)[0]
    compare_runs(ref, run_ranks(_twice, 1, {}, "each"))  # one process: no reduction to race
    for config, who in (({}, "DistributedDataParallel"), ({"zero": {"level": 2}}, "zero")):
        for rank, message in enumerate(run_ranks(_twice, 2, config, "each")):
            assert message.startswith(f"[rank {rank}] {who}: block.") and \
                "nc.utils.checkpoint" in message and "together in one call" in message, message
        compare_runs(ref, run_ranks(_twice, 2, config, "together"))


# -- what the recomputation leaves, and where it cannot go ---------------------------------------

class NormedNet(nn.Module):
    """A BatchNorm inside a checkpointed block: the forward updates its running statistics.
    `ckpt`: the block checkpointed as a module, a bound method, a closure, or not at all."""

    def __init__(self, ckpt: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh())
        self.out = nn.Linear(6, 2)
        self.ckpt = ckpt

    def forward(self, x):
        fn = {"module": self.block, "method": self.block.forward,
              "closure": lambda t: self.block(t)}.get(self.ckpt)
        return self.out(self.block(x) if fn is None else checkpoint(fn, x))


@pytest.mark.parametrize("ckpt", ["module", "method", "closure"])
def test_recomputing_a_batchnorm_counts_each_batch_once_in_its_running_statistics(ckpt):
    """The recomputation runs the block's forward again; the buffers of every module it runs
    are put back after it, so BatchNorm's running mean, variance and batch count are those of
    training without it, whatever fn is."""
    states = []
    for how in (ckpt, None):
        model = NormedNet(how).double()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(1)
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(8, 4, dtype=torch.float64)).pow(2).mean().backward()
            opt.step()
        states.append(model.state_dict())
    assert states[0]["block.1.num_batches_tracked"] == 2
    assert_close(states[0], states[1], rtol=0, atol=0)


class CheckpointedLinear(nn.Module):
    """A layer that checkpoints itself inside a pipeline stage (not through the config key)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x):
        return checkpoint(self.inner, x)


def _zero_bubble_worker(rank, world_size, port, schedule, where):
    nc.launch({"parallel": {"pipeline": 2}, "NUM_MICRO_BATCHES": 2, "PIPELINE_SCHEDULE": schedule,
               "NUM_CHUNKS": 2 if schedule == "zbv" else 1}, rank=rank, world_size=world_size,
              host="127.0.0.1", port=port, timeout=3)
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 2)]
    layers[where] = CheckpointedLinear()
    stage = build_pipeline_model(nn.Sequential(*layers), 2 if schedule == "zbv" else 1)
    engine, *_ = nc.initialize(stage, torch.optim.SGD(stage.parameters(), lr=0.1),
                               nn.CrossEntropyLoss(), verbose=False)
    try:
        engine.execute_schedule((torch.randn(4, 4), torch.randint(0, 2, (4,))))
    except Exception as e:  # noqa: BLE001 (the message is what the test checks)
        return str(e)
    return "trained"


@pytest.mark.parametrize("schedule, where", [("zero_bubble", 0), ("zero_bubble", 2)])
def test_gloo_zero_bubble_refuses_a_block_checkpointed_inside_a_stage(schedule, where):
    """Zero-bubble's W finds the weights by walking autograd's graph, where a reentrant
    checkpoint hides its block's (the first stage would never train): refused on the stage
    that holds it, naming the non-reentrant checkpoint that works. (Its peer then waits for
    it until the job's timeout.)"""
    said = run_ranks(_zero_bubble_worker, 2, schedule, where, timeout=30)[where // 2]
    assert said.startswith(f"[rank {where // 2}] the zero-bubble schedules"), said
    assert "use_reentrant=False" in said and "PIPELINE_SCHEDULE='1f1b'" in said, said


def _warned_worker(rank, world_size, port, mode, make):
    nc.launch({"ACTIVATION_CHECKPOINT": mode}, rank=rank, world_size=world_size,
              host="127.0.0.1", port=port)
    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("nanocolossal").addHandler(handler)
    model = make()
    try:
        nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(),
                      verbose=False)
    finally:
        logging.getLogger("nanocolossal").removeHandler(handler)
    return [line for line in logged if "ACTIVATION_CHECKPOINT" in line]


def test_gloo_a_model_without_blocks_is_told_that_nothing_is_recomputed():
    """ACTIVATION_CHECKPOINT is applied by nc.nn's transformer Blocks; a model of other blocks
    (a Hugging-Face-style ModuleList) is told, in one line, that nothing is checkpointed."""
    said = run_ranks(_warned_worker, 1, "full", _hf_style_blocks)[0]
    assert len(said) == 1 and "nothing is checkpointed here" in said[0], said
    assert "nc.utils.checkpoint(block, x)" in said[0]
    assert run_ranks(_warned_worker, 1, "full", _nc_block)[0] == []


def _hf_style_blocks():
    return nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])


def _nc_block():
    return Block(DIM, 2)
