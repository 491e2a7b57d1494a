"""ZeRO level 3 on gloo ranks: the same training as one process, also for models as written
(blocks in a ModuleList / ModuleDict, a head reading the embedding's weight, a block called
twice, two forwards per backward, activation checkpointing), parameters held as shards between
uses (bytes counted from live tensors), checkpoints as the plain model's, and Colossal-AI
v0.1's zero=dict(model_config=..., optimizer_config=...) spelling."""
import copy
import logging
import math
from functools import partial

import pytest
import torch
from dist_helpers import run_ranks
from torch import nn
from torch.nn import functional as F
from torch.testing import assert_close
from torch.utils.checkpoint import checkpoint
from zero_models import (
    STEPS,
    B,
    Net,
    grouped_adamw,
    launch_net,
    net_batch,
    train_engine,
    train_single,
    zero_config,
)

import nanocolossal as nc
from nanocolossal.amp import AMP_TYPE
from nanocolossal.checkpoint import (
    load_checkpoint,
    load_optimizer_state,
    merge_checkpoint,
    read_file,
    save_checkpoint,
)
from nanocolossal.checkpoint.merge import complete_zero_state
from nanocolossal.config import ConfigError, load_config
from nanocolossal.zero import ParamShardedOptimizer, plan_units, zero_settings

pytestmark = pytest.mark.timeout(120)


def _lesson_worker(rank, world_size, port, xs, ys):
    nc.launch(dict(zero=dict(level=3)), rank=rank, world_size=world_size, host="127.0.0.1",
              port=port)
    torch.manual_seed(0)  # every rank builds the model the reference builds
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()  # 2 units
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    engine, *_ = nc.initialize(model, optimizer, nn.CrossEntropyLoss(), verbose=False)
    for x, y in zip(xs, ys):
        x, y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]  # my half of the batch
        engine.zero_grad()
        # each Linear is gathered just before its forward and its backward, freed after;
        # its gradient is reduce-scattered: I keep (and step) my shard only
        engine.backward(engine.criterion(engine(x), y))
        engine.step()
    return engine.model.state_dict()  # gathered: the plain model's full tensors


def test_gloo_zero3_on_two_ranks_equals_one_process():
    """Parameters held as shards between uses, gathered per layer: each rank holds half of
    everything, and training still equals one process on the whole batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    xs, ys = torch.randn(3, 8, 4, dtype=torch.float64), torch.randint(0, 3, (3, 8))  # 3 batches
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for x, y in zip(xs, ys):  # the whole batch of 8 in one process
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    for rank, state in enumerate(run_ranks(_lesson_worker, 2, xs, ys)):
        assert_close(state, model.state_dict(), msg=lambda m: f"rank {rank}: {m}")


def _freed(model):
    """Between uses every parameter points at the one shared NaN element."""
    return all(p.untyped_storage().nbytes() <= p.element_size() for p in model.parameters())


def _initialized_twice_worker(rank, world_size, port):
    engine = launch_net(rank, world_size, port, {"zero": {"level": 3}})
    train_engine(engine, 1, rank, world_size, 1)
    model = engine.model  # a second initialize of the same model (a notebook, a second phase)
    engine, *_ = nc.initialize(model, grouped_adamw(model), nn.CrossEntropyLoss(), verbose=False)
    train_engine(engine, 2, rank, world_size, 1, first=1)
    return _freed(model), {k: v.clone() for k, v in model.state_dict().items()}


def test_gloo_zero3_a_model_initialized_twice_trains_as_one_process():
    """The second nc.initialize starts from the model's trained values, whole again (the first
    one's shards and hooks let go), and shards it anew: one process with a new optimizer."""
    model = Net()
    train_single(model, grouped_adamw(model), 1, n=2 * B)
    train_single(model, grouped_adamw(model), 2, first=1, n=2 * B)
    for rank, (freed, state) in enumerate(run_ranks(_initialized_twice_worker, 2)):
        assert freed
        assert_close(state, model.state_dict(), msg=lambda m: f"rank {rank}: {m}")


