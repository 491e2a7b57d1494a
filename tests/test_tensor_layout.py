"""The rank layout as a pure function: every rank in exactly one group of each kind, as the formulas
say."""
import itertools
import math

import pytest

from nanocolossal.config import ConfigError
from nanocolossal.config_checks import check_world
from nanocolossal.layout import coordinates, layout


def _modes(T):
    return (None,) if T == 1 else ("1d", "2d") if math.isqrt(T) ** 2 == T else ("1d",)


SHAPES = [(P * T * D, P, T,
           mode) for P, T, D in itertools.product((1, 2, 3), (1, 2, 4, 9), (1, 2, 3))
          for mode in _modes(T)]


@pytest.mark.parametrize("world, P, T, mode", SHAPES)
def test_layout_groups_partition_the_world_as_the_formulas_say(world, P, T, mode):
    groups = layout(world, P, T, mode)
    kinds = ["data", "pipeline", "tensor", "model"]
    kinds += ["tensor_row", "tensor_col"] if mode == "2d" else []
    for kind in kinds:
        members = sorted(r for g in getattr(groups, kind) for r in g)
        assert members == list(range(world)), f"{kind}: every rank in exactly one group"
    for rank in range(world):
        d, p, t = coordinates(rank, P, T)
        assert rank == d * P * T + p * T + t
        mine = {kind: next(g for g in getattr(groups, kind) if rank in g) for kind in kinds}
        assert mine["tensor"] == [d * P * T + p * T + k for k in range(T)]    # consecutive ranks
        assert mine["pipeline"] == [d * P * T + k * T + t for k in range(P)]  # stages T apart
        assert mine["data"] == [k * P * T + p * T + t for k in range(world // (P * T))]
        assert mine["model"] == list(range(d * P * T, (d + 1) * P * T))             # one replica
        if mode == "2d":
            q = math.isqrt(T)
            row, col = divmod(t, q)
            base = d * P * T + p * T
            # same row: splits hidden
            assert mine["tensor_row"] == [base + row * q + c for c in range(q)]
            # same column: splits batch
            assert mine["tensor_col"] == [base + r * q + col for r in range(q)]


def test_layout_of_the_tutorial_config_on_8_ranks():
    groups = layout(8, P=2, T=4, mode="2d")
    assert groups.tensor == [[0, 1, 2, 3],
                             [4, 5, 6, 7]] and groups.pipeline == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups.tensor_row == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups.tensor_col == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups.data == [[r] for r in range(8)]


@pytest.mark.parametrize("world, parallel, message", [
    (6, {"pipeline": 2, "tensor": {"size": 2, "mode": "1d"}},
     "world size 6 is not divisible by pipeline x tensor"),
    (8, {"tensor": {"size": 4, "mode": "2d"}, "data": 4},
     r"parallel.data=4 but world size 8 // \(pipeline x tensor\) = 2"),
])
def test_world_that_does_not_fit_is_a_clear_error(world, parallel, message):
    with pytest.raises(ConfigError, match=message):
        check_world({"parallel": parallel}, world)
