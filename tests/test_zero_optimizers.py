"""ZeRO shards the optimizer the user brings and runs the user's training loop as one process.

ZeRO keeps 1/N of every optimizer state on each of N data ranks and steps only that shard, so it
must work for any element-wise optimizer (each state element depends only on its own parameter
element): SGD with nesterov, RMSprop (centered, momentum), Adagrad (lr decay, an initial
accumulator), Adam with amsgrad, each with two param groups of different lr / weight decay. And
the loop around it must not notice: an LR scheduler built on the user's optimizer before
nc.initialize (stepping it, resuming it across levels, no step-order warning), a parameter frozen
part way, an eval forward between accumulated micro-steps, a branch used only before the micro-step
that reduces, a checkpoint saved at one level and data size and loaded at another, a level-3 unit
called twice in one forward.

Every run is compared with ONE process training the same float64 model on the whole batch.
"""
import pytest
import torch
from dist_helpers import run_ranks
from torch import nn
from torch.nn import functional as F
from torch.testing import assert_close

import nanocolossal as nc
from nanocolossal.checkpoint import load_checkpoint, save_checkpoint
from nanocolossal.context import gpc


def _lesson_worker(rank, world_size, port, xs, ys):
    nc.launch({"zero": {"level": 2}}, rank=rank, world_size=world_size, host="127.0.0.1",
              port=port)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 4)).double()
    opt = torch.optim.RMSprop(model.parameters(), lr=0.01, momentum=0.5, centered=True)
    engine, *_ = nc.initialize(model, opt, nn.CrossEntropyLoss(), verbose=False)
    for x, y in zip(xs, ys):
        mine = slice(rank * len(x) // world_size, (rank + 1) * len(x) // world_size)
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x[mine]), y[mine]))
        engine.step()
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


def test_gloo_zero_shards_the_optimizer_you_bring_and_trains_as_one_process():
    """Centered RMSprop with momentum keeps three states per element; under ZeRO 2 each rank
    keeps and steps 1/2 of them, and the all-gathered parameters are one process's."""
    torch.manual_seed(1)
    xs, ys = torch.randn(3, 8, 6, dtype=torch.float64), torch.randint(0, 4, (3, 8))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 4)).double()
    opt = torch.optim.RMSprop(model.parameters(), lr=0.01, momentum=0.5, centered=True)
    for x, y in zip(xs, ys):  # one process, the whole batch
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    for state in run_ranks(_lesson_worker, 2, xs, ys):
        for key, value in model.state_dict().items():
            assert_close(state[key], value, rtol=1e-9, atol=1e-11)


# -- the harness of the sweeps below: a float64 MLP, one process, the engine's loop ----------


GLOBAL = 8  # samples per optimizer step, split over data ranks and micro-steps
F64 = {"rtol": 1e-9, "atol": 1e-11}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 7), nn.Tanh(),
                         nn.Linear(7, 4)).double()


def _groups(model, weight_lr, bias_lr, weight_wd, bias_wd):
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return [{"params": weights, "lr": weight_lr, "weight_decay": weight_wd},
            {"params": biases, "lr": bias_lr, "weight_decay": bias_wd}]


OPTIMIZERS = {
    "sgd-nesterov": lambda m: torch.optim.SGD(_groups(m, 0.2, 0.05, 0.1, 0.0), lr=0.1,
                                              momentum=0.9, nesterov=True),
    "rmsprop-centered-momentum": lambda m: torch.optim.RMSprop(
        _groups(m, 0.01, 0.003, 0.01, 0.0), lr=0.01, alpha=0.9, momentum=0.5, centered=True),
    "adagrad": lambda m: torch.optim.Adagrad(_groups(m, 0.1, 0.03, 0.01, 0.0), lr=0.1,
                                             lr_decay=0.05, initial_accumulator_value=0.1),
    "adam-amsgrad": lambda m: torch.optim.Adam(_groups(m, 0.01, 0.02, 0.01, 0.0), lr=0.01,
                                               amsgrad=True),
    "sgd-momentum": lambda m: torch.optim.SGD(_groups(m, 0.1, 0.05, 0.1, 0.05), lr=0.1,
                                              momentum=0.9),
    "adamw": lambda m: torch.optim.AdamW(_groups(m, 0.02, 0.03, 0.1, 0.01), lr=0.02),
}