def _worker(rank, world_size, port, accum=1, clip=0.0, bf16=False, overlap=True):
    engine = launch_net(rank, world_size, port,
                        zero_config(dict(level=3), accum, clip, bf16, overlap))
    assert isinstance(engine.optimizer, ParamShardedOptimizer) and _freed(engine.model)
    norms = train_engine(engine, STEPS, rank, world_size, accum)
    assert _freed(engine.model)
    single = Net()
    single_norms = train_single(single, grouped_adamw(single), STEPS, n=world_size * accum * B,
                                clip=clip, bf16=bf16)
    gathered = engine.model.state_dict()  # the plain model's keys, full tensors
    tol = dict(atol=3e-3, rtol=0) if bf16 else {}  # bf16 sums of other batch splits round apart
    assert_close(gathered, single.state_dict(), **tol)
    assert_close(gathered["never.weight"], Net().never.weight, rtol=0, atol=0)  # never used
    assert _freed(engine.model)  # state_dict freed what it gathered
    with pytest.raises(RuntimeError, match=r"\[rank \d\] zero level 3: a part of the model's"):
        engine.model.a.state_dict()  # alone: the freed shards' placeholders, not the values
    assert engine.model.a.state_dict(keep_vars=True).keys() == {"weight", "bias"}  # shapes
    return norms, single_norms


def test_deep_zero3_adamw_equals_one_process():
    """Net: 141 elements in 4 units x 2 param groups, none a multiple of 4 (padding: the 4-rank
    tests below); `side` used on even steps only, `never` never (grad=None kept, no weight
    decay)."""
    run_ranks(_worker, 2, timeout=90)


def test_deep_zero3_without_overlap_equals_one_process():
    run_ranks(_worker, 4, 1, 0.0, False, False, timeout=90)


def test_deep_zero3_gradient_accumulation():
    run_ranks(_worker, 2, 3, timeout=90)


def test_deep_zero3_clipping_really_clips():
    for norms, single_norms in run_ranks(_worker, 4, 2, 0.05, timeout=90):
        assert all(n > 0.05 for n in single_norms)  # the threshold is below every norm
        assert norms == pytest.approx(single_norms, rel=1e-5)


def test_deep_zero3_bf16_autocast():
    run_ranks(_worker, 2, 1, 0.0, True, timeout=90)


