"""Loading a ZeRO checkpoint, each rank reads only the shard files that hold its own shard
(checkpoint/zero.py) -- and what it loads is exactly what the plain route (every file merged into
whole tensors) gives, and training goes on as one process would.

Every rank computes on the same whole batch, so a job of any data size takes the same steps as
one process: a save by N ranks resumed by M ranks must continue bit-for-bit (fp32, 1e-6).
"""
import copy
import math

import pytest
import torch
from dist_helpers import launch_rank, run_ranks
from torch import nn
from torch.nn import functional as F
from torch.testing import assert_close

import nanocolossal as nc
import nanocolossal.checkpoint.files as checkpoint_files
import nanocolossal.checkpoint.merge as checkpoint_merge
import nanocolossal.checkpoint.save_load as ckpt
import nanocolossal.checkpoint.zero as checkpoint_zero
from nanocolossal.amp import AMP_TYPE
from nanocolossal.checkpoint import (
    load_checkpoint,
    load_optimizer_state,
    merge_checkpoint,
    read_file,
    save_checkpoint,
)
from nanocolossal.context import gpc

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

        def recording(file, *args, **kwargs):  # every ZeRO shard file this rank opens
            read.append(int(str(file).rsplit("-zero", 1)[1].split(".")[0]))
            return plain_read(file, *args, **kwargs)
        readers = (checkpoint_zero, checkpoint_merge)  # my segments / the plain route
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


def test_gloo_zero_resume_reads_only_my_own_shard_file_and_trains_on_as_one_process(tmp_path):
    """The lesson: 2 ZeRO-2 ranks train 2 steps and save (each rank writes its shard file);
    2 ranks load it back. Each rank opens its own shard file only, loads exactly what
    merging every file gives, and a third step ends where one process's 3 steps end."""
    path = str(tmp_path / "ckpt.pt")
    run_ranks(_job, 2, 2, path, False, 0, 2, True, timeout=60)  # steps 0-1, then save
    merged = merge_checkpoint(path)  # the plain route: every shard file, whole tensors
    for rank, (read, (_, loaded), after) in enumerate(run_ranks(_job, 2, 2, path, True, 2, 3,
                                                                 False, timeout=60)):
        assert read == [rank], f"rank {rank} opened the shard files {read}"
        assert_close(loaded, merged, rtol=0, atol=0)
        assert_close(after, _one_process(3), rtol=0, atol=1e-6)


@pytest.mark.parametrize("level", [1, 2, 3])
def test_deep_zero_load_reads_only_the_shard_files_holding_my_shard(tmp_path, level):
    """Saved by 2 ranks: loaded by 2 (a resume) and 4; saved by 4: loaded by 2 and 1."""
    expected = _one_process(3)
    for saved_by, loads in ((2, (2, 4)), (4, (2, 1))):
        path = str(tmp_path / f"saved-by-{saved_by}.pt")
        run_ranks(_job, saved_by, level, path, False, 0, 2, True, timeout=60)
        plain_opt, plain_model = load_optimizer_state(path), merge_checkpoint(path)
        for loaded_by in loads:
            results = run_ranks(_job, loaded_by, level, path, True, 2, 3, False, timeout=60)
            for rank, (read, (opt_state, model_state), after) in enumerate(results):
                where = (saved_by, loaded_by, rank)
                assert read == _expected_files(level, saved_by, loaded_by, rank), (where, read)
                if saved_by == loaded_by:
                    assert read == [rank]  # a resume: my own file, nobody else's
                assert_close(opt_state["optimizer"], plain_opt["optimizer"], rtol=0, atol=0)
                assert_close(model_state, plain_model, rtol=0, atol=0)
                assert_close(after, expected, rtol=0, atol=1e-6)  # trains on as one process
            assert sorted({q for read, *_ in results for q in read}) == list(range(saved_by))


@pytest.mark.parametrize("listed_as, reads", [(None, "every file"), ("pieces", "its own")])
def test_deep_zero3_save_without_the_segments_list_merges_every_file_unless_named_pieces(
        tmp_path, listed_as, reads):
    """A save older than the list of segments (or one that lost it) takes the plain route:
    every rank reads every file, and resumes exactly as well. A save that lists them under their
    older name, "pieces", still reads only the files it needs."""
    path = str(tmp_path / "ckpt.pt")
    run_ranks(_job, 2, 3, path, False, 0, 2, True, timeout=60)
    stage = read_file(path, "cpu")
    segments = stage["optimizer"].pop("segments")
    if listed_as is not None:
        stage["optimizer"][listed_as] = segments
    torch.save(stage, path)
    expected = _one_process(3)
    for rank, (read, _, after) in enumerate(run_ranks(_job, 2, 3, path, True, 2, 3, False,
                                                      timeout=60)):
        assert read == ([0, 1] if reads == "every file" else [rank]), (reads, read)
        assert_close(after, expected, rtol=0, atol=1e-6)


