"""ZeRO 1-2 under a pipeline and ZeRO 1-3 beside tensor parallelism, attacked where the features
meet: every schedule (GPipe, 1F1B, interleaved), a clip that really clips, AMP (O1 autocast, O2
half model), a weight tied across stages (the GPT embedding = classifier), a parameter no
micro-batch uses, pipeline x tensor 1d x data x ZeRO on 8 ranks, checkpoints merged and loaded
into another data size, and the Trainer's resume.

Every run is compared with ONE process training on the whole batch (float64 where the feature
allows it, to 1e-9-ish; bf16 to bf16 tolerance), with SGD + momentum + weight decay: a parameter
that gets a zero gradient where one process gets none still moves, and a lost optimizer state
(momentum) after a resume changes the next step.
"""
import pytest
import torch
from dist_helpers import launch_rank, run_ranks
from models import epoch_shards, tensor_model, tensor_pipeline_model
from torch import nn
from torch.nn import functional as F
from torch.testing import assert_close
from torch.utils.data import TensorDataset
from zero_parallel_runs import (
    AMP_MODES,
    BF16,
    F64,
    GLOBAL,
    STEPS,
    VOCAB,
    check_states,
    cloned_state,
    one_process_sgd,
    pipeline_engine,
    pipeline_resume_worker,
    pipeline_save_worker,
    sgd,
    tied_batch,
    tied_lm,
    tied_model,
    train_pipeline,
)

import nanocolossal as nc
import nanocolossal.nn as col_nn
from nanocolossal.checkpoint import load_checkpoint, merge_checkpoint, save_checkpoint
from nanocolossal.config import ConfigError
from nanocolossal.context import gpc
from nanocolossal.pipeline import build_pipeline_model
from nanocolossal.tensor.base import slice_of
from nanocolossal.trainer import Trainer, hooks

pytestmark = pytest.mark.timeout(120)

CLIP = 0.05


# -- tied_model (zero_parallel_runs.py) through a pipeline: its state and norms -----------------

def _pipeline_worker(rank, world_size, port, extra, partition, chunks, dtype, path):
    engine = pipeline_engine(rank, world_size, port, extra, partition, chunks, dtype)
    norms = train_pipeline(engine, 0, STEPS)
    if path:
        save_checkpoint(path, 1, engine.model, engine.optimizer)
    with_grad = [name for name, p in engine.model.named_parameters() if p.grad is not None]
    return cloned_state(engine.model), norms, with_grad


# -- ZeRO 1/2 x pipeline x data x every schedule x clip x tied weight x unused parameter ---------

# 2 stages: [Embed, WithUnused, Linear] | [Tanh, Linear, Tanh, Head, Linear]; interleaved 2 x 2:
# parts (rank 0) [Embed, WithUnused] (rank 1) [Linear, Tanh] (rank 0) [Linear, Tanh]
# (rank 1) [Head, Linear]: W is tied between stage 0 and stage 1 in both.
SCHEDULES = {"gpipe": ({"PIPELINE_SCHEDULE": "gpipe"}, [3, 5], 1),
             "1f1b": ({}, [3, 5], 1),
             "interleaved": ({}, [2, 2, 2, 2], 2)}
SCHEDULES["1f1b-tiny-buckets-no-overlap"] = ({"zero": {"level": 2, "reduce_bucket_size_mb": 1e-4,
                                                      "overlap_communication": False}}, [3, 5], 1)
ZERO_PIPELINE_CASES = [(s, level) for s in SCHEDULES for level in (1, 2)
                       if "tiny" not in s or level == 2]


@pytest.mark.parametrize("schedule, level", ZERO_PIPELINE_CASES,
                         ids=[f"{s}-zero{level}" for s, level in ZERO_PIPELINE_CASES])
