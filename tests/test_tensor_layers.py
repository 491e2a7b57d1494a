"""Every tensor-parallel layer against the plain layer: 1d on 2 and 4 ranks, 2d on 4 ranks.

Each rank feeds its block of the same input and of the same output gradient; the gathered
output, the input gradient and every parameter's gathered gradient must equal the plain
layer's, and every parameter must start as exactly the plain layer's slice (same seed).
"""
import pytest
import torch
from dist_helpers import run_ranks
from torch import nn
from torch.testing import assert_close

import nanocolossal as nc
import nanocolossal.nn as col_nn
from nanocolossal.checkpoint import load_checkpoint, save_checkpoint
from nanocolossal.context import gpc
from nanocolossal.tensor import layers_1d, layers_2d
from nanocolossal.tensor.base import PatchEmbedding, gather_slices, sharded_dropout, slice_of
from nanocolossal.tensor.summa import summa_matmul

pytestmark = pytest.mark.timeout(120)

B, D, C, IMG, PATCH = 4, 8, 6, 8, 4
GRID = [(0, "row"), (-1, "col")]           # 2d activation: batch by grid row, hidden by grid column
HIDDEN_1D = [(-1, "tensor")]


def _lesson_worker(rank, world_size, port, xs, ys):
    nc.launch(dict(parallel=dict(tensor=dict(size=2, mode="1d"))), rank=rank,
              world_size=world_size, host="127.0.0.1", port=port)
    torch.manual_seed(0)  # each layer draws the plain layer's weights, then keeps its slice
    model = nn.Sequential(nn.LayerNorm(4), layers_1d.ColumnLinear1D(4, 8), nn.Tanh(),
                          layers_1d.RowLinear1D(8, 3)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    engine, *_ = nc.initialize(model, optimizer, nn.CrossEntropyLoss(), verbose=False)
    for x, y in zip(xs, ys):  # every rank the whole batch: the features are split, not the samples
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))
        engine.step()
    return engine.model.state_dict()  # my slices


