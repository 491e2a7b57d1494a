"""The composition matrix: each pair of features a user can turn on together, against one process.

Every feature has tests of its own (test_ddp_gloo, test_amp, test_pipeline_gloo, ...). Bugs live
where two features meet: DDP's no_sync and a branch unused in the last micro-step, a gradient
handler and a parameter nothing used, the Trainer's max_steps in the middle of an accumulation
group, a buffer broadcast during uneven evaluation. Testing every product of features is out of
reach, so the matrix asks for each *pair* at least once; docs/testing.md has the table that names,
for every pair, the test that covers it (many live in the features' own files) or why the pair
cannot be configured. This file fills the cells nothing else covered.

Each test turns its features on as users do -- a config dict through nc.launch and nc.initialize
-- and trains a tiny model for a few optimizer steps with SGD, momentum and weight decay (so a
zero gradient where one process has none still moves the weights). The final parameters (and
buffers, gradient norms, metrics) are compared with ONE process on the whole batch with
torch.testing.assert_close. Mixed precision (bf16 on CPU) is compared with one process under the
same AMP settings (nc.amp.initialize), to bf16 tolerance.
"""
import pytest
import torch
from dist_helpers import run_ranks
from torch import nn
from torch.nn import functional as F
from torch.testing import assert_close
from torch.utils.data import TensorDataset

import nanocolossal as nc
import nanocolossal.nn as col_nn
from nanocolossal import amp
from nanocolossal.amp import AMP_TYPE
from nanocolossal.checkpoint import merge_checkpoint, save_checkpoint
from nanocolossal.context import gpc
from nanocolossal.metrics import Accuracy
from nanocolossal.pipeline import build_pipeline_model
from nanocolossal.tensor.base import shard
from nanocolossal.trainer import Trainer, hooks

pytestmark = pytest.mark.timeout(120)

HANDLER = [dict(type="DataParallelGradientHandler")]
STEPS = 3    # optimizer steps per run
B = 2        # samples per rank per micro-step
CLIP = 0.05  # below every gradient norm here: the clip really clips (asserted)
# bf16 keeps 8 bits (1 unit in the last place of 0.3 is 2e-3): sums taken in another order (a
# micro-batch per rank, not the whole batch) round differently. A lost micro-batch is 2-40x outside.
BF16 = {"rtol": 1e-2, "atol": 1e-3}
BF16_VS_FP32 = {"rtol": 2e-2, "atol": 2e-3}
AMP_MODES = {  # opt level -> the fp16 config that selects it (bf16: CPUs have no fast fp16)
    "O1": {"mode": AMP_TYPE.TORCH, "dtype": "bfloat16"},
    "O2": {"mode": AMP_TYPE.NAIVE, "dtype": "bfloat16"},
    "O3": {"mode": AMP_TYPE.APEX, "opt_level": "O3", "dtype": "bfloat16"},
}


# -- models, data and the one-process reference ------------------------------------------------

