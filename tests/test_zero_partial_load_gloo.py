"""Loading a ZeRO checkpoint, each rank reads only the piece files that hold its own shard
(zero/load.py) -- and what it loads is exactly what the plain route (every file merged into
whole tensors) gives, and training goes on as one process would.

Every rank computes on the same whole batch, so a job of any data size takes the same steps as
one process: a save by N ranks resumed by M ranks must continue bit-for-bit (fp32, 1e-6).
"""
import copy
import math

import pytest
import torch
from dist_helpers import run_ranks
from torch import nn
from torch.testing import assert_close

import nanocolossal as nc
import nanocolossal.checkpoint_files as checkpoint_files
import nanocolossal.checkpoint_merge as checkpoint_merge
from nanocolossal.checkpoint import (
    load_checkpoint,
    load_optimizer_state,
    merge_checkpoint,
    read_file,
    save_checkpoint,
)

pytestmark = pytest.mark.timeout(120)
SIZES = [(5, 7), (7, 3)]  # two Linear layers: 42 + 24 parameters (levels 1-2: one buffer of 66)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(*SIZES[0]), nn.Tanh(), nn.Linear(*SIZES[1]))


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.05)


def _batch(step):
    g = torch.Generator().manual_seed(300 + step)
    return torch.randn(6, 5, generator=g), torch.randint(0, 3, (6,), generator=g)


def _steps(engine, first, last):
    for step in range(first, last):
        x, y = _batch(step)
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))
        engine.step()


def _job(rank, world_size, port, level, path, load, first, last, save):
    nc.launch({"zero": {"level": level}}, rank=rank, world_size=world_size, host="127.0.0.1",
              port=port)
    model = _model()
    engine, *_ = nc.initialize(model, _adamw(model), nn.CrossEntropyLoss(), verbose=False)
    read, loaded = [], None
    if load:
        plain_read = checkpoint_files.read_file

        def recording(file, *args, **kwargs):  # every ZeRO piece file this rank opens
            read.append(int(str(file).rsplit("-zero", 1)[1].split(".")[0]))
            return plain_read(file, *args, **kwargs)
        readers = (checkpoint_files, checkpoint_merge)  # my pieces / the plain route
        for module in readers:
            module.read_file = recording
        try:
            load_checkpoint(path, engine.model, engine.optimizer)
        finally:
            for module in readers:
                module.read_file = plain_read
        loaded = copy.deepcopy(engine.optimizer.state_dict()), {k: v.detach().clone() for k, v in
                                                 engine.model.state_dict().items()}
    _steps(engine, first, last)
    if save:
        save_checkpoint(path, last, engine.model, engine.optimizer)
    return sorted(read), loaded, {k: v.detach().clone() for k, v in
                                  engine.model.state_dict().items()}


def _one_process(steps):
    model = _model()
    opt = _adamw(model)
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model.state_dict()


def _expected_files(level, saved_by, loaded_by, rank):
    """The files holding elements of my shard, by arithmetic: each flat buffer (levels 1-2:
    all 66 parameters; level 3: one per Linear) padded into equal shards."""
    buffers = [sum(i * o + o for i, o in SIZES)] if level < 3 else [i * o + o for i, o in SIZES]
    files = set()
    for n in buffers:
        mine, theirs = math.ceil(n / loaded_by), math.ceil(n / saved_by)
        lo, hi = rank * mine, min((rank + 1) * mine, n)
        files |= {q for q in range(saved_by) if max(lo, q * theirs) < min(hi, (q + 1) * theirs)}
    return sorted(files)


@pytest.mark.parametrize("level", [1, 2, 3])
@pytest.mark.parametrize("saved_by, loaded_by", [(2, 2), (4, 2), (2, 4), (4, 1)],
                         ids=["2-to-2", "4-to-2", "2-to-4", "4-to-1"])
def test_gloo_zero_load_reads_only_the_piece_files_holding_my_shard(tmp_path, level, saved_by,
                                                                   loaded_by):
    path = str(tmp_path / "ckpt.pt")
    run_ranks(_job, saved_by, level, path, False, 0, 2, True, timeout=60)
    results = run_ranks(_job, loaded_by, level, path, True, 2, 3, False, timeout=60)
    plain_opt, plain_model = load_optimizer_state(path), merge_checkpoint(path)
    expected = _one_process(3)
    for rank, (read, (opt_state, model_state), after) in enumerate(results):
        assert read == _expected_files(level, saved_by, loaded_by, rank), (rank, read)
        if saved_by == loaded_by:
            assert read == [rank]  # a resume: my own file, nobody else's
        assert_close(opt_state["optimizer"], plain_opt["optimizer"], rtol=0, atol=0)
        assert_close(model_state, plain_model, rtol=0, atol=0)
        assert_close(after, expected, rtol=0, atol=1e-6)  # and it trains on as one process
    assert sorted({q for read, *_ in results for q in read}) == list(range(saved_by))


def test_gloo_zero3_save_without_the_pieces_list_loads_by_merging_every_file(tmp_path):
    """A save older than the list of pieces (or one that lost it) takes the plain route:
    every rank reads every file, and resumes exactly as well."""
    path = str(tmp_path / "ckpt.pt")
    run_ranks(_job, 2, 3, path, False, 0, 2, True, timeout=60)
    stage = read_file(path, "cpu")
    del stage["optimizer"]["pieces"]
    torch.save(stage, path)
    expected = _one_process(3)
    for read, _, after in run_ranks(_job, 2, 3, path, True, 2, 3, False, timeout=60):
        assert read == [0, 1]
        assert_close(after, expected, rtol=0, atol=1e-6)


def _load_only(rank, world_size, port, level, path):
    nc.launch({"zero": {"level": level}}, rank=rank, world_size=world_size, host="127.0.0.1",
              port=port)
    model = _model()
    engine, *_ = nc.initialize(model, _adamw(model), nn.CrossEntropyLoss(), verbose=False)
    load_checkpoint(path, engine.model, engine.optimizer)


@pytest.mark.parametrize("level", [2, 3])
def test_gloo_zero_piece_file_missing_a_piece_is_an_error_naming_what_lacks(tmp_path, level):
    path = str(tmp_path / "ckpt.pt")
    run_ranks(_job, 2, level, path, False, 0, 2, True, timeout=60)
    piece_file = tmp_path / "ckpt-zero1.pt"
    pieces = read_file(piece_file, "cpu")
    index, parts = next(iter(pieces["state"].items()))
    lo, hi, state = parts[0]
    parts[0] = (lo, hi - 1, {k: v[:-1] if v.dim() else v for k, v in state.items()})
    torch.save(pieces, piece_file)
    with pytest.raises(AssertionError, match=r"rank 1.*ckpt-zero1.pt.*hold .* of the .* "
                                             r"elements.*older checkpoint"):
        run_ranks(_load_only, 2, level, path, timeout=60)
