"""Sequence parallelism (tensor mode='sequence') composed with the other features, each against
ONE PROCESS on the whole global batch (the same nanocolossal code on world size 1, whose
equality with plain torch other tests show): AMP, the Trainer's hooks, checkpoints across
layouts, generate(), the Engine's five calls, non-causal attention, DataLoaders with workers or
without __len__, and the errors bad configs must give. Its layouts (x accumulation, x 1F1B and
interleaved, x data x pipeline on 8 ranks, x the sequence gradient handler) are rows of
test_composition.py's table.

float64 and SGD with momentum wherever the feature allows (Adam hides gradient-scale bugs).
"""
import pytest
import torch
from dist_helpers import launch_rank, run_ranks
from run_records import compare_runs
from sequence_runs import (
    BATCH,
    CLIP,
    SEQ,
    VOCAB,
    build_gpt,
    compare_states,
    five_calls,
    generate_run,
    gpt_one_and_layout,
    gpt_run,
)
from torch.testing import assert_close

import nanocolossal as nc
import nanocolossal.nn as col_nn
from nanocolossal.config import AMP_TYPE
from nanocolossal.context import gpc

SEQ2 = {"tensor": {"size": 2, "mode": "sequence"}}


# -- one generic training run (sequence_runs.gpt_run) on one process and on a layout ---------------