class Branchy(nn.Module):
    """An MLP with a branch only some micro-steps use (`extra`) and one nothing uses (`never`)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(col_nn.Linear(6, 8), nn.Tanh())
        self.extra = col_nn.Linear(8, 8)
        self.never = col_nn.Linear(8, 8)
        self.head = col_nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        h = self.body(x)
        if use_extra:
            h = h + torch.tanh(self.extra(h))
        return self.head(h)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(col_nn.Linear(6, 8), nn.Tanh(), col_nn.Linear(8, 8), nn.LayerNorm(8),
                         nn.Tanh(), col_nn.Linear(8, 3))


def _bn_mlp():
    torch.manual_seed(0)
    return nn.Sequential(col_nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), col_nn.Linear(8, 3))


def _deep_mlp():
    """Nine layers: enough to cut into 2 stages x 2 chunks."""
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [col_nn.Linear(6, 6), nn.Tanh()]
    return nn.Sequential(*layers, col_nn.Linear(6, 3))


class TokenMean(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=1)


def _tensor_model(batchnorm=False):
    """nc.nn layers only: the plain model alone, its 1d or 2d version under parallel.tensor."""
    col_nn.reset_1d_alternation()
    torch.manual_seed(0)
    layers = [col_nn.PatchEmbedding(4, 2, 1, 4), col_nn.LayerNorm(4), col_nn.Linear(4, 8),
              nn.Tanh(), col_nn.Linear(8, 4), TokenMean()]
    if batchnorm:  # 1d: on the whole (replicated) [batch, 4] activation; 2d has no BatchNorm
        layers.append(nn.BatchNorm1d(4))
    return nn.Sequential(*layers, col_nn.Classifier(4, 3))


def _tensor_bn_model():
    return _tensor_model(batchnorm=True)


def _tensor_pipeline_model():
    """Column, row, column, row, classifier: 1d-ready, cut as [2, 2, 2, 3] into 2 x 2 chunks."""
    col_nn.reset_1d_alternation()
    torch.manual_seed(0)
    return nn.Sequential(col_nn.Linear(6, 8), nn.Tanh(), col_nn.Linear(8, 6), nn.Tanh(),
                         col_nn.Linear(6, 8), nn.Tanh(), col_nn.Linear(8, 6), nn.Tanh(),
                         col_nn.Classifier(6, 3))


def _batch(step, n, images=False):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(n, 1, 4, 4, generator=g) if images else torch.randn(n, 6, generator=g)
    return x, torch.randint(0, 3, (n,), generator=g)


def _dataset(n, seed, images=False):
    return TensorDataset(*_batch(seed, n, images))


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-2)


def _launch(rank, world_size, port, config, timeout=30):
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port,
              timeout=timeout)


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_states_equal(actual, expected, who="", **tolerance):
    assert set(actual) == set(expected), f"{who}: state_dict keys"
    for key, value in expected.items():
        assert_close(actual[key], value, msg=lambda m: f"{who} {key}: {m}", **tolerance)


def _data_parallel_micro_batches(world_size, n, images=False):
    """Per step, the n global micro-batches of the Engine loop below: micro-batch m holds rank r's
    B samples at [(m * world_size + r) * B, ...), so it is one contiguous slice."""
    steps = []
    for step in range(STEPS):
        x, y = _batch(step, world_size * n * B, images)
        size = world_size * B
        steps.append([(x[m * size:(m + 1) * size], y[m * size:(m + 1) * size])
                      for m in range(n)])
    return steps


def epoch_shards(data, epoch, replicas=2):
    """The sample indices each data replica's DistributedSampler gives in `epoch`."""
    shards = []
    for r in range(replicas):
        sampler = nc.DistributedSampler(data, num_replicas=replicas, rank=r, shuffle=True,
                                        seed=SHUFFLE_SEED)
        sampler.set_epoch(epoch)
        shards.append(list(sampler))
    return shards


def _one_process(make_model, steps, clip=None, opt_level=None):
    """ONE process: for each step the losses of its global micro-batches (every rank's samples,
    which is what BatchNorm normalises over), summed over the step's samples; then torch's
    clipping and one optimizer step. With opt_level: the same under nc.amp.initialize in bf16
    (the one-process run with the same AMP settings). Returns the model and the gradient norms."""
    model = make_model()
    opt = _sgd(model.parameters())
    if opt_level:
        model, opt = amp.initialize(model, opt, opt_level, dtype=torch.bfloat16,
                                    device_type="cpu")
    norms = []
    for micro_batches in steps:
        opt.zero_grad()
        total = sum(len(y) for _, y in micro_batches)
        for x, y in micro_batches:
            loss = F.cross_entropy(model(x), y, reduction="sum") / total
            opt.backward(loss) if opt_level else loss.backward()
        if clip:
            norms.append(clip_one_process(model, opt, clip, opt_level))
        opt.step()
    return model, norms


def clip_one_process(model, opt, clip, opt_level=None):
    """torch's clip_grad_norm_, or nc.amp's under AMP (unscaled, fp32 masters); the norm."""
    if opt_level:
        return opt.clip_grad_norm(clip)
    return torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item()


def _engine_worker(rank, world_size, port, config, make_model, uses=None, images=False):
    """Train make_model() through nc.initialize(config): each optimizer step is
    gradient_accumulation micro-steps, in which rank r feeds its B samples of the global
    micro-batch (routed through Branchy's `extra` iff (r, m) is in `uses`)."""
    _launch(rank, world_size, port, config)
    model = make_model()
    engine, *_ = nc.initialize(model, _sgd(model.parameters()), col_nn.CrossEntropyLoss(),
                               verbose=False)
    n = config.get("gradient_accumulation", 1)
    per_replica, norms = B * world_size // gpc.data_size, []
    for step in range(STEPS):
        x, y = _batch(step, world_size * n * B, images)
        for m in range(n):
            # data rank d's samples of micro-batch m (tensor ranks of one replica share them)
            lo = m * world_size * B + gpc.data_rank * per_replica
            mine = (x[lo:lo + per_replica], y[lo:lo + per_replica])
            engine.zero_grad()
            if uses is None:
                engine.execute_schedule(mine)
            else:
                engine.backward(engine.criterion(engine(mine[0], (rank, m) in uses), mine[1]))
            assert engine.step() == (m == n - 1), "one optimizer step per accumulation group"
        norms.append(engine.last_grad_norm)
    no_grad = {name: p.grad is None for name, p in engine.model.named_parameters()}
    return engine, norms, no_grad