class Chain(nn.Module):
    """Two units of 99 and 50 elements (a Tanh between: no parameters, no unit)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.act, self.l2 = nn.Linear(10, 9), nn.Tanh(), nn.Linear(9, 5)

    def forward(self, x):
        return self.l2(self.act(self.l1(x)))


def _parameter_bytes(engine):
    """Bytes of the live tensors that hold parameter values: the model's parameters, the
    optimizer's shards and the (gathered or empty) full buffers, each storage once."""
    tensors = [*engine.model.parameters()]
    tensors += [t for b in engine.optimizer.buffers for t in (b.data, b.local)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _memory_worker(rank, world_size, port):
    nc.launch({"zero": dict(level=3)}, rank=rank, world_size=world_size, host="127.0.0.1",
              port=port)
    model = Chain()
    engine, *_ = nc.initialize(model, torch.optim.AdamW(model.parameters(), lr=0.01),
                               nn.CrossEntropyLoss(), verbose=False)
    during = []
    for unit in (model.l1, model.l2):  # after the gather hook, before the unit computes
        unit.register_forward_pre_hook(lambda m, a: during.append(_parameter_bytes(engine)))
    for _ in range(2):  # the second step prefetches l2 while l1 computes
        engine.zero_grad()
        engine.backward(engine.criterion(engine(torch.randn(B, 10)), torch.randint(0, 5, (B,))))
        grads = [p.grad for p in model.parameters()]
        shard_grads = sum(p.grad.numel() * 4 for p in engine.optimizer.params()
                          if p.grad is not None)
        engine.step()
    return during, _parameter_bytes(engine), grads, shard_grads, engine.optimizer.state_bytes()


def test_deep_zero3_parameter_bytes_equal_the_formula():
    """Between steps a rank holds its shards: sum over units of ceil(numel/N) x 4 bytes (= 4 Psi/N
    up to padding), + 4 bytes for the NaN element freed parameters share. While a unit computes,
    that unit is whole too; from the second step on, so is the next unit, prefetched: the peak
    is the shards + two consecutive units, each padded to N shards."""
    units = (10 * 9 + 9, 9 * 5 + 5)
    for n in (1, 2, 4):
        for rank, (during, between, grads, shard_grads, state) in enumerate(
                run_ranks(_memory_worker, n, timeout=60)):
            shards = sum(4 * math.ceil(u / n) for u in units)
            l1, l2 = (4 * math.ceil(u / n) * n for u in units)
            assert between == shards + 4, (n, rank, between, shards)
            assert during[:2] == [shards + 4 + l1, shards + 4 + l2], (n, during)  # first step
            # prefetch: both units whole (no parameter points at the NaN element: no + 4)
            assert during[2:] == [shards + l1 + l2, shards + 4 + l2], (n, during)
            assert all(g is None for g in grads)  # no full gradient after backward
            mine = sum(min(math.ceil(u / n), max(0, u - rank * math.ceil(u / n))) for u in units)
            assert shard_grads == 4 * mine and state == 8 * mine  # gradients, Adam: my shard


def _save_worker(rank, world_size, port, path):
    engine = launch_net(rank, world_size, port, {"zero": dict(level=3)})
    train_engine(engine, 3, rank, world_size, 1)
    save_checkpoint(path, 3, engine.model, engine.optimizer)
    assert _freed(engine.model)


def _resume_worker(rank, world_size, port, path):
    engine = launch_net(rank, world_size, port, {"zero": dict(level=3)})
    assert load_checkpoint(path, engine.model, engine.optimizer)["epoch"] == 3
    assert _freed(engine.model)
    train_engine(engine, 2, rank, world_size, 1, first=3)
    return engine.model.state_dict()


def test_deep_zero3_checkpoint_is_the_plain_models_and_resumes_exactly(tmp_path):
    """Saved by 2 ranks after 3 steps: no rank gathered the model -- the file has the plain
    model's keys with None for the sharded parameters, whose segments each rank wrote to its own
    file -- and put together (complete_zero_state, merge_checkpoint) it is the plain model's
    state_dict; its optimizer loads into a plain AdamW; 2 more steps on 2 or 4 ranks end where
    one process ends."""
    path = tmp_path / "ckpt.pt"
    run_ranks(_save_worker, 2, path, timeout=60)
    single = Net()
    opt = grouped_adamw(single)
    train_single(single, opt, 3, n=2 * B)
    on_disk = read_file(path, "cpu")
    assert list(on_disk["model"]) == list(single.state_dict())
    assert all(v is None for v in on_disk["model"].values())  # every parameter is sharded
    for r in range(2):  # each rank's file: its half of the parameters, not more
        segments = read_file(tmp_path / f"ckpt-zero{r}.pt", "cpu")["params"]
        assert sum(hi - lo for _, lo, hi, _ in segments) <= sum(
            math.ceil(p.numel() / 2) for p in single.parameters())
    state = complete_zero_state(on_disk, path)
    assert list(state["model"]) == list(single.state_dict())
    assert_close(state["model"], single.state_dict())
    assert_close(merge_checkpoint(path), single.state_dict())
    plain_opt = grouped_adamw(Net())
    plain_opt.load_state_dict(load_optimizer_state(path)["optimizer"])
    assert_close(plain_opt.state_dict(), opt.state_dict())
    for world_size in (2, 4):
        resumed = run_ranks(_resume_worker, world_size, path, timeout=60)[0]
        expected = Net()
        expected.load_state_dict(single.state_dict())
        expected_opt = grouped_adamw(expected)
        expected_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        train_single(expected, expected_opt, 2, first=3, n=world_size * B)
        assert_close(resumed, expected.state_dict())


class Strategy:  # stands in for Colossal-AI's TensorShardStrategy()
    pass


V01 = dict(model_config=dict(shard_strategy=Strategy(), reduce_scatter_bucket_size_mb=25,
                             fp32_reduce_scatter=False, tensor_placement_policy="cpu",
                             gradient_predivide_factor=1.0, reuse_fp16_shard=True),
           optimizer_config=dict(gpu_margin_mem_ratio=0.8, initial_scale=2**5, min_scale=1,
                                 growth_factor=2, backoff_factor=0.5, growth_interval=1000,
                                 hysteresis=2, max_scale=2**32))


def test_zero_v01_config_is_level3_with_the_scaler_keys_mapped():
    settings, scaler, notes = zero_settings(load_config({"zero": V01}))
    assert settings == dict(level=3, offload="cpu") and scaler == {}  # no fp16: no scaler
    assert any("initial_scale" in n and "no fp16" in n for n in notes)
    ignored = {"shard_strategy", "reduce_scatter_bucket_size_mb", "fp32_reduce_scatter",
               "gradient_predivide_factor", "reuse_fp16_shard",
               "gpu_margin_mem_ratio"}
    assert all(any(f"{key}" in n for n in notes) for key in ignored)
    cfg = load_config({"zero": V01, "fp16": dict(mode=AMP_TYPE.TORCH, dtype="float16")})
    assert zero_settings(cfg)[1] == dict(init_scale=2**5, min_scale=1, growth_factor=2,
                                         backoff_factor=0.5, growth_interval=1000, hysteresis=2,
                                         max_scale=2**32)


@pytest.mark.parametrize("zero, message", [
    (dict(model_config=dict(shard_strategy=None, bogus=1)), "zero.model_config: unknown key"),
    (dict(optimizer_config=dict(lr=1)), "zero.optimizer_config: unknown key(s) ['lr']"),
    (dict(model_config=dict(tensor_placement_policy="disk")), "must be one of cuda, cpu, auto"),
    (dict(model_config={}, level=3), "beside model_config/optimizer_config"),
])
def test_zero_v01_config_errors(zero, message):
    with pytest.raises(ConfigError) as e:
        load_config({"zero": zero})
    assert message in str(e.value)


def _v01_worker(rank, world_size, port, fp16):
    config = {"zero": V01}
    if fp16:
        config["fp16"] = dict(mode=AMP_TYPE.TORCH, dtype="float16")
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("nanocolossal").addHandler(handler)
    model = Net()
    engine, *_ = nc.initialize(model, grouped_adamw(model), nn.CrossEntropyLoss(), verbose=False)
    logging.getLogger("nanocolossal").removeHandler(handler)
    assert isinstance(engine.optimizer, ParamShardedOptimizer) and _freed(engine.model)
    assert engine.optimizer.offload is not None  # tensor_placement_policy='cpu' (offload.py)
    scaler = engine.optimizer.scaler
    if fp16:
        return (scaler.scale, scaler.min_scale, scaler.growth_factor, scaler.backoff_factor,
                scaler.growth_interval, scaler.hysteresis, scaler.max_scale), logged
    assert scaler is None
    train_engine(engine, 3, rank, world_size, 1)
    single = Net()
    train_single(single, grouped_adamw(single), 3, n=world_size * B)
    assert_close(engine.model.state_dict(), single.state_dict())
    return None, logged


def test_deep_zero_v01_config_trains_as_level3_and_sets_the_scaler():
    scaler, logged = run_ranks(_v01_worker, 2, True, timeout=60)[0]
    assert scaler == (2**5, 1, 2, 0.5, 1000, 2, 2**32)
    _, logged = run_ranks(_v01_worker, 2, False, timeout=60)[0]
    assert any("shard_strategy ignored" in line for line in logged), logged


def _branch_on_one_rank_worker(rank, world_size, port):
    engine = launch_net(rank, world_size, port, {"zero": dict(level=3), "debug": True})
    engine.model.use_side = rank == 0  # rank 0 alone runs the unit `side`
    xs, ys = net_batch(0, world_size * B)
    with pytest.raises(RuntimeError) as e:
        engine.zero_grad()
        engine.backward(engine.criterion(engine(xs[rank * B:(rank + 1) * B]),
                                         ys[rank * B:(rank + 1) * B]))
    return str(e.value)


def test_deep_zero3_debug_names_a_unit_only_some_ranks_run():
    """Level 3 needs every data rank to gather the same units; with debug=True each gather first
    checks it (one small all-reduce), so a branch taken on one rank is an error on every rank
    naming the unit, not mis-paired gathers."""
    said = run_ranks(_branch_on_one_rank_worker, 2, timeout=60)
    assert said[0].startswith("[rank 0] zero level 3: this rank gathers unit 'side' while "
                              "another data rank gathers another"), said
    # rank 1, done with its forward, counts the loss's targets (loss_weights.py) meanwhile
    assert said[1].startswith("[rank 1] the loss's target count (loss_weights.py) is "
                              "all-reduced here while another data rank runs another"), said


class Twins(nn.Module):
    """Two children of the same size; `use_left` picks one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.left, self.right = nn.Linear(6, 7), nn.Linear(7, 5), nn.Linear(7, 5)
        self.use_left = True

    def forward(self, x):
        h = torch.tanh(self.first(x))
        return self.left(h) if self.use_left else self.right(h)


def _twins_worker(rank, world_size, port, left_on):
    nc.launch({"zero": dict(level=3)}, rank=rank, world_size=world_size, host="127.0.0.1",
              port=port)
    model = Twins()
    engine, *_ = nc.initialize(model, torch.optim.AdamW(model.parameters(), lr=0.02),
                               nn.CrossEntropyLoss(), verbose=False)
    xs, ys = net_batch(0, world_size * B)
    for step in range(2):
        engine.model.use_left = rank in left_on
        engine.zero_grad()
        engine.backward(engine.criterion(engine(xs[rank * B:(rank + 1) * B]),
                                         ys[rank * B:(rank + 1) * B]))
        try:
            engine.step()
        except RuntimeError as e:
            return str(e)
    return {k: v.clone() for k, v in engine.model.state_dict().items()}


def test_deep_zero3_same_sized_units_run_on_different_ranks_are_refused_at_the_step():
    """Without debug: rank 0 runs `left`, rank 1 the same-sized `right`, so each gather pairs
    one rank's shard of `left` with the other's of `right` -- no size mismatch to abort on. The
    step's order check refuses it on every rank before anything wrong is applied; the same
    branch on every rank trains on."""
    said = run_ranks(_twins_worker, 2, {0}, timeout=60)
    for rank, message in enumerate(said):
        assert isinstance(message, str) and message.startswith(
            f"[rank {rank}] zero level 3: the data ranks gathered different units since the "
            f"last step"), said
    assert "left" in said[0] and "right" in said[1], said
    both = run_ranks(_twins_worker, 2, {0, 1}, timeout=60)
    assert isinstance(both[0], dict) and isinstance(both[1], dict), both
    assert_close(both[0], both[1], rtol=0, atol=0)


V, T, D = 11, 5, 8  # vocabulary, sequence, width of the GPT-like models below


class Block(nn.Module):
    """Causal self-attention and an MLP, residual; `ckpt` (use_reentrant) recomputes the MLP
    under activation checkpointing."""

    def __init__(self, ckpt=None) -> None:
        super().__init__()
        self.ln1, self.qkv, self.proj = nn.LayerNorm(D), nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.ln2, self.fc, self.out = nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.ckpt = ckpt

    def mlp(self, x):
        return self.out(torch.tanh(self.fc(self.ln2(x))))

    def forward(self, x):
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        if self.ckpt is None:
            return x + self.mlp(x)
        return x + checkpoint(self.mlp, x, use_reentrant=self.ckpt)


class ListGPT(nn.Module):
    """Blocks in an nn.ModuleList; `ckpt` inside each block, or `whole`: each block checkpointed
    from the model's forward (use_reentrant); `shared`: one block, called twice."""

    def __init__(self, ckpt=None, whole=None, shared=False) -> None:
        super().__init__()
        self.wte, self.ln_f, self.head = nn.Embedding(V, D), nn.LayerNorm(D), nn.Linear(D, V)
        self.blocks = nn.ModuleList(Block(ckpt) for _ in range(1 if shared else 2))
        self.whole, self.shared = whole, shared

    def forward(self, idx):
        x = self.wte(idx)
        for block in [*self.blocks] * (2 if self.shared else 1):
            x = block(x) if self.whole is None else checkpoint(block, x, use_reentrant=self.whole)
        return self.head(self.ln_f(x)).flatten(0, 1)


class NanoGPT(nn.Module):
    """nanoGPT's layout: a ModuleDict holding a ModuleList; the head is the token embedding,
    read by the model's own forward (F.linear), outside the embedding's unit."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(V, D), wpe=nn.Embedding(T, D),
            h=nn.ModuleList(Block() for _ in range(2)), ln_f=nn.LayerNorm(D)))

    def forward(self, idx):
        tr = self.transformer
        x = tr.wte(idx) + tr.wpe(torch.arange(idx.shape[1]))
        for block in tr.h:
            x = block(x)
        return F.linear(tr.ln_f(x), tr.wte.weight).flatten(0, 1)


def test_zero3_units_are_the_modules_that_run():
    """Containers are opened (a ModuleDict, a ModuleList, a Sequential): nanoGPT's units are its
    embeddings, each block and the final norm; a weight two units share is the root unit's."""
    model = NanoGPT()
    model.head = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, V, bias=False))
    model.head[2].weight = model.transformer.wte.weight
    units, unit_of = plan_units(model, list(model.parameters()))
    names = {id(m): n for n, m in model.named_modules()}
    assert [names[id(u)] for u in units] == [
        "transformer.wte", "transformer.wpe", "transformer.h.0", "transformer.h.1",
        "transformer.ln_f", "head.0", "head.1", "head.2"]
    assert unit_of[id(model.transformer.wte.weight)] == len(units)
    assert unit_of[id(model.head[0].weight)] == 5


