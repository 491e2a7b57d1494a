"""ZeRO checkpoints as one shard file per data rank (ckpt-zero{r}.pt beside
the stage's skeleton), attacked where they meet other features: a weight tied between two
children, buffers (BatchNorm running stats), a frozen parameter, AMP O2 (half segments), tensor 1d
(load_plain_state_dict into another layout), sequence parallelism, the Trainer's resume, a
second save with fewer data ranks over the same path (stale zero files), loading into a job
without ZeRO or at level 1, a save without an optimizer, and weights-only reading of the zero
files; then ZeRO checkpoints across layouts: a pipeline's files loaded into another data size
and level, tensor 1d x ZeRO 3 into another data size, the Trainer's resume under pipeline x
ZeRO 2. Each is compared with one process, or with the same job's in-memory (gathered) state.
"""
import pytest
import torch
from dist_helpers import launch_rank, run_ranks
from models import epoch_shards, tensor_model
from torch import nn
from torch.nn import functional as F
from torch.testing import assert_close
from torch.utils.data import TensorDataset
from zero_models import B, Net, grouped_adamw, train_engine, train_single
from zero_parallel_runs import (
    AMP_MODES,
    BF16,
    F64,
    GLOBAL,
    STEPS,
    check_states,
    cloned_state,
    one_process_sgd,
    pipeline_engine,
    pipeline_resume_worker,
    pipeline_save_worker,
    sgd,
    tied_batch,
    tied_model,
)

import nanocolossal as nc
import nanocolossal.nn as col_nn
from nanocolossal.amp import AMP_TYPE
from nanocolossal.checkpoint import (
    UnsafeCheckpointError,
    load_checkpoint,
    load_optimizer_state,
    load_plain_state_dict,
    merge_checkpoint,
    read_file,
    save_checkpoint,
)
from nanocolossal.context import gpc
from nanocolossal.tensor.base import slice_of
from nanocolossal.trainer import Trainer, hooks

pytestmark = pytest.mark.timeout(120)

N = 6  # samples per step: every rank computes on the whole batch (BatchNorm stats as one process)


class Tied(nn.Module):
    """A weight shared by two children (two state_dict keys, one parameter), BatchNorm buffers,
    a frozen parameter (requires_grad=False, not in the optimizer)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc, self.mid = nn.Linear(5, 5), nn.Linear(5, 5)
        self.dec = nn.Linear(5, 5, bias=False)
        self.dec.weight = self.enc.weight
        self.bn = nn.BatchNorm1d(5)
        self.frozen = nn.Parameter(torch.randn(5), requires_grad=False)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        h = torch.tanh(self.enc(x))
        h = self.bn(self.mid(h)) + self.frozen
        return self.head(torch.tanh(self.dec(h)))


def _adamw(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.02,
                             weight_decay=0.05)


def _data(step):
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(N, 5, generator=g), torch.randint(0, 3, (N,), generator=g)


def _single(steps):
    model = Tied()
    opt = _adamw(model)
    for step in range(steps):
        x, y = _data(step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model, opt


def _tied_worker(rank, world_size, port, config, path, load, first, last, save):
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    model = Tied()
    engine, *_ = nc.initialize(model, _adamw(model), nn.CrossEntropyLoss(), verbose=False)
    if load:
        assert load_checkpoint(path, engine.model, engine.optimizer)["epoch"] == first
    for step in range(first, last):
        x, y = _data(step)
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))
        assert engine.step()
    if save:
        save_checkpoint(path, last, engine.model, engine.optimizer)
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


def _save_tied(path, world_size=2, level=3, steps=3):
    return run_ranks(_tied_worker, world_size, {"zero": {"level": level}}, str(path), False, 0,
                     steps, True, timeout=60)


def test_gloo_zero3_tied_weight_buffers_and_frozen_param_checkpoint_is_one_process(tmp_path):
    path = tmp_path / "ckpt.pt"
    states = _save_tied(path)
    single, opt = _single(3)
    for state in states:
        assert_close(state, single.state_dict())
    on_disk = read_file(path, "cpu")
    assert list(on_disk["model"]) == list(single.state_dict())
    for key in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
        assert_close(on_disk["model"][key], single.state_dict()[key])  # buffers: in the file
    merged = merge_checkpoint(path)
    assert list(merged) == list(single.state_dict())
    assert_close(merged, single.state_dict())
    assert merged["enc.weight"] is merged["dec.weight"] or torch.equal(merged["enc.weight"],
                                                                        merged["dec.weight"])
    plain = _adamw(Tied())
    plain.load_state_dict(load_optimizer_state(path)["optimizer"])
    assert_close(plain.state_dict(), opt.state_dict())


RESUME_ANYWHERE = {  # the layouts that load one level-3 save of 2 ranks: (data size, config)
    "zero3-data2": (2, {"zero": {"level": 3}}), "zero3-data1": (1, {"zero": {"level": 3}}),
    "zero1-data2": (2, {"zero": {"level": 1}}), "plain-1": (1, {}), "plain-ddp2": (2, {})}


def test_deep_zero3_tied_checkpoint_resumes_anywhere_as_one_process(tmp_path):
    """One level-3 save on 2 ranks, loaded by each layout in turn: 2 more steps are one
    process's 5."""
    path = tmp_path / "ckpt.pt"
    _save_tied(path)
    expected, _ = _single(5)
    for name, (world_size, config) in RESUME_ANYWHERE.items():
        for rank, state in enumerate(run_ranks(_tied_worker, world_size, config, str(path), True,
                                               3, 5, False, timeout=60)):
            assert_close(state, expected.state_dict(), msg=lambda m: f"{name} rank {rank}: {m}")