def test_gloo_1d_linear_pair_on_two_ranks_equals_plain_linears():
    """A column-parallel Linear then a row-parallel one, each rank holding half of each weight
    (and a replicated LayerNorm before them), train as the plain layers do in one process:
    act(X A) B = sum_j act(X A_j) B_j."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    xs, ys = torch.randn(3, 8, 4, dtype=torch.float64), torch.randint(0, 3, (3, 8))  # 3 batches
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for x, y in zip(xs, ys):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    first, second = run_ranks(_lesson_worker, 2, xs, ys)
    split = {"1.weight": 0, "1.bias": 0, "3.weight": 1}  # column: by output, row: by input
    for key, value in model.state_dict().items():
        if key in split:
            assert_close(torch.cat([first[key], second[key]], split[key]), value,
                         msg=lambda m: f"{key}: {m}")
        else:  # replicated (the LayerNorm, the row-parallel bias): whole and equal on each rank
            for rank, state in enumerate((first, second)):
                assert_close(state[key], value, msg=lambda m: f"rank {rank} {key}: {m}")


def _inputs(kind):
    g = torch.Generator().manual_seed(7)
    if kind == "ids":
        return torch.randint(0, 10, (B, 3), generator=g)
    if kind == "images":
        return torch.randn(B, 3, IMG, IMG, generator=g)
    return torch.randn(B, 5, D, generator=g) if kind == "seq" else torch.randn(B, D, generator=g)


# (name, tensor-parallel factory, plain factory, input kind, input splits, output splits)
CASES_1D = [
    ("column", lambda: layers_1d.ColumnLinear1D(D, 2 * D), lambda: nn.Linear(D, 2 * D), "seq", [],
     HIDDEN_1D),
    ("row", lambda: layers_1d.RowLinear1D(2 * D, D), lambda: nn.Linear(2 * D, D), "seq2",
     HIDDEN_1D, []),
    ("embedding", lambda: layers_1d.Embedding1D(10, D), lambda: nn.Embedding(10, D), "ids", [], []),
    ("patch", lambda: layers_1d.PatchEmbedding1D(IMG, PATCH, 3, D),
     lambda: PatchEmbedding(IMG, PATCH, 3, D), "images", [], []),
    ("classifier", lambda: layers_1d.Classifier1D(D, C), lambda: nn.Linear(D, C), "flat", [], []),
]
CASES_2D = [
    ("linear", lambda: layers_2d.Linear2D(D, 2 * D), lambda: nn.Linear(D, 2 * D), "seq", GRID,
     GRID),
    ("layernorm", lambda: layers_2d.LayerNorm2D(D), lambda: nn.LayerNorm(D), "seq", GRID, GRID),
    ("embedding", lambda: layers_2d.Embedding2D(10, D), lambda: nn.Embedding(10, D), "ids", [],
     GRID),
    ("patch", lambda: layers_2d.PatchEmbedding2D(IMG, PATCH, 3, D),
     lambda: PatchEmbedding(IMG, PATCH, 3, D), "images", [], GRID),
    ("classifier", lambda: layers_2d.Classifier2D(D, C), lambda: nn.Linear(D, C), "flat", GRID,
     [(0, "row")]),
]


def _check_layer(name, make_tp, make_plain, kind, in_splits, out_splits):
    torch.manual_seed(0)
    plain = make_plain()
    torch.manual_seed(0)
    tp = make_tp()
    params = dict(tp.named_parameters())
    assert set(params) == set(dict(plain.named_parameters())), (
        f"{name}: state_dict keys are the plain layer's"
    )
    # the initialisation contract: shard == slice of the plain layer
    for key, p in plain.named_parameters():
        assert torch.equal(params[key],
                           slice_of(p.detach(), params[key].tensor_splits)), f"{name}.{key} init"
    for module in (plain, tp):  # same perturbation in both, drawn full and sliced
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for key, p in module.named_parameters():
                full = torch.randn(dict(plain.named_parameters())[key].shape, generator=g) * 0.1
                p.add_(slice_of(full, getattr(p, "tensor_splits", [])))
    x = _inputs("seq" if kind == "seq2" else kind)
    if kind == "seq2":
        x = torch.cat([x, x.flip(0)], dim=-1)
    floating = x.is_floating_point()
    x_plain = x.clone().requires_grad_(floating)
    x_tp = slice_of(x, in_splits).clone().requires_grad_(floating)
    y_plain = plain(x_plain)
    y_tp = tp(x_tp)
    dy = torch.randn(y_plain.shape, generator=torch.Generator().manual_seed(11))
    y_plain.backward(dy)
    y_tp.backward(slice_of(dy, out_splits))
    assert_close(gather_slices(y_tp.detach(), out_splits), y_plain.detach(),
                 msg=lambda m: f"{name} output: {m}")
    if floating:
        assert_close(gather_slices(x_tp.grad, in_splits), x_plain.grad,
                     msg=lambda m: f"{name} input grad: {m}")
    for key, p in plain.named_parameters():
        got = gather_slices(params[key].grad, params[key].tensor_splits)
        assert_close(got, p.grad, msg=lambda m: f"{name}.{key} grad: {m}")
    return name


def _layers_worker(rank, world_size, port, mode):
    nc.launch({"parallel": {"tensor": {"size": world_size, "mode": mode}}}, rank=rank,
              world_size=world_size, host="127.0.0.1", port=port)
    cases = CASES_2D if mode == "2d" else CASES_1D
    done = [_check_layer(*case) for case in cases]
    if mode == "2d":  # the loss: each row's block mean, averaged down the column
        logits = torch.randn(B, C, generator=torch.Generator().manual_seed(5))
        target = torch.arange(B) % C
        plain_logits = logits.clone().requires_grad_()
        nn.functional.cross_entropy(plain_logits, target).backward()
        mine = slice_of(logits, [(0, "row")]).clone().requires_grad_()
        loss = col_nn.CrossEntropyLoss()(mine, target)
        loss.backward()
        assert_close(loss, nn.functional.cross_entropy(logits, target))
        assert_close(gather_slices(mine.grad, [(0, "row")]), plain_logits.grad)
        done.append("loss")
    return done


@pytest.mark.parametrize("mode, world", [("1d", 2), ("1d", 4), ("2d", 4)])
def test_deep_tensor_parallel_layers_equal_the_plain_layers(mode, world):
    expected = [c[0] for c in (CASES_2D if mode == "2d" else CASES_1D)] + (
        ["loss"] if mode == "2d" else []
    )
    assert run_ranks(_layers_worker, world, mode, timeout=90) == [expected] * world


def _dropout_worker(rank, world_size, port):
    """Replicated activations must drop the same units on every tensor rank (they are one tensor);
    sharded ones draw their own masks (they are different slices)."""
    nc.launch({"parallel": {"tensor": {"size": world_size, "mode": "1d"}}}, rank=rank,
              world_size=world_size, host="127.0.0.1", port=port)
    col_nn.reset_1d_alternation()
    col_nn.Linear(8, 8)                      # column-parallel: what follows is sharded
    after_column = col_nn.Dropout(0.5)
    col_nn.Linear(8, 8)                      # row-parallel: what follows is replicated
    after_row = col_nn.Dropout(0.5)
    masks = [(d(torch.ones(64)) == 0).tolist() for d in (after_column, after_row)]
    everyone = [None] * world_size
    torch.distributed.all_gather_object(everyone, masks)
    return (
        after_column.sharded,
        after_row.sharded,
        everyone[0][0] != everyone[1][0],
        everyone[0][1] == everyone[1][1],
    )


def test_gloo_dropout_masks_differ_where_sharded_and_agree_where_replicated():
    assert run_ranks(_dropout_worker, 2, timeout=60) == [(True, False, True, True)] * 2


def _dropout_resume_worker(rank, world_size, port, path):
    """A checkpoint carries the sharded dropout's generator: after loading, the masks repeat."""
    nc.launch({"parallel": {"tensor": {"size": world_size, "mode": "1d"}}}, rank=rank,
              world_size=world_size, host="127.0.0.1", port=port)
    col_nn.reset_1d_alternation()
    # column-parallel: sharded dropout
    model = nn.Sequential(col_nn.Linear(8, 8), col_nn.Dropout(0.5))
    x = torch.ones(4, 8)
    model(x)  # the generator exists and has moved on
    save_checkpoint(path, 0, model)
    saved = model(x)
    gpc.dropout_generators.clear()  # as in a fresh process, which then draws on for a while
    model(x), model(x)
    load_checkpoint(path, model)
    return torch.equal(model(x), saved)


