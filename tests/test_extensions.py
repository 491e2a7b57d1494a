"""The loops and their extension points (extensions.py), in one process: the Engine and the
pipeline executor import no feature, and call every extension at its place, in list order."""
import ast
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch import nn

from nanocolossal.amp import MixedPrecisionOptimizer
from nanocolossal.engine import Engine
from nanocolossal.extensions import Extension, training_loader
from nanocolossal.pipeline import make_schedule

ROOT = Path(__file__).resolve().parent.parent / "nanocolossal"


# each file and the project modules it may import: its own parts and the layers beneath it
LEAN = {"engine/engine.py": {"context", "extensions", "nest", "engine_checks"},
        "engine/engine_checks.py": {"context"},
        "pipeline/executor.py": {"context", "extensions", "executor_checks", "p2p", "plan",
                                 "steps"},
        "config.py": set(), "layout.py": {"config"}, "context.py": {"config", "layout"},
        "logging.py": {"context"},
        "checks.py": {"config", "context"}}


@pytest.mark.parametrize("path", LEAN)
def test_the_loops_and_the_bottom_layer_import_no_feature(path):
    """The Engine and the executor know only the context, the extension points and (the
    executor) its own plan, steps, transport and split backward; config, context, logging and
    checks know nothing above them. A feature reaches the loops as an extension. (Names imported
    for annotations alone, under TYPE_CHECKING, are not imports at run time.)"""
    tree = ast.parse((ROOT / path).read_text())
    for node in ast.walk(tree):  # drop `if TYPE_CHECKING:` blocks
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            node.body = []
    imported = {(node.module or "").split(".")[-1] for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.level > 0}
    assert imported <= LEAN[path], imported - LEAN[path]


class Recorder(Extension):
    """Writes down every call; its loss doubles (or adds one to) what it wraps."""

    def __init__(self, name, log, change):
        self.name, self.log, self.change = name, log, change

    def loss(self, compute, output, label):
        self.log.append((self.name, "loss"))
        return self.change(compute(output, label))

    def train_loader(self, loader):
        self.log.append((self.name, "train_loader"))
        return [*loader]

    @contextmanager
    def sync(self, chunk, last):
        self.log.append((self.name, "sync", chunk, last))
        yield

    def end_group(self):
        self.log.append((self.name, "end_group"))

    def clip_options(self):
        self.log.append((self.name, "clip_options"))
        return {}

    def sync_buffers(self):
        self.log.append((self.name, "sync_buffers"))

    def output_labels(self, label):
        self.log.append((self.name, "output_labels"))
        return label


def test_an_engine_calls_its_extensions_at_the_marked_places():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    log = []
    first = Recorder("a", log, lambda loss: loss * 2)
    second = Recorder("b", log, lambda loss: loss + 1)
    engine = Engine(model, MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1)),
                    nn.CrossEntropyLoss(), gradient_accumulation=2, clip_grad_norm=1.0,
                    extensions=[first, second])
    before = nn.functional.cross_entropy(model(x), y).item()
    losses = []
    for batch in training_loader(engine.extensions, ((x, y) for _ in range(2))):
        engine.zero_grad()
        losses.append(engine.execute_schedule(batch)[2].item())
        engine.step()
    assert losses[0] == pytest.approx(before * 2 + 1)  # the first extension's loss is innermost
    engine.eval()
    micro_step = [("b", "loss"), ("a", "loss")]  # (b's wraps a's)
    assert log == [("a", "train_loader"), ("b", "train_loader"),
                   *micro_step, ("a", "sync", 0, False), ("b", "sync", 0, False),
                   ("a", "output_labels"), ("b", "output_labels"),
                   *micro_step, ("a", "sync", 0, True), ("b", "sync", 0, True),
                   ("a", "output_labels"), ("b", "output_labels"),
                   ("a", "end_group"), ("b", "end_group"),
                   ("a", "clip_options"), ("b", "clip_options"),
                   ("a", "sync_buffers"), ("b", "sync_buffers")]


class MicroBatches(Extension):
    """Weighs micro-batch m by 1 / M + m and adds a chunk loss of 10 x share while training."""

    def __init__(self):
        self.syncs, self.extra = [], 0

    def weigh_micro_batches(self, criterion, labels, training):
        return lambda output, m: criterion(output, labels[m]) * (1 / len(labels) + m)

    def extra_loss(self, module, share):
        self.extra += 1
        return module.weight.sum() * 0 + 10 * share

    @contextmanager
    def sync(self, chunk, last):
        self.syncs.append(last)
        yield


def test_the_executor_weighs_micro_batches_and_adds_chunk_losses_through_extensions():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    extension = MicroBatches()
    schedule = make_schedule("1f1b", 4)
    _, _, loss = schedule.forward_backward_step(model, (x, y), nn.CrossEntropyLoss(),
                                                extensions=[extension])
    ce = [nn.functional.cross_entropy(model(xm), ym) for xm, ym in zip(x.split(2), y.split(2))]
    expected = sum(c.item() * (0.25 + m) for m, c in enumerate(ce)) + 10
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert extension.extra == 4 and extension.syncs == [False, False, False, True]
    _, _, loss = schedule.forward_backward_step(model, (x, y), nn.CrossEntropyLoss(),
                                                forward_only=True, extensions=[extension])
    assert extension.extra == 4  # no chunk loss when evaluating
    assert loss.item() == pytest.approx(expected - 10, rel=1e-6)
