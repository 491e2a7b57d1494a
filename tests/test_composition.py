"""The composition matrix: each pair of features a user can turn on together, against one process.

Every feature has tests of its own (test_ddp, test_amp, test_pipeline, ...). Bugs live
where two features meet: DDP's no_sync and a branch unused in the last micro-step, a gradient
handler and a parameter nothing used, the Trainer's max_steps in the middle of an accumulation
group, a buffer broadcast during uneven evaluation. Testing every product of features is out of
reach, so the matrix asks for each *pair* at least once; docs/testing.md has the table that names,
for every pair, the test that covers it (many live in the features' own files) or why the pair
cannot be configured. This file fills the cells nothing else covered.

First the table (TABLE): one row per pair (or triple) of layout and feature -- data, ZeRO 1-3
(offload too), accumulation, the gradient handler, GPipe / 1F1B / interleaved / zero-bubble,
tensor 1d / 2d / 2.5d / 3d, ring and all-to-all sequence parallelism, experts, mixed precision
(bf16 and fp16, O1 / O2 / O3), an overflow on one rank, activation checkpointing -- each run by
one worker on one GPT and compared with one process; a row that cannot be configured checks its
refusal, and a row with resumes saves mid-run, merges and resumes (in its own layout, and merged
into another). The model's knobs are config keys in capitals (see _table_gpt, _plant_overflow).
Below the table, the cells a GPT does not reach: branches, frozen parameters, BatchNorm,
evaluation, the Trainer's resumes.

Each test turns its features on as users do -- a config dict through nc.launch and nc.initialize
-- and trains a tiny model for a few optimizer steps with SGD, momentum and weight decay (so a
zero gradient where one process has none still moves the weights). The final parameters (and
buffers, gradient norms, metrics) are compared with ONE process on the whole batch with
torch.testing.assert_close. Mixed precision (bf16 on CPU) is compared with one process under the
same AMP settings (nc.amp.initialize), to bf16 tolerance.
"""
import contextlib
import sys

import pytest
import torch
from dist_helpers import ROOT, launch_rank, run_ranks
from models import clip_one_process, epoch_shards, tensor_model, tensor_pipeline_model
from plan_runs import live, plan_problems
from torch import nn
from torch.nn import functional as F
from torch.testing import assert_close
from torch.utils.data import TensorDataset

import nanocolossal as nc
import nanocolossal.nn as col_nn
from nanocolossal import amp
from nanocolossal.amp import AMP_TYPE
from nanocolossal.checkpoint import (
    load_checkpoint,
    load_plain_state_dict,
    merge_checkpoint,
    save_checkpoint,
    strip_prefixes,
    tensor_splits_of,
)
from nanocolossal.config import ConfigError
from nanocolossal.context import gpc
from nanocolossal.memory import SavedBytes
from nanocolossal.metrics import Accuracy
from nanocolossal.moe import moe_layers
from nanocolossal.moe.settings import moe_model_settings
from nanocolossal.pipeline import build_pipeline_model
from nanocolossal.sequence import split_batch
from nanocolossal.tensor.base import slice_of
from nanocolossal.traffic import count_collectives
from nanocolossal.trainer import Trainer, hooks

sys.path.insert(0, str(ROOT))
from train_gpt import gpt  # noqa: E402

pytestmark = pytest.mark.timeout(120)

HANDLER = [dict(type="DataParallelGradientHandler")]
STEPS = 3    # optimizer steps per run
B = 2        # samples per rank per micro-step
CLIP = 0.05  # below every gradient norm here: the clip really clips (asserted)
# bf16 keeps 8 bits (1 unit in the last place of 0.3 is 2e-3): sums taken in another order (a
# micro-batch per rank, not the whole batch) round differently. A lost micro-batch is 2-40x outside.
BF16 = {"rtol": 1e-2, "atol": 1e-3}
BF16_VS_FP32 = {"rtol": 2e-2, "atol": 2e-3}
FP16_REL = 2e-3  # fp16 keeps 11 bits: a quarter of bf16's error, with margin
# The half weights round away a clipped step of lr 0.1 x 0.05 (1 ulp of bf16's 0.5 is 2e-3):
# half-precision rows of the table take training-sized steps, so that a wrong gradient shows.
HALF_LR, HALF_CLIP = 0.5, 0.2
AMP_MODES = {  # opt level -> the fp16 config that selects it (bf16: CPUs have no fast fp16)
    "O1": {"mode": AMP_TYPE.TORCH, "dtype": "bfloat16"},
    "O2": {"mode": AMP_TYPE.NAIVE, "dtype": "bfloat16"},
    "O3": {"mode": AMP_TYPE.APEX, "opt_level": "O3", "dtype": "bfloat16"},
}


# -- the table: each pair of features on one GPT, every row against one process ----------------

def _zero(level, offload=None):
    return {"zero": {"level": level, **({"offload": offload} if offload else {})}}


