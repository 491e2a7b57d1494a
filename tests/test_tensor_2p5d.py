"""2.5d tensor parallelism (Tesseract): `depth` stacked q x q grids, each running SUMMA on its own
block of the batch, weight blocks shared by the grids -- against plain torch, in float64.

Layouts: an activation [batch, ..., hidden] has batch blocks over (depth, row) and hidden blocks
over the column; a weight has q x q blocks, the same in every grid.
"""
import pytest
import torch
from dist_helpers import run_ranks
from layer_checks import (
    check_colossal_classes,
    check_layers,
    embedding_padding,
    generate_feature_split,
    small_model,
    tiny_gpt_one_process,
    tiny_gpt_run,
    train_small_model,
)
from models import error_message
from torch.testing import assert_close
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

import nanocolossal as nc
import nanocolossal.nn as col_nn
from nanocolossal.config import ConfigError
from nanocolossal.context import gpc

pytestmark = pytest.mark.timeout(120)
TESSERACT = dict(parallel=dict(tensor=dict(size=8, mode="2.5d", depth=2)))


def test_gloo_2p5d_two_grids_of_2x2_train_as_one_process():
    """8 ranks as 2 stacked 2 x 2 grids: each grid computes SUMMA on half the batch; the weight
    blocks the grids share sum their gradients over the depth group, so every step is one
    process's step on the whole batch (every rank is given the whole batches; its layers keep
    their blocks of them)."""
    xs, ys = torch.randint(0, 10, (3, 8)), torch.randint(0, 3, (3, 8))  # 3 batches of 8 ids
    # small_model(): Embedding, Linear, Tanh, Linear, LayerNorm, Classifier; SGD with momentum
    one_process = train_small_model(0, 1, None, None, xs, ys)
    for rank, params in enumerate(run_ranks(train_small_model, 8, TESSERACT, xs, ys)):
        assert_close(params, one_process, msg=lambda m: f"rank {rank}: {m}")


def _layers_worker(rank, world_size, port, depth):
    nc.launch(dict(parallel=dict(tensor=dict(size=world_size, mode="2.5d", depth=depth))),
              rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    activation = [(0, "depth"), (0, "row"), (-1, "col")]  # also the vocab-parallel logits'
    return gpc.tensor_depth, check_layers(activation, activation, [(0, "depth"), (0, "row")],
                                          activation)


@pytest.mark.parametrize("world, depth", [(8, 2), (4, 1)])
def test_deep_2p5d_layers_equal_plain_torch_forward_and_backward(world, depth):
    """Linear, LayerNorm, Embedding, vocab-parallel Embedding + tied Classifier + loss, and the
    feature-split Classifier + loss, to 1e-10 in float64 (depth 1 is 2d)."""
    results = run_ranks(_layers_worker, world, depth, timeout=90)
    assert results == [(depth, ["linear", "layernorm", "embedding", "classifier + loss",
                                "vocab embedding + classifier + loss"])] * world


def _loader(samples, batch_size, drop_last=False, sampler=False):
    """'initialized', or the ConfigError initialize raises for a loader of `samples` ids (its
    batches made by batch_size=, or by a batch_sampler= of the user's)."""
    model = small_model()
    data = TensorDataset(torch.randint(0, 10, (samples, 2)), torch.randint(0, 3, (samples,)))
    batches = BatchSampler(SequentialSampler(data), batch_size, drop_last)
    loader = (DataLoader(data, batch_sampler=batches) if sampler else
              DataLoader(data, batch_size, drop_last=drop_last))
    try:
        nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      col_nn.CrossEntropyLoss(), loader, verbose=False)
    except ConfigError as e:
        return str(e)
    return "initialized"


def _errors_worker(rank, world_size, port):
    nc.launch(TESSERACT, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    return {"hidden": error_message(lambda: col_nn.Linear(8, 7)),
            "batch": error_message(lambda: col_nn.Embedding(10, 8)(torch.zeros(6, 2).long())),
            "batches of 6": _loader(12, 6), "last batch of 2": _loader(10, 4),
            "last batch dropped": _loader(10, 4, drop_last=True),
            "a batch sampler's last batch": _loader(10, 4, sampler=True)}


def test_gloo_2p5d_bad_shapes_are_one_line_errors():
    """A batch the 4 grid rows cannot split is refused where it arrives; a loader's batches, the
    last too, are checked at initialize (10 samples in batches of 4 would fail after 2 steps).
    All ConfigErrors: one line per rank in a script."""
    grids = "the 4 rows of the 2.5d grids (2 grids of 2) (tensor size 8)"
    for rank, out in enumerate(run_ranks(_errors_worker, 8, timeout=60)):
        assert out == {
            "hidden": f"[rank {rank}] Linear out_features 7 is not divisible by 2 (tensor parallel "
                      f"2.5d, size 8); choose a multiple of 2",
            "batch": f"[rank {rank}] a batch of 6 cannot be split over {grids}; use a batch size "
                     f"that is a multiple of 4",
            "batches of 6": f"[rank {rank}] the train dataloader's batches of 6 cannot be split "
                            f"over {grids}; use a batch size that is a multiple of 4",
            "last batch of 2": f"[rank {rank}] the train dataloader's last batch has 2 sample(s), "
                               f"which cannot be split over {grids}, and would fail after 2 "
                               f"batches; pass drop_last=True, or pick a batch size that leaves "
                               f"no remainder of 10 or a multiple of 4",
            "last batch dropped": "initialized",
            "a batch sampler's last batch": f"[rank {rank}] the train dataloader's last batch "
                                            f"has 2 sample(s), which cannot be split over "
                                            f"{grids}, and would fail after 2 batches; pass "
                                            f"drop_last=True, or pick a batch size that leaves "
                                            f"no remainder of 10 or a multiple of 4"}


def _colossal_worker(rank, world_size, port):
    nc.launch(TESSERACT, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    activation = [(0, "depth"), (0, "row"), (-1, "col")]
    return check_colossal_classes("2p5D", activation, activation, activation[:2], activation,
                                  other="Linear2D")


def test_deep_colossal_2p5d_classes_and_arguments_equal_the_plain_layers():
    results = run_ranks(_colossal_worker, 8, timeout=90)
    assert all(checked == results[0] and "Linear" in checked for checked in results)


def test_deep_train_gpt_2p5d_config_ends_as_one_process():
    """configs/gpt_2p5d.py (shrunk): train_gpt.py's final loss and sample are one process's."""
    loss, sample = tiny_gpt_run("gpt_2p5d.py", 8)
    one_loss, one_sample = tiny_gpt_one_process()
    assert abs(loss - one_loss) < 1e-4 and sample == one_sample, (loss, one_loss, sample)


def test_deep_generate_with_a_feature_split_classifier_gives_one_process_tokens():
    one_process = generate_feature_split(0, 1, None, None)
    assert run_ranks(generate_feature_split, 8, TESSERACT) == [one_process] * 8


def test_deep_nn_embedding_keeps_padding_idx():
    for row, grad in run_ranks(embedding_padding, 8, TESSERACT):
        assert not row.any() and not grad.any(), (row, grad)
