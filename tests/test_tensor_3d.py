"""3d tensor parallelism (Bian et al. 2021): a q x q x q cube of ranks; every activation, weight and
output split over two of its axes -- against plain torch, in float64.

Layouts (tensor/cube.py): layout A, where blocks start and end, cuts the batch over (x, y) and the
hidden dimension over z; a column Linear's output (layout B) cuts the batch over (x, z) and the
hidden dimension over y, and so do the vocabulary-parallel logits.
"""
import pytest
import torch
from dist_helpers import run_ranks
from layer_checks import (
    check_colossal_classes,
    check_layers,
    embedding_padding,
    gathered,
    generate_feature_split,
    small_model,
    tiny_gpt_one_process,
    tiny_gpt_run,
    train_small_model,
)
from models import error_message
from torch import nn
from torch.testing import assert_close
from torch.utils.data import TensorDataset

import nanocolossal as nc
import nanocolossal.nn as col_nn
from nanocolossal.checkpoint import load_plain_state_dict, merge_checkpoint
from nanocolossal.config import ConfigError
from nanocolossal.layout import layout
from nanocolossal.trainer import Trainer, hooks

pytestmark = pytest.mark.timeout(120)
CUBE = dict(parallel=dict(tensor=dict(size=8, mode="3d")))


def test_gloo_3d_a_2x2x2_cube_trains_as_one_process():
    """8 ranks as a 2 x 2 x 2 cube: each Linear all-gathers its input along one axis and its
    weight along another, multiplies one pair of blocks, and reduce-scatters the sum along the
    third; every step is one process's step on the whole batch (every rank is given the whole
    batches; its layers keep their blocks of them)."""
    xs, ys = torch.randint(0, 10, (3, 8)), torch.randint(0, 3, (3, 8))  # 3 batches of 8 ids
    # small_model(): Embedding, Linear, Tanh, Linear, LayerNorm, Classifier; SGD with momentum
    one_process = train_small_model(0, 1, None, None, xs, ys)
    for rank, params in enumerate(run_ranks(train_small_model, 8, CUBE, xs, ys)):
        assert_close(params, one_process, msg=lambda m: f"rank {rank}: {m}")


def test_3d_cube_groups_run_along_named_axes():
    """tensor_rank = x * q^2 + y * q + z; a group along an axis varies that coordinate only, a
    plane (the batch's blocks in layout A or B) two of them (context.layout, no process)."""
    cube = layout(8, T=8, mode="3d")
    assert cube.tensor_x == [[0, 4], [1, 5], [2, 6], [3, 7]]   # same (y, z)
    assert cube.tensor_y == [[0, 2], [1, 3], [4, 6], [5, 7]]   # same (x, z)
    assert cube.tensor_z == [[0, 1], [2, 3], [4, 5], [6, 7]]   # same (x, y)
    assert cube.tensor_xy == [[0, 2, 4, 6], [1, 3, 5, 7]]     # same z, block x * q + y
    assert cube.tensor_xz == [[0, 1, 4, 5], [2, 3, 6, 7]]     # same y, block x * q + z