def test_gloo_zero_x_pipeline_x_tied_weight_x_unused_param_x_clip_equals_one_process(
        schedule, level):
    """pipeline 2 x data 2, float64: final parameters (both copies of the tied table, the unused
    parameter untouched) and the clipped norms equal one process's."""
    extra, partition, chunks = SCHEDULES[schedule]
    states, norms = one_process_sgd(clip=CLIP)
    assert min(norms) > CLIP, "the clip really clips"
    expected = states[-1]
    assert torch.equal(expected["1.never"], tied_model()[1].never.detach())
    results = run_ranks(_pipeline_worker, 4, {"zero": {"level": level}, **extra,
                                              "clip_grad_norm": CLIP},
                        partition, chunks, torch.float64, None, timeout=60)
    check_states(results, expected, F64)
    for rank, (_, our_norms, _) in enumerate(results):
        assert our_norms == pytest.approx(norms, rel=1e-9), f"rank {rank}: the tied table once"


# -- ZeRO x pipeline x AMP (O1 autocast, O2 half model) x tied weight x clip --------------------

AMP_PIPELINE_CASES = [("O1", 1), ("O2", 2)]  # (O1 / O2 x ZeRO 1 / 2: the same two paths)


@pytest.mark.parametrize("opt_level, level", AMP_PIPELINE_CASES,
                         ids=[f"{o}-zero{z}" for o, z in AMP_PIPELINE_CASES])
def test_deep_zero_x_pipeline_x_amp_bf16_x_tied_weight_x_clip_tracks_one_process(opt_level, level):
    """1F1B, pipeline 2 x data 2, bf16; one process under the same AMP settings."""
    states, norms = one_process_sgd(clip=CLIP, opt_level=opt_level, dtype=torch.float32)
    assert min(norms) > CLIP
    results = run_ranks(_pipeline_worker, 4, {"fp16": AMP_MODES[opt_level], "clip_grad_norm": CLIP,
                                              "zero": {"level": level}},
                        [3, 5], 1, torch.float32, None, timeout=60)
    check_states(results, states[-1], BF16)
    for rank, (state, our_norms, _) in enumerate(results):
        assert our_norms == pytest.approx(norms, rel=2e-2), f"rank {rank}"
        if "0.w" in state and "6.w" in state:
            pytest.fail("one stage holds both uses of W")
    # the two stages' copies of the tied table are bit-identical (same gradient, same step)
    copies = [s[k] for s, *_ in results for k in ("0.w", "6.w") if k in s]
    assert all(torch.equal(c, copies[0]) for c in copies), "the tied copies drifted apart"


# -- a tie inside one stage: interleaving puts both uses of W in two chunks of rank 0 -----------

@pytest.mark.parametrize("level", [0, 1, 2], ids=["no-zero", "zero1", "zero2"])
def test_deep_zero_x_interleaved_x_weight_shared_by_two_chunks_of_one_stage_equals_one_process(
        level):
    """partition [2, 2, 3, 1]: parts 0 and 2 (both rank 0) use W; one Parameter in two chunks,
    reduced once, by the first chunk's DDP / ShardKeepingDDP, in the stage's last backward
    (were both chunks' wrappers to reduce W, each would drop the other's part)."""
    states, norms = one_process_sgd(clip=CLIP)
    extra = {"clip_grad_norm": CLIP, **({"zero": {"level": level}} if level else {})}
    results = run_ranks(_pipeline_worker, 4, extra, [2, 2, 3, 1], 2, torch.float64, None,
                        timeout=60)
    check_states(results, states[-1], F64)
    for rank, (_, our_norms, _) in enumerate(results):
        assert our_norms == pytest.approx(norms, rel=1e-9), f"rank {rank}"


# -- checkpoints: pipeline x data 2 x ZeRO saved, merged, loaded into data 1 / data 2 -----------

RESUME_CASES = {  # saved (world, zero level) -> loaded (world, zero level)
    "data2-zero2-to-data1-zero2": (4, 2, 2, 2),
    "data2-zero1-to-data1-plain": (4, 1, 2, 0),
    "data1-plain-to-data2-zero2": (2, 0, 4, 2),
}