def test_gloo_checkpoint_restores_the_sharded_dropout_generator(tmp_path):
    assert run_ranks(_dropout_resume_worker, 2, str(tmp_path / "ckpt.pt"),
                     timeout=60) == [True, True]


# The 2d loss against F.cross_entropy on the whole batch: B = 8 on a 2 x 2 grid, so each grid row
# holds 4 samples. Class 1 is the target of 3 samples of row 0 and of none of row 1: ignoring it
# (or weighting classes) makes the rows count differently, which a mean of row means gets wrong.
LOSS_TARGET = [1, 1, 1, 0, 2, 3, 4, 5]
LOSS_WEIGHT = [0.5, 2.0, 1.0, 3.0, 1.5, 0.25]
LOSS_CASES = {
    "mean": {}, "sum": {"reduction": "sum"}, "none": {"reduction": "none"},
    "ignore_index": {"ignore_index": 1},
    "ignore_index sum": {"ignore_index": 1, "reduction": "sum"},
    "ignore_index none": {"ignore_index": 1, "reduction": "none"},
    "weight": {"weight": LOSS_WEIGHT}, "label_smoothing": {"label_smoothing": 0.1},
    "all at once": {"weight": LOSS_WEIGHT, "ignore_index": 1, "label_smoothing": 0.2},
}