PIPE2 = {"pipeline": 2}
PIPE = {"NUM_MICRO_BATCHES": 2}
ZB = {"PIPELINE_SCHEDULE": "zero_bubble"}
ZBV = {"PIPELINE_SCHEDULE": "zbv", "NUM_CHUNKS": 2, "NUM_MICRO_BATCHES": 4}  # M >= 2P - 1
SEQ_RING = {"tensor": {"size": 2, "mode": "sequence"}}
SEQ_A2A = {"tensor": {"size": 2, "mode": "sequence", "attention": "all_to_all"}}
T1D = {"tensor": {"size": 2, "mode": "1d"}}
T2D = {"tensor": {"size": 4, "mode": "2d"}}
T2P5D = {"tensor": {"size": 8, "mode": "2.5d", "depth": 2}}
T3D = {"tensor": {"size": 8, "mode": "3d"}}
HANDLER_CFG = {"gradient_handler": [{"type": "DataParallelGradientHandler"}]}
ACCUM2 = {"gradient_accumulation": 2}
MOE = {"NUM_EXPERTS": 2, "MOE_CAPACITY_FACTOR": 4.0}  # >= E: no token is dropped
EP2 = {"moe": 2}  # expert parallelism: each of 2 data ranks holds one expert
AMP_O1 = {"fp16": {"mode": AMP_TYPE.TORCH, "dtype": "bfloat16"}}
AMP_O2 = {"fp16": {"mode": AMP_TYPE.NAIVE, "dtype": "bfloat16"}}
AMP_O3 = {"fp16": {"mode": AMP_TYPE.APEX, "opt_level": "O3", "dtype": "bfloat16"}}
APEX_O2 = {"fp16": {"mode": AMP_TYPE.APEX, "opt_level": "O2", "dtype": "bfloat16"}}
FP16_O1 = {"fp16": {"mode": AMP_TYPE.TORCH, "dtype": "float16"}}
FP16_O2 = {"fp16": {"mode": AMP_TYPE.NAIVE, "dtype": "float16", "initial_scale": 2.0 ** 10}}
MOE4_TOP2 = {"NUM_EXPERTS": 4, "MOE_CAPACITY_FACTOR": 4.0, "MOE_TOP_K": 2}  # 2 experts a rank
# half precision may round a token onto another expert, a discrete change: under AMP every
# token goes to both experts (top-2 of 2), and the attention is the explicit one
MOE_HALF = {**MOE, "MOE_TOP_K": 2, "ATTENTION": "explicit"}
OVERFLOW_TOKENS = {"OVERFLOW": (1, 1, "tok")}  # step 1, rank 1, the token embedding
SEQ_RING4 = {"tensor": {"size": 4, "mode": "sequence"}}
UNUSED = {"UNUSED": True}  # a parameter no forward uses (see _table_gpt)
TABLE = {  # row: (ranks, config, what a refused row's error says[, resumes]); every row clips
    "data2 x zero1": (2, _zero(1), None),
    "data2 x zero2 x accum2": (2, {**_zero(2), **ACCUM2}, None),
    "data2 x zero3": (2, _zero(3), None),
    "data2 x handler x accum2": (2, {**HANDLER_CFG, **ACCUM2}, None),
    "1f1b x data2 x zero1 x unused": (4, {"parallel": PIPE2, **PIPE, **_zero(1), **UNUSED}, None),
    "gpipe x zero2 x unused": (2, {"parallel": PIPE2, **PIPE, "PIPELINE_SCHEDULE": "gpipe",
                                   **_zero(2), **UNUSED}, None),
    "interleaved x data2 x zero2 x unused": (4, {"parallel": PIPE2, **PIPE, "NUM_CHUNKS": 2,
                                                 **_zero(2), **UNUSED}, None),
    "zero_bubble x data2 x zero2": (4, {"parallel": PIPE2, **PIPE, **ZB, **_zero(2)}, None),
    "zbv x data2 x zero2": (4, {"parallel": PIPE2, **ZBV, **_zero(2)}, None),
    # a parameter no step uses (UNUSED) beside the tied embedding, under each schedule x ZeRO 1, 2
    "gpipe x data2 x zero1 x unused": (4, {"parallel": PIPE2, **PIPE, "PIPELINE_SCHEDULE": "gpipe",
                                           **_zero(1), **UNUSED}, None),
    "1f1b x data2 x zero2 x unused": (4, {"parallel": PIPE2, **PIPE, **_zero(2), **UNUSED}, None),
    "interleaved x data2 x zero1 x unused": (4, {"parallel": PIPE2, **PIPE, "NUM_CHUNKS": 2,
                                                 **_zero(1), **UNUSED}, None),
    "1f1b x data2 x zero2 (tiny buckets, no overlap) x unused": (
        4, {"parallel": PIPE2, **PIPE, **UNUSED, "zero": {
            "level": 2, "reduce_bucket_size_mb": 1e-4, "overlap_communication": False}}, None),
    "1f1b x 1d x data2 x zero1": (8, {"parallel": {**PIPE2, **T1D}, **PIPE, **_zero(1)}, None),
    "1d x data2 x zero2": (4, {"parallel": T1D, **_zero(2)}, None),
    "1d x data2 x zero1 x accum2": (4, {"parallel": T1D, **_zero(1), **ACCUM2}, None),
    "1d x 1f1b": (4, {"parallel": {**PIPE2, **T1D}, **PIPE}, None),
    "1d x zero_bubble": (4, {"parallel": {**PIPE2, **T1D}, **PIPE, **ZB}, None),
    "1d x zbv": (4, {"parallel": {**PIPE2, **T1D}, **ZBV}, None),
    "2d x zero1": (4, {"parallel": T2D, **_zero(1)}, None),
    "2.5d x accum2": (8, {"parallel": T2P5D, **ACCUM2}, None),
    "3d x zero2": (8, {"parallel": T3D, **_zero(2)}, None),
    "ring x data2 x zero3": (4, {"parallel": SEQ_RING, **_zero(3)}, None, ["same"]),
    "ring x 1f1b": (4, {"parallel": {**PIPE2, **SEQ_RING}, **PIPE}, None),
    "all-to-all x data2 x zero2 x accum2": (4, {"parallel": SEQ_A2A, **_zero(2), **ACCUM2},
                                            None),
    "all-to-all x 1f1b": (4, {"parallel": {**PIPE2, **SEQ_A2A}, **PIPE}, None),
    "ring x accum2": (2, {"parallel": SEQ_RING, **ACCUM2}, None),
    "ring x zero1 x accum2": (2, {"parallel": SEQ_RING, **_zero(1), **ACCUM2}, None),
    "ring x zero3 x accum2": (2, {"parallel": SEQ_RING, **_zero(3), **ACCUM2}, None),
    "ring x interleaved": (4, {"parallel": {**PIPE2, **SEQ_RING}, **PIPE, "NUM_CHUNKS": 2}, None),
    "ring x 1f1b x data2": (8, {"parallel": {**PIPE2, **SEQ_RING}, **PIPE}, None),
    # zbv puts the embedding and the head on rank 0, both blocks on rank 1: a stage without
    # attention is still a stage of a sequence-parallel model
    "ring x zbv": (4, {"parallel": {**PIPE2, **SEQ_RING}, **ZBV}, None),
    "ring x 1f1b x handler": (4, {"parallel": {**PIPE2, **SEQ_RING}, **PIPE, "gradient_handler": [
        {"type": "SequenceParallelGradientHandler"}]}, None),
    # experts: two replicated expert MLPs in the 2nd block (router, aux loss), never dropping
    "moe ep2": (2, {**MOE, "parallel": EP2}, None),
    "moe ep2 x data2 x accum2": (4, {**MOE, "parallel": EP2, **ACCUM2}, None),
    "moe ep4 (experts replicated) x accum2": (4, {**MOE, "parallel": {"moe": 4}, **ACCUM2}, None),
    "moe x data2 x zero1": (2, {**MOE, **_zero(1)}, None),
    "moe x data2 x zero2 x accum2": (2, {**MOE, **_zero(2), **ACCUM2}, None),
    "moe x data4 x zero3": (4, {**MOE, **_zero(3)}, None),
    "moe x interleaved x data2 x zero1": (4, {**MOE, "parallel": PIPE2, **PIPE, "NUM_CHUNKS": 2,
                                              **_zero(1)}, None),
    "moe x 1f1b x data2 x zero2": (4, {**MOE, "parallel": PIPE2, **PIPE, **_zero(2)}, None),
    "moe x zero_bubble x data2 x zero1": (4, {**MOE, "parallel": PIPE2, **PIPE, **ZB, **_zero(1)},
                                          None),
    "moe x zbv x data2 x zero1": (4, {**MOE, "parallel": PIPE2, **ZBV, **_zero(1)}, None),
    "moe x 1d": (4, {**MOE, "parallel": T1D}, "MoE"),
    "moe x 2d": (4, {**MOE, "parallel": T2D}, "MoE"),
    "moe x sequence": (4, {**MOE, "parallel": SEQ_RING}, "MoE"),
    "moe top2 x 4 experts x ep2 x data2 x accum2": (4, {**MOE4_TOP2, "parallel": EP2, **ACCUM2},
                                                    None),
    "moe ep2, every token to expert 0 at first": (2, {**MOE, "ROUTER_ZERO": True,
                                                      "parallel": EP2}, None),
    # attention without the causal mask: the ring's every block is a full one
    "non-causal x ring x data2": (4, {"CAUSAL": False, "parallel": SEQ_RING}, None),
    "non-causal x ring4": (4, {"CAUSAL": False, "parallel": SEQ_RING4}, None),
    # mixed precision (bf16 on CPU) against one process under the same AMP settings
    "O1 x data2 x zero2 x accum2": (2, {**AMP_O1, **_zero(2), **ACCUM2}, None),
    "O2 fp16 x data2 x zero2 x accum2": (2, {**FP16_O2, **_zero(2), **ACCUM2}, None),
    "O2 x 1f1b x data2": (4, {**AMP_O2, "parallel": PIPE2, **PIPE}, None),
    "O1 x 1f1b x data2 x zero1": (4, {**AMP_O1, "parallel": PIPE2, **PIPE, **_zero(1)}, None),
    "O2 x 1f1b x data2 x zero2": (4, {**AMP_O2, "parallel": PIPE2, **PIPE, **_zero(2)}, None),
    "O2 x 1d x zero1": (4, {**AMP_O2, "parallel": T1D, **_zero(1)}, None),
    "O2 x 1d x data2 x zero3": (4, {**AMP_O2, "parallel": T1D, **_zero(3)}, None),
    "O2 fp16 x 1d x data2 x zero3 x accum2": (4, {**FP16_O2, "parallel": T1D, **_zero(3),
                                                  **ACCUM2}, None),
    "O1 x ring x zero3": (4, {**AMP_O1, "parallel": SEQ_RING, **_zero(3)}, None),
    "O1 fp16 x ring": (2, {**FP16_O1, "parallel": SEQ_RING}, None),
    "O2 fp16 x ring": (2, {**FP16_O2, "parallel": SEQ_RING}, None),
    "O3 x ring": (2, {**AMP_O3, "parallel": SEQ_RING}, None),
    "O2 fp16 x ring x 1f1b": (4, {**FP16_O2, "parallel": {**PIPE2, **SEQ_RING}, **PIPE}, None),
    "O1 x moe ep2": (2, {**AMP_O1, **MOE_HALF, "parallel": EP2}, None),
    "O1 fp16 x moe ep2 x accum2": (2, {**FP16_O1, **MOE_HALF, "parallel": EP2, **ACCUM2},
                                   None),
    "O2 fp16 x moe ep2": (2, {**FP16_O2, **MOE_HALF, "parallel": EP2}, None),
    "apex O2 x moe ep2 x data2": (4, {**APEX_O2, **MOE_HALF, "parallel": EP2}, None),
    "apex O0 x data2": (2, {"fp16": {"mode": AMP_TYPE.APEX, "opt_level": "O0",  # fp32: its
                                     "dtype": "bfloat16"}}, None),  # dtype names the tolerance
    "O2 fp16 x moe ep4 (experts replicated)": (4, {**FP16_O2, **MOE_HALF,
                                                   "parallel": {"moe": 4}}, None),
    # dynamic loss scaling: an inf on one rank only skips the step on every rank and halves the
    # scale, as one process does (in a replicated parameter; in an expert only rank 1 holds)
    "overflow on one rank x O2 fp16 x ring": (2, {**FP16_O2, **OVERFLOW_TOKENS,
                                                  "parallel": SEQ_RING}, None),
    "overflow on one rank x O2 fp16 x moe ep2": (2, {**FP16_O2, **MOE_HALF, **OVERFLOW_TOKENS,
                                                     "parallel": EP2}, None),
    "overflow in rank 1's expert x O2 fp16 x moe ep2": (
        2, {**FP16_O2, **MOE_HALF, "OVERFLOW": (1, 1, "experts.1."), "parallel": EP2}, None),
    # ... where the gradient reduction does not spread the inf: ZeRO 2's reduce-scatter gives it
    # to one shard's owner; a pipeline's other stage never sees it
    "overflow on one rank x O2 fp16 x ring x zero2": (2, {**FP16_O2, **OVERFLOW_TOKENS,
                                                          "parallel": SEQ_RING, **_zero(2)}, None),
    "overflow on one stage x O2 fp16 x 1f1b": (2, {**FP16_O2, "OVERFLOW": (1, 1, "mlp"),
                                                   "parallel": PIPE2, **PIPE}, None),
    # ZeRO offload: masters and optimizer state on the CPU (here the CPU stands in for both)
    "offload x data2 x zero2 x accum2": (2, {**_zero(2, "cpu"), **ACCUM2}, None),
    "offload x 1f1b x data2 x zero1": (4, {"parallel": PIPE2, **PIPE, **_zero(1, "cpu")}, None),
    "offload x 1d x data2 x zero3": (4, {"parallel": T1D, **_zero(3, "cpu")}, None),
    "offload x ring x data2 x zero2": (4, {"parallel": SEQ_RING, **_zero(2, "cpu")}, None),
    "offload x O1 x data2 x zero3 x accum2": (2, {**AMP_O1, **_zero(3, "cpu"), **ACCUM2}, None),
    "offload x O2 x 1f1b x data2 x zero2": (4, {**AMP_O2, "parallel": PIPE2, **PIPE,
                                                **_zero(2, "cpu")}, None),
    "checkpointing x 1f1b x data2": (4, {"parallel": PIPE2, **PIPE,
                                         "ACTIVATION_CHECKPOINT": "full"}, None),
    "checkpointing x 1d x zero3": (4, {"parallel": T1D, **_zero(3),
                                       "ACTIVATION_CHECKPOINT": "full"}, None),
    "selective x all-to-all": (2, {"parallel": SEQ_A2A, "ACTIVATION_CHECKPOINT": "selective"},
                               None),
    "every block x 2d": (4, {"parallel": T2D, "ACTIVATION_CHECKPOINT": 1}, None),
    "every 2nd block x 1d": (2, {"parallel": T1D, "ACTIVATION_CHECKPOINT": 2}, None),
    "checkpointing x ring": (2, {"parallel": SEQ_RING, "ACTIVATION_CHECKPOINT": "full"}, None),
    "checkpointing x all-to-all x data2 x zero2": (4, {"parallel": SEQ_A2A, **_zero(2),
                                                      "ACTIVATION_CHECKPOINT": "full"}, None),
    "1f1b x accum2": (2, {"parallel": PIPE2, **PIPE, **ACCUM2},
                      "micro-batches already accumulate"),
    "zero3 x 1f1b": (4, {"parallel": PIPE2, **PIPE, **_zero(3)}, "use zero level 1 or 2"),
    "zero3 (v0.1 spelling) x 1f1b": (2, {"parallel": PIPE2, **PIPE, "zero": {
        "model_config": {}, "optimizer_config": {}}}, "use zero level 1 or 2"),
    "checkpointing x zero_bubble": (2, {"parallel": PIPE2, **PIPE, **ZB,
                                        "ACTIVATION_CHECKPOINT": "full"}, "cannot split"),
    "checkpointing x zbv": (2, {"parallel": PIPE2, **ZBV, "ACTIVATION_CHECKPOINT": "full"},
                            "cannot split into zbv's"),
    "zbv x accum2": (2, {"parallel": PIPE2, **ZBV, **ACCUM2}, "micro-batches already accumulate"),
    # resumes: saved after step 2 (merged, one process after 2 steps), then each of: "same" --
    # load_checkpoint in the same layout (momentum restored); (ranks, config, refused) -- the merged
    # model in another layout (a fresh optimizer), where load_checkpoint is refused saying `refused`
    "interleaved x 1d x data2 x zero2, resumed": (
        8, {"parallel": {**PIPE2, **T1D}, **PIPE, "NUM_CHUNKS": 2, **_zero(2)}, None,
        [(4, {"parallel": T1D, **_zero(3)}, "merge_checkpoint")]),
    "1f1b x 2d x zero1, resumed": (8, {"parallel": {**PIPE2, **T2D}, **PIPE, **_zero(1)}, None,
                                   [(4, {"parallel": PIPE2, **PIPE, **_zero(1)},
                                     "merge_checkpoint")]),
}
RESUMED = {  # 4 ranks; each resumed in its own layout, and merged into the next one's
    "ring x 1f1b x zero2": {"parallel": {**PIPE2, **SEQ_RING}, **PIPE, **_zero(2)},
    "gpipe x data2 x zero2": {"parallel": PIPE2, "PIPELINE_SCHEDULE": "gpipe",
                              "NUM_MICRO_BATCHES": 4, **_zero(2)},
    "interleaved x data2 x handler": {"parallel": PIPE2, **PIPE, "NUM_CHUNKS": 2, **HANDLER_CFG},
    "1d x data2 x zero3 x accum2": {"parallel": T1D, **ACCUM2, **_zero(3)},
    "1f1b x pipe4": {"parallel": {"pipeline": 4}, "NUM_MICRO_BATCHES": 4},
    "zero_bubble x pipe4": {"parallel": {"pipeline": 4}, "NUM_MICRO_BATCHES": 4, **ZB},
    "2d x zero3 x accum2": {"parallel": T2D, **ACCUM2, **_zero(3)},
}
_NEXT = dict(zip(RESUMED, [*list(RESUMED)[1:], next(iter(RESUMED))]))
TABLE.update({f"{name}, resumed": (4, config, None, ["same", (4, RESUMED[_NEXT[name]], None)])
              for name, config in RESUMED.items()})
_REFERENCE: dict = {}  # one process's (state, norms, losses) by model kind, computed once


def _refused_worker(rank, world_size, port, config):
    try:
        _gpt_worker(rank, world_size, port, config, 0, 1, None, None, None, None)
    except Exception as e:  # noqa: BLE001 (the message is what the row checks)
        return str(e)
    return "accepted"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("row", TABLE)
def test_gloo_composition_table_row_trains_as_one_process(row, tmp_path):
    """The GPT (tied embedding, float64 -- or fp32 under AMP --, SGD with momentum, clipped)
    under the row's features takes one process's steps on the whole batch: parameters (under
    AMP their updates too), clipped norms and losses after each of 3 steps, steps taken and
    loss scales; the tied table's copies stay equal; `nanocolossal plan` predicted every
    rank's bytes and elements per collective in the last step (plan_runs.py). A row that
    cannot be configured is refused on every rank, saying why; a row with resumes saves after
    step 2 and resumes as its resumes say."""
    world, config, refused, *resumes = TABLE[row]
    config = {**config, "clip_grad_norm": HALF_CLIP if "fp16" in config else CLIP}
    if refused:
        for rank, message in enumerate(run_ranks(_refused_worker, world, config)):
            assert message.startswith(f"[rank {rank}]") and refused in message, message
        return
    final, norms, losses, record = _reference(config, world)
    path = str(tmp_path / "ckpt.pt") if resumes else None
    start = _layout_state(_table_gpt(config)) if "fp16" in config else None
    results = run_ranks(_gpt_worker, world, config, 0, STEPS, path, None, None, final, None,
                        start, timeout=150)
    rel, moved = _tolerance(config)
    _check(results, final, norms, row, rel, losses, record, moved)
    _check_tied_copies(results, row)
    if "UNUSED" in config:  # one process leaves `never` where it started; so does every rank
        assert torch.equal(final["1.never"], _table_gpt({"UNUSED": True})[1].never.detach())
        assert all(r["diffs"].get("1.never", 0.0) == 0.0 for r in results), "never moved"
    if "OVERFLOW" in config:  # the planted inf really skipped that step and halved the scale
        at = config["OVERFLOW"][0]
        assert not record["took"][at] and record["scales"][at] == record["scales"][at - 1] / 2
    problems = plan_problems(world, config, [r["live"] for r in results],
                             exact="UNUSED" not in config)  # (a parameter the plan's GPT lacks)
    assert not problems, f"{row}: `nanocolossal plan` is wrong:\n" + "\n".join(problems)
    if resumes:
        _check_resumes(row, world, config, path, resumes[0])


