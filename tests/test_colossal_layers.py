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
from layer_compare import (
    ACT,
    COL,
    PAD,
    ROWS,
    B,
    D,
    S,
    V,
    add_skipped_bias,
    b_init,
    compare,
    compare_loss,
    data,
    inited,
    pad_embedding,
    pos_init,
    tie,
    tied_plain,
    w_init,
)
from models import error_message
from torch import nn
from torch.testing import assert_close

import nanocolossal as nc
import nanocolossal.nn as col_nn
from nanocolossal.context import gpc
from nanocolossal.tensor.base import PatchEmbedding, slice_of

pytestmark = pytest.mark.timeout(120)

def _launch(rank, world_size, port, mode):
    nc.launch({"parallel": {"tensor": {"size": world_size, "mode": mode}}}, rank=rank,
              world_size=world_size, host="127.0.0.1", port=port)


def _worker_1d(rank, world_size, port):
    _launch(rank, world_size, port, "1d")
    col, row = {"fan_in": D, "fan_out": 2 * D}, {"fan_in": 2 * D, "fan_out": D}
    compare("Linear1D_Col", lambda: col_nn.Linear1D_Col(
        D, 2 * D, weight_initializer=w_init, bias_initializer=b_init),
        lambda: inited(nn.Linear(D, 2 * D), col, {"fan_in": D}), data("flat"), [], COL)
    compare("Linear1D_Col gather_output", lambda: col_nn.Linear1D_Col(
        D, 2 * D, gather_output=True), lambda: nn.Linear(D, 2 * D), data("seq"), [], [])
    compare("Linear1D_Col skip_bias_add gather_output", lambda: col_nn.Linear1D_Col(
        D, 2 * D, gather_output=True, skip_bias_add=True), lambda: nn.Linear(D, 2 * D),
        data("flat"), [], [], call=add_skipped_bias)
    compare("Linear1D_Col dtype", lambda: col_nn.Linear1D_Col(D, 2 * D, dtype=torch.float64),
            lambda: nn.Linear(D, 2 * D).double(), data("flat", torch.float64), [], COL)
    compare("Linear1D_Row", lambda: col_nn.Linear1D_Row(
        2 * D, D, weight_initializer=w_init, bias_initializer=b_init),
        lambda: inited(nn.Linear(2 * D, D), row, {"fan_in": 2 * D}), data("wide"), COL, [])
    compare("Linear1D_Row parallel_input=False", lambda: col_nn.Linear1D_Row(
        2 * D, D, parallel_input=False), lambda: nn.Linear(2 * D, D), data("wide"), [], [])
    compare("Linear1D_Row skip_bias_add", lambda: col_nn.Linear1D_Row(
        2 * D, D, skip_bias_add=True), lambda: nn.Linear(2 * D, D), data("wide"), COL, [],
        call=add_skipped_bias)
    for name, cls in (("Embedding1D", col_nn.Embedding1D),
                      ("VocabParallelEmbedding1D", col_nn.VocabParallelEmbedding1D)):
        compare(name, lambda: cls(V, D, PAD, None, w_init), pad_embedding, data("ids"), [], [])
    compare("Classifier1D", lambda: col_nn.Classifier1D(
        D, V, weight_initializer=w_init, bias_initializer=b_init),
        lambda: inited(nn.Linear(D, V), {"fan_in": D, "fan_out": V}, {"fan_in": D}),
        data("flat"), [], [])
    compare("Classifier1D tied", lambda: tie(col_nn.Embedding1D, col_nn.Classifier1D),
            lambda: tied_plain(nn.Embedding(V, D), {"fan_in": D}), data("ids"), [], [])
    compare("VocabParallelClassifier1D", lambda: col_nn.VocabParallelClassifier1D(
        D, V, weight_initializer=w_init, bias_initializer=b_init),
        lambda: inited(nn.Linear(D, V), {"fan_in": D, "fan_out": V}, {"fan_in": D}),
        data("seq"), [], COL)
    compare("VocabParallelClassifier1D tied gather_output", lambda: tie(
        col_nn.VocabParallelEmbedding1D, col_nn.VocabParallelClassifier1D, gather_output=True),
        lambda: tied_plain(nn.Embedding(V, D), {"fan_in": D}), data("ids"), [], [])
    logits, target = torch.randn(B, S, V), torch.randint(0, V, (B, S))
    compare_loss("VocabParallelCrossEntropyLoss1D", col_nn.VocabParallelCrossEntropyLoss1D(),
                 {}, logits, target, COL, [])
    compare_loss("VocabParallelCrossEntropyLoss1D reduction=False",
                 col_nn.VocabParallelCrossEntropyLoss1D(reduction=False),
                 {"reduction": "none"}, logits, target, COL, [])
    _stream_chunks()
    return _dropout_masks(), _errors_1d()


