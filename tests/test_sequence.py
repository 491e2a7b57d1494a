"""Sequence parallelism (mode='sequence') trains the GPT exactly as one process does.

float64 and SGD with momentum (not Adam, whose update hides a gradient scaled by any factor),
with a global clip that really clips: after 3 steps every parameter equals one process's on
the whole batch to 1e-10, for sequence x2 and x4, data 2 x sequence 2, pipeline 2 x sequence 2,
Colossal-AI's SequenceParallelGradientHandler instead of DDP, and ZeRO 1-3 sharded over data x
sequence ranks. Then sequence parallelism in the training loop, each against one process
(the same nanocolossal code on world size 1): the Trainer's metrics and its resume, checkpoints
into one process and back, generate(), DataLoaders with workers or without __len__, trailing
padding. Then what is refused. (Its pairs with other features -- accumulation, ZeRO, the
pipeline schedules, AMP, an overflow on one rank, non-causal attention -- are rows of
test_composition.py's table.)
"""
import sys

import pytest
import torch
from dist_helpers import ROOT, launch_rank, run_ranks
from run_records import assert_bit_identical, compare_runs
from sequence_runs import (
    build_gpt,
    compare_states,
    five_calls,
    generate_run,
    gpt_one_and_layout,
)
from torch import nn
from torch.testing import assert_close
from torch.utils.data import DataLoader, TensorDataset

import nanocolossal as nc
import nanocolossal.nn as col_nn
from nanocolossal.config import ConfigError
from nanocolossal.context import gpc
from nanocolossal.nn.transformer import Attention
from nanocolossal.pipeline import build_pipeline_model

sys.path.insert(0, str(ROOT))
from train_gpt import gpt  # noqa: E402
from train_tensor import vit  # noqa: E402

pytestmark = pytest.mark.timeout(120)
BATCH, SEQ, VOCAB, STEPS, CLIP = 4, 16, 32, 3, 0.5
SEQ2 = {"tensor": {"size": 2, "mode": "sequence"}}


def _lesson_worker(rank, world_size, port, xs, ys):
    nc.launch(dict(parallel=dict(tensor=dict(size=2, mode="sequence"))), rank=rank,
              world_size=world_size, host="127.0.0.1", port=port)
    torch.manual_seed(0)  # every rank builds the whole model the reference builds
    model = nn.Sequential(nn.Linear(4, 8), Attention(8, heads=2, causal=True),
                          nn.Linear(8, 3)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    engine, loader, *_ = nc.initialize(model, optimizer, col_nn.CrossEntropyLoss(),
                                       list(zip(xs, ys)), verbose=False)
    for x, y in loader:  # my zig-zag share of every sequence: tokens 0-1 and 6-7, or 2-5
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))  # attention: K/V around the ring
        engine.step()
    return engine.model.state_dict()