def _check_resumes(row, world, config, path, resumes):
    """The checkpoint saved after step SAVE_AT, merged, is one process after SAVE_AT steps;
    each resume then takes one process's remaining steps (float64 rows)."""
    assert "fp16" not in config and "NUM_EXPERTS" not in config, "a float64 row"
    states, norms = _layout_one_process(_table_gpt, _tokens)
    merged = _check_merged(path, states[SAVE_AT - 1])
    for resume in resumes:
        if resume == "same":  # load_checkpoint: this layout's files, optimizer state too
            resumed = run_ranks(_gpt_worker, world, config, SAVE_AT, STEPS, None, path, None,
                                states[-1], timeout=120)
            _check(resumed, states[-1], norms[SAVE_AT:], f"{row} resumed", rel=GPT_REL)
            continue
        other_world, other, refused = resume  # the merged model, a fresh optimizer
        other = {**other, "clip_grad_norm": CLIP}
        fresh_states, fresh_norms = _layout_one_process(_table_gpt, _tokens, fresh_opt_at=SAVE_AT)
        moved = run_ranks(_gpt_worker, other_world, other, SAVE_AT, STEPS, None, "plain", merged,
                          fresh_states[-1], timeout=120)
        _check(moved, fresh_states[-1], fresh_norms[SAVE_AT:], f"{row} -> {other['parallel']}",
               rel=GPT_REL)
        if refused:  # load_checkpoint itself refuses the files, naming the route taken above
            for message in run_ranks(_refused_load_worker, other_world, other, path,
                                     timeout=120):
                assert message and refused in message and "load_plain_state_dict" in message, \
                    message


MODEL_KEYS = ("ATTENTION", "CAUSAL", "UNUSED")  # a model torch's own loop trains as well
ONE_PROCESS_KEYS = (*MODEL_KEYS, "fp16", "OVERFLOW", "ROUTER_ZERO", "NUM_EXPERTS",
                    "MOE_CAPACITY_FACTOR", "MOE_TOP_K")  # what one process runs too


def _reference(config, world):
    """One process's run for the row's model, computed once per kind: the float64 GPT (with the
    row's MODEL_KEYS) by torch's own loop; otherwise _gpt_worker on one rank with the row's
    ONE_PROCESS_KEYS (AMP settings, experts, the planted overflow) -- with experts, running the
    layout's global micro-steps in turn (each micro-step's aux loss is over its own tokens): the
    D data ranks' m-th micro-batches of A, m = 0, 1, ... Returns its final state, norms, losses
    and record of steps taken and loss scales."""
    one, perm = {k: v for k, v in config.items() if k in ONE_PROCESS_KEYS}, None
    if "NUM_EXPERTS" in config:
        P = config.get("parallel", {}).get("pipeline", 1)
        A = config.get("NUM_MICRO_BATCHES", 1) if P > 1 else config.get("gradient_accumulation", 1)
        D, n = world // P, GLOBAL // (world // P * A)
        one.update({"gradient_accumulation": A} if A > 1 else {})
        perm = [(d * A + m) * n + i for m in range(A) for d in range(D) for i in range(n)]
    key = repr((one, perm))
    if key not in _REFERENCE:
        if set(one) <= set(MODEL_KEYS):
            states, norms = _layout_one_process(lambda: _table_gpt(one), _tokens)
            _REFERENCE[key] = (states[-1], norms, list(LOSSES), None)
        else:
            clipped = {**one, "clip_grad_norm": config["clip_grad_norm"]}
            ref = run_ranks(_gpt_worker, 1, clipped, 0, STEPS, None, None, None, None, perm,
                            timeout=60)[0]
            _REFERENCE[key] = (ref["state"], ref["norms"], ref["losses"], ref)
        norms = [n for n in _REFERENCE[key][1] if n is not None]
        assert min(norms) > config["clip_grad_norm"], "every step clips"
    return _REFERENCE[key]


def _tolerance(config):
    """(of a parameter's size, of one process's update): float64 to 1e-9; half precision
    rounds sums taken in another order (a micro-batch per rank, not the whole batch): bf16
    keeps 8 bits, fp16 11. Measured: updates under 5% (fp16) and 16% (bf16) off one process's;
    an expert's gradient summed over too few ranks moves them 55% off."""
    dtype = config.get("fp16", {}).get("dtype")
    return {None: (GPT_REL, None), "bfloat16": (BF16["rtol"], 0.35),
            "float16": (FP16_REL, 0.1)}[dtype]


# -- models, data and the one-process reference ------------------------------------------------

