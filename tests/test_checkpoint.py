import logging
import os
import pickle
import random
import re
import shlex
import time

import pytest
import torch
from dist_helpers import run_ranks
from torch import nn
from torch.testing import assert_close
from torch.utils.data import TensorDataset

import nanocolossal as nc
from nanocolossal import checkpoint
from nanocolossal.amp import AMP_TYPE
from nanocolossal.checkpoint import (
    load_checkpoint,
    load_plain_state_dict,
    merge_checkpoint,
    merge_pipeline_checkpoint,
    save_checkpoint,
)
from nanocolossal.config import ConfigError
from nanocolossal.context import gpc
from nanocolossal.pipeline import build_pipeline_model
from nanocolossal.tensor.base import slice_of
from nanocolossal.trainer import Trainer, hooks

try:
    import numpy as np
except ImportError:  # numpy is optional: its RNG is saved only where it is installed
    np = None

pytestmark = pytest.mark.timeout(120)


def _lesson_worker(rank, world_size, port, path, x, y, max_steps, resume):
    nc.launch({}, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(0.2), nn.Linear(8, 3)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    engine, *_ = nc.initialize(model, optimizer, nn.CrossEntropyLoss(), verbose=False)
    train = nc.get_dataloader(TensorDataset(x, y), shuffle=True, batch_size=4)  # shuffled per epoch
    trainer = Trainer(engine)
    if resume:  # the weights, the momenta, the epoch and batch reached, every rank's RNG
        assert trainer.resume(path)
    trainer.fit(train, epochs=2, max_steps=max_steps, hooks=[hooks.SaveCheckpointHook(path)])
    return engine.model.state_dict()


def test_gloo_resume_from_a_checkpoint_equals_training_without_a_stop(tmp_path):
    """A 2-rank run stopped mid-epoch and resumed from its checkpoint by a new job ends
    bit-identical to a run that never stopped: weights, momenta, data order and dropout masks."""
    torch.manual_seed(0)
    x, y = torch.randn(48, 4, dtype=torch.float64), torch.randint(0, 3, (48,))  # 6 steps an epoch
    straight = run_ranks(_lesson_worker, 2, str(tmp_path / "a.pt"), x, y, None, False)
    run_ranks(_lesson_worker, 2, str(tmp_path / "b.pt"), x, y, 9, False)  # stops after step 9
    resumed = run_ranks(_lesson_worker, 2, str(tmp_path / "b.pt"), x, y, None, True)
    for rank in range(2):
        assert_close(resumed[rank], straight[rank], rtol=0, atol=0,
                     msg=lambda m: f"rank {rank}: {m}")


def _setup(rank, world_size, port):
    """DDP + fp16 loss scaling + dropout + shuffled sampler + momentum + LR schedule: all state that
    must resume."""
    nc.launch({"fp16": {"mode": AMP_TYPE.TORCH, "init_scale": 2.0**20, "growth_interval": 3,
                        "dtype": "float16"}},
              rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(48, 6, generator=g)
    data = nc.get_dataloader(TensorDataset(x, (x.sum(1) > 0).long() + (x[:, 0] > 1).long()),
                             shuffle=True, batch_size=4)
    engine, data, _, sched = nc.initialize(model, opt, nn.CrossEntropyLoss(), data,
                                           lr_scheduler=sched, verbose=False)
    return engine, data, sched


def _train_worker(rank, world_size, port, path, epochs, resume, max_steps=None, resume_at=(1, 6)):
    engine, data, sched = _setup(rank, world_size, port)
    trainer = Trainer(engine)
    if resume:
        assert trainer.resume(path, sched) and (trainer.cur_epoch, trainer.cur_step) == resume_at
    trainer.fit(data, epochs=epochs, max_steps=max_steps,
                hooks=[hooks.LRSchedulerHook(sched, by_epoch=True),
                       hooks.SaveCheckpointHook(path, lr_scheduler=sched)])
    return {k: v.clone() for k, v in engine.model.state_dict().items()}, engine.optimizer.loss_scale


def test_deep_resume_from_checkpoint_equals_uninterrupted_training(tmp_path):
    straight = run_ranks(_train_worker, 2, str(tmp_path / "a.pt"), 2, False)
    run_ranks(_train_worker, 2, str(tmp_path / "b.pt"), 1, False)
    resumed = run_ranks(_train_worker, 2, str(tmp_path / "b.pt"), 2, True)  # new processes
    for (a, scale_a), (b, scale_b) in zip(straight, resumed):
        assert scale_a == scale_b and scale_a != 2.0**20, "the loss scaler moved and was restored"
        for key in a:
            assert torch.equal(a[key], b[key]), key
    saved = torch.load(tmp_path / "b.pt", weights_only=False)
    assert saved["epoch"] == 2 and saved["extra"]["step"] == 12 and len(saved["rng"]) == 2
    assert list(saved["model"]) == ["0.weight", "0.bias", "3.weight", "3.bias"]


def test_deep_resume_after_max_steps_mid_epoch_continues_exactly(tmp_path):
    """max_steps=9 stops 3 steps into the second epoch (6 per epoch): that is no finished epoch."""
    straight = run_ranks(_train_worker, 2, str(tmp_path / "a.pt"), 2, False)
    run_ranks(_train_worker, 2, str(tmp_path / "b.pt"), 2, False, 9)
    saved = torch.load(tmp_path / "b.pt", weights_only=False)
    assert (saved["epoch"], saved["extra"]["step"], saved["extra"]["batch_in_epoch"]) == (1, 9, 3)
    resumed = run_ranks(_train_worker, 2, str(tmp_path / "b.pt"), 2, True, None, (1, 9))
    for (a, _), (b, _) in zip(straight, resumed):
        for key in a:
            assert torch.equal(a[key], b[key]), key


def test_interrupted_save_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    model = nn.Linear(3, 3)
    save_checkpoint(path, 1, model)
    old = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)

    def crash(src, dst):
        raise KeyboardInterrupt("killed between write and rename")
    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, 2, model)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["ckpt.pt"], "no temp file left behind"
    fresh = nn.Linear(3, 3)
    assert load_checkpoint(path, fresh)["epoch"] == 1
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, old[key])