def test_gloo_sequence_parallel_on_two_ranks_equals_one_process():
    """Each of 2 ranks holds half the tokens of every sequence; ring attention lets its queries
    meet every key, and training equals one process on whole sequences."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), Attention(8, heads=2, causal=True),
                          nn.Linear(8, 3)).double()
    xs = torch.randn(3, 2, 8, 4, dtype=torch.float64)  # 3 batches of 2 sequences of 8 tokens
    ys = torch.randint(0, 3, (3, 2, 8))  # a class per token
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for x, y in zip(xs, ys):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        optimizer.step()
    for rank, state in enumerate(run_ranks(_lesson_worker, 2, xs, ys)):
        assert_close(state, model.state_dict(), msg=lambda m: f"rank {rank}: {m}")


def _model():
    torch.manual_seed(0)
    return gpt(vocab=VOCAB, seq_len=SEQ, dim=16, depth=2, heads=2, mlp_ratio=2).double()


def _batches():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (2, BATCH, SEQ), generator=g).unbind(0) for _ in range(STEPS)]


def _optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def _single_process():
    model = _model()
    opt, norms = _optimizer(model), []
    for x, y in _batches():
        opt.zero_grad()
        logits = model(x)
        nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)).backward()
        norms.append(nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
    return model.state_dict(), norms


def _worker(rank, world_size, port, parallel, expected, norms):
    parallel = dict(parallel)
    config = {"parallel": parallel, "clip_grad_norm": CLIP, "NUM_MICRO_BATCHES": 2}
    if parallel.pop("handler", False):
        config["gradient_handler"] = [dict(type="SequenceParallelGradientHandler")]
    if "zero" in parallel:  # sharded over data x sequence ranks
        config["zero"] = dict(level=parallel.pop("zero"))
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    model = _model()
    if gpc.pipeline_size > 1:
        model = build_pipeline_model(model, partition="uniform")
    per = BATCH // gpc.data_size
    mine = slice(gpc.data_rank * per, (gpc.data_rank + 1) * per)
    loader = [(x[mine], y[mine]) for x, y in _batches()]
    engine, loader, *_ = nc.initialize(model, _optimizer(model),
                                       col_nn.VocabParallelCrossEntropyLoss(), loader,
                                       verbose=False)
    assert len(loader) == STEPS
    for step, (x, y) in enumerate(loader):
        assert x.shape == (per, SEQ // gpc.sequence_size), "each rank holds its share of tokens"
        engine.zero_grad()
        engine.execute_schedule((x, y))
        assert engine.step()
        assert engine.last_grad_norm == pytest.approx(norms[step], rel=1e-10)
    for name, p in engine.model.state_dict().items():
        assert_close(p, expected[name], rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}")
    return len(engine.model.state_dict())


LAYOUTS = {
    "sequence x2": (2, {"tensor": {"size": 2, "mode": "sequence"}}),
    "sequence x4": (4, {"tensor": {"size": 4, "mode": "sequence"}}),
    "data 2 x sequence 2": (4, {"tensor": {"size": 2, "mode": "sequence"}}),
    "pipeline 2 x sequence 2": (4, {"pipeline": 2, "tensor": {"size": 2, "mode": "sequence"}}),
    "sequence x2, SequenceParallelGradientHandler":
        (2, {"tensor": {"size": 2, "mode": "sequence"}, "handler": True}),
    "sequence x2, ZeRO 1": (2, {"tensor": {"size": 2, "mode": "sequence"}, "zero": 1}),
    "data 2 x sequence 2, ZeRO 2": (4, {"tensor": {"size": 2, "mode": "sequence"}, "zero": 2}),
    "sequence x2, ZeRO 3": (2, {"tensor": {"size": 2, "mode": "sequence"}, "zero": 3}),
}


@pytest.fixture(scope="module")
def reference():
    return _single_process()


@pytest.mark.parametrize("name", LAYOUTS)
def test_deep_sequence_parallel_training_equals_one_process(reference, name):
    expected, norms = reference
    assert norms[0] > CLIP, "the clip really clips"
    world, parallel = LAYOUTS[name]
    checked = run_ranks(_worker, world, parallel, expected, norms, timeout=90)
    assert sum(checked) >= len(expected)


# -- the Trainer: its loss, last loss and accuracy are one process's; resuming is bit-identical ---

def _datasets(n_train=16, n_test=10):
    from torch.utils.data import TensorDataset
    g = torch.Generator().manual_seed(3)
    make = lambda n: TensorDataset(*torch.randint(0, VOCAB, (2, n, SEQ), generator=g))  # noqa
    return make(n_train), make(n_test)


def _trainer_run(rank, world, port, config, epochs=2, ckpt=None, max_steps=None, resume=False,
                 loader_kw=None):
    from nanocolossal.metrics import Accuracy
    from nanocolossal.trainer import Trainer, hooks
    launch_rank(rank, world, port, config)
    model = build_gpt(config)
    train_set, test_set = _datasets()
    kw = dict(loader_kw or {})
    train = nc.get_dataloader(train_set, shuffle=True, seed=5, drop_last=True,
                              batch_size=BATCH // gpc.data_size, **kw)
    test = nc.get_dataloader(test_set, batch_size=4, pad=False, **kw)  # uneven: 4+4+2 / 4+1
    engine, train, test, _ = nc.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
        col_nn.VocabParallelCrossEntropyLoss(), train, test, verbose=False)
    trainer = Trainer(engine)
    last = hooks.LastLossHook()
    hook_list = [hooks.LossHook(), hooks.AccuracyHook(Accuracy()), last]
    if ckpt is not None:
        hook_list.append(hooks.SaveCheckpointHook(ckpt, every_steps=2))
        if resume:
            assert trainer.resume(ckpt)
    trainer.fit(train, epochs, test, hooks=hook_list, max_steps=max_steps)
    state = {k: v.detach().clone() for k, v in
             nc.checkpoint.strip_prefixes(engine.model.state_dict()).items()}
    return dict(metrics=trainer.states["metrics"], last=last.value, state=state,
                step=trainer.cur_step)


TRAINER_LAYOUTS = {
    "sequence 2": (2, SEQ2),
    "data 2 x sequence 2": (4, SEQ2),
    "pipeline 2 x sequence 2": (4, {"pipeline": 2, **SEQ2}),
}


@pytest.fixture(scope="module")
def trainer_reference():
    return run_ranks(_trainer_run, 1, dict(NUM_MICRO_BATCHES=2, clip_grad_norm=CLIP),
                     timeout=60)[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", TRAINER_LAYOUTS)
def test_deep_trainer_hooks_under_sequence_report_one_process_numbers(trainer_reference, name):
    """LossHook (train and test), LastLossHook and AccuracyHook over uneven evaluation shards
    give one process's numbers; the weights after 2 epochs are one process's."""
    world, parallel = TRAINER_LAYOUTS[name]
    ref = trainer_reference
    config = dict(NUM_MICRO_BATCHES=2, clip_grad_norm=CLIP, parallel=parallel)
    # a pipeline sums its micro-batches' losses in float32 (pipeline/executor.py, total_loss),
    # whatever the model's dtype: its reported loss is one process's to float32 only
    rel = 1e-7 if "pipeline" in name else 1e-10
    for run in run_ranks(_trainer_run, world, config, timeout=60):
        for split in ("train", "test"):
            for key, value in ref["metrics"][split].items():
                assert run["metrics"][split][key] == pytest.approx(value, rel=rel, abs=1e-12), \
                    (split, key, run["metrics"], ref["metrics"])
        assert run["last"] == pytest.approx(ref["last"], rel=rel)
        for key, value in run["state"].items():
            assert_close(value, ref["state"][key], rtol=1e-10, atol=1e-10)


@pytest.mark.timeout(60)
def test_deep_trainer_resume_under_pipeline_x_sequence_is_bit_identical(tmp_path):
    """pipeline 2 x sequence 2: stop after 3 of 8 steps (mid-epoch), resume in a new job, end
    bit-identical to a run that never stopped."""
    config = dict(NUM_MICRO_BATCHES=2, clip_grad_norm=CLIP, parallel={"pipeline": 2, **SEQ2})
    whole = run_ranks(_trainer_run, 4, config, 2, None, timeout=60)
    ckpt = str(tmp_path / "ckpt.pt")
    first = run_ranks(_trainer_run, 4, config, 2, ckpt, 3, timeout=60)
    assert first[0]["step"] == 3
    second = run_ranks(_trainer_run, 4, config, 2, ckpt, None, True, timeout=60)
    assert_bit_identical(whole, second)


# -- checkpoints across layouts, through the tutorial's five-call loop -------------------------

@pytest.mark.timeout(60)
def test_deep_checkpoint_moves_between_one_process_and_sequence_with_optimizer_state(tmp_path):
    """3 steps in one process == 2 steps under sequence 2, saved, then the 3rd in one process
    (the file loads as it is: sequence ranks hold whole replicas) == 2 in one process, then the
    3rd under data 2 x sequence 2. Momentum comes along, so a lost optimizer state shows."""
    cfg, seq = dict(clip_grad_norm=CLIP), dict(clip_grad_norm=CLIP, parallel=SEQ2)
    ref = run_ranks(five_calls, 1, cfg, 0, 3, timeout=60)[0]
    run_ranks(five_calls, 2, seq, 0, 2, None, str(tmp_path / "seq.pt"), timeout=60)
    assert [p.name for p in tmp_path.iterdir()] == ["seq.pt"], "one file: no sequence suffix"
    compare_states(run_ranks(five_calls, 1, cfg, 2, 3, str(tmp_path / "seq.pt"), timeout=60), ref)
    run_ranks(five_calls, 1, cfg, 0, 2, None, str(tmp_path / "one.pt"), timeout=60)
    compare_states(run_ranks(five_calls, 4, seq, 2, 3, str(tmp_path / "one.pt"), timeout=60), ref)


# -- generate(): the same tokens as one process ------------------------------------------------

@pytest.mark.timeout(60)
def test_deep_generate_under_sequence_gives_one_process_tokens():
    ref = run_ranks(generate_run, 1, {}, timeout=60)[0]
    assert len(set(ref)) > 1
    zbv = dict(PIPELINE_SCHEDULE="zbv", NUM_CHUNKS=2, NUM_MICRO_BATCHES=3)
    for world, parallel, schedule in [(2, SEQ2, {}),
                                      (4, {"tensor": {"size": 4, "mode": "sequence"}}, {}),
                                      (4, {"pipeline": 2, **SEQ2}, {}),
                                      (2, {"pipeline": 2}, zbv)]:  # zbv: rank 0 holds the output
        config = {"NUM_MICRO_BATCHES": 2, "parallel": parallel, **schedule}
        assert run_ranks(generate_run, world, config, timeout=60) == [ref] * world, parallel


# -- loaders: worker processes, no __len__ -----------------------------------------------------

class _Unsized:
    """A loader without __len__ (a stream): yields the batches of a DataLoader."""

    def __init__(self, loader):
        self.inner = loader

    def __iter__(self):
        return iter(self.inner)


def _loader_run(rank, world, port, config, workers):
    from nanocolossal.trainer import Trainer, hooks
    launch_rank(rank, world, port, config)
    model = build_gpt(config)
    train_set, _ = _datasets()
    loader = nc.get_dataloader(train_set, batch_size=BATCH // gpc.data_size, drop_last=True,
                               num_workers=workers,
                               multiprocessing_context="fork" if workers else None)
    if not workers:
        loader = _Unsized(loader)
    engine, loader, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.5,
                                                              momentum=0.9),
                                       col_nn.VocabParallelCrossEntropyLoss(), loader,
                                       verbose=False)
    assert hasattr(loader, "__len__") == bool(workers)
    last = hooks.LastLossHook()
    # the pooled ranks are daemonic processes, which may not start DataLoader workers: lift that
    # for this job (the workers end with the epoch's iterator)
    import multiprocessing
    config = multiprocessing.current_process()._config
    daemon = config.get("daemon")
    config["daemon"] = False
    try:
        Trainer(engine).fit(loader, 1, hooks=[last, hooks.LossHook()])
    finally:
        config["daemon"] = daemon
    return last.value, {k: v.detach().clone() for k, v in
                        nc.checkpoint.strip_prefixes(engine.model.state_dict()).items()}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 1], ids=["no __len__", "num_workers=1"])
def test_deep_sequence_loaders_with_workers_or_without_len(workers):
    ref_loss, ref = run_ranks(_loader_run, 1, {}, workers, timeout=60)[0]
    for loss, state in run_ranks(_loader_run, 2, dict(parallel=SEQ2), workers, timeout=60):
        assert loss == pytest.approx(ref_loss, rel=1e-10)
        compare_states([state], ref)


@pytest.mark.timeout(60)
def test_deep_sequence_with_trailing_padding_equals_one_process():
    """Targets of the last 6 of 16 positions are ignore_index: sequence rank 0 (chunks 0, 3)
    counts 4 tokens per sequence, rank 1 (chunks 1, 2) counts 6. One process's loss is the mean
    over all 10; each rank divides by the count of all ranks (SequenceCrossEntropyLoss), not by its
    own (which made it the mean of the two ranks' means)."""
    ref, runs = gpt_one_and_layout(dict(PAD=6), 2, SEQ2, 1)
    compare_runs(ref, runs)


# -- what is refused, and how it is said -------------------------------------------------------

def _refusals(rank, world_size, port):
    """Every refusal sequence parallelism makes, in one job: bad layouts at launch, then, on
    sequence ranks, models and inputs it cannot split."""
    said = {}
    bad = {
        "zero 3 beside a pipeline": dict(zero=dict(level=3), parallel=dict(pipeline=2)),
        "sequence key beside 1d": dict(parallel=dict(tensor=dict(size=2, mode="1d"), sequence=2)),
        "sequence key beside sequence": dict(parallel=dict(sequence=2, **SEQ2)),
        "sequence x4 on 2": dict(parallel=dict(tensor=dict(size=4, mode="sequence"))),
    }
    for case, config in bad.items():
        try:
            launch_rank(rank, world_size, port, config)
        except Exception as e:  # noqa: BLE001 -- the message is what is tested
            said[case] = f"{type(e).__name__}: {e}"
        else:
            said[case] = "accepted"
        gpc.destroy()
    launch_rank(rank, world_size, port, dict(parallel=SEQ2))
    cases = {
        "vit": lambda: vit(img_size=8, patch_size=4, dim=8, depth=1, heads=2, num_classes=5),
        "no attention": lambda: nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB)),
    }
    for case, build in cases.items():
        model = build()
        with pytest.raises(ConfigError) as err:
            nc.initialize(model, _optimizer(model), verbose=False)
        said[case] = str(err.value)
    with pytest.raises(ConfigError) as err:
        gpt(vocab=VOCAB, seq_len=SEQ, dim=16, depth=1, heads=2, dropout=0.1)
    said["dropout"] = str(err.value)
    model = _model()
    six = TensorDataset(*(torch.zeros(4, 6).long(),) * 2)
    with pytest.raises(ConfigError) as err:  # a DataLoader's first sample: at initialize
        nc.initialize(model, _optimizer(model), verbose=False,
                      train_dataloader=DataLoader(six, batch_size=2))
    said["length"] = str(err.value)
    engine, loader, *_ = nc.initialize(model, _optimizer(model), verbose=False,
                                       train_dataloader=[(torch.zeros(2, 6).long(),) * 2])
    with pytest.raises(ConfigError) as err:  # any other loader: its first batch
        next(iter(loader))
    said["length of a batch"] = str(err.value)
    with pytest.raises(ValueError) as err:
        engine(torch.zeros(2, 5).long())  # a share given by hand, not by the loader
    said["odd share"] = str(err.value)
    return said