class Branchy(nn.Module):
    """An MLP with a branch only some micro-steps use (`extra`) and one nothing uses (`never`)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(col_nn.Linear(6, 8), nn.Tanh())
        self.extra = col_nn.Linear(8, 8)
        self.never = col_nn.Linear(8, 8)
        self.head = col_nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        h = self.body(x)
        if use_extra:
            h = h + torch.tanh(self.extra(h))
        return self.head(h)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(col_nn.Linear(6, 8), nn.Tanh(), col_nn.Linear(8, 8), nn.LayerNorm(8),
                         nn.Tanh(), col_nn.Linear(8, 3))


def _bn_mlp():
    torch.manual_seed(0)
    return nn.Sequential(col_nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), col_nn.Linear(8, 3))


def _deep_mlp():
    """Nine layers: enough to cut into 2 stages x 2 chunks."""
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [col_nn.Linear(6, 6), nn.Tanh()]
    return nn.Sequential(*layers, col_nn.Linear(6, 3))


def _tensor_bn_model():
    return tensor_model(batchnorm=True)


def _batch(step, n, images=False):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(n, 1, 4, 4, generator=g) if images else torch.randn(n, 6, generator=g)
    return x, torch.randint(0, 3, (n,), generator=g)


def _dataset(n, seed, images=False):
    return TensorDataset(*_batch(seed, n, images))


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-2)


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_states_equal(actual, expected, who="", **tolerance):
    assert set(actual) == set(expected), f"{who}: state_dict keys"
    for key, value in expected.items():
        assert_close(actual[key], value, msg=lambda m: f"{who} {key}: {m}", **tolerance)


def _data_parallel_micro_batches(world_size, n, images=False):
    """Per step, the n global micro-batches of the Engine loop below: micro-batch m holds rank r's
    B samples at [(m * world_size + r) * B, ...), so it is one contiguous slice."""
    steps = []
    for step in range(STEPS):
        x, y = _batch(step, world_size * n * B, images)
        size = world_size * B
        steps.append([(x[m * size:(m + 1) * size], y[m * size:(m + 1) * size])
                      for m in range(n)])
    return steps


def _one_process(make_model, steps, clip=None, opt_level=None):
    """ONE process: for each step the losses of its global micro-batches (every rank's samples,
    which is what BatchNorm normalises over), summed over the step's samples; then torch's
    clipping and one optimizer step. With opt_level: the same under nc.amp.initialize in bf16
    (the one-process run with the same AMP settings). Returns the model and the gradient norms."""
    model = make_model()
    opt = _sgd(model.parameters())
    if opt_level:
        model, opt = amp.initialize(model, opt, opt_level, dtype=torch.bfloat16,
                                    device_type="cpu")
    norms = []
    for micro_batches in steps:
        opt.zero_grad()
        total = sum(len(y) for _, y in micro_batches)
        for x, y in micro_batches:
            loss = F.cross_entropy(model(x), y, reduction="sum") / total
            opt.backward(loss) if opt_level else loss.backward()
        if clip:
            norms.append(clip_one_process(model, opt, clip, opt_level))
        opt.step()
    return model, norms


def _engine_worker(rank, world_size, port, config, make_model, uses=None, images=False):
    """Train make_model() through nc.initialize(config): each optimizer step is
    gradient_accumulation micro-steps, in which rank r feeds its B samples of the global
    micro-batch (routed through Branchy's `extra` iff (r, m) is in `uses`)."""
    launch_rank(rank, world_size, port, config)
    model = make_model()
    engine, *_ = nc.initialize(model, _sgd(model.parameters()), col_nn.CrossEntropyLoss(),
                               verbose=False)
    n = config.get("gradient_accumulation", 1)
    per_replica, norms = B * world_size // gpc.data_size, []
    for step in range(STEPS):
        x, y = _batch(step, world_size * n * B, images)
        for m in range(n):
            # data rank d's samples of micro-batch m (tensor ranks of one replica share them)
            lo = m * world_size * B + gpc.data_rank * per_replica
            mine = (x[lo:lo + per_replica], y[lo:lo + per_replica])
            engine.zero_grad()
            if uses is None:
                engine.execute_schedule(mine)
            else:
                engine.backward(engine.criterion(engine(mine[0], (rank, m) in uses), mine[1]))
            assert engine.step() == (m == n - 1), "one optimizer step per accumulation group"
        norms.append(engine.last_grad_norm)
    no_grad = {name: p.grad is None for name, p in engine.model.named_parameters()}
    return engine, norms, no_grad


def _plain_engine_worker(rank, world_size, port, config, make_model, uses=None):
    engine, norms, no_grad = _engine_worker(rank, world_size, port, config, make_model, uses)
    return _state(engine.model), norms, no_grad


# -- DDP / gradient handler x accumulation, clipping and unused parameters ----------------------

def _branchy_one_process(world_size, n, uses, clip=None):
    """One process on the whole batch, each rank's slices routed as that rank routes them."""
    model = Branchy()
    opt = _sgd(model.parameters())
    norms = []
    for step in range(STEPS):
        x, y = _batch(step, world_size * n * B)
        opt.zero_grad()
        loss = 0
        for m in range(n):
            for r in range(world_size):
                lo = (m * world_size + r) * B
                loss = loss + F.cross_entropy(model(x[lo:lo + B], (r, m) in uses),
                                              y[lo:lo + B], reduction="sum")
        (loss / len(y)).backward()
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
    no_grad = {name: p.grad is None for name, p in model.named_parameters()}
    return _state(model), norms, no_grad


def _check_branchy(config, n, uses, clip=None):
    expected, expected_norms, expected_no_grad = _branchy_one_process(2, n, uses, clip)
    assert expected_no_grad["never.weight"], "one process: `never` has no gradient"
    untouched = Branchy().never.weight.detach()
    assert torch.equal(expected["never.weight"], untouched), "one process: `never` never moves"
    for rank, (state, norms, no_grad) in enumerate(run_ranks(_plain_engine_worker, 2, config,
                                                             Branchy, uses)):
        _assert_states_equal(state, expected, f"rank {rank}")
        assert no_grad == expected_no_grad, f"rank {rank}: which parameters have a gradient"
        if clip:
            assert norms == pytest.approx(expected_norms, rel=1e-5)
    return expected_norms


# (rank, micro-step) pairs that route through `extra`: the first of 3 micro-steps only
UNUSED_IN_THE_LAST_MICRO_STEP = {"on-all-ranks": {(0, 0), (1, 0)}, "on-one-rank": {(1, 0)}}


@pytest.mark.parametrize("uses", UNUSED_IN_THE_LAST_MICRO_STEP.values(),
                         ids=UNUSED_IN_THE_LAST_MICRO_STEP.keys())
def test_gloo_ddp_x_accumulation_keeps_the_gradient_of_a_parameter_unused_in_the_last_micro_step(
        uses):
    """The last backward of a group is the one DDP synchronises; `extra`'s gradient, accumulated
    under no_sync in micro-step 1, must still be averaged into every replica."""
    _check_branchy({"gradient_accumulation": 3}, 3, uses)


def test_gloo_ddp_x_accumulation_x_clip_clips_the_accumulated_gradient_by_the_whole_batch_norm():
    everything = {(r, m) for r in range(2) for m in range(3)}
    norms = _check_branchy({"gradient_accumulation": 3, "clip_grad_norm": CLIP}, 3, everything,
                           clip=CLIP)
    assert min(norms) > CLIP, "the clip really clips"


def test_gloo_gradient_handler_leaves_a_parameter_no_rank_uses_without_gradient():
    """No rank uses `never`: as in one process its grad stays None, so weight decay and momentum
    leave it alone. (`extra` is used on rank 0 only: averaged with rank 1's nothing.)"""
    _check_branchy({"gradient_handler": HANDLER}, 1, {(0, 0)})


def test_gloo_gradient_handler_x_accumulation_averages_a_gradient_one_rank_had_early_on():
    _check_branchy({"gradient_handler": HANDLER, "gradient_accumulation": 3}, 3, {(1, 0)})


# -- SyncBN x data parallel x accumulation ------------------------------------------------------

@pytest.mark.parametrize("mechanism", ["ddp", "gradient_handler"])
def test_gloo_syncbn_x_data_parallel_x_accumulation_equals_one_process(mechanism):
    """BatchNorm normalises each micro-batch: SyncBN makes that the global micro-batch (every
    rank's slice), as one process accumulating the same micro-batches; the running statistics
    too."""
    config = {"sync_bn": True, "gradient_accumulation": 2,
              **({"gradient_handler": HANDLER} if mechanism == "gradient_handler" else {})}
    expected = _state(_one_process(_bn_mlp, _data_parallel_micro_batches(2, 2))[0])
    for rank, (state, _, _) in enumerate(run_ranks(_plain_engine_worker, 2, config, _bn_mlp)):
        _assert_states_equal(state, expected, f"rank {rank}")


# -- AMP x data parallel x accumulation (x SyncBN, x clip) --------------------------------------

AMP_CASES = [  # (opt_level, data-parallel mechanism, model, sync_bn)
    ("O1", "ddp", _bn_mlp, True),
    ("O2", "gradient_handler", _bn_mlp, True),
    ("O3", "ddp", _mlp, False),  # everything bf16, BatchNorm included: a LayerNorm model instead
]


@pytest.mark.parametrize("opt_level, mechanism, make_model, sync_bn", AMP_CASES,
                         ids=[f"{c[0]}-{c[1]}" + ("-syncbn" if c[3] else "") for c in AMP_CASES])
def test_gloo_amp_bf16_x_data_parallel_x_accumulation_x_clip_tracks_one_process(
        opt_level, mechanism, make_model, sync_bn):
    config = {"fp16": AMP_MODES[opt_level], "gradient_accumulation": 2, "clip_grad_norm": CLIP,
              "sync_bn": sync_bn,
              **({"gradient_handler": HANDLER} if mechanism == "gradient_handler" else {})}
    steps = _data_parallel_micro_batches(2, 2)
    model, norms = _one_process(make_model, steps, CLIP, opt_level)
    expected = _state(model)
    assert min(norms) > CLIP, "the clip really clips"
    # the same training in fp32: AMP may round, never change what is trained
    fp32 = _state(_one_process(make_model, steps, CLIP)[0])
    for rank, (state, our_norms, _) in enumerate(run_ranks(_plain_engine_worker, 2, config,
                                                           make_model)):
        _assert_states_equal(state, expected, f"rank {rank}", **BF16)
        assert our_norms == pytest.approx(norms, rel=2e-2)
        for key, value in fp32.items():
            assert_close(state[key].to(value.dtype), value, **BF16_VS_FP32,
                         msg=lambda m: f"rank {rank} {key} against fp32: {m}")


# -- (Sync)BatchNorm x DDP x Trainer x metrics on uneven evaluation shards ----------------------

EVAL_CASES = {
    "batchnorm-ddp": {},
    "syncbn-ddp": {"sync_bn": True},
    "syncbn-gradient_handler-amp-O2": {"sync_bn": True, "gradient_handler": HANDLER,
                                       "fp16": AMP_MODES["O2"]},
}


def _eval_worker(rank, world_size, port, config):
    launch_rank(rank, world_size, port, config, timeout=10)  # a lone collective: an error
    model = _bn_mlp()
    train = nc.get_dataloader(_dataset(16, seed=1), batch_size=4)  # rank r: samples r, r + 2, ...
    test = nc.get_dataloader(_dataset(9, seed=2), batch_size=4, pad=False)
    engine, train, test, _ = nc.initialize(model, _sgd(model.parameters()), nn.CrossEntropyLoss(),
                                           train, test, verbose=False)
    trained = {}

    class Snapshot(hooks.BaseHook):  # the model as training left it, before evaluation
        def after_train_epoch(self, trainer):
            trained.update(_state(engine.model))

    trainer = Trainer(engine)
    trainer.fit(train, epochs=1, test_dataloader=test,
                hooks=[Snapshot(), hooks.LossHook(), hooks.AccuracyHook(Accuracy())])
    return (trainer.states["metrics"]["test"], trained, _state(engine.model),
            [len(label) for _, label in test])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("config", EVAL_CASES.values(), ids=EVAL_CASES.keys())
def test_gloo_trainer_x_ddp_batchnorm_evaluates_uneven_pad_false_shards_exactly(config):
    """9 test samples over 2 ranks (pad=False): rank 0 runs batches of 4 and 1, rank 1 one of 4.
    Evaluation must finish (no collective per forward) and every rank must evaluate the same
    model (rank 0's BatchNorm statistics), giving one process's accuracy and loss exactly."""
    results = run_ranks(_eval_worker, 2, config, timeout=25)
    assert [r[3] for r in results] == [[4, 1], [4]], "uneven shards, uneven batch counts"
    evaluated = results[0][2]
    for rank, (_, _, state, _) in enumerate(results):
        _assert_states_equal(state, evaluated, f"rank {rank} evaluated another model:", rtol=0,
                             atol=0)
    model = _bn_mlp()
    if "fp16" in config:
        model, _ = amp.initialize(model, _sgd(model.parameters()), "O2", dtype=torch.bfloat16,
                                  device_type="cpu")
    model.load_state_dict(evaluated)
    x, y = _dataset(9, seed=2).tensors
    with torch.no_grad():
        logits = model.eval()(x)
    accuracy = int((logits.argmax(1) == y).sum()) / len(y)
    loss = F.cross_entropy(logits, y).item()
    for rank, (metrics, trained, _, _) in enumerate(results):
        assert metrics["accuracy"] == accuracy, f"rank {rank}: the whole test set's accuracy"
        assert metrics["loss"] == pytest.approx(loss, rel=1e-5 if "fp16" not in config else 1e-3)
        if config.get("sync_bn"):  # SyncBN: the training itself is one process's, batches of 8
            x, y = _dataset(16, seed=1).tensors
            steps = [[(x[k * 8:(k + 1) * 8], y[k * 8:(k + 1) * 8])] for k in range(2)]
            level = "O2" if "fp16" in config else None
            expected = _state(_one_process(_bn_mlp, steps, opt_level=level)[0])
            _assert_states_equal(trained, expected, f"rank {rank} trained",
                                 **(BF16 if level else {}))


# -- Trainer x accumulation x max_steps x checkpoint/resume (x SyncBN, x clip, x LR schedule) ---

# 5 iterations per epoch per rank, accumulation 2: groups of 2, 2 and 1 (every epoch ends with an
# optimizer step; a short last group is still divided by 2, as Hugging Face Accelerate does)
TRAIN_SIZE, SHUFFLE_SEED, EPOCHS, ACCUMULATION = 20, 7, 2, 2


def _trainer_worker(rank, world_size, port, mechanism, path, max_steps, resume):
    config = {"gradient_accumulation": ACCUMULATION, "clip_grad_norm": CLIP, "sync_bn": True,
              **({"gradient_handler": HANDLER} if mechanism == "gradient_handler" else {})}
    launch_rank(rank, world_size, port, config)
    model = _bn_mlp()
    opt = _sgd(model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)
    loader = nc.get_dataloader(_dataset(TRAIN_SIZE, seed=3), shuffle=True, seed=SHUFFLE_SEED,
                               batch_size=B)
    engine, loader, _, scheduler = nc.initialize(model, opt, nn.CrossEntropyLoss(), loader,
                                                 lr_scheduler=scheduler, verbose=False)
    trainer = Trainer(engine)
    if resume:
        assert trainer.resume(path, scheduler)
    trainer.fit(loader, epochs=EPOCHS, max_steps=max_steps,
                hooks=[hooks.LossHook(), hooks.LRSchedulerHook(scheduler, by_epoch=False),
                       hooks.SaveCheckpointHook(path, lr_scheduler=scheduler)])
    return (_state(engine.model), trainer.states["metrics"]["train"]["loss"],
            scheduler.get_last_lr()[0])


def _trainer_one_process():
    """The same run in one process: each iteration's global batch is both ranks' B samples (from
    the same sampler), loss / ACCUMULATION backward, a step after each group and at the end of
    each epoch. Returns the state after every step, the last epoch's mean loss and the final
    learning rate."""
    data = _dataset(TRAIN_SIZE, seed=3)
    x, y = data.tensors
    model = _bn_mlp()
    opt = _sgd(model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)
    after_each_step, losses = [], []
    for epoch in range(EPOCHS):
        shards = epoch_shards(data, epoch, SHUFFLE_SEED)
        losses, iterations = [], len(shards[0]) // B
        for k in range(iterations):
            idx = shards[0][k * B:(k + 1) * B] + shards[1][k * B:(k + 1) * B]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            losses.append(loss.item())
            (loss / ACCUMULATION).backward()
            if k % ACCUMULATION == ACCUMULATION - 1 or k == iterations - 1:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item()
                assert norm > CLIP, "the clip really clips"
                opt.step()
                scheduler.step()
                opt.zero_grad()
                after_each_step.append(_state(model))
    assert iterations % ACCUMULATION, "an epoch that ends inside a group"
    return after_each_step, sum(losses) / len(losses), scheduler.get_last_lr()[0]


def test_gloo_trainer_x_accumulation_x_syncbn_x_clip_x_lr_schedule_equals_one_process(tmp_path):
    after_each_step, loss, lr = _trainer_one_process()
    for rank, (state, our_loss, our_lr) in enumerate(
            run_ranks(_trainer_worker, 2, "ddp", str(tmp_path / "ckpt.pt"), None, False)):
        _assert_states_equal(state, after_each_step[-1], f"rank {rank}")
        assert our_loss == pytest.approx(loss, rel=1e-5), "the last epoch's mean loss (LossHook)"
        assert our_lr == pytest.approx(lr), "the scheduler steps once per optimizer step"


@pytest.mark.parametrize("mechanism", ["ddp", "gradient_handler"])
def test_gloo_trainer_x_accumulation_stopped_by_max_steps_resumes_to_the_one_process_result(
        tmp_path, mechanism):
    """max_steps counts optimizer steps: max_steps=1 stops after the first group (2 batches) in
    the middle of epoch 1. The checkpoint holds one process's model after 1 step, and the resumed
    run ends where one uninterrupted process ends (its last epoch's loss and LR included)."""
    after_each_step, loss, lr = _trainer_one_process()
    path = str(tmp_path / "ckpt.pt")
    stopped = run_ranks(_trainer_worker, 2, mechanism, path, 1, False)
    saved = torch.load(path, weights_only=False)["model"]
    resumed = run_ranks(_trainer_worker, 2, mechanism, path, None, True)
    for rank, (state, our_loss, our_lr) in enumerate(resumed):
        _assert_states_equal(state, after_each_step[-1], f"rank {rank} resumed")
        assert our_loss == pytest.approx(loss, rel=1e-5), "the last epoch's mean loss (LossHook)"
        assert our_lr == pytest.approx(lr)
    for rank, (state, _, _) in enumerate(stopped):
        _assert_states_equal(state, after_each_step[0], f"rank {rank} stopped after 1 step")
    _assert_states_equal(saved, after_each_step[0], "the checkpoint")


# -- pipeline x data x (interleaving + clip, SyncBN, AMP) ---------------------------------------

PIPE_BATCH = 8  # per data replica per step: M = 2 micro-batches of 4
PIPELINE_CASES = {  # (extra config, model, partition, opt_level)
    "interleaved-clip": ({"NUM_CHUNKS": 2, "clip_grad_norm": CLIP}, _deep_mlp, "uniform", None),
    "1f1b-syncbn": ({"sync_bn": True}, _bn_mlp, [2, 2], None),
    "1f1b-amp-O2": ({"fp16": AMP_MODES["O2"]}, _mlp, [3, 3], "O2"),
    # ZeRO over each stage's data ranks: the optimizer state (level 2: and gradients) sharded
    "interleaved-clip-zero1": ({"NUM_CHUNKS": 2, "clip_grad_norm": CLIP, "zero": {"level": 1}},
                               _deep_mlp, "uniform", None),
    "interleaved-clip-zero2": ({"NUM_CHUNKS": 2, "clip_grad_norm": CLIP, "zero": {"level": 2}},
                               _deep_mlp, "uniform", None),
    "1f1b-amp-O2-zero2": ({"fp16": AMP_MODES["O2"], "zero": {"level": 2}}, _mlp, [3, 3], "O2"),
}


def _pipeline_micro_batches(data_size, num_micro):
    """Per step, the global micro-batches: micro-batch m of every data replica together (each
    replica takes its PIPE_BATCH slice of the step's batch and cuts it into num_micro)."""
    steps, size = [], PIPE_BATCH // num_micro
    for step in range(STEPS):
        x, y = _batch(step, data_size * PIPE_BATCH)
        micro_batches = []
        for m in range(num_micro):
            idx = [d * PIPE_BATCH + m * size + i for d in range(data_size) for i in range(size)]
            micro_batches.append((x[idx], y[idx]))
        steps.append(micro_batches)
    return steps


def _pipeline_worker(rank, world_size, port, case, path):
    extra, make_model, partition, _ = PIPELINE_CASES[case]
    config = {"parallel": {"pipeline": 2}, "NUM_MICRO_BATCHES": 2, **extra}
    launch_rank(rank, world_size, port, config)
    stage = build_pipeline_model(make_model(), num_chunks=config.get("NUM_CHUNKS", 1),
                                 partition=partition)
    engine, *_ = nc.initialize(stage, _sgd(stage.parameters()), nn.CrossEntropyLoss(),
                               verbose=False)
    norms = []
    for step in range(STEPS):
        x, y = _batch(step, gpc.data_size * PIPE_BATCH)
        mine = slice(gpc.data_rank * PIPE_BATCH, (gpc.data_rank + 1) * PIPE_BATCH)
        engine.zero_grad()
        engine.execute_schedule((x[mine], y[mine]))
        assert engine.step()
        norms.append(engine.last_grad_norm)
    save_checkpoint(path, 1, engine.model, engine.optimizer)
    return _state(engine.model), norms


@pytest.mark.parametrize("case", PIPELINE_CASES, ids=PIPELINE_CASES)
def test_gloo_pipeline_x_data_parallel_equals_one_process_with(tmp_path, case):
    """2 stages x 2 data replicas; the stage files merge into the one-process model."""
    extra, make_model, _, opt_level = PIPELINE_CASES[case]
    clip = extra.get("clip_grad_norm")
    model, norms = _one_process(make_model, _pipeline_micro_batches(2, 2), clip, opt_level)
    expected = _state(model)
    tolerance = BF16 if opt_level else {}
    path = tmp_path / "ckpt.pt"
    results = run_ranks(_pipeline_worker, 4, case, str(path))
    seen = set()
    for rank, (state, our_norms) in enumerate(results):
        for key, value in state.items():
            assert_close(value, expected[key], msg=lambda m: f"rank {rank} {key}: {m}",
                         **tolerance)
        seen |= set(state)
        if clip:
            assert min(norms) > clip, "the clip really clips"
            assert our_norms == pytest.approx(norms, rel=1e-5), "all stages' squares, once"
    assert seen == set(expected), "the stages hold the whole model"
    _assert_states_equal(merge_checkpoint(path), expected, "merged", **tolerance)


# -- tensor (1d, 2d) x data parallel x accumulation x clip x metrics ----------------------------

TENSOR_CASES = [  # (mode, tensor size, data-parallel mechanism, sync_bn); data size 2 each
    ("1d", 2, "ddp", True),
    ("1d", 2, "gradient_handler", False),
    ("2d", 4, "ddp", False),
    ("2d", 4, "gradient_handler", False),
    # ZeRO over the data ranks of each tensor rank: the tensor-split parameters stay split
    ("1d", 2, "zero1", True),
    ("1d", 2, "zero2", False),
    ("1d", 2, "zero3", False),
    ("2d", 4, "zero2", False),
    ("2d", 4, "zero3", False),
]
MECHANISMS = {"ddp": {}, "gradient_handler": {"gradient_handler": HANDLER},
              **{f"zero{level}": {"zero": {"level": level}} for level in (1, 2, 3)}}


def _tensor_worker(rank, world_size, port, mode, size, mechanism, sync_bn, expected, norms):
    config = {"parallel": {"tensor": {"size": size, "mode": mode}}, "gradient_accumulation": 2,
              "clip_grad_norm": CLIP, "sync_bn": sync_bn, **MECHANISMS[mechanism]}
    engine, our_norms, _ = _engine_worker(rank, world_size, port, config,
                                          _tensor_bn_model if sync_bn else tensor_model,
                                          images=True)
    assert our_norms == pytest.approx(norms, rel=1e-4), "each element's square counted once"
    checked = []
    splits = {name: getattr(p, "tensor_splits", []) for name, p in engine.model.named_parameters()}
    for name, value in engine.model.state_dict().items():  # (ZeRO 3: gathered, collective)
        # my slice of one process's parameter (buffers and replicated parameters: all of it)
        assert_close(value, slice_of(expected[name], splits.get(name, [])),
                     msg=lambda m: f"[rank {rank}] {name}: {m}")
        checked.append(name)
    test = nc.get_dataloader(_dataset(8, seed=9, images=True), batch_size=2, pad=False)
    metrics = Trainer(engine).evaluate(test, hooks=[hooks.LossHook(),
                                                    hooks.AccuracyHook(Accuracy())])
    return checked, metrics


@pytest.mark.parametrize("mode, size, mechanism, sync_bn", TENSOR_CASES,
                         ids=[f"{c[0]}x{c[1]}-{c[2]}" + ("-syncbn" if c[3] else "")
                              for c in TENSOR_CASES])
def test_gloo_tensor_x_data_parallel_x_accumulation_x_clip_equals_one_process(mode, size,
                                                                              mechanism, sync_bn):
    """Each rank ends with exactly its slice of one process's parameters (and the BatchNorm
    statistics), and the evaluation metrics are one process's."""
    make_model = _tensor_bn_model if sync_bn else tensor_model
    model, norms = _one_process(make_model, _data_parallel_micro_batches(2 * size, 2, True), CLIP)
    assert min(norms) > CLIP, "the clip really clips"
    expected = _state(model)
    x, y = _dataset(8, seed=9, images=True).tensors
    with torch.no_grad():
        logits = model.eval()(x)
    accuracy = int((logits.argmax(1) == y).sum()) / len(y)
    loss = F.cross_entropy(logits, y).item()
    results = run_ranks(_tensor_worker, 2 * size, mode, size, mechanism, sync_bn, expected, norms,
                        timeout=90)
    assert {name for checked, _ in results for name in checked} == set(expected)
    for rank, (_, metrics) in enumerate(results):
        assert metrics["accuracy"] == accuracy, f"rank {rank}"
        assert metrics["loss"] == pytest.approx(loss, rel=1e-5), f"rank {rank}"


# -- interleaved pipeline x tensor 1d x Trainer (max_steps, resume) x metrics x checkpoints -----

TP_TRAIN, TP_TEST, TP_BATCH = 16, 10, 4  # 4 steps per epoch; test batches 4, 4, 2 (M = 2)


def _tensor_pipeline_worker(rank, world_size, port, path, max_steps, resume):
    launch_rank(rank, world_size, port, {"parallel": {"pipeline": 2, "tensor": {"size": 2,
                                                                            "mode": "1d"}},
                                     "NUM_MICRO_BATCHES": 2, "NUM_CHUNKS": 2})
    chunks = build_pipeline_model(tensor_pipeline_model(), num_chunks=2, partition=[2, 2, 2, 3])
    train = nc.get_dataloader(_dataset(TP_TRAIN, seed=4), shuffle=True, seed=SHUFFLE_SEED,
                              batch_size=TP_BATCH)
    test = nc.get_dataloader(_dataset(TP_TEST, seed=5), batch_size=TP_BATCH, pad=False)
    engine, train, test, _ = nc.initialize(chunks, _sgd(chunks.parameters()),
                                           col_nn.CrossEntropyLoss(), train, test,
                                           verbose=False)
    trainer = Trainer(engine)
    if resume:
        assert trainer.resume(path)
    trainer.fit(train, epochs=EPOCHS, test_dataloader=test, max_steps=max_steps,
                hooks=[hooks.LossHook(), hooks.AccuracyHook(Accuracy()),
                       hooks.SaveCheckpointHook(path)])
    params = {name: (p.detach().clone(), list(getattr(p, "tensor_splits", [])))
              for chunk in engine.model for name, p in chunk.named_parameters()}
    return params, gpc.tensor_rank, trainer.states["metrics"]["test"]


def _slice_1d(full, splits, tensor_rank, size=2):
    for dim, axis in splits:
        assert axis == "tensor"
        full = full.chunk(size, dim=dim)[tensor_rank]
    return full


def _assert_slices(results, expected, who):
    seen = set()
    for rank, (params, tensor_rank, _) in enumerate(results):
        for name, (value, splits) in params.items():
            assert_close(value, _slice_1d(expected[name], splits, tensor_rank),
                         msg=lambda m: f"{who} rank {rank} {name}: {m}")
            seen.add(name)
    assert seen == {k for k in expected}, f"{who}: every parameter is on some rank"


def test_gloo_interleaved_pipeline_x_tensor_1d_x_trainer_resumes_and_merges_to_one_process(
        tmp_path):
    """2 stages x 2 chunks x 1d tensor 2: stopped by max_steps=3 mid-epoch, resumed to the end;
    every rank holds its slice of one process's model, the evaluation metrics are one process's,
    and each save merges (merge_checkpoint) into one process's state_dict."""
    data, test = _dataset(TP_TRAIN, seed=4), _dataset(TP_TEST, seed=5)
    model = tensor_pipeline_model()
    opt = _sgd(model.parameters())
    after_each_step = []
    for epoch in range(EPOCHS):
        sampler = nc.DistributedSampler(data, num_replicas=1, rank=0, shuffle=True,
                                        seed=SHUFFLE_SEED)
        sampler.set_epoch(epoch)
        order = list(sampler)
        for k in range(0, len(order), TP_BATCH):
            x, y = data[order[k:k + TP_BATCH]]
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            after_each_step.append(_state(model))
    x, y = test.tensors
    with torch.no_grad():
        logits = model(x)
    accuracy = int((logits.argmax(1) == y).sum()) / len(y)
    loss = F.cross_entropy(logits, y).item()

    path = tmp_path / "ckpt.pt"
    stopped = run_ranks(_tensor_pipeline_worker, 4, str(path), 3, False)
    merged_stopped = merge_checkpoint(path)
    resumed = run_ranks(_tensor_pipeline_worker, 4, str(path), None, True)
    _assert_slices(stopped, after_each_step[2], "stopped")
    _assert_slices(resumed, after_each_step[-1], "resumed")
    for rank, (_, _, metrics) in enumerate(resumed):
        assert metrics["accuracy"] == accuracy, f"rank {rank}"
        assert metrics["loss"] == pytest.approx(loss, rel=1e-5), f"rank {rank}"
    _assert_states_equal(merged_stopped, after_each_step[2], "merged after max_steps")
    _assert_states_equal(merge_checkpoint(path), after_each_step[-1], "merged at the end")


# -- three- and four-way layouts x clip x checkpoints: one process each -------------------------
# Three- and four-way compositions of layouts, each against ONE process on the whole batch: a GPT
# (tied, vocab-parallel embedding = classifier) under pipeline x tensor 1d / 2d x data x ZeRO,
# sequence x pipeline x ZeRO, interleaved x tensor x ZeRO x tied weight, and frozen / unused
# parameters inside tensor-parallel layers x ZeRO 1-3 x accumulation x clip.
#
# Checked at once per run: the clipped gradient norm of every step (a clip that really clips:
# each element counted once however many ranks hold a copy), the final parameters, the merged
# checkpoint saved mid-run (= one process's state_dict), and resuming from it -- same layout
# (optimizer state restored: momentum) and another layout through merge_checkpoint +
# load_plain_state_dict (the documented route: the model only, a fresh optimizer).
# float64, SGD + momentum + weight decay: exact to ~1e-10.
#
# And where a layout could differ: a weight tied across pipeline stages that is frozen after
# build_pipeline_model, or unused by every stage in a step, gets no gradient (as in one process)
# and does not move; at ZeRO 2 such a frozen table outside the optimizer does not break the step;
# a pipeline stage whose parameters one data rank does not use in a step must not hang under
# DDP / ZeRO 2.

VOCAB, SEQ, DIM = 16, 8, 8
GLOBAL = 8      # sequences per step (split over the data replicas, then micro-batches)
SAVE_AT = 2     # saved after step 2 of STEPS = 3 (above); CLIP = 0.05 as above
TOL = {"rtol": 1e-9, "atol": 1e-11}
GPT_REL = 1e-9  # the vocab-parallel loss keeps float64 (test_gloo_vocab_..._keeps_float64)


def _layout_sgd(params, lr=0.1):
    return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=1e-2)


