"""Comparing whole training runs: one process against a layout, record by record.

A worker returns a record of its run -- steps taken (`took`), loss scales, losses, gradient
norms, and its final `state` (parameters, optimizer state) -- and `compare_runs` checks every
rank's record against one process's: the composition tests' notion of "the same training".
"""
import torch
from dist_helpers import run_ranks
from torch.testing import assert_close


def compare_runs(ref: dict, runs: list, rtol: float = 1e-10, atol: float = 1e-10,
                 norms: bool = True) -> None:
    for run in runs:
        assert run["took"] == ref["took"]
        assert run["scales"] == ref["scales"]
        assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), rtol=rtol,
                     atol=atol, msg=lambda m: f"losses {run['losses']} vs {ref['losses']}: {m}")
        if norms:  # None where a step was skipped
            assert [n is None for n in run["norms"]] == [n is None for n in ref["norms"]]
            assert_close(torch.tensor([n or 0.0 for n in run["norms"]]),
                         torch.tensor([n or 0.0 for n in ref["norms"]]), rtol=rtol, atol=atol,
                         msg=lambda m: f"norms {run['norms']} vs {ref['norms']}: {m}")
        for key, value in run["state"].items():
            assert_close(value, ref["state"][key], rtol=rtol, atol=atol,
                         msg=lambda m, key=key: f"{key}: {m}")


def one_and_layout(train, config: dict, world: int, parallel: dict, *args, timeout: float = 60):
    """(one process's record, every rank's record under `parallel`) of `train`(config, *args)."""
    ref = run_ranks(train, 1, config, *args, timeout=timeout)[0]
    runs = run_ranks(train, world, {**config, "parallel": parallel}, *args, timeout=timeout)
    return ref, runs