def _loss_case(name, kwargs, logits, target, upstream):
    kwargs = {k: torch.tensor(v) if k == "weight" else v for k, v in kwargs.items()}
    plain_logits = logits.clone().requires_grad_()
    want = nn.functional.cross_entropy(plain_logits, target, **kwargs)
    mine = slice_of(logits, [(0, "row")]).clone().requires_grad_()  # this grid row's samples
    loss = col_nn.CrossEntropyLoss(**kwargs)(mine, target)
    if kwargs.get("reduction") == "none":  # this row's samples' losses, laid out as the logits
        assert_close(gather_slices(loss.detach(), [(0, "row")]), want.detach(),
                     msg=lambda m: f"{name} losses: {m}")
        want.backward(upstream)
        loss.backward(slice_of(upstream, [(0, "row")]))
    else:
        assert_close(loss.detach(), want.detach(), msg=lambda m: f"{name} loss: {m}")
        want.backward()
        loss.backward()
    assert_close(gather_slices(mine.grad, [(0, "row")]), plain_logits.grad,
                 msg=lambda m: f"{name} logits gradient: {m}")


def _loss_2d_worker(rank, world_size, port):
    nc.launch({"parallel": {"tensor": {"size": 4, "mode": "2d"}}}, rank=rank,
              world_size=world_size, host="127.0.0.1", port=port)
    g = torch.Generator().manual_seed(5)
    logits, target = torch.randn(8, C, generator=g), torch.tensor(LOSS_TARGET)
    upstream = torch.rand(8, generator=g) + 0.5  # reduction 'none': any gradient of the losses
    wrong = {}
    for name, kwargs in LOSS_CASES.items():
        try:
            _loss_case(name, kwargs, logits, target, upstream)
        except (AssertionError, RuntimeError) as e:  # every case's failure, not just the first
            wrong[name] = str(e).splitlines()[0]
    try:
        col_nn.CrossEntropyLoss(size_average=False)  # torch's deprecated spelling
        wrong["size_average"] = "accepted, not a clear error"
    except TypeError as e:
        if "size_average" not in str(e):
            wrong["size_average"] = str(e)
    return wrong


def test_deep_2d_cross_entropy_equals_the_whole_batchs_for_every_reduction():
    assert run_ranks(_loss_2d_worker, 4, timeout=90) == [{}] * 4


def _summa_worker(rank, world_size, port):
    """summa_matmul(x, w) computes x @ w^T on the grid; here both operands are transposed views
    (as `summa_matmul(x, w.t())` of a weight stored [in, out]): strides other than contiguous."""
    nc.launch({"parallel": {"tensor": {"size": 4, "mode": "2d"}}}, rank=rank,
              world_size=world_size, host="127.0.0.1", port=port)
    g = torch.Generator().manual_seed(9)
    x, w = torch.randn(4, 6, generator=g), torch.randn(6, 10, generator=g)  # w: [in, out]
    x_plain, w_plain = x.clone().requires_grad_(), w.clone().requires_grad_()
    dy = torch.randn(4, 10, generator=g)
    (x_plain @ w_plain).backward(dy)
    # my blocks, stored transposed: x's [in/q, b/q] block and w's [in/q, out/q] block
    x_t = slice_of(x.t(), [(1, "row"), (0, "col")]).clone(memory_format=torch.contiguous_format)
    w_io = slice_of(w, [(0, "row"), (1, "col")]).clone(memory_format=torch.contiguous_format)
    x_t.requires_grad_(), w_io.requires_grad_()
    assert not x_t.t().is_contiguous() and not w_io.t().is_contiguous()
    y = summa_matmul(x_t.t(), w_io.t())
    y.backward(slice_of(dy, GRID))
    assert_close(gather_slices(y.detach(), GRID), (x @ w), msg=lambda m: f"output: {m}")
    assert_close(gather_slices(x_t.grad.t(), GRID), x_plain.grad, msg=lambda m: f"x grad: {m}")
    assert_close(gather_slices(w_io.grad, [(0, "row"), (1, "col")]), w_plain.grad,
                 msg=lambda m: f"w grad: {m}")
    return True