def _tokens(step):
    g = torch.Generator().manual_seed(5000 + step)
    t = torch.randint(0, VOCAB, (GLOBAL, SEQ + 1), generator=g)
    return t[:, :-1], t[:, 1:]


def _layout_state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _layout_one_process(make_model, batch, steps=STEPS, clip=CLIP, fresh_opt_at=None, loss_fn=None):
    """States after each step and the norms; `fresh_opt_at`: a new optimizer from that step on
    (what a cross-layout resume does: the model only)."""
    model = make_model()
    opt = _layout_sgd([p for p in model.parameters()])
    states, norms, LOSSES[:] = [], [], []
    for step in range(steps):
        if step == fresh_opt_at:
            opt = _layout_sgd([p for p in model.parameters()])
        x, y = batch(step)
        opt.zero_grad()
        out = model(x)
        loss = (loss_fn or _lm_loss)(out, y)
        LOSSES.append(loss.item())
        loss.backward()
        params = [p for p in model.parameters() if p.grad is not None]
        norms.append(torch.nn.utils.clip_grad_norm_(params, clip).item() if clip else None)
        opt.step()
        states.append(_layout_state(model))
    return states, norms


LOSSES = []  # the last _layout_one_process's losses, step by step


def _lm_loss(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


# -- a GPT worker for every layout ---------------------------------------------------------------

def _splits(engine):
    return tensor_splits_of(engine.model)


def _table_gpt(config=None):
    """The table's GPT as the row's capitals ask (the way train_gpt.py reads NUM_EXPERTS):
    ATTENTION 'fused' or 'explicit', CAUSAL=False (every token sees the whole sequence),
    UNUSED (the first block holds a parameter `never` no forward uses: its grad stays None, so
    neither weight decay nor momentum may move it), ROUTER_ZERO (every router starts uniform:
    top-1 sends every token to expert 0)."""
    config = config or {}
    torch.manual_seed(0)
    model = gpt(vocab=VOCAB, seq_len=SEQ, dim=DIM, depth=2, heads=2, mlp_ratio=2,
                moe=moe_model_settings(config), attention=config.get("ATTENTION", "fused"))
    for block in model[1:-1]:
        block.attn.causal = config.get("CAUSAL", True)
    if config.get("UNUSED"):
        model[1].never = nn.Parameter(torch.randn(DIM))
    if config.get("ROUTER_ZERO"):
        for layer in moe_layers(model):
            nn.init.zeros_(layer.router.gate.weight)
    return model if "fp16" in config else model.double()  # (AMP: the fp32 model it expects)


def _plant_overflow(engine, config, step, micro_step):
    """OVERFLOW = (step, rank, name): an inf in the gradient of the first parameter whose name
    holds `name`, on that rank only (one process: its only rank), in the step's first
    micro-step -- an overflow the other ranks do not see. Returns the hook to remove."""
    at, rank, name = config.get("OVERFLOW", (None, None, None))
    if (step, micro_step) != (at, 0) or gpc.rank != (rank if gpc.world_size > 1 else 0):
        return None
    param = next((p for n, p in engine.model.named_parameters() if name in n), None)
    assert param is not None, f"OVERFLOW: rank {gpc.rank} holds no parameter named *{name}*"
    return param.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))