def _stream_chunks():
    """stream_chunk_num=4: the same output from 4 all-reduces instead of 1; training refuses."""
    torch.manual_seed(0)
    layer = col_nn.Linear1D_Row(2 * D, D, stream_chunk_num=4).eval()
    torch.manual_seed(0)
    plain = nn.Linear(2 * D, D)
    x = data("wide")
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
    return {name: error_message(build) for name, build in builds.items()}


def _worker_2d(rank, world_size, port):
    _launch(rank, world_size, port, "2d")
    assert (gpc.grid_row, gpc.grid_col) == divmod(gpc.tensor_rank, 2)
    assert (gpc.tensor_row_rank, gpc.tensor_col_rank) == (gpc.grid_col, gpc.grid_row)
    assert dist.get_rank(gpc.tensor_row_group) == gpc.grid_col  # my place along my row
    fans = {"fan_in": D, "fan_out": D}
    compare("Linear2D", lambda: col_nn.Linear2D(
        D, D, weight_initializer=w_init, bias_initializer=b_init),
        lambda: inited(nn.Linear(D, D), fans, {"fan_in": D}), data("seq"), ACT, ACT)
    compare("Linear2D dtype", lambda: col_nn.Linear2D(D, D, dtype=torch.float64),
            lambda: nn.Linear(D, D).double(), data("seq", torch.float64), ACT, ACT)
    compare("Linear2D skip_bias_add", lambda: col_nn.Linear2D(D, D, skip_bias_add=True),
            lambda: nn.Linear(D, D), data("seq"), ACT, ACT, call=add_skipped_bias)
    compare("LayerNorm2D bias=False", lambda: col_nn.LayerNorm2D(D, bias=False),
            lambda: nn.LayerNorm(D, bias=False), data("seq"), ACT, ACT)
    compare("LayerNorm2D dtype", lambda: col_nn.LayerNorm2D(D, 1e-5, True, torch.float64),
            lambda: nn.LayerNorm(D).double(), data("seq", torch.float64), ACT, ACT)
    for name, cls in (("Embedding2D", col_nn.Embedding2D),
                      ("VocabParallelEmbedding2D", col_nn.VocabParallelEmbedding2D)):
        compare(name, lambda: cls(V, D, PAD, weight_initializer=w_init), pad_embedding,
                data("ids"), [], ACT)
    compare("PatchEmbedding2D", lambda: col_nn.PatchEmbedding2D(
        4, (2, 2), 3, D, weight_initializer=w_init, bias_initializer=b_init,
        position_embed_initializer=pos_init), _patch_embedding, data("images"), [], ACT)
    compare("Classifier2D", lambda: col_nn.Classifier2D(
        D, V, weight_initializer=w_init, bias_initializer=b_init),
        lambda: inited(nn.Linear(D, V), {"fan_in": D, "fan_out": V}, {"fan_in": D}),
        data("flat"), ACT, ROWS)
    compare("Classifier2D tied", lambda: tie(col_nn.Embedding2D, col_nn.Classifier2D),
            lambda: tied_plain(nn.Embedding(V, D), {"fan_in": D}), data("ids"), [], ROWS)
    compare("VocabParallelClassifier2D", lambda: col_nn.VocabParallelClassifier2D(
        D, V, weight_initializer=w_init, bias_initializer=b_init),
        lambda: inited(nn.Linear(D, V), {"fan_in": D, "fan_out": V}, {"fan_in": D}),
        data("seq"), ACT, ACT)
    compare("VocabParallelClassifier2D tied", lambda: tie(
        col_nn.VocabParallelEmbedding2D, col_nn.VocabParallelClassifier2D),
        lambda: tied_plain(nn.Embedding(V, D), {"fan_in": D}), data("ids"), [], ACT)
    class_weight = torch.linspace(0.5, 2.0, V)
    flat_logits, flat_target = torch.randn(B, V), torch.randint(0, V, (B,))
    compare_loss("CrossEntropyLoss2D", col_nn.CrossEntropyLoss2D(), {}, flat_logits,
                 flat_target, ROWS, [])
    compare_loss("CrossEntropyLoss2D reduction=False, weight",  # Colossal-AI's positional order
                 col_nn.CrossEntropyLoss2D(False, class_weight),
                 {"reduction": "none", "weight": class_weight}, flat_logits, flat_target, ROWS,
                 ROWS)
    logits, target = torch.randn(B, S, V), torch.randint(0, V, (B, S))
    compare_loss("VocabParallelCrossEntropyLoss2D", col_nn.VocabParallelCrossEntropyLoss2D(),
                 {}, logits, target, ACT, [])
    compare_loss("VocabParallelCrossEntropyLoss2D reduction=False",
                 col_nn.VocabParallelCrossEntropyLoss2D(reduction=False),
                 {"reduction": "none"}, logits, target, ACT, ROWS)
    return {"flatten": error_message(lambda: col_nn.PatchEmbedding2D(4, 2, 3, D, flatten=False)),
            "size_average": error_message(lambda: col_nn.CrossEntropyLoss2D(size_average=True)),
            "Linear1D_Col is a 1d layer": error_message(lambda: col_nn.Linear1D_Col(D, D))}


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