# (sequence x accumulation, x 1F1B / interleaved, x data x pipeline, x the sequence gradient
# handler: rows of test_composition.py's TABLE; here the attention the GPT there does not use)
TRAIN_CASES = {  # name: (config, processes, parallel)
    "non-causal attention, data 2 x sequence 2": (dict(CAUSAL=False, clip_grad_norm=CLIP), 4,
                                                  SEQ2),
    "non-causal attention, sequence 4": (dict(CAUSAL=False), 4,
                                         {"tensor": {"size": 4, "mode": "sequence"}}),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", TRAIN_CASES)
def test_gloo_sequence_non_causal_training_equals_one_process(name):
    config, world, parallel = TRAIN_CASES[name]
    ref, runs = gpt_one_and_layout(config, world, parallel)
    if "clip" in name:
        assert max(n for n in ref["norms"] if n) > config["clip_grad_norm"], "it really clips"
    compare_runs(ref, runs)


AMP_CASES = {  # name: (fp16 config, processes, parallel)
    "TORCH bf16": (dict(mode=AMP_TYPE.TORCH, dtype="bfloat16"), 2, SEQ2),
    "TORCH fp16": (dict(mode=AMP_TYPE.TORCH, dtype="float16"), 2, SEQ2),
    "NAIVE fp16": (dict(mode=AMP_TYPE.NAIVE, dtype="float16"), 2, SEQ2),
    "APEX O3 bf16": (dict(mode=AMP_TYPE.APEX, opt_level="O3", dtype="bfloat16"), 2, SEQ2),
    "NAIVE fp16, pipeline 2 x sequence 2": (dict(mode=AMP_TYPE.NAIVE, dtype="float16"), 4,
                                            {"pipeline": 2, **SEQ2}),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", AMP_CASES)
def test_deep_sequence_x_amp_equals_one_process_to_half_precision(name):
    """Ring attention's blockwise softmax rounds otherwise than one process's: the two agree
    to half precision (each as far from the float32 run as the other, measured: 1e-3 bf16,
    2e-4 fp16 after 3 steps at lr 0.5)."""
    fp16, world, parallel = AMP_CASES[name]
    config = dict(fp16=fp16, clip_grad_norm=CLIP, NUM_MICRO_BATCHES=2)
    ref, runs = gpt_one_and_layout(config, world, parallel, 3, torch.float32)
    if world == 2:
        for key in ref["state"]:
            assert torch.equal(runs[0]["state"][key], runs[1]["state"][key]), "replicas drifted"
    compare_runs(ref, runs, rtol=0, atol=1e-2 if "bf16" in name else 2e-3)


@pytest.mark.timeout(60)
def test_deep_sequence_x_fp16_overflow_on_one_rank_skips_everywhere():
    """Dynamic loss scaling: an inf in one rank's gradient (rank 1 of 2; one process: its
    only rank) skips that step on every rank and halves the scale, as one process does."""
    config = dict(fp16=dict(mode=AMP_TYPE.NAIVE, dtype="float16", initial_scale=2.0 ** 10),
                  clip_grad_norm=CLIP)
    ref = run_ranks(gpt_run, 1, config, 4, torch.float32, (1, [0]), timeout=60)[0]
    runs = run_ranks(gpt_run, 2, {**config, "parallel": SEQ2}, 4, torch.float32, (1, [1]),
                     timeout=60)
    assert ref["took"] == [True, False, True, True] and ref["scales"][1] == 2.0 ** 9
    compare_runs(ref, runs, rtol=0, atol=2e-3, norms=False)


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
    # a pipeline sums its micro-batches' losses in float32 (pipeline/schedule.py, total_loss),
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
    for a, b in zip(whole, second):
        assert a["state"].keys() == b["state"].keys()
        for key in a["state"]:
            assert torch.equal(a["state"][key], b["state"][key]), key
        assert a["last"] == b["last"]


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
    over all 10; each rank divides by the count of all ranks (TokenCrossEntropyLoss), not by its
    own (which made it the mean of the two ranks' means)."""
    ref, runs = gpt_one_and_layout(dict(PAD=6), 2, SEQ2, 1)
    compare_runs(ref, runs)


# -- what is refused, and how it is said -------------------------------------------------------

def _refusals(rank, world, port):
    said = {}
    bad = {
        "zero 3 beside a pipeline": dict(zero=dict(level=3), parallel=dict(pipeline=2)),
        "sequence key beside 1d": dict(parallel=dict(tensor=dict(size=2, mode="1d"), sequence=2)),
        "sequence key beside sequence": dict(parallel=dict(sequence=2, **SEQ2)),
        "sequence x4 on 2": dict(parallel=dict(tensor=dict(size=4, mode="sequence"))),
    }
    for case, config in bad.items():
        try:
            launch_rank(rank, world, port, config)
        except Exception as e:  # noqa: BLE001 -- the message is what is tested
            said[case] = f"{type(e).__name__}: {e}"
        else:
            said[case] = "accepted"
        gpc.destroy()
    launch_rank(rank, world, port, dict(parallel=SEQ2))
    model = build_gpt({})
    engine, loader, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                       col_nn.VocabParallelCrossEntropyLoss(),
                                       [(torch.zeros(2, 12).long(),) * 2], verbose=False)
    for case, length in {"odd share": 5}.items():
        try:
            engine(torch.zeros(2, length).long())  # a share given by hand, not by the loader
        except Exception as e:  # noqa: BLE001
            said[case] = f"{type(e).__name__}: {e}"
    try:
        next(iter(loader))
    except Exception as e:  # noqa: BLE001
        said["loader 12 on 2"] = f"{type(e).__name__}: {e}"
    return said


@pytest.mark.timeout(60)
def test_gloo_sequence_refusals_name_the_rank_and_what_to_change():
    said = run_ranks(_refusals, 2, timeout=45)[1]
    assert all(text.startswith("ConfigError: [rank 1]") for case, text in said.items()
               if case != "odd share"), said
    # ZeRO shards over data x sequence ranks (test_sequence.py); level 3 x pipeline: refused
    assert "use zero level 1 or 2 with a pipeline" in said["zero 3 beside a pipeline"]
    for case in ("sequence key beside 1d", "sequence key beside sequence"):
        assert "tensor=dict(size=N, mode='sequence')" in said[case]
        assert "remove parallel.sequence" in said[case]
    assert "launch a multiple of 4" in said["sequence x4 on 2"]
    # (the message speaks of the whole sequence, 2 x 5 = 10 tokens: engine(x) takes a share)
    assert said["odd share"].startswith("ValueError: [rank 1]") and "zig-zag" in said["odd share"]


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