def _gpt_worker(rank, world_size, port, config, first, last, save, load, merged, expected,
                perm=None, start=None):
    """Train steps [first, last) of the GPT under `config`; `load`: 'same' (load_checkpoint) or
    'plain' (load_plain_state_dict(merged)); `save`: a path written after step SAVE_AT;
    `expected`, `start`: one process's state at the end and at the start."""
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port, timeout=60)
    model = _table_gpt(config)
    if gpc.pipeline_size > 1:
        model = build_pipeline_model(model, num_chunks=config.get("NUM_CHUNKS", 1),
                                     partition="uniform")
    lr = HALF_LR if "fp16" in config else 0.1
    engine, *_ = nc.initialize(model, _layout_sgd(model.parameters(), lr),
                               col_nn.VocabParallelCrossEntropyLoss(), verbose=False)
    if load == "plain":
        load_plain_state_dict(engine.model, merged)
    elif load:
        load_checkpoint(load, engine.model, engine.optimizer)
    norms, losses, took, scales = [], [], [], []
    for step in range(first, last):
        x, y = _tokens(step)
        if perm is not None:  # one process running the pipeline's global micro-batches in turn
            x, y = x[perm], y[perm]
        accum = config.get("gradient_accumulation", 1)
        n = GLOBAL // gpc.data_size // accum
        measure = step == last - 1 and first == 0 and expected is not None
        with _measured(engine, measure) as measured:  # a first run's last step: for the planner
            for m in range(accum):
                lo = (gpc.data_rank * accum + m) * n
                batch = (x[lo:lo + n], y[lo:lo + n])
                if gpc.sequence_size > 1:  # my zig-zag share of every sequence (the loader's)
                    batch = split_batch(batch, gpc.sequence_size, gpc.sequence_rank)
                engine.zero_grad()
                planted = _plant_overflow(engine, config, step, m)
                _, _, loss = engine.execute_schedule(batch)
                if planted:
                    planted.remove()
                stepped = engine.step()
                assert not stepped or m == accum - 1, "one optimizer step per accumulation group"
        took.append(stepped)
        scales.append(engine.optimizer.loss_scale)
        norms.append(engine.last_grad_norm)
        losses.append(nc.metrics.all_reduce_mean(loss.item()))
        if save and step + 1 == SAVE_AT:
            save_checkpoint(save, 1, engine.model, engine.optimizer)
    report = _report(engine.model, expected, norms, rank, losses if accum == 1 else None, start)
    return {**report, "took": took, "scales": scales, "live": measured}


@contextlib.contextmanager
def _measured(engine, measure):
    """Yields {} and, if `measure`, fills it with plan_runs.live() for the block."""
    measured = {}
    if not measure:
        yield measured
        return
    with count_collectives() as counted, SavedBytes(engine.model.parameters()) as saved:
        yield measured
    measured.update(live(engine, counted, saved))


def _report(model, expected, norms, rank, losses=None, start=None):
    """This rank's parameters against its slice of one process's (in the worker: shard needs the
    job's tensor coordinates): the difference relative to the parameter's size, and (given one
    process's `start`) relative to how far one process moved it -- what half precision needs,
    whose weights hardly move in 3 steps next to their size."""
    if expected is None:  # one process's reference run: the whole state
        return {"state": strip_prefixes(_layout_state(model)), "norms": norms, "rank": rank,
                "losses": losses}
    layout = tensor_splits_of(model)
    diffs, moves = {}, {}
    for key, value in strip_prefixes(_layout_state(model)).items():
        want = slice_of(expected[key], layout[key])
        if value.shape != want.shape:
            diffs[key] = moves[key] = float("inf")
            continue
        diff = (value - want).abs().max().item()
        diffs[key] = diff / (1 + want.abs().max().item())
        if start is not None and value.is_floating_point():
            moved = (want - slice_of(start[key], layout[key]).to(want.dtype)).abs().max().item()
            # a floor of 4 units in the last place: a step one process rounds to nothing
            ulps = 4 * torch.finfo(value.dtype).eps * want.abs().max().item()
            moves[key] = diff / (moved + ulps) if diff else 0.0
    tied = {k: v for k, v in strip_prefixes(_layout_state(model)).items() if k in TIED_TABLE}
    return {"diffs": diffs, "moves": moves, "norms": norms, "rank": rank, "losses": losses,
            "tied": tied, "tensor_rank": gpc.tensor_rank}


TIED_TABLE = ("0.tok.weight", "3.classifier.weight")  # one table: the embedding = the classifier


def _check_tied_copies(results, what):
    """The tied table stays one table: every copy of it (on the first and the last stage, on
    every data or sequence rank) is the same to the bit at each tensor coordinate."""
    first = {}
    for r in results:
        for key, value in r["tied"].items():
            rank, key0, value0 = first.setdefault(r["tensor_rank"], (r["rank"], key, value))
            assert torch.equal(value, value0), \
                f"{what}: rank {r['rank']}'s {key} drifted from rank {rank}'s {key0}"


def _check(results, expected, norms, what, rel=1e-9, losses=None, record=None, moved=None):
    """Every rank's parameters = its slice of one process's (and, given `moved`, their updates
    to that fraction); the norms (and the reported losses, where given and recorded; the steps
    taken and loss scales, where recorded) = one process's."""
    seen = set()
    for r in results:
        if record is not None:
            assert (r["took"], r["scales"]) == (record["took"], record["scales"]), \
                f"{what} rank {r['rank']}: steps taken, loss scales {r['took']} {r['scales']}"
            # (a skipped step's norm may be None)
            r["norms"], norms = [n or 0.0 for n in r["norms"]], [n or 0.0 for n in norms]
        if losses is not None and r.get("losses") is not None:
            assert r["losses"] == pytest.approx(losses, rel=rel), \
                f"{what} rank {r['rank']}: losses {r['losses']} vs one process {losses}"
        bad = {k: d for k, d in r["diffs"].items() if not d < rel}
        assert not bad, f"{what} rank {r['rank']}: parameters differ from one process: {bad}"
        bad = {k: d for k, d in r.get("moves", {}).items() if not d < moved}
        assert not bad, f"{what} rank {r['rank']}: updates differ from one process's: {bad}"
        seen |= set(r["diffs"])
        assert r["norms"] == pytest.approx(norms, rel=rel), \
            f"{what} rank {r['rank']}: norms {r['norms']} vs one process {norms}"
    assert seen == set(expected), f"{what}: the ranks hold the whole model"


def _check_merged(path, expected):
    merged = merge_checkpoint(path)
    assert set(merged) >= set(expected) - {"3.classifier.weight"}, sorted(merged)
    for key, value in merged.items():
        assert_close(value, expected[key], msg=lambda m, key=key: f"merged {key}: {m}", **TOL)
    return merged


def _refused_load_worker(rank, world_size, port, config, path):
    """load_checkpoint of another layout's files: a ConfigError naming the way through."""
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port, timeout=60)
    model = _table_gpt()
    if gpc.pipeline_size > 1:
        model = build_pipeline_model(model, num_chunks=config.get("NUM_CHUNKS", 1),
                                     partition="uniform")
    engine, *_ = nc.initialize(model, _layout_sgd(model.parameters()),
                               col_nn.VocabParallelCrossEntropyLoss(), verbose=False)
    try:
        load_checkpoint(path, engine.model, engine.optimizer)
    except ConfigError as e:
        return str(e)
    return None


# -- frozen parameters inside tensor-parallel layers, a branch only step 0 uses, ZeRO 1-3 x
#    tensor 1d / 2d x accumulation x clip ------------------------------------------------------

class FrozenBranchy(nn.Module):
    """Patch embedding, LayerNorm (bias frozen), a residual MLP whose first (tensor-split) weight
    is frozen, the token mean, a residual branch run only while `use_branch`, a classifier.
    One process: frozen parameters and the branch (after step 0) have grad None, are not counted
    by the clip, never move again (no weight decay, no momentum)."""

    def __init__(self, dtype=torch.float64) -> None:
        super().__init__()
        col_nn.reset_1d_alternation()
        torch.manual_seed(0)
        self.embed = col_nn.PatchEmbedding(4, 2, 1, 4)
        self.norm = col_nn.LayerNorm(4)
        self.fc1, self.fc2 = col_nn.Linear(4, 8), col_nn.Linear(8, 4)
        self.b1, self.b2 = col_nn.Linear(4, 8), col_nn.Linear(8, 4)
        self.head = col_nn.Classifier(4, 3)
        self.to(dtype)
        self.fc1.weight.requires_grad_(False)
        self.norm.bias.requires_grad_(False)
        self.use_branch = True

    def forward(self, x):
        h = self.norm(self.embed(x))
        h = (h + self.fc2(torch.tanh(self.fc1(h)))).mean(dim=1)
        if self.use_branch:
            h = h + self.b2(torch.tanh(self.b1(h)))
        return self.head(h)


def _images(step):
    g = torch.Generator().manual_seed(7000 + step)
    return (torch.randn(GLOBAL, 1, 4, 4, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (GLOBAL,), generator=g))


def _branch_one_process(fresh_opt_at=None):
    model = FrozenBranchy()
    opt = _layout_sgd(model.parameters())
    states, norms = [], []
    for step in range(STEPS):
        if step == fresh_opt_at:
            opt = _layout_sgd(model.parameters())
        model.use_branch = step == 0
        x, y = _images(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(
            [p for p in model.parameters() if p.grad is not None], CLIP).item())
        opt.step()
        states.append(_layout_state(model))
    return states, norms