def _layers_worker(rank, world_size, port):
    nc.launch(CUBE, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    layout_a = [(0, "x"), (0, "y"), (-1, "z")]
    layout_b = [(0, "x"), (0, "z"), (-1, "y")]
    return check_layers(layout_a, layout_b, [(0, "x"), (0, "y")], layout_b)


def test_deep_3d_layers_equal_plain_torch_forward_and_backward():
    """Linear, LayerNorm, Embedding, vocab-parallel Embedding + tied Classifier + loss, and the
    feature-split Classifier + loss, to 1e-10 in float64."""
    assert run_ranks(_layers_worker, 8, timeout=90) == [
        ["linear", "layernorm", "embedding", "classifier + loss",
         "vocab embedding + classifier + loss"]] * 8


def _config_error(build):
    """The message of the ConfigError (one line, no traceback, in a script) `build()` raises."""
    with pytest.raises(ConfigError) as err:
        build()
    return str(err.value)


def _errors_worker(rank, world_size, port):
    nc.launch(CUBE, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    col_nn.Linear(8, 8)  # a column Linear without its row partner yet:
    norm = _config_error(lambda: col_nn.LayerNorm(8))
    col_nn.reset_1d_alternation()
    return {"norm": norm, "in": _config_error(lambda: col_nn.Linear(6, 8)),
            "batch": _config_error(lambda: col_nn.Embedding(10, 8)(torch.zeros(6, 2).long())),
            "both": _config_error(lambda: col_nn.Linear(8, 8, parallel="row",
                                                         input_is_split=False))}


def test_gloo_3d_bad_shapes_are_one_line_errors():
    """Said when the layer is built (the batch: when it arrives), as ConfigErrors: a script ends
    with the message alone on every rank."""
    for rank, out in enumerate(run_ranks(_errors_worker, 8, timeout=60)):
        assert out == {
            "norm": f"[rank {rank}] LayerNorm built after a column Linear under 3d tensor "
                    f"parallelism: its input would be the column Linear's output (layout B), "
                    f"where only a row Linear fits; build Linears in the order data flows, in "
                    f"column/row pairs (nc.nn.Linear alternates), and pass input_is_split=False "
                    f"to a column Linear whose input is not the previous Linear's output (as "
                    f"SwiGLU's second)",
            "in": f"[rank {rank}] Linear in_features 6 is not divisible by 4 (tensor parallel "
                  f"3d, size 8); choose a multiple of 4",
            "batch": f"[rank {rank}] a batch of 6 cannot be split over the 4 batch shares of the "
                     f"3d cube (tensor size 8); use a batch size that is a multiple of 4",
            "both": f"[rank {rank}] Linear(parallel='row', input_is_split=False) contradict each "
                    f"other: a column Linear takes a whole input (3d: layout A), a row Linear a "
                    f"split one (layout B); pass one of them"}


def _colossal_worker(rank, world_size, port):
    nc.launch(CUBE, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    a, b = [(0, "x"), (0, "y"), (-1, "z")], [(0, "x"), (0, "z"), (-1, "y")]
    col_nn.reset_1d_alternation()  # Linear3D alternates: column (A -> B), then row (B -> A)
    return check_colossal_classes("3D", a, b, a[:2], b, other="Linear2p5D")


def test_deep_colossal_3d_classes_and_arguments_equal_the_plain_layers():
    results = run_ranks(_colossal_worker, 8, timeout=90)
    assert all(checked == results[0] and "Linear" in checked for checked in results)


def _load_plain_worker(rank, world_size, port, config, merged):
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    model = small_model()
    load_plain_state_dict(model, merged)
    return gathered(model)


def test_deep_3d_checkpoint_merges_to_the_plain_model_and_loads_into_2p5d(tmp_path):
    """A 3d save (one file per tensor rank) merges into one process's state_dict, which loads
    into 2.5d's blocks."""
    xs, ys = torch.randint(0, 10, (2, 8)), torch.randint(0, 3, (2, 8))
    one_process = train_small_model(0, 1, None, None, xs, ys)
    run_ranks(train_small_model, 8, CUBE, xs, ys, str(tmp_path / "cube.pt"))
    merged = merge_checkpoint(tmp_path / "cube.pt")
    assert_close(merged, one_process)
    tesseract = dict(parallel=dict(tensor=dict(size=8, mode="2.5d", depth=2)))
    for params in run_ranks(_load_plain_worker, 8, tesseract, merged):
        assert_close(params, one_process)


def test_deep_train_gpt_3d_config_ends_as_one_process():
    """configs/gpt_3d.py (shrunk): train_gpt.py's final loss and sample are one process's."""
    loss, sample = tiny_gpt_run("gpt_3d.py", 8)
    one_loss, one_sample = tiny_gpt_one_process()
    assert abs(loss - one_loss) < 1e-4 and sample == one_sample, (loss, one_loss, sample)


def _misplaced_worker(rank, world_size, port):
    """Layers built where their input would be in the wrong layout; each must be refused: every
    one computes a plausible-looking, wrong result otherwise (the shapes of layouts A and B agree:
    [B/q^2, ..., d/q])."""
    nc.launch(CUBE, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    out = {}
    for name, build in {
        "column after column": lambda: [col_nn.Linear(8, 8, parallel="column"),
                                        col_nn.Linear(8, 8, parallel="column")],
        "row first": lambda: col_nn.Linear(8, 8, parallel="row"),
        "LayerNorm3D after Linear3D": lambda: [col_nn.Linear3D(8, 8), col_nn.LayerNorm3D(8)],
        "Classifier3D after Linear3D": lambda: [col_nn.Linear3D(8, 8), col_nn.Classifier3D(8, 3)],
        "VocabParallelClassifier3D after Linear3D": lambda: [
            col_nn.Linear3D(8, 8), col_nn.VocabParallelClassifier3D(8, 16)],
    }.items():
        col_nn.reset_1d_alternation()
        out[name] = error_message(build)
    return out


def test_deep_3d_layers_misplaced_against_the_layouts_are_refused():
    for rank, out in enumerate(run_ranks(_misplaced_worker, 8, timeout=60)):
        for name, message in out.items():
            assert message.startswith(f"[rank {rank}]") and "layout" in message \
                and "\n" not in message, f"{name}: {message}"


def test_deep_generate_with_a_feature_split_classifier_gives_one_process_tokens():
    one_process = generate_feature_split(0, 1, None, None)
    assert run_ranks(generate_feature_split, 8, CUBE) == [one_process] * 8


def test_deep_nn_embedding_keeps_padding_idx():
    for row, grad in run_ranks(embedding_padding, 8, CUBE):
        assert not row.any() and not grad.any(), (row, grad)


def _trainer_worker(rank, world_size, port, path, max_steps, resume):
    """3 epochs of 6 batches of 4 ids (shuffled), accumulation 2, clipped, dropout 0.3 in layout
    B and A; a checkpoint after every step (stopped by `max_steps`, or resumed from it)."""
    nc.launch({**CUBE, "gradient_accumulation": 2, "clip_grad_norm": 0.05}, rank=rank,
              world_size=world_size, host="127.0.0.1", port=port, seed=3)
    torch.manual_seed(0)
    col_nn.reset_1d_alternation()
    model = nn.Sequential(col_nn.Embedding(10, 8), col_nn.Linear(8, 8), col_nn.Dropout(0.3),
                          nn.Tanh(), col_nn.Linear(8, 8), col_nn.LayerNorm(8),
                          col_nn.Dropout(0.3), col_nn.Classifier(8, 3)).double()
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randint(0, 10, (24,), generator=g),
                         torch.randint(0, 3, (24,), generator=g))
    engine, loader, _, _ = nc.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2),
        col_nn.CrossEntropyLoss(), nc.get_dataloader(data, shuffle=True, seed=7, batch_size=4),
        verbose=False)
    trainer = Trainer(engine)
    if resume:
        assert trainer.resume(path)
    trainer.fit(loader, epochs=2, max_steps=max_steps,
                hooks=[hooks.LossHook(), hooks.SaveCheckpointHook(path)])
    return gathered(engine.model), trainer.states["metrics"]["train"].get("loss")


def test_deep_3d_trainer_resumed_mid_epoch_is_the_straight_run(tmp_path):
    """Stopped after step 4 (the first of epoch 2's 3 steps) and resumed: the parameters (dropout
    masks included) are the uninterrupted run's, and so is the reported epoch loss, which counts
    the batches before the stop (LossHook's sums travel in the checkpoint)."""
    straight = run_ranks(_trainer_worker, 8, str(tmp_path / "straight.pt"), None, False)
    run_ranks(_trainer_worker, 8, str(tmp_path / "ckpt.pt"), 4, False)
    resumed = run_ranks(_trainer_worker, 8, str(tmp_path / "ckpt.pt"), None, True)
    for (params, loss), (want, want_loss) in zip(resumed, straight):
        assert all(torch.equal(params[k], want[k]) for k in want), "bit-identical parameters"
        # the same samples' losses, summed in another order (before and after the stop)
        assert loss == pytest.approx(want_loss, rel=1e-12, abs=0), (loss, want_loss)