# -- AMP O2 x ZeRO 3: half segments, fp32 masters; the file is the job's gathered state ------------

def _o2_worker(rank, world_size, port, path, load, first, last, save, level=3, dtype="bfloat16"):
    config = {"fp16": dict(mode=AMP_TYPE.NAIVE, dtype=dtype)}
    if level:
        config["zero"] = {"level": level}
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    model = Net()
    engine, *_ = nc.initialize(model, grouped_adamw(model), nn.CrossEntropyLoss(), verbose=False)
    if load:
        load_checkpoint(path, engine.model, engine.optimizer)
    g = torch.Generator().manual_seed(1)
    for step in range(last):  # every rank: the whole batch
        x, y = torch.randn(4, 6, generator=g), torch.randint(0, 5, (4,), generator=g)
        if step < first:
            continue
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))
        engine.step()
    if save:
        save_checkpoint(path, last, engine.model, engine.optimizer)
    model_state = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    scaler = getattr(engine.optimizer, "scaler", None)
    return model_state, engine.optimizer.state_dict(), scaler and scaler.state_dict()


def test_deep_zero3_o2_checkpoint_is_the_gathered_state_and_resumes_exactly(tmp_path):
    path = tmp_path / "ckpt.pt"
    (model_state, opt_state, _), _ = run_ranks(_o2_worker, 2, str(path), False, 0, 2, True,
                                               timeout=60)
    assert all(v.dtype == torch.bfloat16 for v in model_state.values())
    merged = merge_checkpoint(path)
    assert all(v.dtype == torch.bfloat16 for v in merged.values()), {
        k: v.dtype for k, v in merged.items()}
    assert_close(merged, model_state, rtol=0, atol=0)
    saved = load_optimizer_state(path)
    assert_close(saved["optimizer"], opt_state["optimizer"], rtol=0, atol=0)
    assert_close(saved["masters"], opt_state["masters"], rtol=0, atol=0)
    straight = run_ranks(_o2_worker, 2, None, False, 0, 3, False, timeout=60)[0][0]
    for world_size in (2, 1):
        resumed = run_ranks(_o2_worker, world_size, str(path), True, 2, 3, False, timeout=60)
        assert_close(resumed[0][0], straight, rtol=0, atol=0)