def _load_only(rank, world_size, port, level, path):
    nc.launch({"zero": {"level": level}}, rank=rank, world_size=world_size, host="127.0.0.1",
              port=port)
    model = _model()
    engine, *_ = nc.initialize(model, _adamw(model), nn.CrossEntropyLoss(), verbose=False)
    load_checkpoint(path, engine.model, engine.optimizer)


@pytest.mark.parametrize("level", [2, 3])
def test_deep_zero_shard_file_missing_a_segment_is_an_error_naming_what_lacks(tmp_path, level):
    path = str(tmp_path / "ckpt.pt")
    run_ranks(_job, 2, level, path, False, 0, 2, True, timeout=60)
    shard_file = tmp_path / "ckpt-zero1.pt"
    segments = read_file(shard_file, "cpu")
    index, parts = next(iter(segments["state"].items()))
    lo, hi, state = parts[0]
    parts[0] = (lo, hi - 1, {k: v[:-1] if v.dim() else v for k, v in state.items()})
    torch.save(segments, shard_file)
    with pytest.raises(AssertionError, match=r"rank 1.*ckpt-zero1.pt.*hold .* of the .* "
                                             r"elements.*older checkpoint"):
        run_ranks(_load_only, 2, level, path, timeout=60)


# -- partial load x layouts, schedulers under ZeRO, level 3's unit-order check ------------------
# ZeRO checkpoints loaded segment by segment (checkpoint/zero.py), LR schedulers built on the user's
# optimizer before nc.initialize under ZeRO, and level 3's unit-order check
# (zero/sharded_model_checks.py).
#
# The partial load is compared with the library's plain route (complete_zero_state: every file
# merged, then cut) in the SAME job, same batches: the loaded optimizer state, the loaded model
# and the model after one more step must be identical. Schedulers and the unit-order check are
# compared with one process (float64).

GLOBAL = 8
F64 = {"rtol": 1e-9, "atol": 1e-11}
BF16_O2 = {"fp16": dict(mode=AMP_TYPE.NAIVE, dtype="bfloat16")}


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _mixed_batch(step, n=GLOBAL, dtype=torch.float32):
    g = torch.Generator().manual_seed(4100 + step)
    return torch.randn(n, 6, generator=g, dtype=dtype), torch.randint(0, 4, (n,), generator=g)


def _train(engine, first, last, dtype=torch.float32, sched=None, hook=None):
    accum = engine.gradient_accumulation
    n = GLOBAL // gpc.data_size // accum
    for step in range(first, last):
        if hook is not None:
            hook(step)
        x, y = _mixed_batch(step, dtype=dtype)
        for m in range(accum):
            lo = (m * gpc.data_size + gpc.data_rank) * n
            engine.train()
            engine.zero_grad()
            engine.backward(engine.criterion(engine(x[lo:lo + n]), y[lo:lo + n]))
            engine.step()
        if sched is not None:
            sched.step()


# == 1. partial load vs the plain route ============================================================

class LNNet(nn.Module):
    """Linear, LayerNorm (fp32 under O2: its own flat buffer), Linear: three level-3 units."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.norm, self.b = nn.Linear(6, 10), nn.LayerNorm(10), nn.Linear(10, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.norm(self.a(x))))


class Odd(nn.Module):
    """A tied weight (root unit), BatchNorm buffers, a frozen Linear, a zero-size parameter."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(6, 5)
        self.bn = nn.BatchNorm1d(5)
        self.frozen = nn.Linear(5, 5)
        self.frozen.requires_grad_(False)
        self.mid = nn.Linear(5, 5)
        self.out = nn.Linear(5, 5)
        self.mid.weight = self.out.weight  # tied between two children
        self.empty = nn.Parameter(torch.zeros(0))
        self.head = nn.Linear(5, 4)

    def forward(self, x):
        h = torch.tanh(self.bn(self.inp(x)))
        h = torch.tanh(self.mid(self.frozen(h)))
        return self.head(torch.tanh(self.out(h))) + self.empty.sum()