def _killed_saver(rank, world_size, port, path):
    model = nn.Linear(3, 3)
    save_checkpoint(path, 1, model)
    with torch.no_grad():
        model.weight.add_(1.0)
    # dies after writing, before renaming
    os.replace = lambda src, dst: os.kill(os.getpid(), 9)
    save_checkpoint(path, 2, model)


def test_deep_process_killed_between_write_and_rename_leaves_the_old_checkpoint(tmp_path):
    path = tmp_path / "ckpt.pt"
    with pytest.raises(AssertionError, match="died with exit code -9"):
        run_ranks(_killed_saver, 1, str(path), timeout=60)
    assert load_checkpoint(path, nn.Linear(3, 3))["epoch"] == 1  # whole, and the old one
    assert any(name.startswith("ckpt.pt.tmp-") for name in os.listdir(tmp_path)), (
        "the new one was written"
    )


def test_checkpoint_keys_are_prefix_free_and_wrapped_files_load(tmp_path):
    model = nn.Sequential(nn.Linear(2, 2))
    wrapped = {f"module._orig_mod.{k}": v for k, v in model.state_dict().items()}
    torch.save({"epoch": 3, "model": wrapped}, tmp_path / "w.pt")
    fresh = nn.Sequential(nn.Linear(2, 2))
    assert load_checkpoint(tmp_path / "w.pt", fresh, map_location="cpu")["epoch"] == 3
    assert torch.equal(fresh[0].weight, model[0].weight)
    # a submodule that really is called "model" keeps its name
    assert list(checkpoint.strip_prefixes({"model.w": 1, "head.b": 2})) == ["model.w", "head.b"]


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"\[rank 0\] checkpoint .*nope.pt' not found"):
        load_checkpoint(tmp_path / "nope.pt", nn.Linear(1, 1))


