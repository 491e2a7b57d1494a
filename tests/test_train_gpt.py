"""train_gpt.py end to end: with dropout 0, one seed and one global batch, the final train loss and
the sampled text are the same for one process and a layout of each kind -- tensor 1d and 2d,
pipeline x tensor with the embedding tied to the classifier across stages, ZeRO 2 under a pipeline
(the tied embedding too), ZeRO 3 beside 1d tensor parallelism, and sequence parallelism (ring
attention) alone and under a pipeline. (Each layout's exactness against one process is its own
file's lesson; here the script runs them.)"""
import re

import pytest
import torch
from dist_helpers import ROOT, run_script

from nanocolossal.checkpoint import merge_checkpoint

MODEL = "NUM_EPOCHS = 1\nSEQ_LEN = 16\nNUM_MICRO_BATCHES = 2\nDIM = 32\nDEPTH = 2\nHEADS = 4\n"
LAYOUTS = {  # name: (processes, BATCH_SIZE per data replica (global 8), parallel)
    "one process": (1, 8, ""),
    "1d x2": (2, 8, "parallel = dict(tensor=dict(size=2, mode='1d'))"),
    "2d x4": (4, 8, "parallel = dict(tensor=dict(size=4, mode='2d'))"),
    "pipeline 2 x 1d 2": (4, 8, "parallel = dict(pipeline=2, tensor=dict(size=2, mode='1d'))"),
    "pipeline 2 x data 2, ZeRO 2": (4, 4, "parallel = dict(pipeline=2)\nzero = dict(level=2)"),
    "data 2 x 1d 2, ZeRO 3": (4, 4, "parallel = dict(tensor=dict(size=2, mode='1d'))\n"
                                    "zero = dict(level=3)"),
    "sequence x2": (2, 8, "parallel = dict(tensor=dict(size=2, mode='sequence'))"),
    "pipeline 2 x sequence 2":
        (4, 8, "parallel = dict(pipeline=2, tensor=dict(size=2, mode='sequence'))"),
    "sequence x2, all-to-all": (2, 8, "parallel = dict(tensor=dict(size=2, mode='sequence', "
                                      "attention='all_to_all'))"),
}


def _run(tmp_path, name, *args):
    nproc, batch, parallel = LAYOUTS[name]
    config = tmp_path / f"{name.replace(' ', '_')}.py"
    config.write_text(f"BATCH_SIZE = {batch}\n{MODEL}{parallel}\n")
    out = run_script(ROOT / "train_gpt.py",
                     ["--config", str(config), "--max-steps", "3", "--seed", "5",
                      "--max-bytes", "6000", "--sample", "12", *args],
                     nproc=nproc, cwd=tmp_path).replace("\r", "\n")
    loss = float(re.search(r"final train loss ([0-9.e+-]+)", out).group(1))
    return loss, re.search(r"sample: (.*)", out).group(1)


@pytest.mark.timeout(300)
def test_deep_train_gpt_final_loss_and_sample_are_the_same_for_every_layout(tmp_path):
    runs = {name: _run(tmp_path, name) for name in LAYOUTS}
    loss, sample = runs["one process"]
    for name, (other_loss, other_sample) in runs.items():
        assert other_loss == pytest.approx(loss, rel=1e-4), runs
        assert other_sample == sample, f"{name} wrote other text: {runs}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["pipeline 2 x 1d 2", "pipeline 2 x data 2, ZeRO 2"])
def test_deep_the_tied_embedding_stays_one_table_across_pipeline_stages(tmp_path, layout):
    """The token embedding (stage 0) and the classifier (stage 1) hold copies of one table:
    after training they are still equal, and equal to one process's single table. (ZeRO 2: each
    stage's data ranks hold segments of the table's gradient, summed across stages segment by
    segment.)"""
    _run(tmp_path, layout, "--checkpoint", "pp.pt")
    _run(tmp_path, "one process", "--checkpoint", "one.pt")
    pipelined, single = merge_checkpoint(tmp_path / "pp.pt"), merge_checkpoint(tmp_path / "one.pt")
    embedding, classifier = "0.tok.weight", "3.classifier.weight"
    assert torch.equal(pipelined[embedding], pipelined[classifier]), "the copies drifted apart"
    torch.testing.assert_close(pipelined[embedding], single[embedding])


@pytest.mark.timeout(300)
def test_deep_a_sequence_parallel_checkpoint_is_the_plain_models_state_dict(tmp_path):
    """Sequence ranks hold whole replicas: one file per stage (none per sequence rank), merging
    to one process's state_dict after the same training. (Exact equality in float64 is
    test_sequence's; here AdamW moves the key bias, whose gradient is exactly zero as
    softmax ignores a shift, by up to lr per step on rounding noise alone.)"""
    _run(tmp_path, "pipeline 2 x sequence 2", "--checkpoint", "seq.pt")
    _run(tmp_path, "one process", "--checkpoint", "one.pt")
    assert sorted(p.name for p in tmp_path.glob("seq*.pt")) == ["seq-stage0.pt", "seq-stage1.pt"]
    merged, single = merge_checkpoint(tmp_path / "seq.pt"), merge_checkpoint(tmp_path / "one.pt")
    assert merged.keys() == single.keys()
    for key in single:
        torch.testing.assert_close(merged[key], single[key], rtol=0, atol=3 * 3e-3, msg=key)
        if "qkv.bias" not in key:
            torch.testing.assert_close(merged[key], single[key], rtol=1e-4, atol=1e-5, msg=key)