def _plain_engine_worker(rank, world_size, port, config, make_model, uses=None):
    engine, norms, no_grad = _engine_worker(rank, world_size, port, config, make_model, uses)
    return _state(engine.model), norms, no_grad


# -- DDP / gradient handler x accumulation, clipping and unused parameters ----------------------

def _branchy_one_process(world_size, n, uses, clip=None):
    """One process on the whole batch, each rank's slices routed as that rank routes them."""
    model = Branchy()
    opt = _sgd(model.parameters())
    norms = []
    for step in range(STEPS):
        x, y = _batch(step, world_size * n * B)
        opt.zero_grad()
        loss = 0
        for m in range(n):
            for r in range(world_size):
                lo = (m * world_size + r) * B
                loss = loss + F.cross_entropy(model(x[lo:lo + B], (r, m) in uses),
                                              y[lo:lo + B], reduction="sum")
        (loss / len(y)).backward()
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
    no_grad = {name: p.grad is None for name, p in model.named_parameters()}
    return _state(model), norms, no_grad


def _check_branchy(config, n, uses, clip=None):
    expected, expected_norms, expected_no_grad = _branchy_one_process(2, n, uses, clip)
    assert expected_no_grad["never.weight"], "one process: `never` has no gradient"
    untouched = Branchy().never.weight.detach()
    assert torch.equal(expected["never.weight"], untouched), "one process: `never` never moves"
    for rank, (state, norms, no_grad) in enumerate(run_ranks(_plain_engine_worker, 2, config,
                                                             Branchy, uses)):
        _assert_states_equal(state, expected, f"rank {rank}")
        assert no_grad == expected_no_grad, f"rank {rank}: which parameters have a gradient"
        if clip:
            assert norms == pytest.approx(expected_norms, rel=1e-5)
    return expected_norms


# (rank, micro-step) pairs that route through `extra`: the first of 3 micro-steps only
UNUSED_IN_THE_LAST_MICRO_STEP = {"on-all-ranks": {(0, 0), (1, 0)}, "on-one-rank": {(1, 0)}}


@pytest.mark.parametrize("uses", UNUSED_IN_THE_LAST_MICRO_STEP.values(),
                         ids=UNUSED_IN_THE_LAST_MICRO_STEP.keys())
def test_gloo_ddp_x_accumulation_keeps_the_gradient_of_a_parameter_unused_in_the_last_micro_step(
        uses):
    """The last backward of a group is the one DDP synchronises; `extra`'s gradient, accumulated
    under no_sync in micro-step 1, must still be averaged into every replica."""
    _check_branchy({"gradient_accumulation": 3}, 3, uses)


def test_gloo_ddp_x_accumulation_x_clip_clips_the_accumulated_gradient_by_the_whole_batch_norm():
    everything = {(r, m) for r in range(2) for m in range(3)}
    norms = _check_branchy({"gradient_accumulation": 3, "clip_grad_norm": CLIP}, 3, everything,
                           clip=CLIP)
    assert min(norms) > CLIP, "the clip really clips"


def test_gloo_gradient_handler_leaves_a_parameter_no_rank_uses_without_gradient():
    """No rank uses `never`: as in one process its grad stays None, so weight decay and momentum
    leave it alone. (`extra` is used on rank 0 only: averaged with rank 1's nothing.)"""
    _check_branchy({"gradient_handler": HANDLER}, 1, {(0, 0)})


def test_gloo_gradient_handler_x_accumulation_averages_a_gradient_one_rank_had_early_on():
    _check_branchy({"gradient_handler": HANDLER, "gradient_accumulation": 3}, 3, {(1, 0)})


# -- SyncBN x data parallel x accumulation ------------------------------------------------------

@pytest.mark.parametrize("mechanism", ["ddp", "gradient_handler"])
def test_gloo_syncbn_x_data_parallel_x_accumulation_equals_one_process(mechanism):
    """BatchNorm normalises each micro-batch: SyncBN makes that the global micro-batch (every
    rank's slice), as one process accumulating the same micro-batches; the running statistics
    too."""
    config = {"sync_bn": True, "gradient_accumulation": 2,
              **({"gradient_handler": HANDLER} if mechanism == "gradient_handler" else {})}
    expected = _state(_one_process(_bn_mlp, _data_parallel_micro_batches(2, 2))[0])
    for rank, (state, _, _) in enumerate(run_ranks(_plain_engine_worker, 2, config, _bn_mlp)):
        _assert_states_equal(state, expected, f"rank {rank}")