def test_merge_pipeline_checkpoint_gives_the_plain_models_state(tmp_path):
    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    state = full.state_dict()
    checkpoint.atomic_save({"model": {k: v for k, v in state.items() if k.startswith("0.")}},
                           tmp_path / "s0.pt")
    checkpoint.atomic_save({"model": {k: v for k, v in state.items() if k.startswith("2.")}},
                           tmp_path / "s1.pt")
    merged = merge_pipeline_checkpoint([tmp_path / "s0.pt", tmp_path / "s1.pt"])
    plain = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    plain.load_state_dict(merged, strict=True)
    assert all(torch.equal(plain.state_dict()[k], v) for k, v in state.items())
    with pytest.raises(ValueError, match="repeats keys"):
        merge_pipeline_checkpoint([tmp_path / "s0.pt", tmp_path / "s0.pt"])


def _mixed_set_worker(rank, world_size, port, path):
    nc.launch({"parallel": {"pipeline": 2}}, rank=rank, world_size=world_size, host="127.0.0.1",
              port=port)
    stage = nn.Linear(3, 3)
    save_checkpoint(path, 0, stage, step=9)
    old = checkpoint.stage_path(path, 1).read_bytes()
    save_checkpoint(path, 1, stage, step=12)
    if rank == 1:  # as if the job died after stage 0's rename and before stage 1's
        checkpoint.stage_path(path, 1).write_bytes(old)
    torch.distributed.barrier()
    try:
        load_checkpoint(path, stage)
    except RuntimeError as e:
        return str(e)
    return "loaded"


def test_deep_pipeline_stages_from_different_saves_are_refused(tmp_path):
    path = tmp_path / "ckpt.pt"
    for rank, message in enumerate(run_ranks(_mixed_set_worker, 2, str(path), timeout=60)):
        assert message.startswith(f"[rank {rank}] the checkpoint's files come from different "
                                  "saves")
        assert (
            "ckpt-stage0.pt: epoch 1, step 12" in message
            and "ckpt-stage1.pt: epoch 0, step 9" in message
        )
    with pytest.raises(RuntimeError, match="different saves"):
        merge_pipeline_checkpoint([checkpoint.stage_path(path, 0), checkpoint.stage_path(path, 1)])



