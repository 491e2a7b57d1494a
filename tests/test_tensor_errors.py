"""Bad tensor-parallel inputs end in an error that names the rank and says what to change."""
import sys

import pytest
import torch
from dist_helpers import ROOT, free_port, run_ranks
from models import error_message
from torch import nn

import nanocolossal as nc
import nanocolossal.nn as col_nn
from nanocolossal.config import ConfigError
from nanocolossal.tensor.layers_1d import ColumnLinear1D, RowLinear1D

sys.path.insert(0, str(ROOT))
from train_tensor import vit  # noqa: E402

pytestmark = pytest.mark.timeout(120)


class Scale(nn.Module):
    """A module of the user's own: alpha * x, alpha a plain nn.Parameter."""

    def __init__(self, requires_grad: bool = True) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.tensor(0.7), requires_grad=requires_grad)

    def forward(self, x):
        return self.alpha * x


def _initialized(*layers):
    """'initialized', or the ConfigError nc.initialize raises for a model of `layers`."""
    col_nn.reset_1d_alternation()
    model = nn.Sequential(*(layer() for layer in layers))
    try:
        nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), verbose=False)
    except ConfigError as e:
        return str(e)
    return "initialized"


def _stray_parameters(mode):
    """A scalar between nc.nn Linears, trainable or frozen; 1d: a torch LayerNorm after a pair."""
    def linear():
        return col_nn.Linear(8, 8)
    out = {"stray parameter": _initialized(linear, Scale, linear),
           "frozen": _initialized(linear, lambda: Scale(requires_grad=False), linear)}
    if mode == "1d":
        out["torch layernorm"] = _initialized(linear, linear, lambda: nn.LayerNorm(8))
        out["torch prelu"] = _initialized(linear, nn.PReLU, linear)  # on a slice: refused too
    return out


def _errors_worker(rank, world_size, port, mode):
    nc.launch({"parallel": {"tensor": {"size": world_size, "mode": mode}}}, rank=rank,
              world_size=world_size, host="127.0.0.1", port=port)
    stray = _stray_parameters(mode)
    plain = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    out = {
        "hidden": error_message(lambda: col_nn.Linear(8, 7)),
        "layernorm": error_message(lambda: col_nn.LayerNorm(5)),
        "heads": error_message(lambda: vit(img_size=8, patch_size=4, dim=8, heads=1, depth=1)),
        "plain model": error_message(lambda: nc.initialize(plain,
                                                    torch.optim.SGD(plain.parameters(), lr=0.1))),
    }
    if mode == "1d":  # features that do not fit the split, said before the collective
        column, row = ColumnLinear1D(8, 4), RowLinear1D(8, 4)
        out["column input"] = error_message(lambda: column(torch.randn(2, 6)))
        out["row input"] = error_message(lambda: row(torch.randn(2, 8)))
    if mode == "2d":
        model = col_nn.PatchEmbedding(8, 4, 3, 8)
        out["batch"] = error_message(lambda: model(torch.randn(3, 3, 8, 8)))
        normed = nn.Sequential(col_nn.Linear(4, 4), nn.BatchNorm1d(4))  # one block's statistics
        out["batchnorm"] = error_message(lambda: nc.initialize(
            normed, torch.optim.SGD(normed.parameters(), lr=0.1)))
    return {**out, **stray}


def _stray_message(rank, size, mode):
    return (f"[rank {rank}] parallel.tensor={size} ({mode}) but 1.alpha (Scale's) is not a "
            f"parameter of a nanocolossal.nn layer: each tensor rank would compute its gradient "
            f"from the activation it holds and nothing would sum them, so its {size} copies "
            f"would drift apart; build it from nc.nn layers (e.g. nc.nn.Linear, "
            f"nc.nn.LayerNorm) or freeze it (requires_grad=False)")