# -- AMP x data parallel x accumulation (x SyncBN, x clip) --------------------------------------

AMP_CASES = [  # (opt_level, data-parallel mechanism, model, sync_bn)
    ("O1", "ddp", _bn_mlp, True),
    ("O2", "gradient_handler", _bn_mlp, True),
    ("O3", "ddp", _mlp, False),  # everything bf16, BatchNorm included: a LayerNorm model instead
]


@pytest.mark.parametrize("opt_level, mechanism, make_model, sync_bn", AMP_CASES,
                         ids=[f"{c[0]}-{c[1]}" + ("-syncbn" if c[3] else "") for c in AMP_CASES])
def test_gloo_amp_bf16_x_data_parallel_x_accumulation_x_clip_tracks_one_process(
        opt_level, mechanism, make_model, sync_bn):
    config = {"fp16": AMP_MODES[opt_level], "gradient_accumulation": 2, "clip_grad_norm": CLIP,
              "sync_bn": sync_bn,
              **({"gradient_handler": HANDLER} if mechanism == "gradient_handler" else {})}
    steps = _data_parallel_micro_batches(2, 2)
    model, norms = _one_process(make_model, steps, CLIP, opt_level)
    expected = _state(model)
    assert min(norms) > CLIP, "the clip really clips"
    # the same training in fp32: AMP may round, never change what is trained
    fp32 = _state(_one_process(make_model, steps, CLIP)[0])
    for rank, (state, our_norms, _) in enumerate(run_ranks(_plain_engine_worker, 2, config,
                                                           make_model)):
        _assert_states_equal(state, expected, f"rank {rank}", **BF16)
        assert our_norms == pytest.approx(norms, rel=2e-2)
        for key, value in fp32.items():
            assert_close(state[key].to(value.dtype), value, **BF16_VS_FP32,
                         msg=lambda m: f"rank {rank} {key} against fp32: {m}")


# -- (Sync)BatchNorm x DDP x Trainer x metrics on uneven evaluation shards ----------------------

EVAL_CASES = {
    "batchnorm-ddp": {},
    "syncbn-ddp": {"sync_bn": True},
    "syncbn-gradient_handler-amp-O2": {"sync_bn": True, "gradient_handler": HANDLER,
                                       "fp16": AMP_MODES["O2"]},
}


def _eval_worker(rank, world_size, port, config):
    _launch(rank, world_size, port, config, timeout=10)  # a collective with no partner: an error
    model = _bn_mlp()
    train = nc.get_dataloader(_dataset(16, seed=1), batch_size=4)  # rank r: samples r, r + 2, ...
    test = nc.get_dataloader(_dataset(9, seed=2), batch_size=4, pad=False)
    engine, train, test, _ = nc.initialize(model, _sgd(model.parameters()), nn.CrossEntropyLoss(),
                                           train, test, verbose=False)
    trained = {}

    class Snapshot(hooks.BaseHook):  # the model as training left it, before evaluation
        def after_train_epoch(self, trainer):
            trained.update(_state(engine.model))

    trainer = Trainer(engine)
    trainer.fit(train, epochs=1, test_dataloader=test,
                hooks=[Snapshot(), hooks.LossHook(), hooks.AccuracyHook(Accuracy())])
    return (trainer.states["metrics"]["test"], trained, _state(engine.model),
            [len(label) for _, label in test])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("config", EVAL_CASES.values(), ids=EVAL_CASES.keys())
