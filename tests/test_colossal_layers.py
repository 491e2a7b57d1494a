"""Colossal-AI's layer classes and their arguments (nanocolossal.nn.Linear1D_Col, ...), ported
from Colossal-AI's own 1d and 2d layer checks: each against the plain torch layer on the whole
tensors -- every parameter starts as the plain one's slice (initializers included), and the
output, the input gradient and every parameter gradient are the plain ones' blocks.

Each argument has a case that fails if it were ignored: a different shape (gather_output,
parallel_input, reduction=False), a tuple (skip_bias_add), a parameter the plain model lacks
(weight tying, bias=False), other numbers (initializers, padding_idx, class weights), a dtype,
or a count of all-reduces (stream_chunk_num)."""
import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_ranks
from torch import nn
from torch.nn import functional as F
from torch.testing import assert_close

import nanocolossal as nc
import nanocolossal.nn as col_nn
from nanocolossal.context import gpc
from nanocolossal.tensor.base import PatchEmbedding, slice_of

pytestmark = pytest.mark.timeout(120)

B, S, D, V, PAD = 4, 3, 8, 16, 5
COL = [(-1, "tensor")]                       # 1d: last dimension split
ACT = [(0, "row"), (-1, "col")]              # 2d: batch by grid row, last dim by grid column
ROWS = [(0, "row")]                          # 2d: this grid row's samples


def w_init(tensor, fan_in, fan_out):
    """A Colossal-AI-style initializer whose numbers show the fans it was given."""
    return nn.init.normal_(tensor, mean=1.0 / fan_out, std=1.0 / fan_in)


def b_init(tensor, fan_in, fan_out=None):
    return nn.init.uniform_(tensor, fan_in, fan_in + 1.0)


def pos_init(tensor, fan_in=None, fan_out=None):
    return nn.init.uniform_(tensor, -3.0, 3.0)


def _inited(plain, weight=None, bias=None):
    """The plain layer initialised as the Colossal-AI layer is asked to (fans as dicts)."""
    with torch.no_grad():
        if weight is not None:
            w_init(plain.weight, **weight)
        if bias is not None:
            b_init(plain.bias, **bias)
    return plain


def _embedding(vocab=V):
    plain = _inited(nn.Embedding(vocab, D, padding_idx=PAD), {"fan_in": vocab, "fan_out": D})
    with torch.no_grad():
        plain.weight[PAD].zero_()
    return plain


def _tied(embedding, classifier_bias_fans):
    classifier = nn.Linear(D, V)
    classifier.weight = embedding.weight
    return nn.Sequential(embedding, _inited(classifier, bias=classifier_bias_fans))


def _data(kind, dtype=torch.float32):
    g = torch.Generator().manual_seed(7)
    if kind == "ids":
        ids = torch.randint(0, V, (B, S), generator=g)
        ids[0, 0] = PAD  # the padding row is looked up, and must get no gradient
        return ids
    shape = {"flat": (B, D), "seq": (B, S, D), "wide": (B, 2 * D), "images": (B, 3, 4, 4)}[kind]
    return torch.randn(*shape, generator=g, dtype=dtype)


def _compare(name, make, make_plain, x, x_cut, y_cut, call=None):
    """Forward and backward of `make()` on my block of x against `make_plain()` on all of x."""
    torch.manual_seed(0)
    layer = make()
    torch.manual_seed(0)
    plain = make_plain()
    mine_params = dict(layer.named_parameters())
    assert mine_params.keys() == dict(plain.named_parameters()).keys(), name
    for key, p in mine_params.items():
        whole = plain.get_parameter(key)
        assert p.dtype == whole.dtype, f"{name}: {key} dtype"
        assert torch.equal(p.detach(), slice_of(whole.detach(), p.tensor_splits)), f"{name}: {key}"
    grads = x.is_floating_point()
    mine_x = slice_of(x, x_cut).clone().requires_grad_(grads)
    whole_x = x.clone().requires_grad_(grads)
    y = call(layer, mine_x) if call else layer(mine_x)
    whole_y = plain(whole_x)
    assert_close(y, slice_of(whole_y, y_cut), msg=lambda m: f"{name}: {m}")
    upstream = torch.linspace(-1.0, 1.0, whole_y.numel(), dtype=whole_y.dtype)
    upstream = upstream.reshape(whole_y.shape)
    (y * slice_of(upstream, y_cut)).sum().backward()
    (whole_y * upstream).sum().backward()
    if grads:
        assert_close(mine_x.grad, slice_of(whole_x.grad, x_cut), msg=lambda m: f"{name}: {m}")
    for key, p in mine_params.items():
        whole = plain.get_parameter(key).grad
        assert_close(p.grad, slice_of(whole, p.tensor_splits), msg=lambda m: f"{name} {key}: {m}")