def _mixed_batch(step, n=GLOBAL):
    g = torch.Generator().manual_seed(700 + step)
    return torch.randn(n, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (n,),
                                                                              generator=g)


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _freeze(model, step, freeze_at):
    """freeze_at: (step, names): from that step on those parameters get requires_grad=False."""
    if freeze_at is not None and step == freeze_at[0]:
        for name, p in model.named_parameters():
            if name in freeze_at[1]:
                p.requires_grad_(False)


def _one_process(opt_name, steps, scheduler=False, freeze_at=None):
    """The whole batch of every step in one process; the state after each step."""
    model = _model()
    opt = OPTIMIZERS[opt_name](model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if scheduler else None
    states = []
    for step in range(steps):
        _freeze(model, step, freeze_at)
        x, y = _mixed_batch(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if sched:
            sched.step()
        states.append(_state(model))
    return states


def _worker(rank, world_size, port, config, opt_name, first, last, scheduler=False,
            freeze_at=None, eval_mid=None, load=None, save=None):
    """Steps [first, last) of GLOBAL samples: this data rank's share, in
    gradient_accumulation micro-steps. eval_mid: "nograd" / "grad": an eval-mode forward on a
    separate batch after micro-step 0 of every step (its outputs returned)."""
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port, timeout=30)
    model = _model()
    opt = OPTIMIZERS[opt_name](model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if scheduler else None
    engine, _, _, sched = nc.initialize(model, opt, nn.CrossEntropyLoss(), lr_scheduler=sched,
                                        verbose=False)
    if load is not None:
        load_checkpoint(load, engine.model, engine.optimizer, sched)
    accum = engine.gradient_accumulation
    n = GLOBAL // gpc.data_size // accum
    evals = []
    for step in range(first, last):
        _freeze(model, step, freeze_at)
        x, y = _mixed_batch(step)
        for m in range(accum):
            lo = (m * gpc.data_size + gpc.data_rank) * n
            engine.train()
            engine.zero_grad()
            engine.backward(engine.criterion(engine(x[lo:lo + n]), y[lo:lo + n]))
            stepped = engine.step()
            assert stepped == (m == accum - 1)
            if eval_mid and m == 0:
                engine.eval()
                xe, _ = _mixed_batch(900 + step, 4)
                if eval_mid == "nograd":
                    with torch.no_grad():
                        evals.append(engine(xe).detach().clone())
                else:
                    evals.append(engine(xe).detach().clone())
        if sched is not None:
            sched.step()
    if save is not None:
        save_checkpoint(save, last, engine.model, engine.optimizer, sched)
    return _state(engine.model), evals


def _check(results, expected, tol=F64):
    for rank, (state, _) in enumerate(results):
        for key, value in expected.items():
            assert_close(state[key], value, **tol, msg=lambda m: f"rank {rank} {key}: {m}")


# -- element-wise optimizers other than SGD/AdamW, two param groups, every level ----------------

# Levels 1 and 2 step the same shards of one flat buffer (they differ in how gradients arrive,
# which no optimizer changes): each optimizer at level 3 and at one of them.
OPT_CASES = [("sgd-nesterov", 1), ("rmsprop-centered-momentum", 2), ("adagrad", 1),
             ("adam-amsgrad", 2)] + [(o, 3) for o in ("sgd-nesterov", "rmsprop-centered-momentum",
                                                      "adagrad", "adam-amsgrad")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("opt_name, level", OPT_CASES, ids=[f"{o}-zero{lv}" for o, lv in OPT_CASES])
def test_deep_zero_levels_x_elementwise_optimizers_x_param_groups_x_accumulation(opt_name, level):
    expected = _one_process(opt_name, 3)[-1]
    config = {"zero": {"level": level, "reduce_bucket_size_mb": 2e-4},
              "gradient_accumulation": 2}
    _check(run_ranks(_worker, 2, config, opt_name, 0, 3, timeout=60), expected)


# -- an LR scheduler built on the user's optimizer before nc.initialize -------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("level", [0, 1, 2, 3], ids=["no-zero", "zero1", "zero2", "zero3"])
def test_deep_zero_x_lr_scheduler_built_before_initialize_equals_one_process(level):
    """The tutorials' order: optimizer, lr_scheduler(optimizer), then initialize(..., lr_scheduler)
    and scheduler.step() after each optimizer step: the learning rate halves every step."""
    expected = _one_process("sgd-momentum", 3, scheduler=True)[-1]
    config = {"zero": {"level": level}} if level else {}
    _check(run_ranks(_worker, 2, config, "sgd-momentum", 0, 3, True, timeout=60), expected)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("saved, resumed", [((2, 2), (4, 3)), ((2, 3), (1, 0)), ((1, 0), (2, 1))],
                         ids=["zero2-data2-to-zero3-data4", "zero3-to-one-process",
                              "one-process-to-zero1"])
def test_deep_zero_x_lr_scheduler_x_checkpoint_resumes_the_learning_rate(tmp_path, saved,
                                                                        resumed):
    """Saved after 2 steps with the scheduler, resumed for 2 more at another level and data
    size: the learning rate goes on halving from where it was (the saved groups' lr reaches the
    user's groups, which the scheduler and each step read)."""
    path = str(tmp_path / "ckpt.pt")
    (size, level), (size2, level2) = saved, resumed
    config = {"zero": {"level": level}} if level else {}
    run_ranks(_worker, size, config, "sgd-momentum", 0, 2, True, None, None, None, path,
              timeout=60)
    config = {"zero": {"level": level2}} if level2 else {}
    expected = _one_process("sgd-momentum", 4, scheduler=True)[-1]
    _check(run_ranks(_worker, size2, config, "sgd-momentum", 2, 4, True, None, None, path,
                     timeout=60), expected)


# -- a parameter frozen part way (requires_grad=False): one process skips it -------------------

FREEZE = {"one-weight": ("2.weight",), "middle-unit": ("2.weight", "2.bias"),
          "first-unit": ("0.weight", "0.bias")}
FREEZE_CASES = [(lv, f) for lv in (1, 2, 3) for f in FREEZE if lv == 3 or f == "one-weight"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("level, frozen", FREEZE_CASES,
                         ids=[f"zero{lv}-{f}" for lv, f in FREEZE_CASES])
def test_deep_zero_x_parameter_frozen_part_way_is_not_moved_by_momentum_or_decay(level, frozen):
    """SGD momentum 0.9, weight decay 0.1: after freezing, one process gives the frozen weight
    no gradient (grad None) and SGD leaves it alone; a zero gradient would still move it.
    Level 3: one weight of a unit, a whole unit, the first unit (whose inputs need no grad)."""
    names = FREEZE[frozen]
    states = _one_process("sgd-momentum", 4, freeze_at=(2, names))
    for name in names:
        assert torch.equal(states[1][name], states[3][name])
    config = {"zero": {"level": level, "reduce_bucket_size_mb": 2e-4}}
    _check(run_ranks(_worker, 2, config, "sgd-momentum", 0, 4, False, (2, names), timeout=60),
           states[-1])


# -- an eval forward in the middle of gradient accumulation -----------------------------------

EVAL_CASES = [(lvl, mode) for lvl in (1, 2, 3) for mode in ("nograd", "grad")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("level, mode", EVAL_CASES, ids=[f"zero{lv}-{m}" for lv, m in EVAL_CASES])
def test_deep_zero_x_eval_forward_between_accumulated_micro_steps(level, mode):
    """accumulation 2: after micro-step 0 an eval forward (under no_grad, or grad mode on):
    the training result is one process's, and the eval outputs are the model's at that time."""
    states = _one_process("adamw", 3)
    config = {"zero": {"level": level, "reduce_bucket_size_mb": 2e-4},
              "gradient_accumulation": 2}
    results = run_ranks(_worker, 2, config, "adamw", 0, 3, False, None, mode, timeout=60)
    _check(results, states[-1])
    model = _model()
    for step in range(3):  # the eval of step s sees the weights after step s-1
        if step:
            model.load_state_dict(states[step - 1])
        else:
            model = _model()
        with torch.no_grad():
            want = model(_mixed_batch(900 + step, 4)[0])
        for rank, (_, evals) in enumerate(results):
            assert_close(evals[step], want, **F64, msg=lambda m: f"rank {rank} step {step}: {m}")


# -- a checkpoint saved at one ZeRO level (and data size), loaded at another -------------------

# (3 -> 1: adagrad below; amsgrad's third state across levels: the three amsgrad rows)
LEVEL_CHANGES = [("adam-amsgrad", 2, 1, 2, 3), ("adam-amsgrad", 2, 2, 4, 3),
                 ("adam-amsgrad", 4, 3, 2, 2), ("rmsprop-centered-momentum", 2, 3, 1, 0),
                 ("adagrad", 2, 3, 4, 1), ("sgd-nesterov", 1, 0, 2, 3)]


def _zero(level):
    return {"zero": {"level": level}} if level else {}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("opt_name, saved_world, saved_level, loaded_world, loaded_level",
                         LEVEL_CHANGES, ids=[f"{o}-data{a}-zero{b}-to-data{c}-zero{d}"
                                             for o, a, b, c, d in LEVEL_CHANGES])
def test_deep_zero_checkpoint_across_levels_resumes_as_one_process(
        tmp_path, opt_name, saved_world, saved_level, loaded_world, loaded_level):
    """Two param groups, per-element states (Adam amsgrad: three; RMSprop centered with momentum:
    three; Adagrad: its sums): 2 steps, save, load at another level / data size (0: no ZeRO),
    2 more steps: one process's 4 steps straight."""
    expected = _one_process(opt_name, 4)[-1]
    path = str(tmp_path / "ckpt.pt")
    run_ranks(_worker, saved_world, _zero(saved_level), opt_name, 0, 2,
              False, None, None, None, path, timeout=60)
    _check(run_ranks(_worker, loaded_world, _zero(loaded_level), opt_name,
                     2, 4, False, None, None, path, timeout=60), expected)


# -- a branch used in the first micro-step of an accumulation group only ----------------------

class Branch(nn.Module):
    """`side` runs only while use_side is set: on every rank in micro-step 0 of each step,
    never in the last one (the one that reduces)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.side = nn.Linear(6, 7), nn.Linear(7, 4), nn.Linear(7, 4)
        self.double()
        self.use_side = True

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h) + self.side(h) if self.use_side else self.b(h)


ACCUM = 2


def _branch_one_process(steps, opt_name):
    model = Branch()
    opt = OPTIMIZERS[opt_name](model)
    n = GLOBAL // ACCUM
    for step in range(steps):
        x, y = _mixed_batch(step)
        opt.zero_grad()
        for m in range(ACCUM):
            model.use_side = m == 0
            (F.cross_entropy(model(x[m * n:(m + 1) * n]), y[m * n:(m + 1) * n]) / ACCUM).backward()
        opt.step()
    return _state(model)


def _branch_worker(rank, world_size, port, config, opt_name, steps):
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port, timeout=30)
    model = Branch()
    engine, *_ = nc.initialize(model, OPTIMIZERS[opt_name](model), nn.CrossEntropyLoss(),
                               verbose=False)
    n = GLOBAL // gpc.data_size // ACCUM
    for step in range(steps):
        x, y = _mixed_batch(step)
        for m in range(ACCUM):
            model.use_side = m == 0
            lo = (m * gpc.data_size + gpc.data_rank) * n
            engine.zero_grad()
            engine.backward(engine.criterion(engine(x[lo:lo + n]), y[lo:lo + n]))
            assert engine.step() == (m == ACCUM - 1)
    return _state(engine.model), []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("level", [0, 1, 2, 3], ids=["ddp", "zero1", "zero2", "zero3"])
def test_deep_zero_x_accumulation_x_branch_used_only_before_the_reducing_micro_step(level):
    """The side branch's gradient comes from micro-step 0 alone (under no_sync): it must still
    be averaged and stepped, as one process accumulates it."""
    expected = _branch_one_process(3, "adamw")
    config = {"gradient_accumulation": ACCUM,
              **({"zero": {"level": level, "reduce_bucket_size_mb": 2e-4}} if level else {})}
    _check(run_ranks(_branch_worker, 2, config, "adamw", 3, timeout=60), expected)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("level", [2, 3], ids=["zero2", "zero3"])
def test_deep_zero_no_overlap_x_accumulation_x_branch_used_only_before_the_reducing_micro_step(
        level):
    expected = _branch_one_process(3, "sgd-momentum")
    config = {"gradient_accumulation": ACCUM,
              "zero": {"level": level, "reduce_bucket_size_mb": 2e-4,
                       "overlap_communication": False}}
    _check(run_ranks(_branch_worker, 2, config, "sgd-momentum", 3, timeout=60), expected)


# -- level 3: a child module called twice in one forward (a weight-shared recurrent block) -------

class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.block, self.head = nn.Linear(6, 7), nn.Linear(7, 7), nn.Linear(7, 4)
        self.double()

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.block(h))
        h = torch.tanh(self.block(h))  # the same unit again
        return self.head(h)


def _twice_worker(rank, world_size, port, config, steps):
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port, timeout=30)
    model = Twice()
    engine, *_ = nc.initialize(model, OPTIMIZERS["sgd-momentum"](model), nn.CrossEntropyLoss(),
                               verbose=False)
    n = GLOBAL // gpc.data_size
    try:
        for step in range(steps):
            x, y = _mixed_batch(step)
            lo = gpc.data_rank * n
            engine.zero_grad()
            engine.backward(engine.criterion(engine(x[lo:lo + n]), y[lo:lo + n]))
            assert engine.step()
    except Exception as e:  # refusing it, with an error that says so, is acceptable too
        return None, repr(e)
    return _state(engine.model), None


@pytest.mark.timeout(120)
def test_gloo_zero3_unit_called_twice_per_forward_is_one_process_or_refused():
    model = Twice()
    opt = OPTIMIZERS["sgd-momentum"](model)
    for step in range(2):
        x, y = _mixed_batch(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    results = run_ranks(_twice_worker, 2, {"zero": {"level": 3}}, 2, timeout=60)
    for rank, (state, error) in enumerate(results):
        if error is not None:
            assert "twice" in error or "once" in error or "more than one" in error, error
            continue
        for key, value in _state(model).items():
            assert_close(state[key], value, **F64, msg=lambda m: f"rank {rank} {key}: {m}")


def _scheduler_warning_worker(rank, world_size, port, level):
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _worker(rank, world_size, port, {"zero": {"level": level}}, "sgd-momentum", 0, 2, True)
    return [str(w.message) for w in caught if "lr_scheduler.step()" in str(w.message)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("level", [1, 3], ids=["zero1", "zero3"])
def test_deep_zero_x_lr_scheduler_gives_no_step_order_warning(level):
    """torch's schedulers warn when they step before the optimizer did, watching the user's
    optimizer.step(); ZeRO steps its own inner optimizer, and says so to them."""
    for said in run_ranks(_scheduler_warning_worker, 2, level, timeout=60):
        assert said == [], said