def test_gloo_trainer_x_ddp_batchnorm_evaluates_uneven_pad_false_shards_exactly(config):
    """9 test samples over 2 ranks (pad=False): rank 0 runs batches of 4 and 1, rank 1 one of 4.
    Evaluation must finish (no collective per forward) and every rank must evaluate the same
    model (rank 0's BatchNorm statistics), giving one process's accuracy and loss exactly."""
    results = run_ranks(_eval_worker, 2, config, timeout=25)
    assert [r[3] for r in results] == [[4, 1], [4]], "uneven shards, uneven batch counts"
    evaluated = results[0][2]
    for rank, (_, _, state, _) in enumerate(results):
        _assert_states_equal(state, evaluated, f"rank {rank} evaluated another model:", rtol=0,
                             atol=0)
    model = _bn_mlp()
    if "fp16" in config:
        model, _ = amp.initialize(model, _sgd(model.parameters()), "O2", dtype=torch.bfloat16,
                                  device_type="cpu")
    model.load_state_dict(evaluated)
    x, y = _dataset(9, seed=2).tensors
    with torch.no_grad():
        logits = model.eval()(x)
    accuracy = int((logits.argmax(1) == y).sum()) / len(y)
    loss = F.cross_entropy(logits, y).item()
    for rank, (metrics, trained, _, _) in enumerate(results):
        assert metrics["accuracy"] == accuracy, f"rank {rank}: the whole test set's accuracy"
        assert metrics["loss"] == pytest.approx(loss, rel=1e-5 if "fp16" not in config else 1e-3)
        if config.get("sync_bn"):  # SyncBN: the training itself is one process's, batches of 8
            x, y = _dataset(16, seed=1).tensors
            steps = [[(x[k * 8:(k + 1) * 8], y[k * 8:(k + 1) * 8])] for k in range(2)]
            level = "O2" if "fp16" in config else None
            expected = _state(_one_process(_bn_mlp, steps, opt_level=level)[0])
            _assert_states_equal(trained, expected, f"rank {rank} trained",
                                 **(BF16 if level else {}))


# -- Trainer x accumulation x max_steps x checkpoint/resume (x SyncBN, x clip, x LR schedule) ---

# 5 iterations per epoch per rank, accumulation 2: groups of 2, 2 and 1 (every epoch ends with an
# optimizer step; a short last group is still divided by 2, as Hugging Face Accelerate does)
TRAIN_SIZE, SHUFFLE_SEED, EPOCHS, ACCUMULATION = 20, 7, 2, 2


def _trainer_worker(rank, world_size, port, mechanism, path, max_steps, resume):
    config = {"gradient_accumulation": ACCUMULATION, "clip_grad_norm": CLIP, "sync_bn": True,
              **({"gradient_handler": HANDLER} if mechanism == "gradient_handler" else {})}
    _launch(rank, world_size, port, config)
    model = _bn_mlp()
    opt = _sgd(model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)
    loader = nc.get_dataloader(_dataset(TRAIN_SIZE, seed=3), shuffle=True, seed=SHUFFLE_SEED,
                               batch_size=B)
    engine, loader, _, scheduler = nc.initialize(model, opt, nn.CrossEntropyLoss(), loader,
                                                 lr_scheduler=scheduler, verbose=False)
    trainer = Trainer(engine)
    if resume:
        assert trainer.resume(path, scheduler)
    trainer.fit(loader, epochs=EPOCHS, max_steps=max_steps,
                hooks=[hooks.LossHook(), hooks.LRSchedulerHook(scheduler, by_epoch=False),
                       hooks.SaveCheckpointHook(path, lr_scheduler=scheduler)])
    return (_state(engine.model), trainer.states["metrics"]["train"]["loss"],
            scheduler.get_last_lr()[0])


def _trainer_one_process():
    """The same run in one process: each iteration's global batch is both ranks' B samples (from
    the same sampler), loss / ACCUMULATION backward, a step after each group and at the end of
    each epoch. Returns the state after every step, the last epoch's mean loss and the final
    learning rate."""
    data = _dataset(TRAIN_SIZE, seed=3)
    x, y = data.tensors
    model = _bn_mlp()
    opt = _sgd(model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)
    after_each_step, losses = [], []
    for epoch in range(EPOCHS):
        shards = epoch_shards(data, epoch)
        losses, iterations = [], len(shards[0]) // B
        for k in range(iterations):
            idx = shards[0][k * B:(k + 1) * B] + shards[1][k * B:(k + 1) * B]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            losses.append(loss.item())
            (loss / ACCUMULATION).backward()
            if k % ACCUMULATION == ACCUMULATION - 1 or k == iterations - 1:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item()
                assert norm > CLIP, "the clip really clips"
                opt.step()
                scheduler.step()
                opt.zero_grad()
                after_each_step.append(_state(model))
    assert iterations % ACCUMULATION, "an epoch that ends inside a group"
    return after_each_step, sum(losses) / len(losses), scheduler.get_last_lr()[0]


def test_gloo_trainer_x_accumulation_x_syncbn_x_clip_x_lr_schedule_equals_one_process(tmp_path):
    after_each_step, loss, lr = _trainer_one_process()
    for rank, (state, our_loss, our_lr) in enumerate(
            run_ranks(_trainer_worker, 2, "ddp", str(tmp_path / "ckpt.pt"), None, False)):
        _assert_states_equal(state, after_each_step[-1], f"rank {rank}")
        assert our_loss == pytest.approx(loss, rel=1e-5), "the last epoch's mean loss (LossHook)"
        assert our_lr == pytest.approx(lr), "the scheduler steps once per optimizer step"