KINDS = {  # name: (model, ranks, forwards before each backward, gradient accumulation)
    "ModuleList of blocks": (ListGPT, 2, 1, 1),
    "nanoGPT ModuleDict, head tied by F.linear": (NanoGPT, 3, 1, 1),
    "one block called twice": (partial(ListGPT, shared=True), 2, 1, 1),
    "siamese: two forwards, one backward, accumulation 2": (ListGPT, 2, 2, 2),
    "checkpointing in a block, reentrant": (partial(ListGPT, ckpt=True), 2, 1, 1),
    "checkpointing in a block, non-reentrant": (partial(ListGPT, ckpt=False), 2, 1, 1),
    "blocks checkpointed whole, reentrant": (partial(ListGPT, whole=True), 2, 1, 1),
    "blocks checkpointed whole, non-reentrant": (partial(ListGPT, whole=False), 2, 1, 1),
}


def _model(kind):
    torch.manual_seed(0)
    return KINDS[kind][0]().double()


def _tokens(step, n):
    g = torch.Generator().manual_seed(200 + step)
    return torch.randint(0, V, (n, T), generator=g), torch.randint(0, V, (n, T), generator=g)


def _kind_steps(kind, model_loss, ranks, rank=None, steps=3):
    """Yields (last micro-step of its step?, loss): each step `accum` micro-steps of `forwards`
    forwards on B samples per rank (rank None: one process, on every rank's); model_loss(idx,
    targets) runs a forward and returns its loss, summed over the forwards."""
    _, _, forwards, accum = KINDS[kind]
    n = B if rank is not None else ranks * B
    for step in range(steps):
        idx, tgt = _tokens(step, accum * forwards * ranks * B)
        for micro in range(accum):
            at = [((micro * forwards + f) * ranks + (rank or 0)) * B for f in range(forwards)]
            yield micro == accum - 1, sum(model_loss(idx[a:a + n], tgt[a:a + n].flatten())
                                          for a in at)