def test_deep_summa_of_transposed_views_equals_the_plain_product():
    assert run_ranks(_summa_worker, 4, timeout=60) == [True] * 4


def _stage_dropout_worker(rank, world_size, port):
    """pipeline 2 x 1d 2: each (stage, tensor rank) draws its own sharded dropout masks."""
    nc.launch({"parallel": {"pipeline": 2, "tensor": {"size": 2, "mode": "1d"}}}, rank=rank,
              world_size=world_size, host="127.0.0.1", port=port)
    mask = (sharded_dropout(torch.ones(256), 0.5, True) == 0).tolist()
    state = gpc.dropout_generators[torch.device("cpu")].get_state().tolist()
    everyone = [None] * world_size
    torch.distributed.all_gather_object(everyone, (gpc.pipeline_rank, gpc.tensor_rank, mask))
    return everyone, state


def test_deep_sharded_dropout_masks_differ_between_pipeline_stages():
    first = run_ranks(_stage_dropout_worker, 4, timeout=60)
    states = [state for _, state in first]
    everyone = {(p, t): mask for p, t, mask in first[0][0]}
    assert sorted(everyone) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for t in range(2):
        assert everyone[(0, t)] != everyone[(1, t)], (
            f"tensor rank {t} draws the same sharded dropout mask on stage 0 and stage 1"
        )
    for p in range(2):
        assert everyone[(p, 0)] != everyone[(p, 1)], f"stage {p}: the tensor ranks' masks agree"
    assert len({tuple(s) for s in states}) == 4, "each (stage, tensor rank) has its own generator"
    again = run_ranks(_stage_dropout_worker, 4, timeout=60)
    assert again == first, "the same seed draws the same masks again"


def _layernorm_half_worker(rank, world_size, port, dtype):
    """LayerNorm2D in half precision, and torch's LayerNorm in the same precision, against torch's
    in float32 on the same inputs: activations near 100 (their squares overflow fp16) and tiny
    ones (std 0.02, as after an embedding). Per case: the relative errors of the output and the
    input gradient, ours and torch's, and whether ours are finite."""
    nc.launch({"parallel": {"tensor": {"size": world_size, "mode": "2d"}}}, rank=rank,
              world_size=world_size, host="127.0.0.1", port=port)
    cut, cases = [(0, "row"), (1, "col")], []

    def run(layer, x, dy):
        x = x.clone().requires_grad_()
        y = layer(x)
        (y * dy).sum().backward()
        return y.detach().float(), x.grad.float()

    def error(got, want):
        return ((got - want).abs().max() / want.abs().max()).item()
    for scale, offset in ((0.02, 0.0), (3.0, 100.0)):
        g = torch.Generator().manual_seed(3)
        x = (torch.randn(4, 16, generator=g) * scale + offset).to(dtype)
        dy = (torch.randn(4, 16, generator=g) * 50).to(dtype)
        torch.manual_seed(0)
        mine = layers_2d.LayerNorm2D(16).to(dtype)
        y32, dx32 = (slice_of(t, cut) for t in run(nn.LayerNorm(16), x.float(), dy.float()))
        y_torch, dx_torch = (slice_of(t, cut) for t in run(nn.LayerNorm(16).to(dtype), x, dy))
        y_ours, dx_ours = run(mine, slice_of(x, cut), slice_of(dy, cut))
        cases.append((error(y_ours, y32), error(dx_ours, dx32), error(y_torch, y32),
                      error(dx_torch, dx32), bool(dx_ours.isfinite().all())))
    return cases


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_deep_layernorm_2d_in_half_precision_keeps_float32_statistics(dtype):
    """As precise as torch's own LayerNorm in that precision (a few ulps of slack)."""
    for cases in run_ranks(_layernorm_half_worker, 4, dtype):
        for y_ours, dx_ours, y_torch, dx_torch, finite in cases:
            assert finite, cases
            assert y_ours <= max(2 * y_torch, 1e-2) and dx_ours <= max(2 * dx_torch, 1e-2), cases