@pytest.mark.parametrize("mechanism", ["ddp", "gradient_handler"])
def test_gloo_trainer_x_accumulation_stopped_by_max_steps_resumes_to_the_one_process_result(
        tmp_path, mechanism):
    """max_steps counts optimizer steps: max_steps=1 stops after the first group (2 batches) in
    the middle of epoch 1. The checkpoint holds one process's model after 1 step, and the resumed
    run ends where one uninterrupted process ends (its last epoch's loss and LR included)."""
    after_each_step, loss, lr = _trainer_one_process()
    path = str(tmp_path / "ckpt.pt")
    stopped = run_ranks(_trainer_worker, 2, mechanism, path, 1, False)
    saved = torch.load(path, weights_only=False)["model"]
    resumed = run_ranks(_trainer_worker, 2, mechanism, path, None, True)
    for rank, (state, our_loss, our_lr) in enumerate(resumed):
        _assert_states_equal(state, after_each_step[-1], f"rank {rank} resumed")
        assert our_loss == pytest.approx(loss, rel=1e-5), "the last epoch's mean loss (LossHook)"
        assert our_lr == pytest.approx(lr)
    for rank, (state, _, _) in enumerate(stopped):
        _assert_states_equal(state, after_each_step[0], f"rank {rank} stopped after 1 step")
    _assert_states_equal(saved, after_each_step[0], "the checkpoint")


# -- pipeline x data x (interleaving + clip, SyncBN, AMP) ---------------------------------------

PIPE_BATCH = 8  # per data replica per step: M = 2 micro-batches of 4
PIPELINE_CASES = {  # (extra config, model, partition, opt_level)
    "interleaved-clip": ({"NUM_CHUNKS": 2, "clip_grad_norm": CLIP}, _deep_mlp, "uniform", None),
    "1f1b-syncbn": ({"sync_bn": True}, _bn_mlp, [2, 2], None),
    "1f1b-amp-O2": ({"fp16": AMP_MODES["O2"]}, _mlp, [3, 3], "O2"),
    # ZeRO over each stage's data ranks: the optimizer state (level 2: and gradients) sharded
    "interleaved-clip-zero1": ({"NUM_CHUNKS": 2, "clip_grad_norm": CLIP, "zero": {"level": 1}},
                               _deep_mlp, "uniform", None),
    "interleaved-clip-zero2": ({"NUM_CHUNKS": 2, "clip_grad_norm": CLIP, "zero": {"level": 2}},
                               _deep_mlp, "uniform", None),
    "1f1b-amp-O2-zero2": ({"fp16": AMP_MODES["O2"], "zero": {"level": 2}}, _mlp, [3, 3], "O2"),
}


def _pipeline_micro_batches(data_size, num_micro):
    """Per step, the global micro-batches: micro-batch m of every data replica together (each
    replica takes its PIPE_BATCH slice of the step's batch and cuts it into num_micro)."""
    steps, size = [], PIPE_BATCH // num_micro
    for step in range(STEPS):
        x, y = _batch(step, data_size * PIPE_BATCH)
        micro_batches = []
        for m in range(num_micro):
            idx = [d * PIPE_BATCH + m * size + i for d in range(data_size) for i in range(size)]
            micro_batches.append((x[idx], y[idx]))
        steps.append(micro_batches)
    return steps


def _pipeline_worker(rank, world_size, port, case, path):
    extra, make_model, partition, _ = PIPELINE_CASES[case]
    config = {"parallel": {"pipeline": 2}, "NUM_MICRO_BATCHES": 2, **extra}
    _launch(rank, world_size, port, config)
    stage = build_pipeline_model(make_model(), num_chunks=config.get("NUM_CHUNKS", 1),
                                 partition=partition)
    engine, *_ = nc.initialize(stage, _sgd(stage.parameters()), nn.CrossEntropyLoss(),
                               verbose=False)
    norms = []
    for step in range(STEPS):
        x, y = _batch(step, gpc.data_size * PIPE_BATCH)
        mine = slice(gpc.data_rank * PIPE_BATCH, (gpc.data_rank + 1) * PIPE_BATCH)
        engine.zero_grad()
        engine.execute_schedule((x[mine], y[mine]))
        assert engine.step()
        norms.append(engine.last_grad_norm)
    save_checkpoint(path, 1, engine.model, engine.optimizer)
    return _state(engine.model), norms