def _add_skipped_bias(layer, x):
    out = layer(x)
    assert isinstance(out, tuple), "skip_bias_add must return (output, bias)"
    return out[0] + out[1]


def _compare_loss(name, loss_fn, kwargs, logits, target, logit_cut, loss_cut):
    """The loss of my logits block (and all the targets) against F.cross_entropy on all."""
    mine = slice_of(logits, logit_cut).clone().requires_grad_()
    whole = logits.clone().requires_grad_()
    loss = loss_fn(mine, target)
    ref = F.cross_entropy(whole.reshape(-1, whole.shape[-1]), target.reshape(-1), **kwargs)
    ref = ref.reshape(target.shape) if ref.dim() else ref
    assert_close(loss, slice_of(ref, loss_cut), msg=lambda m: f"{name}: {m}")
    upstream = torch.linspace(0.5, 1.5, ref.numel()).reshape(ref.shape)
    (loss * slice_of(upstream, loss_cut)).sum().backward()
    (ref * upstream).sum().backward()
    assert_close(mine.grad, slice_of(whole.grad, logit_cut), msg=lambda m: f"{name}: {m}")


def _launch(rank, world_size, port, mode):
    nc.launch({"parallel": {"tensor": {"size": world_size, "mode": mode}}}, rank=rank,
              world_size=world_size, host="127.0.0.1", port=port)


def _worker_1d(rank, world_size, port):
    _launch(rank, world_size, port, "1d")
    col, row = {"fan_in": D, "fan_out": 2 * D}, {"fan_in": 2 * D, "fan_out": D}
    _compare("Linear1D_Col", lambda: col_nn.Linear1D_Col(
        D, 2 * D, weight_initializer=w_init, bias_initializer=b_init),
        lambda: _inited(nn.Linear(D, 2 * D), col, {"fan_in": D}), _data("flat"), [], COL)
    _compare("Linear1D_Col gather_output", lambda: col_nn.Linear1D_Col(
        D, 2 * D, gather_output=True), lambda: nn.Linear(D, 2 * D), _data("seq"), [], [])
    _compare("Linear1D_Col skip_bias_add gather_output", lambda: col_nn.Linear1D_Col(
        D, 2 * D, gather_output=True, skip_bias_add=True), lambda: nn.Linear(D, 2 * D),
        _data("flat"), [], [], call=_add_skipped_bias)
    _compare("Linear1D_Col dtype", lambda: col_nn.Linear1D_Col(D, 2 * D, dtype=torch.float64),
             lambda: nn.Linear(D, 2 * D).double(), _data("flat", torch.float64), [], COL)
    _compare("Linear1D_Row", lambda: col_nn.Linear1D_Row(
        2 * D, D, weight_initializer=w_init, bias_initializer=b_init),
        lambda: _inited(nn.Linear(2 * D, D), row, {"fan_in": 2 * D}), _data("wide"), COL, [])
    _compare("Linear1D_Row parallel_input=False", lambda: col_nn.Linear1D_Row(
        2 * D, D, parallel_input=False), lambda: nn.Linear(2 * D, D), _data("wide"), [], [])
    _compare("Linear1D_Row skip_bias_add", lambda: col_nn.Linear1D_Row(
        2 * D, D, skip_bias_add=True), lambda: nn.Linear(2 * D, D), _data("wide"), COL, [],
        call=_add_skipped_bias)
    for name, cls in (("Embedding1D", col_nn.Embedding1D),
                      ("VocabParallelEmbedding1D", col_nn.VocabParallelEmbedding1D)):
        _compare(name, lambda: cls(V, D, PAD, None, w_init), _embedding, _data("ids"), [], [])
    _compare("Classifier1D", lambda: col_nn.Classifier1D(
        D, V, weight_initializer=w_init, bias_initializer=b_init),
        lambda: _inited(nn.Linear(D, V), {"fan_in": D, "fan_out": V}, {"fan_in": D}),
        _data("flat"), [], [])
    _compare("Classifier1D tied", lambda: _tie(col_nn.Embedding1D, col_nn.Classifier1D),
             lambda: _tied(nn.Embedding(V, D), {"fan_in": D}), _data("ids"), [], [])
    _compare("VocabParallelClassifier1D", lambda: col_nn.VocabParallelClassifier1D(
        D, V, weight_initializer=w_init, bias_initializer=b_init),
        lambda: _inited(nn.Linear(D, V), {"fan_in": D, "fan_out": V}, {"fan_in": D}),
        _data("seq"), [], COL)
    _compare("VocabParallelClassifier1D tied gather_output", lambda: _tie(
        col_nn.VocabParallelEmbedding1D, col_nn.VocabParallelClassifier1D, gather_output=True),
        lambda: _tied(nn.Embedding(V, D), {"fan_in": D}), _data("ids"), [], [])
    logits, target = torch.randn(B, S, V), torch.randint(0, V, (B, S))
    _compare_loss("VocabParallelCrossEntropyLoss1D", col_nn.VocabParallelCrossEntropyLoss1D(),
                  {}, logits, target, COL, [])
    _compare_loss("VocabParallelCrossEntropyLoss1D reduction=False",
                  col_nn.VocabParallelCrossEntropyLoss1D(reduction=False),
                  {"reduction": "none"}, logits, target, COL, [])
    _stream_chunks()
    return _dropout_masks(), _errors_1d()