def _grid_model(seed=0):
    """nc.nn layers with non-square weights (so a 2d layout's row/column swap shows), the
    LayerNorm's weight made informative too (it starts as ones)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nc.nn.Embedding(10, 8), nc.nn.Linear(8, 12), nc.nn.LayerNorm(12),
                          nc.nn.Linear(12, 4), nc.nn.Classifier(4, 6))
    with torch.no_grad():
        gamma = torch.arange(1.0, 13.0) + seed
        model[2].weight.copy_(slice_of(gamma, getattr(model[2].weight, "tensor_splits", [])))
    return model


def _grid_worker(rank, world_size, port, path):
    nc.launch({"parallel": {"tensor": {"size": 4, "mode": "2d"}}}, rank=rank,
              world_size=world_size, host="127.0.0.1", port=port)
    model = _grid_model()
    save_checkpoint(path, 0, model)  # one file per tensor rank
    # all four files -> the plain state_dict -> loaded into the 2d layout: each rank its own shard
    other = _grid_model(seed=1)
    load_plain_state_dict(other, merge_checkpoint(path))
    loaded_back = {name: torch.equal(p, q)
                   for (name, p), q in zip(model.named_parameters(), other.parameters())}
    return {name: (p.detach().clone(), list(p.tensor_splits))
            for name, p in model.named_parameters()}, loaded_back


def test_gloo_2d_tensor_parallel_checkpoint_merges_into_the_plain_model(tmp_path):
    """2d (2 x 2 grid, tensor_rank = row * 2 + col): rank t holds block (row t // 2, col t % 2)."""
    path = tmp_path / "ckpt.pt"
    shards, loaded_back = zip(*run_ranks(_grid_worker, 4, str(path), timeout=60))
    plain = _grid_model().state_dict()  # gpc has no tensor mode here: the plain layers
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"ckpt-tensor{t}.pt" for t in range(4)]
    assert plain["1.weight"].shape == (12, 8) and shards[0]["1.weight"][0].shape == (6, 4)
    for t, mine in enumerate(shards):  # the layout spelled out: "col" -> t % 2, "row" -> t // 2
        for name, (block, splits) in mine.items():
            want = plain[name]
            for dim, axis in splits:
                want = want.chunk(2, dim)[{"col": t % 2, "row": t // 2}[axis]]
            assert torch.equal(block, want), f"rank {t} {name} ({splits}) is not its block"
    assert shards[1]["1.weight"][1] == [(0, "col"), (1, "row")], "a weight cut both ways"
    merged = merge_checkpoint(path)
    assert set(merged) == set(plain)
    for key, value in plain.items():
        assert_close(merged[key], value, rtol=0, atol=0, msg=lambda m: f"merged {key}: {m}")
    for t, equal in enumerate(loaded_back):
        assert all(equal.values()), f"rank {t}: the merge loaded into the 2d layout is not my " \
                                    f"shard for {[k for k, same in equal.items() if not same]}"


def _draws() -> dict:
    """A few numbers from every generator a checkpoint restores (numpy's if installed)."""
    draws = {"torch": torch.rand(3).tolist(), "python": [random.random() for _ in range(3)]}
    if np is not None:
        draws["numpy"] = np.random.rand(3).tolist()
    return draws


def _rng_worker(rank, world_size, port, path):
    nc.launch({}, rank=rank, world_size=world_size, host="127.0.0.1", port=port)  # data x2
    seed = 100 + rank  # the ranks' streams differ (as augmentation / dropout streams may)
    torch.manual_seed(seed)
    random.seed(seed)
    if np is not None:
        np.random.seed(seed)
    model = nn.Linear(2, 2)
    _draws()  # the streams moved on before the save
    save_checkpoint(path, 0, model)
    after_save = _draws()
    _draws()  # and on again before the load
    info = load_checkpoint(path, model)  # the defaults: restore_rng=True
    return after_save, _draws(), info


def test_gloo_load_checkpoint_restores_each_ranks_own_rng_state(tmp_path):
    """Loading gives every data-parallel rank back the RNG state it saved: torch, python, numpy."""
    results = run_ranks(_rng_worker, 2, str(tmp_path / "ckpt.pt"), timeout=60)
    (save0, _, _), (save1, _, _) = results
    assert all(save0[k] != save1[k] for k in save0), "the ranks' streams differ"
    for rank, (after_save, after_load, info) in enumerate(results):
        for kind, drawn in after_load.items():
            whose = [r for r, (saved, _, _) in enumerate(results) if saved[kind] == drawn]
            source = f"rank {whose[0]}" if whose else "no rank"
            assert drawn == after_save[kind], (
                f"rank {rank}: {kind} draws after load_checkpoint are not those right after the "
                f"save; they are {source}'s")
        assert info["epoch"] == 0


def test_merge_checkpoint_reads_only_the_newest_save_of_that_name(tmp_path):
    """A stale single-process ckpt.pt beside newer per-stage files, and other saves whose names
    share the prefix (ckpt-best.pt, ckpt-old-stage0.pt), are not part of the save."""
    def stage(rank, value):
        return {"model": {f"{rank}.weight": torch.full((2,), value)},
                "pipeline": {"rank": rank, "size": 2}, "save_id": "new"}
    checkpoint.atomic_save({"model": {"0.weight": torch.zeros(2)}}, tmp_path / "ckpt.pt")
    for name in ("ckpt-best.pt", "ckpt-old-stage0.pt"):
        checkpoint.atomic_save({"model": {"9.weight": torch.zeros(2)}}, tmp_path / name)
    time.sleep(0.01)  # the per-stage files are written later
    checkpoint.atomic_save(stage(0, 1.0), tmp_path / "ckpt-stage0.pt")
    checkpoint.atomic_save(stage(1, 2.0), tmp_path / "ckpt-stage1.pt")
    merged = merge_checkpoint(tmp_path / "ckpt.pt")
    assert set(merged) == {"0.weight", "1.weight"} and torch.equal(merged["0.weight"],
                                                                 torch.ones(2))
    time.sleep(0.01)  # now the single-process save is the newest
    checkpoint.atomic_save({"model": {"0.weight": torch.zeros(2)}}, tmp_path / "ckpt.pt")
    assert set(merge_checkpoint(tmp_path / "ckpt.pt")) == {"0.weight"}


def _layout_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nc.nn.Linear(8, 8), nc.nn.Linear(8, 8))


def _layout_saver(rank, world_size, port, parallel, path):
    nc.launch({"parallel": parallel}, rank=rank, world_size=world_size, host="127.0.0.1",
              port=port)
    model = _layout_model(seed=0)
    stage = build_pipeline_model(model, partition="uniform") if gpc.pipeline_size > 1 else model
    save_checkpoint(path, 0, stage, step=1)


def _layout_loader(rank, world_size, port, parallel, path, resume=False):
    """Load another layout's checkpoint (directly, or as a resume does): the error, then the way
    across it names."""
    nc.launch({"parallel": parallel}, rank=rank, world_size=world_size, host="127.0.0.1",
              port=port)
    model = _layout_model(seed=1)
    try:
        if resume:  # never a silent fresh start because this layout's file names are absent
            assert nc.Progress().resume(path, model), "resume found nothing to resume"
        else:
            load_checkpoint(path, model)
        return "loaded", None
    except Exception as e:  # noqa: BLE001 -- the test reports whatever it was
        error = f"{type(e).__name__}: {e}"
    load_plain_state_dict(model, merge_checkpoint(path))
    saved = _layout_model(seed=0)
    return error, all(torch.equal(p, q) for p, q in zip(model.parameters(), saved.parameters()))


CHANGES = [  # (saved parallel, world, saved as, job's parallel, world, job runs)
    ({"tensor": {"size": 2, "mode": "1d"}}, 2, "pipeline 1, tensor 1d x2",
     {"tensor": {"size": 4, "mode": "2d"}}, 4, "pipeline 1, tensor 2d x4"),
    ({"tensor": {"size": 4, "mode": "1d"}}, 4, "pipeline 1, tensor 1d x4",
     {"tensor": {"size": 4, "mode": "2d"}}, 4, "pipeline 1, tensor 2d x4"),
    ({"pipeline": 2}, 2, "pipeline 2, no tensor parallelism",
     {"tensor": {"size": 2, "mode": "1d"}}, 2, "pipeline 1, tensor 1d x2"),
]


@pytest.mark.parametrize("saved_parallel, saved_world, saved_as, parallel, world, runs", CHANGES,
                         ids=["1d x2 -> 2d x4", "1d x4 -> 2d x4", "pipeline 2 -> 1d x2"])
@pytest.mark.parametrize("resume", [False, True], ids=["load_checkpoint", "resume"])
def test_deep_loading_another_layouts_checkpoint_names_both_layouts_and_the_way_across(
        tmp_path, saved_parallel, saved_world, saved_as, parallel, world, runs, resume):
    path = str(tmp_path / "ckpt.pt")
    run_ranks(_layout_saver, saved_world, saved_parallel, path, timeout=60)
    for rank, (error, converted) in enumerate(run_ranks(_layout_loader, world, parallel, path,
                                                        resume, timeout=60)):
        assert error.startswith(f"ConfigError: [rank {rank}] "), error  # a user error: one line
        assert f"saved under {saved_as}, but this job runs {runs}" in error, error
        assert f"merge_checkpoint({path!r})" in error and "load_plain_state_dict" in error, error
        assert converted, "merge_checkpoint + load_plain_state_dict loads the saved model"


def _stale_loader(rank, world_size, port, parallel, path):
    nc.launch({"parallel": parallel}, rank=rank, world_size=world_size, host="127.0.0.1",
              port=port)
    model = _layout_model(seed=1)
    stage = build_pipeline_model(model, partition="uniform") if gpc.pipeline_size > 1 else model
    try:
        return load_checkpoint(path, stage)
    except ConfigError as e:
        return str(e)


@pytest.mark.parametrize("older, newer", [({"pipeline": 2}, {}), ({}, {"pipeline": 2})],
                         ids=["pipeline files, then one file", "one file, then pipeline files"])
def test_gloo_load_checkpoint_refuses_a_save_older_than_another_layouts_at_that_path(
        tmp_path, older, newer):
    """Two layouts saved to one path write files of other names; merge_checkpoint reads the
    newer save. load_checkpoint in the older save's layout finds its own files too, and must
    not resume that older run without a word: it says which save is newer and the way to it."""
    path = str(tmp_path / "ckpt.pt")
    run_ranks(_layout_saver, 2, older, path, timeout=60)
    time.sleep(0.01)  # (file times order the saves)
    run_ranks(_layout_saver, 2, newer, path, timeout=60)
    for rank, message in enumerate(run_ranks(_stale_loader, 2, older, path, timeout=60)):
        assert isinstance(message, str) and message.startswith(f"[rank {rank}] "), message
        assert "by another layout after" in message and "merge_checkpoint" in message, message
    assert run_ranks(_stale_loader, 2, newer, path, timeout=60)[0]["step"] == 1  # its own: loads


def _save(engine, path):
    try:
        save_checkpoint(path, 0, engine.model, engine.optimizer)
        return "saved"
    except ConfigError as e:
        return str(e)


def _mid_group_saver(rank, world_size, port, config, path):
    """Micro-step 0 of a group of 2 (a pipeline: its batch's schedule) and save; the step and
    save: the two messages."""
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    model = _layout_model(seed=0)
    if gpc.pipeline_size > 1:
        model = build_pipeline_model(model, partition="uniform")
    engine, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               nn.MSELoss(), verbose=False)
    if gpc.pipeline_size > 1:  # the schedule runs the backwards; engine.step() ends the group
        engine.execute_schedule((torch.randn(4, 8), torch.zeros(4, 8)))
        said = [_save(engine, path)]
        engine.step()
        return said + [_save(engine, path)]
    said = []
    for micro in range(2):
        engine.zero_grad()
        engine.backward(engine.criterion(engine(torch.randn(2, 8)), torch.zeros(2, 8)))
        engine.step()  # micro-step 0: no optimizer step yet
        said.append(_save(engine, path))
    return said