def _kind_worker(rank, world_size, port, kind):
    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("nanocolossal").addHandler(handler)
    nc.launch({"zero": dict(level=3), "gradient_accumulation": KINDS[kind][3]}, rank=rank,
              world_size=world_size, host="127.0.0.1", port=port)
    model = _model(kind)
    engine, *_ = nc.initialize(model, torch.optim.AdamW(model.parameters(), lr=0.01),
                               nn.CrossEntropyLoss(), verbose=False)
    for _, loss in _kind_steps(kind, lambda x, y: engine.criterion(engine(x), y), world_size,
                               rank):
        engine.zero_grad()
        engine.backward(loss)
        engine.step()
    assert _freed(engine.model)
    logging.getLogger("nanocolossal").removeHandler(handler)
    return engine.model.state_dict(), [line for line in logged if "zero level 3" in line]


@pytest.mark.parametrize("kind", KINDS)
def test_deep_zero3_models_as_written_train_as_one_process(kind):
    """Units are the modules that run (blocks inside a ModuleList / ModuleDict); a unit called
    twice, two forwards before one backward and activation checkpointing (in a block, or of
    whole blocks) give one process's parameters after 3 AdamW steps; a head reading the
    embedding's weight outside its unit moves that unit to the root unit, and says so."""
    ranks, accum = KINDS[kind][1], KINDS[kind][3]
    single = _model(kind)
    opt = torch.optim.AdamW(single.parameters(), lr=0.01)
    for last, loss in _kind_steps(kind, lambda x, y: F.cross_entropy(single(x), y), ranks):
        (loss / accum).backward()
        if last:
            opt.step()
            opt.zero_grad()
    results = run_ranks(_kind_worker, ranks, kind, timeout=90)
    for state, _ in results:
        assert_close(state, single.state_dict())
    moved = ["zero level 3: transformer.wte.weight is read outside unit 'transformer.wte', which "
             "joins the root unit (gathered for the whole forward and backward)"]
    assert results[0][1] == (moved if kind.startswith("nanoGPT") else []), results[0][1]