@pytest.mark.parametrize("case", RESUME_CASES, ids=RESUME_CASES)
def test_deep_zero_x_pipeline_checkpoint_merges_and_resumes_in_another_data_size(tmp_path, case):
    """Train 2 steps, save (merge = one process after 2 steps), load into another data size with
    another ZeRO level and train the 3rd step: one process after 3 steps (momentum restored).
    The global batch is the same: data 1 runs all 16 samples per step, data 2 8 each."""
    saved_world, saved_level, loaded_world, loaded_level = RESUME_CASES[case]
    states, _ = one_process_sgd()
    path = str(tmp_path / "ckpt.pt")
    zero = lambda level: {"zero": {"level": level}} if level else {}  # noqa: E731
    run_ranks(pipeline_save_worker, saved_world, zero(saved_level), path, 2, timeout=60)
    merged = merge_checkpoint(path)
    for key, value in states[1].items():
        assert_close(merged[key], value, msg=lambda m: f"merged {key}: {m}", **F64)
    results = run_ranks(pipeline_resume_worker, loaded_world, zero(loaded_level), path, 2,
                        timeout=60)
    check_states(results, states[2], F64)


# -- ZeRO 3 is refused under a pipeline, by a ConfigError that says why -------------------------

def _zero3_pipeline_worker(rank, world_size, port, zero):
    try:
        launch_rank(rank, world_size, port, {"parallel": {"pipeline": 2}, "NUM_MICRO_BATCHES": 2,
                                         "zero": zero})
        stage = build_pipeline_model(tied_model(), partition=[3, 5])
        nc.initialize(stage, sgd(stage.parameters()), nn.CrossEntropyLoss(), verbose=False)
    except ConfigError as e:
        return str(e)
    return None


@pytest.mark.parametrize("zero", [{"level": 3}, {"model_config": {}, "optimizer_config": {}}],
                         ids=["level3", "v0.1-spelling"])
def test_gloo_zero3_x_pipeline_is_a_config_error_that_names_the_way_out(zero):
    for message in run_ranks(_zero3_pipeline_worker, 2, zero, timeout=60):
        assert message is not None, "refused"
        assert "level 3" in message and "pipeline" in message and "level 1 or 2" in message


# -- pipeline 2 x tensor 1d 2 x data 2 x ZeRO 1/2 (8 ranks) -------------------------------------

def _tp_model(dtype=None):
    return tensor_pipeline_model()  # nc.nn layers, float32: Linear 6-8-6-8-6, Classifier(6, 3)


def _pipeline_tensor_worker(rank, world_size, port, level, chunks, expected):
    config = {"parallel": {"pipeline": 2, "tensor": {"size": 2, "mode": "1d"}},
              "NUM_MICRO_BATCHES": 2, "NUM_CHUNKS": chunks, "clip_grad_norm": CLIP,
              "zero": {"level": level}}
    launch_rank(rank, world_size, port, config)
    stage = build_pipeline_model(_tp_model(), num_chunks=chunks,
                                 partition=[2, 2, 2, 3] if chunks == 2 else [4, 5])
    engine, *_ = nc.initialize(stage, sgd(stage.parameters()), col_nn.CrossEntropyLoss(),
                               verbose=False)
    norms = train_pipeline(engine, 0, STEPS)
    checked = []
    chunks = list(engine.model) if chunks > 1 else [engine.model]
    splits = {name: getattr(p, "tensor_splits", []) for chunk in chunks
              for name, p in chunk.named_parameters()}
    for name, value in engine.model.state_dict().items():
        assert_close(value, slice_of(expected[name], splits.get(name, [])),
                     msg=lambda m: f"[rank {rank}] {name}: {m}")
        checked.append(name)
    return checked, norms


# (interleaved x 1d x data 2 x ZeRO 2 on 8 ranks: a row of test_composition.py's table, tier 1)
@pytest.mark.parametrize("level, chunks", [(1, 1)], ids=["1f1b-zero1"])
def test_deep_zero_x_pipeline_x_tensor_1d_x_data_x_clip_equals_one_process(level, chunks):
    """8 ranks, float32: every rank holds its 1d slice of one process's parameters; the clipped
    norm counts each element once (tensor slices, replicated biases, stages, data shards)."""
    states, norms = one_process_sgd(clip=CLIP, dtype=torch.float32, make_model=_tp_model)
    assert min(norms) > CLIP
    results = run_ranks(_pipeline_tensor_worker, 8, level, chunks, states[-1], timeout=100)
    assert {name for checked, _ in results for name in checked} == set(states[-1])
    for rank, (_, our_norms) in enumerate(results):
        assert our_norms == pytest.approx(norms, rel=1e-5), f"rank {rank}"


