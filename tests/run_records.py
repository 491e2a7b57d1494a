"""Comparing whole training runs: one process against a layout, record by record.

A worker returns a record of its run -- steps taken (`took`), loss scales, losses, gradient
norms, and its final `state` (parameters, optimizer state) -- and `compare_runs` checks every
rank's record against one process's: the composition tests' notion of "the same training";
`assert_bit_identical` checks two runs of one layout (a resumed one and one that never stopped)
against each other.
"""
import torch
from dist_helpers import run_ranks
from torch.testing import assert_close

import nanocolossal as nc
from nanocolossal.context import gpc


def record_steps(engine, loader, inject=None, after_step=None) -> dict:
    """Train through `loader`, recording per step what compare_runs compares. `inject` =
    (step, ranks[, parameter name]): an inf in one row of that parameter's gradient on those
    ranks only -- an overflow some ranks see. `after_step(out)` records more per step."""
    out = dict(losses=[], norms=[], took=[], scales=[])
    for i, (x, y) in enumerate(loader):
        engine.zero_grad()
        hook = None
        if inject is not None and i == inject[0] and gpc.rank in inject[1]:
            name = inject[2] if len(inject) > 2 else ""
            first = next(p for n, p in engine.model.named_parameters()
                         if name in n and p.requires_grad)
            hook = first.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
        _, _, loss = engine.execute_schedule((x, y))
        if hook is not None:
            hook.remove()
        out["took"].append(engine.step())
        out["norms"].append(engine.last_grad_norm)
        out["scales"].append(engine.optimizer.loss_scale)
        out["losses"].append(nc.metrics.all_reduce_mean(loss.item()))
        if after_step is not None:
            after_step(out)
    return out


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


def assert_bit_identical(runs: list, others: list) -> None:
    """Every rank's record of one run = the other run's to the bit: the state and, where
    recorded, the optimizer state and the last loss (a resumed job against one that never
    stopped)."""
    for a, b in zip(runs, others, strict=True):
        assert a["state"].keys() == b["state"].keys()
        for key in a["state"]:
            assert torch.equal(a["state"][key], b["state"][key]), key
        if "opt" in a:
            assert_close(a["opt"], b["opt"], rtol=0, atol=0)
        if "last" in a:
            assert a["last"] == b["last"]


def one_and_layout(train, config: dict, world: int, parallel: dict, *args, timeout: float = 60):
    """(one process's record, every rank's record under `parallel`) of `train`(config, *args)."""
    ref = run_ranks(train, 1, config, *args, timeout=timeout)[0]
    runs = run_ranks(train, world, {**config, "parallel": parallel}, *args, timeout=timeout)
    return ref, runs


def record_run(engine, loader, inject):
    """record_steps of a run, with the optimizer's skipped steps and the model's dtypes (as
    initialize left them, before any step)."""
    dtypes = {k: str(v.dtype) for k, v in
              nc.checkpoint.strip_prefixes(engine.model.state_dict()).items()
              if torch.is_tensor(v) and v.is_floating_point()}
    out = record_steps(engine, loader, inject)
    out["skipped"] = getattr(engine.optimizer, "skipped_steps", None)
    out["dtypes"] = dtypes
    return out


def half_update_mismatches(run, ref, tol):
    """Parameters whose update differs from one process's by more than half precision allows
    (10 x its relative tolerance, plus 2 ulps of the half weights): name -> (diff, size)."""
    return {k: ((v - ref["delta"][k]).abs().max().item(), ref["delta"][k].abs().max().item())
            for k, v in run["delta"].items()
            if not (v - ref["delta"][k]).abs().max() <= 10 * tol * ref["delta"][k].abs().max()
            + 2 * ref["ulp"][k]}