def _branch_worker(rank, world_size, port, config, first, last, save, load, merged, expected):
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port, timeout=60)
    model = FrozenBranchy()
    engine, *_ = nc.initialize(model, _layout_sgd(model.parameters()), col_nn.CrossEntropyLoss(),
                               verbose=False)
    if load == "plain":
        load_plain_state_dict(engine.model, merged)
    elif load:
        load_checkpoint(load, engine.model, engine.optimizer)
    accum = config.get("gradient_accumulation", 1)
    n = GLOBAL // gpc.data_size // accum
    norms = []
    for step in range(first, last):
        model.use_branch = step == 0
        x, y = _images(step)
        for m in range(accum):
            lo = gpc.data_rank * n * accum + m * n
            engine.zero_grad()
            engine.execute_schedule((x[lo:lo + n], y[lo:lo + n]))
            assert engine.step() == (m == accum - 1)
        norms.append(engine.last_grad_norm)
        if save and step + 1 == SAVE_AT:
            save_checkpoint(save, 1, engine.model, engine.optimizer)
    return _report(engine.model, expected, norms, rank)


def _z(level, tensor, accum=2):
    return {"parallel": {"tensor": tensor}, "gradient_accumulation": accum,
            "clip_grad_norm": CLIP, "zero": {"level": level}}


T1D2, T2D4 = {"size": 2, "mode": "1d"}, {"size": 4, "mode": "2d"}
FROZEN = {  # layout -> the layout its merged checkpoint is resumed into (plain, fresh optimizer)
    "1d2-data2-zero1": (_z(1, T1D2), _z(3, T2D4)),
    "1d2-data2-zero2": (_z(2, T1D2), _z(1, T1D2, accum=1)),
    "1d2-data2-zero3": (_z(3, T1D2), _z(2, T2D4)),
    "2d4-zero3": (_z(3, T2D4), _z(3, T1D2)),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", FROZEN, ids=FROZEN)
def test_gloo_frozen_in_tensor_layers_x_branch_unused_later_x_zero_x_accum_x_clip_ckpt(
        tmp_path, case):
    """4 ranks, float64: norms (frozen and unused parameters not counted), final parameters
    (frozen ones and, after step 0, the branch untouched by weight decay and momentum), the
    merged mid-run checkpoint, resumed in the same layout (momentum restored) and in another
    (model only)."""
    config, other = FROZEN[case]
    states, norms = _branch_one_process()
    assert min(norms) > CLIP
    first = FrozenBranchy()
    assert torch.equal(states[-1]["fc1.weight"], first.fc1.weight)
    assert torch.equal(states[-1]["b1.weight"], states[0]["b1.weight"])
    path = str(tmp_path / "ckpt.pt")
    results = run_ranks(_branch_worker, 4, config, 0, STEPS, path, None, None, states[-1],
                        timeout=120)
    _check(results, states[-1], norms, case)
    merged = merge_checkpoint(path)
    assert set(merged) == set(states[SAVE_AT - 1])
    for key, value in merged.items():
        assert_close(value, states[SAVE_AT - 1][key], msg=lambda m, key=key: f"merged {key}: {m}",
                     **TOL)
    resumed = run_ranks(_branch_worker, 4, config, SAVE_AT, STEPS, None, path, None, states[-1],
                        timeout=120)
    _check(resumed, states[-1], norms[SAVE_AT:], f"{case} resumed")
    fresh_states, fresh_norms = _branch_one_process(fresh_opt_at=SAVE_AT)
    moved = run_ranks(_branch_worker, 4, other, SAVE_AT, STEPS, None, "plain", merged,
                      fresh_states[-1], timeout=120)
    _check(moved, fresh_states[-1], fresh_norms[SAVE_AT:], f"{case} -> other layout")


# -- MoE with replicated experts (EP 1) inside the GPT x tensor / sequence / pipeline / ZeRO -----

# -- a pipeline stage's frozen parameters: the tied table frozen, stage 0 frozen altogether -----

def _freeze(model, names):
    for name, p in model.named_parameters(remove_duplicate=False):
        if any(name.startswith(n) for n in names):
            p.requires_grad_(False)


def _frozen_gpt_worker(rank, world_size, port, config, names, when, expected, path=None,
                       trainable_only=False):
    """`when`: freeze `names` before build_pipeline_model or after it (on the stage)."""
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port, timeout=60)
    model = _table_gpt()
    if when == "before":
        _freeze(model, names)
    if gpc.pipeline_size > 1:
        model = build_pipeline_model(model, partition="uniform")
    if when == "after":
        _freeze(model, names)
    params = [p for p in model.parameters() if p.requires_grad or not trainable_only]
    engine, *_ = nc.initialize(model, _layout_sgd(params),
                               col_nn.VocabParallelCrossEntropyLoss(), verbose=False)
    norms = []
    for step in range(STEPS):
        x, y = _tokens(step)
        n = GLOBAL // gpc.data_size
        lo = gpc.data_rank * n
        batch = (x[lo:lo + n], y[lo:lo + n])
        if gpc.sequence_size > 1:
            batch = split_batch(batch, gpc.sequence_size, gpc.sequence_rank)
        engine.zero_grad()
        engine.execute_schedule(batch)
        assert engine.step()
        norms.append(engine.last_grad_norm)
        if path and step + 1 == SAVE_AT:
            save_checkpoint(path, 1, engine.model, engine.optimizer)
    return _report(engine.model, expected, norms, rank)


def _frozen_gpt_one_process(names, clip=CLIP):
    def make():
        model = _table_gpt()
        _freeze(model, names)
        return model
    return _layout_one_process(make, _tokens, clip=clip)