MODELS = {"ln": LNNet, "odd": Odd}


def _two_groups(model):
    named = [(n, p) for n, p in model.named_parameters()]
    weights = [p for n, p in named if n.endswith("weight")]
    rest = [p for n, p in named if not n.endswith("weight")]
    return torch.optim.AdamW([{"params": weights, "lr": 0.02, "weight_decay": 0.05},
                              {"params": rest, "lr": 0.05, "weight_decay": 0.0}], lr=0.01)


def _save_job(rank, world_size, port, config, name, path, steps):
    launch_rank(rank, world_size, port, config)
    model = MODELS[name]()
    engine, *_ = nc.initialize(model, _two_groups(model), nn.CrossEntropyLoss(), verbose=False)
    _train(engine, 0, steps)
    save_checkpoint(path, steps, engine.model, engine.optimizer)
    return None


def _routes_job(rank, world_size, port, config, name, path, first):
    """Load by the partial route, then by the plain route, into the same engine; after each,
    the loaded state and one more step."""
    launch_rank(rank, world_size, port, config)
    model = MODELS[name]()
    engine, *_ = nc.initialize(model, _two_groups(model), nn.CrossEntropyLoss(), verbose=False)
    real = ckpt.read_my_segments
    took = []

    def recording(*args, **kwargs):
        out = real(*args, **kwargs)
        took.append(out is not None)
        return out
    out = {}
    for route in ("partial", "plain"):
        ckpt.read_my_segments = recording if route == "partial" else (lambda *a, **k: None)
        try:
            load_checkpoint(path, engine.model, engine.optimizer)
        finally:
            ckpt.read_my_segments = real
        opt_state = copy.deepcopy(engine.optimizer.state_dict())
        loaded = _state(engine.model)
        groups = [{k: v for k, v in g.items() if k != "params"}
                  for g in engine.optimizer.param_groups]
        _train(engine, first, first + 1)
        out[route] = (opt_state, loaded, groups, _state(engine.model),
                      copy.deepcopy(engine.optimizer.state_dict()))
    return took, out


def _zcfg(level, extra):
    return {**extra, **({"zero": {"level": level}} if level else {})}


PARTIAL = [  # (model, saved by, level, loaded by, level, amp)
    ("ln", 2, 1, 4, 3, "bf16"), ("ln", 4, 3, 2, 3, "bf16"), ("ln", 1, 2, 2, 1, "bf16"),
    ("ln", 2, 3, 1, 3, "fp32"), ("ln", 2, 3, 2, 0, "bf16"), ("odd", 2, 3, 4, 3, "fp32"),
]


@pytest.mark.parametrize("name, n, l1, m, l2, amp", PARTIAL,
                         ids=[f"{a}-data{b}-zero{c}-to-data{d}-zero{e}-{f}"
                              for a, b, c, d, e, f in PARTIAL])
def test_deep_partial_load_equals_plain_route(tmp_path, name, n, l1, m, l2, amp):
    path = str(tmp_path / "ckpt.pt")
    extra = BF16_O2 if amp == "bf16" else {}
    run_ranks(_save_job, n, _zcfg(l1, extra), name, path, 2, timeout=90)
    results = run_ranks(_routes_job, m, _zcfg(l2, extra), name, path, 2, timeout=90)
    expect_partial = l2 >= 1 and not (l1 == 3 and l2 < 3)
    for rank, (took, out) in enumerate(results):
        assert took == ([expect_partial] if l2 else [False]), (rank, took)
        p, q = out["partial"], out["plain"]
        for what, a, b in zip(("optimizer", "model", "groups", "after", "opt after"), p, q):
            assert_close(a, b, rtol=0, atol=0, msg=lambda s: f"rank {rank} {what}: {s}")


# == 2. LR schedulers built on the user's optimizer before initialize ==============================

def _dmodel():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 7), nn.Tanh(),
                         nn.Linear(7, 4)).double()


def _dgroups(model):
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return torch.optim.AdamW([{"params": weights, "lr": 0.03, "weight_decay": 0.1},
                              {"params": biases, "lr": 0.08, "weight_decay": 0.0}], lr=0.01)


def _scheduler(kind, opt):
    from nanocolossal.nn.lr_scheduler import CosineAnnealingWarmupLR, LinearWarmupLR
    if kind == "linear":
        return LinearWarmupLR(opt, total_steps=5, warmup_steps=2)
    return CosineAnnealingWarmupLR(opt, total_steps=5, warmup_steps=2, eta_min=0.001)