@pytest.mark.parametrize("config", [
    {"gradient_accumulation": 2}, {"gradient_accumulation": 2, "zero": {"level": 2}},
    {"gradient_accumulation": 2, "zero": {"level": 3}},
    {"parallel": {"pipeline": 2}, "NUM_MICRO_BATCHES": 2}],
    ids=["ddp", "zero2", "zero3", "pipeline, between execute_schedule and step"])
def test_gloo_save_checkpoint_in_the_middle_of_an_accumulation_group_is_refused(tmp_path, config):
    """The gradients of an open group live in no file: resumed, the run would mix micro-steps
    of two steps. Every rank refuses the save, saying when to save; after the step it saves."""
    for rank, (mid, after) in enumerate(run_ranks(_mid_group_saver, 2, config,
                                                  str(tmp_path / "ckpt.pt"), timeout=60)):
        assert mid.startswith(f"[rank {rank}] checkpoint requested in the middle of a gradient "
                              f"accumulation group"), mid
        assert after == "saved"


def _refused_batch_saver(rank, world_size, port, path):
    """A batch the schedule refuses before any backward, then a save: the message (or none)."""
    nc.launch({"parallel": {"pipeline": 2}, "NUM_MICRO_BATCHES": 4}, rank=rank,
              world_size=world_size, host="127.0.0.1", port=port)
    stage = build_pipeline_model(_layout_model(seed=0), partition="uniform")
    engine, *_ = nc.initialize(stage, torch.optim.SGD(stage.parameters(), lr=0.1), nn.MSELoss(),
                               verbose=False)
    with pytest.raises(ValueError, match="smaller than NUM_MICRO_BATCHES=4"):
        engine.execute_schedule((torch.randn(1, 8), torch.zeros(1, 8)))
    return _save(engine, path), bool(engine.step())