def test_deep_zero3_fp16_o2_checkpoint_loads_into_plain_o2_and_level1(tmp_path):
    """fp16 O2 (a loss scaler) at level 3 on 2 ranks, 2 steps, saved; resumed for step 3 in a
    job without ZeRO (one process) and at level 1 (2 ranks): the straight level-3 run's
    parameters and loss scale."""
    path = str(tmp_path / "ckpt.pt")
    run_ranks(_o2_worker, 2, path, False, 0, 2, True, 3, "float16", timeout=60)
    straight, _, scale = run_ranks(_o2_worker, 2, None, False, 0, 3, False, 3, "float16",
                                   timeout=60)[0]
    for world_size, level in ((1, None), (2, 1)):
        ours, _, our_scale = run_ranks(_o2_worker, world_size, path, True, 2, 3, False, level,
                                       "float16", timeout=60)[0]
        assert_close(ours, straight, rtol=0, atol=1e-3, msg=lambda m: f"level {level}: {m}")
        assert our_scale == scale, level


# -- stale zero files: a second save with fewer data ranks over the same path ---------------------

def test_deep_zero3_second_save_with_fewer_data_ranks_ignores_stale_zero_files(tmp_path):
    path = tmp_path / "ckpt.pt"
    _save_tied(path, world_size=4, steps=2)
    assert (tmp_path / "ckpt-zero3.pt").is_file()
    _save_tied(path, world_size=2, steps=3)
    single, opt = _single(3)
    assert_close(merge_checkpoint(path), single.state_dict())
    plain = _adamw(Tied())
    plain.load_state_dict(load_optimizer_state(path)["optimizer"])
    assert_close(plain.state_dict(), opt.state_dict())
    expected, _ = _single(5)
    for state in run_ranks(_tied_worker, 4, {"zero": {"level": 3}}, str(path), True, 3, 5,
                           False, timeout=60):
        assert_close(state, expected.state_dict())


def test_deep_zero2_save_over_a_zero3_save_with_more_ranks(tmp_path):
    """Level 3 on 4 ranks, then level 2 on 2 ranks (no param segments) over the same path."""
    path = tmp_path / "ckpt.pt"
    _save_tied(path, world_size=4, steps=2)
    _save_tied(path, world_size=2, level=2, steps=3)
    single, opt = _single(3)
    assert_close(merge_checkpoint(path), single.state_dict())
    expected, _ = _single(5)
    for state in run_ranks(_tied_worker, 2, {"zero": {"level": 3}}, str(path), True, 3, 5,
                           False, timeout=60):
        assert_close(state, expected.state_dict())


# -- no optimizer under level 3: the model must still be whole -----------------------------------

def _model_only_worker(rank, world_size, port, path, load):
    nc.launch({"zero": {"level": 3}}, rank=rank, world_size=world_size, host="127.0.0.1",
              port=port)
    model = Tied()
    engine, *_ = nc.initialize(model, _adamw(model), nn.CrossEntropyLoss(), verbose=False)
    if load:
        load_checkpoint(path, engine.model)
    else:
        x, y = _data(0)
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))
        engine.step()
        save_checkpoint(path, 1, engine.model)
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


def test_deep_zero3_save_without_optimizer_keeps_the_whole_model(tmp_path):
    path = tmp_path / "ckpt.pt"
    saved = run_ranks(_model_only_worker, 2, str(path), False, timeout=60)[0]
    single, _ = _single(1)
    assert_close(saved, single.state_dict())
    on_disk = read_file(path, "cpu")
    assert all(v is not None for v in on_disk["model"].values())
    assert_close(merge_checkpoint(path), single.state_dict())
    for state in run_ranks(_model_only_worker, 2, str(path), True, timeout=60):
        assert_close(state, single.state_dict())


# -- weights-only reading holds for the zero files ------------------------------------------------

class Evil:
    def __reduce__(self):
        return (print, ("a zero file ran code",))


def test_deep_zero3_zero_files_are_read_weights_only(tmp_path):
    path = tmp_path / "ckpt.pt"
    _save_tied(path)
    zero1 = tmp_path / "ckpt-zero1.pt"
    segments = torch.load(zero1, weights_only=True)
    segments["evil"] = Evil()
    torch.save(segments, zero1)
    with pytest.raises(UnsafeCheckpointError):
        load_optimizer_state(path)
    with pytest.raises(UnsafeCheckpointError):
        merge_checkpoint(path)
    single, _ = _single(3)
    assert_close(merge_checkpoint(path, trusted=True), single.state_dict())