def _flat(rows):
    return [x for row in rows for x in row]


def _set_wd(groups, step):
    if step == 2:  # by hand, between steps: weight decay up, the biases' lr pinned
        groups[0]["weight_decay"] = 0.4


def _sched_one_process(kind, steps, accum=1):
    model = _dmodel()
    opt = _dgroups(model)
    sched = _scheduler(kind, opt)
    lrs = []
    for step in range(steps):
        _set_wd(opt.param_groups, step)
        x, y = _mixed_batch(step, dtype=torch.float64)
        opt.zero_grad()
        n = GLOBAL // accum
        for m in range(accum):
            (F.cross_entropy(model(x[m * n:(m + 1) * n]), y[m * n:(m + 1) * n]) / accum).backward()
        opt.step()
        sched.step()
        lrs.append([g["lr"] for g in opt.param_groups])
    return _state(model), lrs


def _sched_job(rank, world_size, port, config, kind, first, last, load=None, save=None):
    launch_rank(rank, world_size, port, config)
    model = _dmodel()
    opt = _dgroups(model)
    sched = _scheduler(kind, opt)
    engine, _, _, sched = nc.initialize(model, opt, nn.CrossEntropyLoss(), lr_scheduler=sched,
                                        verbose=False)
    if load:
        load_checkpoint(load, engine.model, engine.optimizer, sched)
    lrs, inner = [], []

    def hook(step):  # through the engine's optimizer: the user's groups
        _set_wd(engine.optimizer.param_groups, step)
    accum = engine.gradient_accumulation
    n = GLOBAL // gpc.data_size // accum
    for step in range(first, last):
        hook(step)
        x, y = _mixed_batch(step, dtype=torch.float64)
        for m in range(accum):
            lo = (m * gpc.data_size + gpc.data_rank) * n
            engine.zero_grad()
            engine.backward(engine.criterion(engine(x[lo:lo + n]), y[lo:lo + n]))
            engine.step()
        sched.step()
        lrs.append([g["lr"] for g in opt.param_groups])
        inner_opt = getattr(engine.optimizer, "optimizer", None)
        inner.append([(g["lr"], g["weight_decay"]) for g in inner_opt.param_groups])
    if save:
        save_checkpoint(save, last, engine.model, engine.optimizer, sched)
    return _state(engine.model), lrs, inner


SCHED = [("linear", 1, 2), ("cosine", 2, 1), ("linear", 3, 2), ("cosine", 3, 1)]


@pytest.mark.parametrize("kind, level, accum", SCHED,
                         ids=[f"{k}-zero{lv}-accum{a}" for k, lv, a in SCHED])
def test_deep_zero_x_nanocolossal_warmup_scheduler_x_two_groups_x_hand_weight_decay(kind, level,
                                                                                    accum):
    expected, want_lrs = _sched_one_process(kind, 4, accum)
    config = {"zero": {"level": level}, "gradient_accumulation": accum}
    for rank, (state, lrs, inner) in enumerate(run_ranks(_sched_job, 2, config, kind, 0, 4,
                                                         timeout=60)):
        assert _flat(lrs) == pytest.approx(_flat(want_lrs), rel=1e-12), rank
        assert inner[-1][0][1] == 0.4  # the hand-set weight decay reached the inner optimizer
        for key, value in expected.items():
            assert_close(state[key], value, **F64, msg=lambda m: f"rank {rank} {key}: {m}")


@pytest.mark.parametrize("saved, resumed", [((2, 3), (4, 3)), ((4, 2), (2, 3)), ((2, 3), (1, 0))],
                         ids=["data2-zero3-to-data4-zero3", "data4-zero2-to-data2-zero3",
                              "data2-zero3-to-one-process"])
def test_deep_zero_x_warmup_scheduler_resumed_mid_schedule(tmp_path, saved, resumed):
    """Saved after step 3 (inside the decay, after the hand change of weight decay), resumed:
    the schedule and the hand-set weight decay go on as in one process."""
    path = str(tmp_path / "ckpt.pt")
    expected, want_lrs = _sched_one_process("cosine", 5)
    run_ranks(_sched_job, saved[0], _zcfg(saved[1], {}), "cosine", 0, 3, None, path, timeout=60)
    for rank, (state, lrs, _) in enumerate(run_ranks(_sched_job, resumed[0],
                                                     _zcfg(resumed[1], {}), "cosine", 3, 5,
                                                     path, timeout=60)):
        assert _flat(lrs) == pytest.approx(_flat(want_lrs[3:]), rel=1e-12), rank
        for key, value in expected.items():
            assert_close(state[key], value, **F64, msg=lambda m: f"rank {rank} {key}: {m}")