@pytest.mark.timeout(60)
def test_gloo_what_sequence_parallelism_refuses_and_says():
    said = run_ranks(_refusals, 2, timeout=45)[1]
    assert "[rank 1]" in said["vit"] and "Conv2d" in said["vit"], said
    assert "mixes tokens" in said["vit"] and "mode '1d'/'2d'" in said["vit"]
    assert "no attention that knows the sequence is split" in said["no attention"]
    assert "no attention dropout" in said["dropout"] and "dropout=0" in said["dropout"]
    assert said["length"] == said["length of a batch"] == (
        "[rank 1] sequence length 6 does not split into 2 x 2 zig-zag stripes for 2 "
        "sequence-parallel ranks; use a multiple of 4 (nearest: 4, 8)")
    launches = ("zero 3 beside a pipeline", "sequence key beside 1d",
                "sequence key beside sequence", "sequence x4 on 2")
    assert all(said[case].startswith("ConfigError: [rank 1]") for case in launches), said
    # ZeRO shards over data x sequence ranks (above); level 3 x pipeline: refused
    assert "use zero level 1 or 2 with a pipeline" in said["zero 3 beside a pipeline"]
    for case in ("sequence key beside 1d", "sequence key beside sequence"):
        assert "tensor=dict(size=N, mode='sequence')" in said[case]
        assert "remove parallel.sequence" in said[case]
    assert "launch a multiple of 4" in said["sequence x4 on 2"]
    # (the message speaks of the whole sequence, 2 x 5 = 10 tokens: engine(x) takes a share)
    assert said["odd share"].startswith("[rank 1]") and "zig-zag" in said["odd share"]