# -- tensor 1d x ZeRO 3: merged, then load_plain_state_dict into other layouts -----------------

def _tensor_worker(rank, world_size, port, parallel, path, plain):
    config = {"zero": {"level": 3}}
    if parallel:
        config["parallel"] = {"tensor": parallel}
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    model = tensor_model()
    engine, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               col_nn.CrossEntropyLoss(), verbose=False)
    if plain is None:
        g = torch.Generator().manual_seed(3)
        x, y = torch.randn(8, 1, 4, 4, generator=g), torch.randint(0, 3, (8,), generator=g)
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))
        engine.step()
        save_checkpoint(path, 1, engine.model, engine.optimizer)
    else:
        load_plain_state_dict(engine.model, plain)
    splits = {k: getattr(p, "tensor_splits", []) for k, p in
              nc.checkpoint.strip_prefixes(engine.model.state_dict(keep_vars=True)).items()}
    state = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    if plain is not None:  # my slice of the plain model, whole (gathered) in memory
        for key, value in state.items():
            assert_close(value, slice_of(plain[key], splits[key]),
                         msg=lambda m: f"[rank {rank}] {key}: {m}")
    return state


def test_deep_zero3_tensor1d_merged_loads_plain_into_another_zero3_layout(tmp_path):
    """1d x2 x data 2 at level 3: saved, merged; load_plain_state_dict of the merged state into
    a level-3 job of the same layout (each rank's state as it was saved), of data 4, of 2d x4."""
    path = tmp_path / "ckpt.pt"
    saved = run_ranks(_tensor_worker, 4, {"size": 2, "mode": "1d"}, str(path), None, timeout=60)
    merged = merge_checkpoint(path)
    for target in ({"size": 2, "mode": "1d"}, None, {"size": 4, "mode": "2d"}):
        loaded = run_ranks(_tensor_worker, 4, target, str(path), merged, timeout=60)
        if target == {"size": 2, "mode": "1d"}:
            for rank in range(4):
                assert_close(loaded[rank], saved[rank])


# -- the Trainer's SaveCheckpointHook + resume under ZeRO 3 ------------------------------------

def _trainer_worker(rank, world_size, port, path, max_steps, resume):
    nc.launch({"zero": {"level": 3}}, rank=rank, world_size=world_size, host="127.0.0.1",
              port=port)
    model = Net()
    engine, *_ = nc.initialize(model, grouped_adamw(model), nn.CrossEntropyLoss(), verbose=False)
    g = torch.Generator().manual_seed(9)
    data = TensorDataset(torch.randn(24, 6, generator=g), torch.randint(0, 5, (24,), generator=g))
    train = nc.get_dataloader(data, shuffle=True, seed=7, batch_size=4)
    trainer = Trainer(engine)
    if resume:
        assert trainer.resume(path)
    trainer.fit(train, epochs=2, max_steps=max_steps, hooks=[hooks.SaveCheckpointHook(path)])
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


def test_deep_zero3_trainer_stopped_and_resumed_equals_uninterrupted(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    straight = run_ranks(_trainer_worker, 2, str(tmp_path / "straight.pt"), None, False,
                         timeout=60)[0]
    run_ranks(_trainer_worker, 2, path, 4, False, timeout=60)  # 3 steps an epoch: stops mid-epoch 2
    for state in run_ranks(_trainer_worker, 2, path, None, True, timeout=60):
        assert_close(state, straight)
    # the uninterrupted run's final save merges to its model
    assert_close(merge_checkpoint(tmp_path / "straight.pt"), straight)


# -- every allowed optimizer's states (RMSprop centered + momentum, Adagrad, Adam amsgrad) --------

OPTIMIZERS = {
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.9, centered=True),
    # Adagrad fills its state in its constructor (it was refused as "already stepped" before)
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05, lr_decay=0.01),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=0.02, amsgrad=True),
}