def _penalty_worker(rank, world_size, port, first):
    nc.launch({"zero": dict(level=3)}, rank=rank, world_size=world_size, host="127.0.0.1",
              port=port)
    model = _model("ModuleList of blocks")
    engine, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               nn.CrossEntropyLoss(), verbose=False)
    before = engine.model.state_dict()
    x, y = _tokens(0, B)
    engine.zero_grad()
    try:
        penalty = lambda: sum((p ** 2).sum() for p in engine.model.parameters())  # noqa: E731
        before_forward = penalty() if first else 0.0  # (autograd reaches it after the units)
        loss = engine.criterion(engine(x), y.flatten())
        engine.backward(loss + 1e-3 * (before_forward if first else penalty()))
        engine.step()
    except RuntimeError as e:
        assert_close(engine.model.state_dict(), before)  # nothing applied
        return str(e)
    return "stepped"


@pytest.mark.parametrize("first", [False, True], ids=["after", "before"])
def test_deep_zero3_parameters_read_outside_the_forward_are_refused(first):
    """Between uses a rank holds only its shards: a parameter read in the loop (an L2 penalty
    over model.parameters(), computed after the forward or before it) reads NaN. Its gradient
    reaches the units before their reduction (the step refuses the NaN gradients) or after it
    (the end of backward refuses the late gradients): either way every rank stops, names a
    parameter and says where to compute the penalty, and nothing is applied."""
    start = "non-finite gradients (" if not first else ""
    for rank, message in enumerate(run_ranks(_penalty_worker, 2, first, timeout=60)):
        assert message.startswith(f"[rank {rank}] zero level 3: {start}") and \
            "inside the model's forward" in message, message