def test_config_refuses_a_seq_len_ring_attention_cannot_split():
    """Ring attention's blocks are equal: SEQ_LEN (train_gpt.py's) must cut into 2N stripes,
    said when the config is loaded; all-to-all attention takes any length."""
    ring = dict(SEQ_LEN=6, parallel=SEQ2)
    with pytest.raises(ConfigError) as err:
        nc.load_config(ring)
    assert str(err.value) == ("sequence length SEQ_LEN = 6 does not split into 2 x 2 zig-zag "
                              "stripes for 2 sequence-parallel ranks; use a multiple of 4 "
                              "(nearest: 4, 8)")
    assert nc.load_config(dict(SEQ_LEN=6, parallel={"tensor": {**SEQ2["tensor"],
                                                               "attention": "all_to_all"}}))


def _too_long(rank, world, port):
    """Sequences of 20 tokens into a model with 16 positions, split over 2 ranks: rank 0's
    tokens (chunks 0 and 3: positions 0-4, 15-19) are past the table, rank 1's (5-14) are not."""
    import time
    launch_rank(rank, world, port, dict(parallel=SEQ2, timeout=3))
    model = build_gpt({})
    engine, loader, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                       col_nn.VocabParallelCrossEntropyLoss(),
                                       [(torch.zeros(2, 20).long(),) * 2], verbose=False)
    start = time.monotonic()
    try:
        engine.execute_schedule(next(iter(loader)))
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}", time.monotonic() - start
    return "accepted", time.monotonic() - start


@pytest.mark.timeout(30)
def test_gloo_sequence_longer_than_the_positions_fails_at_once_on_every_rank():
    said = run_ranks(_too_long, 2, timeout=20)
    for rank, (text, seconds) in enumerate(said):
        assert text.startswith(f"ValueError: [rank {rank}]"), said  # or any error naming it
        assert "20" in text and "16" in text, said                  # the lengths
        assert seconds < 1.0, said                                  # not the timeout