def _opt_worker(rank, world_size, port, name, path, load, first, last):
    nc.launch({"zero": {"level": 3}}, rank=rank, world_size=world_size, host="127.0.0.1",
              port=port)
    model = Net()
    engine, *_ = nc.initialize(model, OPTIMIZERS[name](model.parameters()),
                               nn.CrossEntropyLoss(), verbose=False)
    if load:
        load_checkpoint(path, engine.model, engine.optimizer)
    train_engine(engine, last - first, rank, world_size, 1, first=first)
    if not load:
        save_checkpoint(path, last, engine.model, engine.optimizer)
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_deep_zero3_optimizer_states_round_trip_as_one_process(tmp_path, name):
    path = str(tmp_path / "ckpt.pt")
    run_ranks(_opt_worker, 2, name, path, False, 0, 2, timeout=60)
    single = Net()
    opt = OPTIMIZERS[name](single.parameters())
    train_single(single, opt, 2, n=2 * B)
    plain = OPTIMIZERS[name](Net().parameters())
    plain.load_state_dict(load_optimizer_state(path)["optimizer"])
    assert_close(plain.state_dict(), opt.state_dict())
    train_single(single, opt, 1, first=2, n=4 * B)
    for state in run_ranks(_opt_worker, 4, name, path, True, 2, 3, timeout=60):
        assert_close(state, single.state_dict())


# -- ZeRO 1/2 under a pipeline: files per stage x data rank; each stage's optimizer state ---------

def test_deep_zero_x_pipeline_stage_files_hold_each_stages_optimizer_state(tmp_path):
    """pipeline 2 x data 2 at ZeRO level 1 and 2 vs pipeline 2 x data 1 without ZeRO (the same
    global batch): per stage, the merged optimizer state (momentum) and merge_checkpoint agree."""
    plain = tmp_path / "plain" / "plain.pt"
    run_ranks(pipeline_save_worker, 2, {}, str(plain), 2, timeout=60)
    assert sorted(p.name for p in plain.parent.iterdir()) == ["plain-stage0.pt", "plain-stage1.pt"]
    for level in (1, 2):
        zero = tmp_path / f"zero{level}" / "zero.pt"
        run_ranks(pipeline_save_worker, 4, {"zero": {"level": level}}, str(zero), 2, timeout=60)
        names = sorted(p.name for p in zero.parent.iterdir())
        expected = [f"zero-stage{p}{z}.pt" for p in (0, 1) for z in ("", "-zero0", "-zero1")]
        assert names == sorted(expected), (level, names)
        assert_close(merge_checkpoint(zero), merge_checkpoint(plain), **F64)
        for stage in (0, 1):
            ours = load_optimizer_state(zero.parent / f"zero-stage{stage}.pt")["optimizer"]
            theirs = load_optimizer_state(plain.parent / f"plain-stage{stage}.pt")["optimizer"]
            assert sorted(ours["state"]) == sorted(theirs["state"]), level
            for i, entry in theirs["state"].items():
                assert_close(ours["state"][i]["momentum_buffer"], entry["momentum_buffer"],
                             **F64, msg=lambda m: f"level {level} stage {stage} {i}: {m}")


# -- a zero-size parameter under level 3: no rank holds a segment of it ----------------------------

class WithEmpty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(5, 3)
        self.empty = nn.Parameter(torch.zeros(0, 5))  # e.g. a table sized by a config of 0

    def forward(self, x):
        return self.a(x) + self.empty.sum()


def _empty_worker(rank, world_size, port, path, load):
    nc.launch({"zero": {"level": 3}}, rank=rank, world_size=world_size, host="127.0.0.1",
              port=port)
    model = WithEmpty()
    engine, *_ = nc.initialize(model, torch.optim.AdamW(model.parameters(), lr=0.1),
                               nn.CrossEntropyLoss(), verbose=False)
    if load:
        load_checkpoint(path, engine.model, engine.optimizer)
    else:
        save_checkpoint(path, 0, engine.model, engine.optimizer)
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