# -- ZeRO 3 x tensor 1d x accumulation x clip: checkpoint merged, loaded into another data size --

def _two_micro_steps_each(engine, batch, steps):
    """Each step: this data rank's half of batch(step), in 2 accumulated micro-steps; the norms."""
    norms, n = [], GLOBAL // gpc.data_size // 2  # per data rank per micro-step
    for step in steps:
        x, y = batch(step)
        for m in range(2):
            lo = gpc.data_rank * 2 * n + m * n
            engine.zero_grad()
            engine.execute_schedule((x[lo:lo + n], y[lo:lo + n]))
            assert engine.step() == (m == 1)
        norms.append(engine.last_grad_norm)
    return norms


def _images(step):
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randn(GLOBAL, 1, 4, 4, generator=g), torch.randint(0, 3, (GLOBAL,), generator=g)


def _zero3_tensor_worker(rank, world_size, port, mode, path, first, last, save, expected):
    config = {"parallel": {"tensor": {"size": 2 if mode == "1d" else 4, "mode": mode}},
              "gradient_accumulation": 2,
              "clip_grad_norm": CLIP, "zero": {"level": 3}}
    launch_rank(rank, world_size, port, config)
    model = tensor_model()
    engine, *_ = nc.initialize(model, sgd(model.parameters()), col_nn.CrossEntropyLoss(),
                               verbose=False)
    if first:
        load_checkpoint(path, engine.model, engine.optimizer)
    norms = _two_micro_steps_each(engine, _images, range(first, last))
    if save:
        save_checkpoint(path, 1, engine.model, engine.optimizer)
    splits = {name: getattr(p, "tensor_splits", []) for name, p in engine.model.named_parameters()}
    for name, value in engine.model.state_dict().items():  # ZeRO 3: gathered (collective)
        assert_close(value, slice_of(expected[name], splits.get(name, [])),
                     msg=lambda m: f"[rank {rank}] {name}: {m}")
    return norms