def _o2_sched_job(rank, world_size, port, config):
    launch_rank(rank, world_size, port, config)
    model = LNNet()
    opt = _two_groups(model)
    sched = _scheduler("linear", opt)
    engine, _, _, sched = nc.initialize(model, opt, nn.CrossEntropyLoss(), lr_scheduler=sched,
                                        verbose=False)
    _train(engine, 0, 4, sched=sched)
    inner = engine.optimizer
    while hasattr(inner, "optimizer"):
        inner = inner.optimizer
    return ({k: v.float() for k, v in _state(engine.model).items()},
            [g["lr"] for g in opt.param_groups], [g["lr"] for g in inner.param_groups])


def test_deep_zero3_x_o2_x_accumulation_x_warmup_scheduler_tracks_plain_o2():
    cfg = {**BF16_O2, "gradient_accumulation": 2}
    ref, ref_lrs, ref_inner = run_ranks(_o2_sched_job, 1, cfg, timeout=60)[0]
    assert ref_lrs == ref_inner
    for state, lrs, inner in run_ranks(_o2_sched_job, 2, {**cfg, "zero": {"level": 3}},
                                       timeout=60):
        assert lrs == ref_lrs  # (the inner groups take the user's lr at the next step)
        assert_close(state, ref, rtol=1e-2, atol=1e-2)


# == 3. level 3's unit-order check: no false alarm, no miss ========================================