TIED = ("0.tok.", "3.classifier.")
STAGE0 = ("0.", "1.")  # uniform over 2 stages: [Embeddings, Block] | [Block, LMHead]
FROZEN_STAGE_CASES = {
    "pipe2-data2-zero2-tied-frozen-before-build": (TIED, "before", {"parallel": PIPE2, **PIPE,
                                                                    **_zero(2)}),
    "pipe2-data2-zero2-stage0-frozen": (STAGE0, "before", {"parallel": PIPE2, **PIPE,
                                                           **_zero(2)}),
    "pipe2-data2-zero1-stage0-and-table-frozen": (STAGE0 + TIED, "before",
                                                  {"parallel": PIPE2, **PIPE, **_zero(1)}),
    "zero-bubble-pipe2-data2-stage0-frozen": (STAGE0, "before", {"parallel": PIPE2, **PIPE, **ZB}),
    "zero-bubble-pipe2-data2-tied-frozen": (TIED, "before", {"parallel": PIPE2, **PIPE, **ZB}),
    "1d2-data2-zero3-tied-frozen": (TIED, "before", {"parallel": {"tensor": T1D2},
                                                     "zero": {"level": 3}}),
    "2d4-zero3-block1-frozen": (("1.",), "before", {"parallel": {"tensor": T2D4},
                                                    "zero": {"level": 3}}),
    "seq2-pipe2-zero2-pos-and-block2-frozen": (("0.pos.", "2."), "before", {
        "parallel": {"pipeline": 2, "tensor": {"size": 2, "mode": "sequence"}},
        "NUM_MICRO_BATCHES": 2, "zero": {"level": 2}}),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", FROZEN_STAGE_CASES, ids=FROZEN_STAGE_CASES)
def test_gloo_gpt_frozen_tied_table_stage_or_block_x_pipeline_tensor_sequence_x_zero_x_clip(
        tmp_path, case):
    """4 ranks: frozen parameters never move, are not in the norm; the rest = one process's;
    the checkpoint saved after step 2 merges into one process's state_dict."""
    names, when, extra = FROZEN_STAGE_CASES[case]
    clip = CLIP / 4  # stage 0 frozen: a smaller norm
    states, norms = _frozen_gpt_one_process(names, clip)
    assert min(norms) > clip
    config = {"clip_grad_norm": clip, **extra}
    path = str(tmp_path / "ckpt.pt")
    results = run_ranks(_frozen_gpt_worker, 4, config, names, when, states[-1], path,
                        timeout=120)
    _check(results, states[-1], norms, case, rel=GPT_REL)
    _check_merged(path, states[SAVE_AT - 1])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("level", [0, 2], ids=["no-zero", "zero2"])
def test_gloo_pipeline_tied_table_frozen_after_build_pipeline_model_stays_frozen(level):
    """The user freezes the tied embedding / classifier table on the stage modules (after
    build_pipeline_model, before initialize): one process never moves it."""
    states, norms = _frozen_gpt_one_process(TIED)
    config = {"parallel": {"pipeline": 2}, "NUM_MICRO_BATCHES": 2, "clip_grad_norm": CLIP,
              **({"zero": {"level": level}} if level else {})}
    results = run_ranks(_frozen_gpt_worker, 2, config, TIED, "after", states[-1], timeout=120)
    _check(results, states[-1], norms, f"zero {level}", rel=GPT_REL)


# -- the vocab-parallel loss on float64 logits -------------------------------------------------

def _vocab_loss_worker(rank, world_size, port):
    nc.launch({"parallel": {"tensor": T1D2}}, rank=rank, world_size=world_size, host="127.0.0.1",
              port=port, timeout=60)
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(6, VOCAB, generator=g, dtype=torch.float64) * 3
    target = torch.randint(0, VOCAB, (6,), generator=g)
    want = F.cross_entropy(logits, target)
    per = VOCAB // world_size
    mine = logits[:, rank * per:(rank + 1) * per].clone().requires_grad_()
    loss = col_nn.VocabParallelCrossEntropyLoss()(mine, target)
    loss.backward()
    full = logits.clone().requires_grad_()
    F.cross_entropy(full, target).backward()
    return (loss.dtype, (loss.detach().double() - want).abs().item(),
            (mine.grad - full.grad[:, rank * per:(rank + 1) * per]).abs().max().item())


@pytest.mark.timeout(300)
def test_gloo_vocab_parallel_cross_entropy_keeps_float64():
    """float64 logits: the loss is float64 and equals torch's (computed in float32 it would be off
    by 2.2e-7, the gradient by 1.7e-8)."""
    for dtype, loss_err, grad_err in run_ranks(_vocab_loss_worker, 2, timeout=60):
        assert dtype == torch.float64 and loss_err < 1e-12 and grad_err < 1e-12, \
            (dtype, loss_err, grad_err)


# -- a tied table that no stage uses in a step (both uses behind a branch) ---------------------

USE_TABLE = [True]  # True: every row through the table, False: none, k: the first k rows


def _rows(x, table, alt):
    """The first k rows through `table`, the others through `alt`; an empty part not run."""
    k = {True: len(x), False: 0}.get(USE_TABLE[0], USE_TABLE[0])
    parts = ([table(x[:k])] if k else []) + ([alt(x[k:])] if k < len(x) else [])
    return torch.cat(parts)


class CondEmbed(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w, self.alt = w, nn.Linear(6, 8, dtype=torch.float64)

    def forward(self, x):
        return torch.tanh(_rows(x, lambda r: r @ self.w.t(), self.alt))


class CondHead(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w, self.alt = w, nn.Linear(8, 6, dtype=torch.float64)

    def forward(self, h):
        return _rows(h, lambda r: r @ self.w, self.alt)


def _cond_tied_model(tied=True):
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(8, 6, dtype=torch.float64) * 0.5)
    head_w = w if tied else nn.Parameter(w.detach().clone())
    return nn.Sequential(CondEmbed(w), nn.Linear(8, 8, dtype=torch.float64), nn.Tanh(),
                         CondHead(head_w), nn.Linear(6, 3, dtype=torch.float64))


def _vectors(step):
    g = torch.Generator().manual_seed(9000 + step)
    return (torch.randn(GLOBAL, 6, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (GLOBAL,), generator=g))


def _cond_tied_one_process(tied=True, split=False):
    """`split`: the tables in every step, but in step 1 only for the first half of the batch
    (data rank 0's); else the tables in step 0 only."""
    model = _cond_tied_model(tied)
    opt = _layout_sgd(model.parameters())
    norms = []
    for step in range(STEPS):
        USE_TABLE[0] = (True if step != 1 else GLOBAL // 2) if split else step == 0
        x, y = _vectors(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(
            [p for p in model.parameters() if p.grad is not None], CLIP).item())
        opt.step()
    USE_TABLE[0] = True
    return _layout_state(model), norms


def _cond_tied_worker(rank, world_size, port, config, expected, tied=True, split=False):
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port, timeout=60)
    chunks = config.get("NUM_CHUNKS", 1)
    stage = build_pipeline_model(_cond_tied_model(tied), num_chunks=chunks,
                                 partition=[2, 3] if chunks == 1 else [1, 2, 1, 1])
    engine, *_ = nc.initialize(stage, _layout_sgd(stage.parameters()), nn.CrossEntropyLoss(),
                               verbose=False)
    return _train_vectors(engine, expected, rank,
                          lambda step: (step != 1 or gpc.data_rank == 0) if split else step == 0)


def _train_vectors(engine, expected, rank, use_table):
    """STEPS steps on my data rank's rows of _vectors, USE_TABLE[0] = use_table(step)."""
    norms = []
    for step in range(STEPS):
        USE_TABLE[0] = use_table(step)
        x, y = _vectors(step)
        n = GLOBAL // gpc.data_size
        lo = gpc.data_rank * n
        engine.zero_grad()
        engine.execute_schedule((x[lo:lo + n], y[lo:lo + n]))
        assert engine.step()
        norms.append(engine.last_grad_norm)
    USE_TABLE[0] = True
    return _report(engine.model, expected, norms, rank)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("level, chunks", [(0, 1), (2, 1), (2, 2)],
                         ids=["no-zero", "zero2", "interleaved-zero2"])
def test_gloo_pipeline_x_data_x_zero_weights_no_stage_uses_after_step_0_do_not_move(level,
                                                                                  chunks):
    """The same model with two untied tables (one per stage), each used in step 0 only: one
    process's grad None afterwards, so no weight decay and no momentum; clipped norms equal."""
    state, norms = _cond_tied_one_process(tied=False)
    assert min(norms) > CLIP
    config = {"parallel": {"pipeline": 2}, "NUM_MICRO_BATCHES": 2, "clip_grad_norm": CLIP,
              "NUM_CHUNKS": chunks, **({"zero": {"level": level}} if level else {})}
    results = run_ranks(_cond_tied_worker, 4, config, state, False, timeout=120)
    _check(results, state, norms, f"zero {level}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("level", [0, 2], ids=["no-zero", "zero2"])
def test_gloo_pipeline_tied_table_no_stage_uses_in_a_step_does_not_move(level):
    """pipeline 2 x data 2: W (stage 0's embedding = stage 1's head) is used in step 0 only; one
    process leaves it alone afterwards (grad None: no weight decay, no momentum)."""
    state, norms = _cond_tied_one_process()
    config = {"parallel": {"pipeline": 2}, "NUM_MICRO_BATCHES": 2, "clip_grad_norm": CLIP,
              **({"zero": {"level": level}} if level else {})}
    results = run_ranks(_cond_tied_worker, 4, config, state, timeout=120)
    _check(results, state, norms, f"zero {level}")


# -- AMP O2 bf16 x ZeRO 3 x tensor 1d x data x frozen x unused branch x accumulation x clip ----

O2 = {"mode": AMP_TYPE.NAIVE, "dtype": "bfloat16"}


def _o2_one_process():
    model = FrozenBranchy(torch.float32)
    model, opt = amp.initialize(model, _layout_sgd(model.parameters()), "O2", dtype=torch.bfloat16,
                                device_type="cpu")
    norms = []
    for step in range(STEPS):
        model.use_branch = step == 0
        x, y = _images(step)
        opt.zero_grad()
        opt.backward(F.cross_entropy(model(x.float()), y))
        norms.append(opt.clip_grad_norm(CLIP))
        opt.step()
    return _layout_state(model), norms


def _o2_worker(rank, world_size, port, config, expected):
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port, timeout=60)
    model = FrozenBranchy(torch.float32)
    engine, *_ = nc.initialize(model, _layout_sgd(model.parameters()), col_nn.CrossEntropyLoss(),
                               verbose=False)
    accum, norms = config["gradient_accumulation"], []
    n = GLOBAL // gpc.data_size // accum
    for step in range(STEPS):
        model.use_branch = step == 0
        x, y = _images(step)
        for m in range(accum):
            lo = gpc.data_rank * n * accum + m * n
            engine.zero_grad()
            engine.execute_schedule((x[lo:lo + n].float(), y[lo:lo + n]))
            assert engine.step() == (m == accum - 1)
        norms.append(engine.last_grad_norm)
    return _report(engine.model, expected, norms, rank)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("level", [2, 3], ids=["zero2", "zero3"])
def test_gloo_amp_o2_bf16_x_zero_x_tensor_1d_x_data_x_frozen_x_branch_x_clip(level):
    """4 ranks, bf16 model / fp32 masters: norms and parameters track one process's O2 run; the
    frozen parameters (tensor-split fc1.weight, LayerNorm bias) are bit-identical to it."""
    state, norms = _o2_one_process()
    assert min(norms) > CLIP
    first = FrozenBranchy(torch.float32)
    assert state["fc1.weight"].dtype == torch.bfloat16
    assert torch.equal(state["fc1.weight"], first.fc1.weight.to(torch.bfloat16))
    config = {**_z(level, T1D2), "fp16": O2}
    for r in run_ranks(_o2_worker, 4, config, state, timeout=120):
        assert r["diffs"]["fc1.weight"] == 0 and r["diffs"]["norm.bias"] == 0, r["diffs"]
        bad = {k: d for k, d in r["diffs"].items() if not d < 2e-2}
        assert not bad, f"rank {r['rank']}: {bad}"
        assert r["norms"] == pytest.approx(norms, rel=2e-2), (r["norms"], norms)


# -- sequence ranks hold replicas: their files load with load_checkpoint into data ranks -------

SEQ2_PIPE2_Z2 = {**RESUMED["ring x 1f1b x zero2"], "clip_grad_norm": CLIP}
SEQ2_PIPE2_Z1 = {**SEQ2_PIPE2_Z2, "zero": {"level": 1}}
SAME_FILES = {  # saved by -> loaded into (world); every one writes pipeline-2 files
    "seq2-pipe2-zero2 -> pipe2-data2-zero1": (SEQ2_PIPE2_Z2, 4, {
        "parallel": {"pipeline": 2}, "NUM_MICRO_BATCHES": 2, "clip_grad_norm": CLIP,
        "zero": {"level": 1}}, 4),
    "seq2-pipe2-zero2 -> pipe2": (SEQ2_PIPE2_Z2, 4, {
        "parallel": {"pipeline": 2}, "NUM_MICRO_BATCHES": 2, "clip_grad_norm": CLIP}, 2),
    "pipe2-data2-zero2 -> seq2-pipe2-zero1": ({
        "parallel": {"pipeline": 2}, "NUM_MICRO_BATCHES": 2, "clip_grad_norm": CLIP,
        "zero": {"level": 2}}, 4, SEQ2_PIPE2_Z1, 4),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", SAME_FILES, ids=SAME_FILES)
def test_gloo_gpt_sequence_x_pipeline_x_zero_checkpoint_loads_into_data_ranks_and_back(
        tmp_path, case):
    """A sequence x pipeline job writes the files a pipeline job of the same stages writes (the
    weights are whole on every sequence rank): load_checkpoint (optimizer state too) from one
    into the other ends where one process does after 3 steps (momentum restored)."""
    saved, saved_world, loaded, loaded_world = SAME_FILES[case]
    states, norms = _layout_one_process(_table_gpt, _tokens)
    path = str(tmp_path / "ckpt.pt")
    run_ranks(_gpt_worker, saved_world, saved, 0, SAVE_AT, path, None, None, states[SAVE_AT - 1],
              timeout=120)
    resumed = run_ranks(_gpt_worker, loaded_world, loaded, SAVE_AT, STEPS, None, path, None,
                        states[-1], timeout=120)
    _check(resumed, states[-1], norms[SAVE_AT:], case, rel=GPT_REL)


# -- one weight used by three of four stages -----------------------------------------------------

class Mid(nn.Module):
    """A stage in the middle using the table too: h + tanh(h W W^T)."""

    def __init__(self, w):
        super().__init__()
        self.w = w

    def forward(self, h):
        return h + torch.tanh(h @ self.w @ self.w.t())


class Embed(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w = w

    def forward(self, x):
        return torch.tanh(x @ self.w.t())


class Head(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w = w

    def forward(self, h):
        return h @ self.w


def _three_way_model():
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(8, 6, dtype=torch.float64) * 0.5)
    return nn.Sequential(Embed(w), Mid(w), nn.Linear(8, 8, dtype=torch.float64), nn.Tanh(),
                         Head(w), nn.Linear(6, 3, dtype=torch.float64))


def _three_way_worker(rank, world_size, port, config, expected):
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port, timeout=60)
    stage = build_pipeline_model(_three_way_model(), partition=[1, 1, 2, 2])
    engine, *_ = nc.initialize(stage, _layout_sgd(stage.parameters()), nn.CrossEntropyLoss(),
                               verbose=False)
    norms = []
    for step in range(STEPS):
        x, y = _vectors(step)
        engine.zero_grad()
        engine.execute_schedule((x, y))
        assert engine.step()
        norms.append(engine.last_grad_norm)
    return _report(engine.model, expected, norms, rank)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["1f1b"])
def test_gloo_pipeline_4_stages_weight_shared_by_3_stages_x_clip_equals_one_process(schedule):
    """Stages 0, 1, 3 hold W (stage 2 none): it steps with the sum of 3 gradients and the clip
    counts it once (pipeline_copies 3)."""
    states, norms = _layout_one_process(_three_way_model, _vectors, loss_fn=F.cross_entropy)
    assert min(norms) > CLIP
    config = {"parallel": {"pipeline": 4}, "NUM_MICRO_BATCHES": 4, "clip_grad_norm": CLIP,
              "PIPELINE_SCHEDULE": schedule}
    results = run_ranks(_three_way_worker, 4, config, states[-1], timeout=120)
    _check(results, states[-1], norms, schedule)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("level", [0, 1, 2], ids=["no-zero", "zero1", "zero2"])
def test_gloo_pipeline_tied_table_frozen_after_build_optimizer_over_trainable_only(level):
    """The usual fine-tuning spelling: freeze the tied table on the stages, then an optimizer over
    the parameters that still require a gradient. One process: the table never moves."""
    states, norms = _frozen_gpt_one_process(TIED)
    config = {"parallel": {"pipeline": 2}, "NUM_MICRO_BATCHES": 2, "clip_grad_norm": CLIP,
              **({"zero": {"level": level}} if level else {})}
    results = run_ranks(_frozen_gpt_worker, 2, config, TIED, "after", states[-1], None, True,
                        timeout=120)
    _check(results, states[-1], norms, f"zero {level}", rel=GPT_REL)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tied, level, chunks", [(False, 2, 1), (False, 2, 2), (True, 2, 1)],
                         ids=["untied-zero2", "untied-interleaved-zero2",
                              "tied-across-stages-zero2"])
def test_gloo_pipeline_x_data_x_zero_a_table_only_data_rank_0_uses_in_a_step(tied, level,
                                                                             chunks):
    """Step 1: data rank 0's samples go through the tables, data rank 1's through the other
    Linear (so rank 1 has no gradient for the tables at all): the average over the data ranks
    is one process's gradient of the whole batch; tied or not, 1F1B or interleaved."""
    state, norms = _cond_tied_one_process(tied=tied, split=True)
    assert min(norms) > CLIP
    config = {"parallel": {"pipeline": 2}, "NUM_MICRO_BATCHES": 2, "clip_grad_norm": CLIP,
              "NUM_CHUNKS": chunks, **({"zero": {"level": level}} if level else {})}
    results = run_ranks(_cond_tied_worker, 4, config, state, tied, True, timeout=120)
    _check(results, state, norms, f"tied {tied} zero {level} chunks {chunks}")


class MaybeHead(nn.Module):
    """The last stage's only parameters, behind a branch: rows [:k] through the Linear, the rest
    take their first 3 features."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 3, dtype=torch.float64)

    def forward(self, h):
        return _rows(h, self.lin, lambda r: r[:, :3])


def _maybe_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8, dtype=torch.float64), nn.Tanh(), MaybeHead())


def _maybe_one_process():
    model = _maybe_model()
    opt = _layout_sgd(model.parameters())
    norms = []
    for step in range(STEPS):
        USE_TABLE[0] = True if step != 1 else GLOBAL // 2
        x, y = _vectors(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
    USE_TABLE[0] = True
    return _layout_state(model), norms


def _maybe_worker(rank, world_size, port, config, expected):
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port, timeout=60)
    stage = build_pipeline_model(_maybe_model(), partition=[2, 1])
    engine, *_ = nc.initialize(stage, _layout_sgd(stage.parameters()), nn.CrossEntropyLoss(),
                               verbose=False)
    return _train_vectors(engine, expected, rank, lambda step: step != 1 or gpc.data_rank == 0)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("reduce", ["handler", "ddp"])
def test_gloo_pipeline_x_data_a_stage_whose_parameters_one_data_rank_skips_in_a_step(reduce):
    """Step 1: the last stage's Linear on data rank 0's samples only (rank 1 uses none of the
    stage's parameters): the data mean = one process's gradient of the whole batch."""
    state, norms = _maybe_one_process()
    assert min(norms) > CLIP
    config = {"parallel": {"pipeline": 2}, "NUM_MICRO_BATCHES": 2, "clip_grad_norm": CLIP}
    if reduce == "handler":
        config["gradient_handler"] = [{"type": "DataParallelGradientHandler"}]
    results = run_ranks(_maybe_worker, 4, config, state, timeout=6 if reduce == "ddp" else 120)
    _check(results, state, norms, f"pipeline 2 x data 2, {reduce}")