def _tie(embedding_cls, classifier_cls, **kwargs):
    embedding = embedding_cls(V, D)
    # a tied table is the embedding's: the classifier's weight_initializer leaves it alone
    classifier = classifier_cls(D, V, embedding.weight, True, weight_initializer=w_init,
                                bias_initializer=b_init, **kwargs)
    assert classifier.weight is embedding.weight
    return nn.Sequential(embedding, classifier)


def _stream_chunks():
    """stream_chunk_num=4: the same output from 4 all-reduces instead of 1; training refuses."""
    torch.manual_seed(0)
    layer = col_nn.Linear1D_Row(2 * D, D, stream_chunk_num=4).eval()
    torch.manual_seed(0)
    plain = nn.Linear(2 * D, D)
    x = _data("wide")
    calls, all_reduce = [], dist.all_reduce
    dist.all_reduce = lambda *a, **k: calls.append(1) or all_reduce(*a, **k)
    try:
        y = layer(slice_of(x, COL))
    finally:
        dist.all_reduce = all_reduce
    assert_close(y, plain(x))
    assert len(calls) == 4, f"{len(calls)} all-reduces"
    with pytest.raises(RuntimeError, match="stream_chunk_num"):
        layer.train()(slice_of(x, COL))


def _dropout_masks():
    """Dropout1D's mask after each kind of layer (the test compares them across ranks)."""
    masks = {}
    for name, before in (("split", lambda: col_nn.Linear1D_Col(D, 2 * D)),
                         ("gathered", lambda: col_nn.Linear1D_Col(D, 2 * D, gather_output=True)),
                         ("row", lambda: col_nn.Linear1D_Row(2 * D, D))):
        before()
        masks[name] = col_nn.Dropout1D(0.5)(torch.ones(64)) > 0
    return masks


def _errors_1d():
    builds = {
        "skip_bias_add": lambda: col_nn.Linear1D_Col(D, D, bias=False, skip_bias_add=True),
        "max_norm": lambda: col_nn.Embedding1D(V, D, None, None, None, 1.0),
        "sparse": lambda: col_nn.VocabParallelEmbedding1D(V, D, sparse=True),
        "Linear2D is a 2d layer": lambda: col_nn.Linear2D(D, D),
        "stream_chunk_num": lambda: col_nn.Linear1D_Row(D, D, stream_chunk_num=0),
    }
    return {name: _message(build) for name, build in builds.items()}


def _message(build):
    try:
        build()
    except (ValueError, TypeError) as e:
        return str(e)
    return "no error"