def test_deep_zero3_zero_size_parameter_checkpoint_reads_back(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    saved = run_ranks(_empty_worker, 2, path, False, timeout=60)[0]
    assert_close(merge_checkpoint(path), saved)
    for state in run_ranks(_empty_worker, 2, path, True, timeout=60):
        assert_close(state, saved)


CLIP = 0.05


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


def _pipeline_trainer_worker(rank, world_size, port, level, path, max_steps, resume):
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


def _pipeline_trainer_one_process():
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
    after_each_step = _pipeline_trainer_one_process()
    path = str(tmp_path / "ckpt.pt")
    stopped = run_ranks(_pipeline_trainer_worker, 4, level, path, 2, False, timeout=60)
    check_states(stopped, after_each_step[1], F64)
    merged = merge_checkpoint(path)
    for key, value in after_each_step[1].items():
        assert_close(merged[key], value, msg=lambda m: f"merged {key}: {m}", **F64)
    resumed = run_ranks(_pipeline_trainer_worker, 4, level, path, None, True, timeout=60)
    check_states(resumed, after_each_step[-1], F64)


# -- pipeline 2 x data 2 x ZeRO 1/2 x bf16 O2 saved; resumed WITHOUT a pipeline, another level --

# tied_model's parameters in one process -> (stage, index among that stage's parameters) under
# partition [3, 5]; the tied table W is in both stages (same value, same momentum): stage 0's
STAGE_OF = [(0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (0, 5), (1, 0), (1, 1), (1, 3), (1, 4)]


def _unpipelined_resume_worker(rank, world_size, port, config, path):
    from zero_parallel_runs import GLOBAL as PGLOBAL  # (this file's GLOBAL is its own)

    from nanocolossal.checkpoint import (
        load_optimizer_state,
        load_plain_state_dict,
        merge_checkpoint,
        stage_path,
    )
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port, timeout=30)
    model = tied_model()
    engine, *_ = nc.initialize(model, sgd(model.parameters()), nn.CrossEntropyLoss(),
                               verbose=False)
    load_plain_state_dict(engine.model, merge_checkpoint(path))
    stages = [load_optimizer_state(stage_path(path, s)) for s in (0, 1)]
    params = list(model.parameters())
    state, masters = {}, []
    for i, (s, j) in enumerate(STAGE_OF):
        assert stages[s]["masters"][j].shape == params[i].shape, (i, s, j)
        masters.append(stages[s]["masters"][j])
        if j in stages[s]["optimizer"]["state"]:
            state[i] = stages[s]["optimizer"]["state"][j]
    group = {**stages[0]["optimizer"]["param_groups"][0], "params": list(range(len(params)))}
    engine.optimizer.load_state_dict({"optimizer": {"state": state, "param_groups": [group]},
                                      "masters": masters, "scaler": stages[0]["scaler"]})
    x, y = tied_batch(2, PGLOBAL, torch.float32)
    n = PGLOBAL // gpc.data_size
    mine = slice(gpc.data_rank * n, (gpc.data_rank + 1) * n)
    engine.zero_grad()
    engine.backward(engine.criterion(engine(x[mine]), y[mine]))
    assert engine.step()
    return cloned_state(engine.model), []


UNPIPELINED = [(1, 2, 2), (2, 2, 1), (2, 2, 3), (2, 1, 0)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("saved_level, world, level", UNPIPELINED,
                         ids=[f"zero{a}-to-data{b}-{'zero%d' % c if c else 'plain'}"
                              for a, b, c in UNPIPELINED])
def test_deep_pipeline_x_zero_x_o2_checkpoint_resumes_without_a_pipeline(tmp_path, saved_level,
                                                                         world, level):
    """Saved by pipeline 2 x data 2 (ZeRO saved_level, bf16 O2) after 2 steps; its merged model,
    each stage's plain optimizer state (momentum) and fp32 masters put together, loaded into a
    job with no pipeline (`world` data ranks, ZeRO `level`): its 3rd step is one process's."""
    states, _ = one_process_sgd(opt_level="O2")
    path = str(tmp_path / "ckpt.pt")
    fp16 = {"fp16": AMP_MODES["O2"]}
    run_ranks(pipeline_save_worker, 4, {**fp16, "zero": {"level": saved_level}}, path, 2,
              timeout=60)
    config = {**fp16, **({"zero": {"level": level}} if level else {})}
    results = run_ranks(_unpipelined_resume_worker, world, config, path, timeout=60)
    check_states(results, states[2], BF16)