def _zero3_one_process():
    model = tensor_model()
    opt = sgd(model.parameters())
    states, norms = [], []
    for step in range(STEPS):
        x, y = _images(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        states.append(cloned_state(model))
    return states, norms


# (2d x ZeRO 3 saved and resumed: test_composition.py's row "2d x zero3 x accum2, resumed")
ZERO3_RESUME = [("1d", 4, 2), ("1d", 2, 4)]


@pytest.mark.parametrize("mode, saved, loaded", ZERO3_RESUME,
                         ids=["1d-data2-to-data1", "1d-data1-to-data2"])
def test_deep_zero3_x_tensor_x_accumulation_x_clip_checkpoint_resumes_in_another_data_size(
        tmp_path, mode, saved, loaded):
    """1d x2 with data 2 or data 1, ZeRO 3: 2 steps, save, merge (one process after 2
    steps), load into the other data size, step 3 (momentum restored)."""
    states, norms = _zero3_one_process()
    assert min(norms) > CLIP
    path = str(tmp_path / "ckpt.pt")
    for rank, our in enumerate(run_ranks(_zero3_tensor_worker, saved, mode, path, 0, 2, True,
                                         states[1], timeout=60)):
        assert our == pytest.approx(norms[:2], rel=1e-5), f"rank {rank}"
    merged = merge_checkpoint(path)
    assert set(merged) == set(states[1])
    for key, value in states[1].items():
        assert_close(merged[key], value, msg=lambda m: f"merged {key}: {m}")
    for rank, our in enumerate(run_ranks(_zero3_tensor_worker, loaded, mode, path, 2, 3, False,
                                         states[2], timeout=60)):
        assert our == pytest.approx(norms[2:], rel=1e-5), f"rank {rank}"


# -- the Trainer x pipeline x data x ZeRO 2 x tied weight: stopped by max_steps, resumed ---------

TRAIN_SIZE, SHUFFLE_SEED, EPOCHS = 24, 7, 2  # per data rank 12 = 3 batches of 4 per epoch


def _trainer_worker(rank, world_size, port, level, path, max_steps, resume):
    engine = pipeline_engine(rank, world_size, port, {"zero": {"level": level},
                                                      "clip_grad_norm": CLIP}, [3, 5], 1)
    x, y = tied_batch(99, TRAIN_SIZE)
    train = nc.get_dataloader(TensorDataset(x, y), shuffle=True, seed=SHUFFLE_SEED, batch_size=4)
    trainer = Trainer(engine)
    if resume:
        assert trainer.resume(path)
    trainer.fit(train, epochs=EPOCHS, max_steps=max_steps,
                hooks=[hooks.LossHook(), hooks.SaveCheckpointHook(path)])
    return (cloned_state(engine.model),)


def _trainer_one_process():
    x, y = tied_batch(99, TRAIN_SIZE)
    data = TensorDataset(x, y)
    model = tied_model()
    opt = sgd(model.parameters())
    after_each_step = []
    for epoch in range(EPOCHS):
        shards = epoch_shards(data, epoch, SHUFFLE_SEED)
        for k in range(len(shards[0]) // 4):
            idx = shards[0][k * 4:(k + 1) * 4] + shards[1][k * 4:(k + 1) * 4]
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            after_each_step.append(cloned_state(model))
    return after_each_step


@pytest.mark.parametrize("level", [2], ids=["zero2"])  # (ZeRO 1 saves and loads alike)
def test_deep_trainer_x_pipeline_x_zero_x_tied_weight_stopped_and_resumed_equals_one_process(
        tmp_path, level):
    after_each_step = _trainer_one_process()
    path = str(tmp_path / "ckpt.pt")
    stopped = run_ranks(_trainer_worker, 4, level, path, 2, False, timeout=60)
    check_states(stopped, after_each_step[1], F64)
    merged = merge_checkpoint(path)
    for key, value in after_each_step[1].items():
        assert_close(merged[key], value, msg=lambda m: f"merged {key}: {m}", **F64)
    resumed = run_ranks(_trainer_worker, 4, level, path, None, True, timeout=60)
    check_states(resumed, after_each_step[-1], F64)


# -- ZeRO 1-3 x tensor 1d x a vocab-parallel embedding tied to its classifier x vocab-parallel
#    cross-entropy x accumulation x clip ---------------------------------------------------------

SEQ = 4


def _tokens(step):
    g = torch.Generator().manual_seed(3000 + step)
    return (torch.randint(0, VOCAB, (GLOBAL, SEQ), generator=g),
            torch.randint(0, VOCAB, (GLOBAL, SEQ), generator=g))


def _lm_worker(rank, world_size, port, level, expected, norms):
    config = {"parallel": {"tensor": {"size": 2, "mode": "1d"}}, "gradient_accumulation": 2,
              "clip_grad_norm": CLIP, "zero": {"level": level}}
    launch_rank(rank, world_size, port, config)
    model = tied_lm()
    engine, *_ = nc.initialize(model, sgd(model.parameters()),
                               col_nn.VocabParallelCrossEntropyLoss(), verbose=False)
    our_norms = _two_micro_steps_each(engine, _tokens, range(STEPS))
    assert our_norms == pytest.approx(norms, rel=1e-5), "the tied table counted once"
    splits = {name: getattr(p, "tensor_splits", []) for name, p in engine.model.named_parameters()}
    splits["5.weight"] = splits["0.weight"]  # (named_parameters names a shared one once)
    state = engine.model.state_dict()  # ZeRO 3: gathered (collective)
    assert set(state) == set(expected)
    for name, value in state.items():
        assert_close(value, slice_of(expected[name], splits.get(name, [])),
                     msg=lambda m: f"[rank {rank}] {name}: {m}")


# (ZeRO 2 shards as ZeRO 1 does, plus its gradients: 1d x ZeRO 2 is a row of the table)
@pytest.mark.parametrize("level", [1, 3], ids=["zero1", "zero3"])
def test_deep_zero_x_tensor_1d_x_tied_vocab_parallel_lm_x_accumulation_x_clip_equals_one_process(
        level):
    model = tied_lm()
    opt = sgd(model.parameters())
    norms = []
    for step in range(STEPS):
        x, y = _tokens(step)
        opt.zero_grad()
        F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
    assert min(norms) > CLIP
    run_ranks(_lm_worker, 4, level, cloned_state(model), norms, timeout=60)