@pytest.mark.parametrize("case", PIPELINE_CASES, ids=PIPELINE_CASES)
def test_gloo_pipeline_x_data_parallel_equals_one_process_with(tmp_path, case):
    """2 stages x 2 data replicas; the stage files merge into the one-process model."""
    extra, make_model, _, opt_level = PIPELINE_CASES[case]
    clip = extra.get("clip_grad_norm")
    model, norms = _one_process(make_model, _pipeline_micro_batches(2, 2), clip, opt_level)
    expected = _state(model)
    tolerance = BF16 if opt_level else {}
    path = tmp_path / "ckpt.pt"
    results = run_ranks(_pipeline_worker, 4, case, str(path))
    seen = set()
    for rank, (state, our_norms) in enumerate(results):
        for key, value in state.items():
            assert_close(value, expected[key], msg=lambda m: f"rank {rank} {key}: {m}",
                         **tolerance)
        seen |= set(state)
        if clip:
            assert min(norms) > clip, "the clip really clips"
            assert our_norms == pytest.approx(norms, rel=1e-5), "all stages' squares, once"
    assert seen == set(expected), "the stages hold the whole model"
    _assert_states_equal(merge_checkpoint(path), expected, "merged", **tolerance)


# -- tensor (1d, 2d) x data parallel x accumulation x clip x metrics ----------------------------

TENSOR_CASES = [  # (mode, tensor size, data-parallel mechanism, sync_bn); data size 2 each
    ("1d", 2, "ddp", True),
    ("1d", 2, "gradient_handler", False),
    ("2d", 4, "ddp", False),
    ("2d", 4, "gradient_handler", False),
    # ZeRO over the data ranks of each tensor rank: the tensor-split parameters stay split
    ("1d", 2, "zero1", True),
    ("1d", 2, "zero2", False),
    ("1d", 2, "zero3", False),
    ("2d", 4, "zero2", False),
    ("2d", 4, "zero3", False),
]
MECHANISMS = {"ddp": {}, "gradient_handler": {"gradient_handler": HANDLER},
              **{f"zero{level}": {"zero": {"level": level}} for level in (1, 2, 3)}}


def _tensor_worker(rank, world_size, port, mode, size, mechanism, sync_bn, expected, norms):
    config = {"parallel": {"tensor": {"size": size, "mode": mode}}, "gradient_accumulation": 2,
              "clip_grad_norm": CLIP, "sync_bn": sync_bn, **MECHANISMS[mechanism]}
    engine, our_norms, _ = _engine_worker(rank, world_size, port, config,
                                          _tensor_bn_model if sync_bn else _tensor_model,
                                          images=True)
    assert our_norms == pytest.approx(norms, rel=1e-4), "each element's square counted once"
    checked = []
    splits = {name: getattr(p, "tensor_splits", []) for name, p in engine.model.named_parameters()}
    for name, value in engine.model.state_dict().items():  # (ZeRO 3: gathered, collective)
        # my slice of one process's parameter (buffers and replicated parameters: all of it)
        assert_close(value, shard(expected[name], splits.get(name, [])),
                     msg=lambda m: f"[rank {rank}] {name}: {m}")
        checked.append(name)
    test = nc.get_dataloader(_dataset(8, seed=9, images=True), batch_size=2, pad=False)
    metrics = Trainer(engine).evaluate(test, hooks=[hooks.LossHook(),
                                                    hooks.AccuracyHook(Accuracy())])
    return checked, metrics


@pytest.mark.parametrize("mode, size, mechanism, sync_bn", TENSOR_CASES,
                         ids=[f"{c[0]}x{c[1]}-{c[2]}" + ("-syncbn" if c[3] else "")
                              for c in TENSOR_CASES])
def test_gloo_tensor_x_data_parallel_x_accumulation_x_clip_equals_one_process(mode, size,
                                                                              mechanism, sync_bn):
    """Each rank ends with exactly its slice of one process's parameters (and the BatchNorm
    statistics), and the evaluation metrics are one process's."""
    make_model = _tensor_bn_model if sync_bn else _tensor_model
    model, norms = _one_process(make_model, _data_parallel_micro_batches(2 * size, 2, True), CLIP)
    assert min(norms) > CLIP, "the clip really clips"
    expected = _state(model)
    x, y = _dataset(8, seed=9, images=True).tensors
    with torch.no_grad():
        logits = model.eval()(x)
    accuracy = int((logits.argmax(1) == y).sum()) / len(y)
    loss = F.cross_entropy(logits, y).item()
    results = run_ranks(_tensor_worker, 2 * size, mode, size, mechanism, sync_bn, expected, norms,
                        timeout=90)
    assert {name for checked, _ in results for name in checked} == set(expected)
    for rank, (_, metrics) in enumerate(results):
        assert metrics["accuracy"] == accuracy, f"rank {rank}"
        assert metrics["loss"] == pytest.approx(loss, rel=1e-5), f"rank {rank}"