class Routed(nn.Module):
    """Two same-size units b, c run in the order `route` says ("bc", "cb", "b", "c")."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(6, 7), nn.Linear(7, 7), nn.Linear(7, 7)
        self.head = nn.Linear(7, 4)
        self.double()
        self.route = "bc"

    def forward(self, x):
        h = torch.tanh(self.a(x))
        for name in self.route:
            h = torch.tanh(getattr(self, name)(h))
        return self.head(h)


ROUTES = ["bc", "cb", "b", "cb"]  # the same on every rank: prefetch after a changed order


def _routed_one_process(steps, accum=2):
    model = Routed()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    n = GLOBAL // accum
    for step in range(steps):
        model.route = ROUTES[step % len(ROUTES)]
        x, y = _mixed_batch(step, dtype=torch.float64)
        opt.zero_grad()
        for m in range(accum):
            (F.cross_entropy(model(x[m * n:(m + 1) * n]), y[m * n:(m + 1) * n]) / accum).backward()
        opt.step()
    return _state(model)


def _routed_job(rank, world_size, port, config, steps, path, wrong=None):
    """wrong: None (all ranks alike); "train": rank 0 runs c-b where the others run b-c in
    training; "eval": the same, in a no_grad eval forward between steps only."""
    launch_rank(rank, world_size, port, config)
    model = Routed()
    engine, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               nn.CrossEntropyLoss(), verbose=False)
    accum = engine.gradient_accumulation
    n = GLOBAL // gpc.data_size // accum
    evals = []
    try:
        for step in range(steps):
            route = ROUTES[step % len(ROUTES)]
            if wrong == "train" and step == 1:
                route = "cb" if gpc.data_rank == 0 else "bc"
            x, y = _mixed_batch(step, dtype=torch.float64)
            for m in range(accum):
                model.route = route
                lo = (m * gpc.data_size + gpc.data_rank) * n
                engine.train()
                engine.zero_grad()
                engine.backward(engine.criterion(engine(x[lo:lo + n]), y[lo:lo + n]))
                if m == 0:  # between micro-steps: an eval forward, grad mode on
                    engine.eval()
                    model.route = "cb"
                    evals.append(engine(_mixed_batch(50 + step, 2, torch.float64)[0]).detach())
                engine.step()
            # between steps: no_grad eval, state_dict, save + load
            engine.eval()
            model.route = "b"
            if wrong == "eval" and step == 1:
                model.route = "c" if gpc.data_rank == 0 else "b"
            with torch.no_grad():
                evals.append(engine(_mixed_batch(80 + step, 3, torch.float64)[0]))
            engine.model.state_dict()
            if path and step == 1:
                save_checkpoint(path, step, engine.model, engine.optimizer)
                load_checkpoint(path, engine.model, engine.optimizer)
    except RuntimeError as e:
        return None, None, str(e)
    return _state(engine.model), evals, None


@pytest.mark.parametrize("overlap", [True, False], ids=["prefetch", "no-prefetch"])
def test_deep_zero3_unit_order_no_false_alarm_with_evals_state_dict_checkpoint_and_order_changes(
        tmp_path, overlap):
    expected = _routed_one_process(4)
    config = {"zero": {"level": 3, "overlap_communication": overlap}, "gradient_accumulation": 2}
    results = run_ranks(_routed_job, 2, config, 4, str(tmp_path / "c.pt"), timeout=60)
    for rank, (state, evals, error) in enumerate(results):
        assert error is None, f"rank {rank}: false alarm: {error}"
        for key, value in expected.items():
            assert_close(state[key], value, **F64, msg=lambda m: f"rank {rank} {key}: {m}")
    assert_close(results[0][1], results[1][1], **F64)


def test_gloo_zero3_unit_order_mismatch_in_a_no_grad_eval_raises_at_the_next_step_on_every_rank():
    """Same-size units, rank 0 runs c where the others run b, in a no_grad eval forward between
    steps only (the collectives pair up, silently): the next step must raise on every rank.
    (No prefetch: a prefetch after another order pairs units of different sizes, which gloo
    aborts on, as sharded_model_checks.py says.)"""
    config = {"zero": {"level": 3, "overlap_communication": False}}
    results = run_ranks(_routed_job, 2, config, 3, None, "eval", timeout=60)
    for rank, (_, _, error) in enumerate(results):
        assert error is not None and "gathered different units" in error, (rank, error)


def test_deep_zero3_unit_order_debug_names_a_training_mismatch_on_every_rank():
    """debug=True: rank 0 runs c-b where the other runs b-c in training: the first gather that
    differs raises on every rank (without debug the backward's gathers and reductions pair
    crosswise and gloo times out: a hang, not a silent miss)."""
    config = {"zero": {"level": 3, "overlap_communication": False}, "debug": True}
    results = run_ranks(_routed_job, 2, config, 3, None, "train", timeout=60)
    for rank, (_, _, error) in enumerate(results):
        assert error is not None and "gathers unit" in error, (rank, error)


# == the Trainer: LR hook per iteration, stopped mid-schedule and resumed ==========================

def _trainer_job(rank, world_size, port, config, path, max_steps, resume):
    from torch.utils.data import TensorDataset

    from nanocolossal.trainer import Trainer, hooks
    launch_rank(rank, world_size, port, config)
    model = _dmodel()
    opt = _dgroups(model)
    sched = _scheduler("cosine", opt)
    engine, _, _, sched = nc.initialize(model, opt, nn.CrossEntropyLoss(), lr_scheduler=sched,
                                        verbose=False)
    g = torch.Generator().manual_seed(5)
    data = TensorDataset(torch.randn(16, 6, generator=g, dtype=torch.float64),
                         torch.randint(0, 4, (16,), generator=g))
    train = nc.get_dataloader(data, shuffle=True, seed=3, batch_size=8 // world_size)
    test = nc.get_dataloader(data, shuffle=False, batch_size=4)
    trainer = Trainer(engine)
    if resume:
        assert trainer.resume(path, sched)
    trainer.fit(train, epochs=3, max_steps=max_steps, test_dataloader=test, test_interval=1,
                hooks=[hooks.LRSchedulerHook(sched, by_epoch=False), hooks.LossHook(),
                       hooks.SaveCheckpointHook(path, lr_scheduler=sched)])
    return _state(engine.model), [g["lr"] for g in opt.param_groups]


@pytest.mark.parametrize("level", [2, 3])
def test_deep_zero_trainer_lr_hook_resumed_mid_schedule_equals_uninterrupted(tmp_path, level):
    config = {"zero": {"level": level}}
    straight, lrs = run_ranks(_trainer_job, 2, config, str(tmp_path / "s.pt"), None, False,
                              timeout=60)[0]
    path = str(tmp_path / "c.pt")
    run_ranks(_trainer_job, 2, config, path, 3, False, timeout=60)  # 2 steps an epoch
    for state, lrs2 in run_ranks(_trainer_job, 2, config, path, None, True, timeout=60):
        assert lrs2 == lrs
        assert_close(state, straight, **F64)