def _worker_2d(rank, world_size, port):
    _launch(rank, world_size, port, "2d")
    assert (gpc.grid_row, gpc.grid_col) == divmod(gpc.tensor_rank, 2)
    assert (gpc.tensor_row_rank, gpc.tensor_col_rank) == (gpc.grid_col, gpc.grid_row)
    assert dist.get_rank(gpc.tensor_row_group) == gpc.grid_col  # my place along my row
    fans = {"fan_in": D, "fan_out": D}
    _compare("Linear2D", lambda: col_nn.Linear2D(
        D, D, weight_initializer=w_init, bias_initializer=b_init),
        lambda: _inited(nn.Linear(D, D), fans, {"fan_in": D}), _data("seq"), ACT, ACT)
    _compare("Linear2D dtype", lambda: col_nn.Linear2D(D, D, dtype=torch.float64),
             lambda: nn.Linear(D, D).double(), _data("seq", torch.float64), ACT, ACT)
    _compare("Linear2D skip_bias_add", lambda: col_nn.Linear2D(D, D, skip_bias_add=True),
             lambda: nn.Linear(D, D), _data("seq"), ACT, ACT, call=_add_skipped_bias)
    _compare("LayerNorm2D bias=False", lambda: col_nn.LayerNorm2D(D, bias=False),
             lambda: nn.LayerNorm(D, bias=False), _data("seq"), ACT, ACT)
    _compare("LayerNorm2D dtype", lambda: col_nn.LayerNorm2D(D, 1e-5, True, torch.float64),
             lambda: nn.LayerNorm(D).double(), _data("seq", torch.float64), ACT, ACT)
    for name, cls in (("Embedding2D", col_nn.Embedding2D),
                      ("VocabParallelEmbedding2D", col_nn.VocabParallelEmbedding2D)):
        _compare(name, lambda: cls(V, D, PAD, weight_initializer=w_init), _embedding,
                 _data("ids"), [], ACT)
    _compare("PatchEmbedding2D", lambda: col_nn.PatchEmbedding2D(
        4, (2, 2), 3, D, weight_initializer=w_init, bias_initializer=b_init,
        position_embed_initializer=pos_init), _patch_embedding, _data("images"), [], ACT)
    _compare("Classifier2D", lambda: col_nn.Classifier2D(
        D, V, weight_initializer=w_init, bias_initializer=b_init),
        lambda: _inited(nn.Linear(D, V), {"fan_in": D, "fan_out": V}, {"fan_in": D}),
        _data("flat"), ACT, ROWS)
    _compare("Classifier2D tied", lambda: _tie(col_nn.Embedding2D, col_nn.Classifier2D),
             lambda: _tied(nn.Embedding(V, D), {"fan_in": D}), _data("ids"), [], ROWS)
    _compare("VocabParallelClassifier2D", lambda: col_nn.VocabParallelClassifier2D(
        D, V, weight_initializer=w_init, bias_initializer=b_init),
        lambda: _inited(nn.Linear(D, V), {"fan_in": D, "fan_out": V}, {"fan_in": D}),
        _data("seq"), ACT, ACT)
    _compare("VocabParallelClassifier2D tied", lambda: _tie(
        col_nn.VocabParallelEmbedding2D, col_nn.VocabParallelClassifier2D),
        lambda: _tied(nn.Embedding(V, D), {"fan_in": D}), _data("ids"), [], ACT)
    class_weight = torch.linspace(0.5, 2.0, V)
    flat_logits, flat_target = torch.randn(B, V), torch.randint(0, V, (B,))
    _compare_loss("CrossEntropyLoss2D", col_nn.CrossEntropyLoss2D(), {}, flat_logits,
                  flat_target, ROWS, [])
    _compare_loss("CrossEntropyLoss2D reduction=False, weight",  # Colossal-AI's positional order
                  col_nn.CrossEntropyLoss2D(False, class_weight),
                  {"reduction": "none", "weight": class_weight}, flat_logits, flat_target, ROWS,
                  ROWS)
    logits, target = torch.randn(B, S, V), torch.randint(0, V, (B, S))
    _compare_loss("VocabParallelCrossEntropyLoss2D", col_nn.VocabParallelCrossEntropyLoss2D(),
                  {}, logits, target, ACT, [])
    _compare_loss("VocabParallelCrossEntropyLoss2D reduction=False",
                  col_nn.VocabParallelCrossEntropyLoss2D(reduction=False),
                  {"reduction": "none"}, logits, target, ACT, ROWS)
    return {"flatten": _message(lambda: col_nn.PatchEmbedding2D(4, 2, 3, D, flatten=False)),
            "size_average": _message(lambda: col_nn.CrossEntropyLoss2D(size_average=True)),
            "Linear1D_Col is a 1d layer": _message(lambda: col_nn.Linear1D_Col(D, D))}


def _patch_embedding():
    plain = PatchEmbedding(4, 2, 3, D)
    fans = {"fan_in": 3 * 2 * 2, "fan_out": D}
    with torch.no_grad():
        w_init(plain.proj.weight, **fans)
        b_init(plain.proj.bias, fan_in=fans["fan_in"])
        pos_init(plain.pos_embed)
    return plain


def test_gloo_colossal_1d_layers_and_arguments_equal_the_plain_layers():
    results = run_ranks(_worker_1d, 2)
    (masks, errors), (other_masks, _) = results
    assert not torch.equal(masks["split"], other_masks["split"]), "a split activation: own masks"
    assert torch.equal(masks["gathered"], other_masks["gathered"]), "a whole one: shared masks"
    assert torch.equal(masks["row"], other_masks["row"])
    for name, message in errors.items():
        assert name in message, (name, message)


def test_deep_colossal_2d_layers_and_arguments_equal_the_plain_layers():
    for errors in run_ranks(_worker_2d, 4):
        for name, message in errors.items():
            assert name in message, (name, message)