def test_gloo_1d_a_parameter_outside_nc_nn_layers_is_refused_at_initialize():
    """A plain nn.Parameter between a column and a row Linear scales a slice on each rank: its
    gradient is a piece, and nothing sums the pieces, so its copies would drift apart (after a
    row Linear it would see the whole activation; no check can tell). initialize refuses it by
    name, before any step, as is a torch layer's that is no normalisation (a PReLU). A frozen
    one cannot drift; torch's LayerNorm after a pair sees the whole activation, as before."""
    for rank, out in enumerate(run_ranks(_errors_worker, 2, "1d", timeout=60)):
        assert out["stray parameter"] == _stray_message(rank, 2, "1d")
        assert out["frozen"] == out["torch layernorm"] == "initialized"
        assert out["torch prelu"].startswith(f"[rank {rank}] parallel.tensor=2 (1d) but 1.weight "
                                             f"(PReLU's) is not a parameter of a nanocolossal.nn")


def test_gloo_1d_bad_inputs_are_clear_errors():
    for rank, out in enumerate(run_ranks(_errors_worker, 2, "1d", timeout=60)):
        assert out["hidden"] == (f"[rank {rank}] Linear out_features 7 is not divisible by 2 "
                                 f"(tensor parallel 1d, "
                                 f"size 2); choose a multiple of 2")
        assert out["layernorm"] == "no error"  # 1d LayerNorm is replicated: any size
        assert out["heads"].startswith(f"[rank {rank}] 1 heads of a 8-wide model do not split over "
                                       f"2 tensor ranks")
        assert out["plain model"].startswith(f"[rank {rank}] parallel.tensor=2 (1d) but the model "
                                             f"has plain torch layers (0, 2), which cannot split")
        assert "build it with nanocolossal.nn layers" in out["plain model"]
        assert out["column input"] == (f"[rank {rank}] column-parallel Linear(8, 4) got an input "
                                       f"with 6 features; 1d Linears alternate column/row, so a "
                                       f"model needs its Linears in pairs (or pass a replicated "
                                       f"input here)")
        assert out["row input"] == (f"[rank {rank}] row-parallel Linear(8, 4) expects its input "
                                    f"split over 2 ranks (4 features), got 8; put a "
                                    f"column-parallel Linear before it")


def test_deep_2d_bad_inputs_are_clear_errors():
    for rank, out in enumerate(run_ranks(_errors_worker, 4, "2d", timeout=60)):
        assert out["hidden"] == (f"[rank {rank}] Linear out_features 7 is not divisible by 2 "
                                 f"(tensor parallel 2d, "
                                 f"size 4); choose a multiple of 2")
        assert out["layernorm"].startswith(f"[rank {rank}] LayerNorm size 5 is not divisible by 2")
        assert out["heads"].startswith(f"[rank {rank}] 1 heads of a 8-wide model do not split over "
                                       f"2 tensor ranks")
        assert out["batchnorm"].startswith(f"[rank {rank}] parallel.tensor=4 (2d) but the model "
                                           f"has plain torch layers (1), which cannot split")
        assert out["batch"] == (f"[rank {rank}] a batch of 3 cannot be split over the 2 rows of "
                                "the 2d grid (tensor size 4); use a batch size that is a "
                                "multiple of 2")
        assert out["stray parameter"] == _stray_message(rank, 4, "2d")
        assert out["frozen"] == "initialized"


@pytest.mark.parametrize("world, parallel, message", [
    (3, {"tensor": {"size": 2, "mode": "1d"}},
     r"\[rank 0\] world size 3 is not divisible by pipeline x tensor = "
     r"1 x 2 = 2; launch a multiple of 2 processes"),
    (8, {"tensor": {"size": 8, "mode": "2d"}},
     r"\[rank 0\] parallel.tensor size 8 is not a perfect square.*use size 4 or 9"),
    (4, {"tensor": {"size": 4, "mode": "3d"}},
     r"\[rank 0\] parallel.tensor size 4 is not a cube, which mode='3d' needs.*use size 1 or 8"),
    (8, {"tensor": {"size": 8, "mode": "2.5d", "depth": 4}},
     r"\[rank 0\] parallel.tensor size 8 is not q \* q \* depth for depth 4.*use size 4 or 16"),
])
def test_launch_refuses_a_tensor_layout_that_cannot_work(world, parallel, message):
    with pytest.raises(ConfigError, match=message):
        nc.launch({"parallel": parallel}, rank=0, world_size=world, host="127.0.0.1",
                  port=free_port(), timeout=5)