def test_gloo_a_batch_the_schedule_refuses_opens_no_group(tmp_path):
    """No backward ran, so no gradient is lost: the save is taken, and no step follows."""
    assert run_ranks(_refused_batch_saver, 2, str(tmp_path / "ckpt.pt")) == [("saved", False)] * 2


class _RunsCode:
    """What a malicious checkpoint holds: unpickling it runs a shell command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def test_a_checkpoint_that_would_run_code_when_loaded_is_refused_unless_trusted(tmp_path):
    path, marker = tmp_path / "ckpt.pt", tmp_path / "code-ran"
    save_checkpoint(path, 0, nn.Linear(2, 2), note=_RunsCode(marker))  # in **extra
    system = re.escape(f"{os.system.__module__}.{os.system.__name__}")
    for load in (lambda: load_checkpoint(path, nn.Linear(2, 2)), lambda: merge_checkpoint(path),
                 lambda: merge_pipeline_checkpoint([path]),
                 lambda: checkpoint.merge_tensor_parallel([path])):
        with pytest.raises(pickle.UnpicklingError, match=rf"{system}.*trusted=True"):
            load()
        assert not marker.exists(), "the file's code ran"
    # the explicit opt-in for a file you trust unpickles it as it is: here, running its code
    assert load_checkpoint(path, nn.Linear(2, 2), trusted=True)["epoch"] == 0
    assert marker.exists()
    marker.unlink()
    assert set(merge_checkpoint(path, trusted=True)) == {"weight", "bias"} and marker.exists()


def test_merge_checkpoint_after_a_layout_change_ignores_the_older_layouts_files(tmp_path):
    """A pipeline-4 save, then a pipeline-2 save to the same name: stage2/3 of the first are
    still there, beside the second's stage0/1. The merge is the newest save's."""
    def save(stages, value, save_id):
        for rank in range(stages):
            checkpoint.atomic_save({"model": {f"{rank}.weight": torch.full((2,), value)},
                                    "pipeline": {"rank": rank, "size": stages},
                                    "save_id": save_id}, tmp_path / f"ckpt-stage{rank}.pt")
    save(4, 0.0, "pipeline 4")
    time.sleep(0.01)
    save(2, 1.0, "pipeline 2")
    merged = merge_checkpoint(tmp_path / "ckpt.pt")
    assert sorted(merged) == ["0.weight", "1.weight"]
    assert all(torch.equal(v, torch.ones(2)) for v in merged.values())


def _cpu_half_worker(rank, world_size, port, path, other):
    """fp16 on a CPU without a dtype: save, then load as a run on another kind of CPU would."""
    nc.launch({"fp16": {"mode": AMP_TYPE.TORCH}}, rank=rank, world_size=world_size,
              host="127.0.0.1", port=port)
    model = nn.Linear(4, 2)
    engine, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               nn.MSELoss(), verbose=False)
    save_checkpoint(path, 0, engine.model, engine.optimizer)
    saved = checkpoint.read_file(path, "cpu")["cpu_half"]
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logger = nc.get_dist_logger()._logger
    logger.addHandler(handler)
    load_checkpoint(path, engine.model, engine.optimizer)  # the same CPU: nothing to say
    nc.cpu_half._cache["dtype"] = other  # this run decided otherwise (another CPU)
    load_checkpoint(path, engine.model, engine.optimizer)
    logger.removeHandler(handler)
    return saved, warnings


def test_deep_a_checkpoint_records_the_cpu_half_type_and_a_resume_on_another_warns(tmp_path):
    """fp16 on a CPU computes in bf16 or float32 by the CPU's instructions (cpu_half.py): the
    checkpoint stores which, and loading it where the choice differs says so and how to pin it."""
    native = nc.cpu_half.has_bf16_instructions()
    other = None if native else torch.bfloat16
    [(saved, warnings)] = run_ranks(_cpu_half_worker, 1, tmp_path / "c.pt", other, timeout=60)
    assert saved == ("bfloat16" if native else "float32")
    assert len(warnings) == 1 and f"computed in {saved}" in warnings[0] and \
        "set fp16=dict(..., dtype='bfloat16')" in warnings[0], warnings