# -- interleaved pipeline x tensor 1d x Trainer (max_steps, resume) x metrics x checkpoints -----

TP_TRAIN, TP_TEST, TP_BATCH = 16, 10, 4  # 4 steps per epoch; test batches 4, 4, 2 (M = 2)


def _tensor_pipeline_worker(rank, world_size, port, path, max_steps, resume):
    _launch(rank, world_size, port, {"parallel": {"pipeline": 2, "tensor": {"size": 2,
                                                                            "mode": "1d"}},
                                     "NUM_MICRO_BATCHES": 2, "NUM_CHUNKS": 2})
    chunks = build_pipeline_model(_tensor_pipeline_model(), num_chunks=2, partition=[2, 2, 2, 3])
    train = nc.get_dataloader(_dataset(TP_TRAIN, seed=4), shuffle=True, seed=SHUFFLE_SEED,
                              batch_size=TP_BATCH)
    test = nc.get_dataloader(_dataset(TP_TEST, seed=5), batch_size=TP_BATCH, pad=False)
    engine, train, test, _ = nc.initialize(chunks, _sgd(chunks.parameters()),
                                           col_nn.CrossEntropyLoss(), train, test,
                                           verbose=False)
    trainer = Trainer(engine)
    if resume:
        assert trainer.resume(path)
    trainer.fit(train, epochs=EPOCHS, test_dataloader=test, max_steps=max_steps,
                hooks=[hooks.LossHook(), hooks.AccuracyHook(Accuracy()),
                       hooks.SaveCheckpointHook(path)])
    params = {name: (p.detach().clone(), list(getattr(p, "tensor_splits", [])))
              for chunk in engine.model for name, p in chunk.named_parameters()}
    return params, gpc.tensor_rank, trainer.states["metrics"]["test"]


def _slice_1d(full, splits, tensor_rank, size=2):
    for dim, axis in splits:
        assert axis == "tensor"
        full = full.chunk(size, dim=dim)[tensor_rank]
    return full


def _assert_slices(results, expected, who):
    seen = set()
    for rank, (params, tensor_rank, _) in enumerate(results):
        for name, (value, splits) in params.items():
            assert_close(value, _slice_1d(expected[name], splits, tensor_rank),
                         msg=lambda m: f"{who} rank {rank} {name}: {m}")
            seen.add(name)
    assert seen == {k for k in expected}, f"{who}: every parameter is on some rank"


def test_gloo_interleaved_pipeline_x_tensor_1d_x_trainer_resumes_and_merges_to_one_process(
        tmp_path):
    """2 stages x 2 chunks x 1d tensor 2: stopped by max_steps=3 mid-epoch, resumed to the end;
    every rank holds its slice of one process's model, the evaluation metrics are one process's,
    and each save merges (merge_checkpoint) into one process's state_dict."""
    data, test = _dataset(TP_TRAIN, seed=4), _dataset(TP_TEST, seed=5)
    model = _tensor_pipeline_model()
    opt = _sgd(model.parameters())
    after_each_step = []
    for epoch in range(EPOCHS):
        sampler = nc.DistributedSampler(data, num_replicas=1, rank=0, shuffle=True,
                                        seed=SHUFFLE_SEED)
        sampler.set_epoch(epoch)
        order = list(sampler)
        for k in range(0, len(order), TP_BATCH):
            x, y = data[order[k:k + TP_BATCH]]
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            after_each_step.append(_state(model))
    x, y = test.tensors
    with torch.no_grad():
        logits = model(x)
    accuracy = int((logits.argmax(1) == y).sum()) / len(y)
    loss = F.cross_entropy(logits, y).item()

    path = tmp_path / "ckpt.pt"
    stopped = run_ranks(_tensor_pipeline_worker, 4, str(path), 3, False)
    merged_stopped = merge_checkpoint(path)
    resumed = run_ranks(_tensor_pipeline_worker, 4, str(path), None, True)
    _assert_slices(stopped, after_each_step[2], "stopped")
    _assert_slices(resumed, after_each_step[-1], "resumed")
    for rank, (_, _, metrics) in enumerate(resumed):
        assert metrics["accuracy"] == accuracy, f"rank {rank}"
        assert metrics["loss"] == pytest.approx(loss, rel=1e-5), f"rank {rank}"
    _assert_states_equal(merged_stopped, after_each_step[2], "merged after max_steps")
    _assert_states_equal(merge_checkpoint(path), after_each_step[-1], "merged at the end")

