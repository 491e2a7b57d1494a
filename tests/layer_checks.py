"""Layer-by-layer checks of a tensor-parallel mode against plain torch, in float64 to 1e-10:
each rank feeds its block of the same input (and of the output's gradient), and the gathered
output, input gradient and every parameter's gathered gradient must equal the plain layer's.
Called on every rank after launch; a layout is a list of tensor/base.py splits (dim, axis)."""
import functools
import re
import tempfile
from pathlib import Path

import layer_compare as cl
import torch
from dist_helpers import ROOT, run_script
from models import error_message
from torch import nn
from torch.testing import assert_close

import nanocolossal as nc
import nanocolossal.nn as col_nn
from nanocolossal.checkpoint import save_checkpoint
from nanocolossal.context import gpc
from nanocolossal.generate import generate
from nanocolossal.nn.transformer import Block
from nanocolossal.sequence import token_positions
from nanocolossal.tensor.base import gather_slices, slice_of

B, S, D, V = 8, 2, 8, 16


def small_model():
    """Embedding, a pair of Linears, LayerNorm, Classifier: plain torch's layers in one process,
    the mode's after launch (a 3d pair starts and ends in the same layout)."""
    torch.manual_seed(0)
    return nn.Sequential(col_nn.Embedding(10, 8), col_nn.Linear(8, 8), nn.Tanh(),
                         col_nn.Linear(8, 8), col_nn.LayerNorm(8), col_nn.Classifier(8, 3)).double()


def train_small_model(rank, world_size, port, config, xs, ys, save=None):
    """small_model() trained by the engine (SGD + momentum) on the whole batches xs, ys, every
    rank given all of them (rank 0 of 1 without `config`: one process); returns its parameters
    gathered whole (`save`: a checkpoint written at the end)."""
    if config:
        nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    engine, *_ = nc.initialize(model, optimizer, col_nn.CrossEntropyLoss(), verbose=False)
    for x, y in zip(xs, ys):
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))
        engine.step()
    if save:
        save_checkpoint(save, 1, engine.model, engine.optimizer)
    return gathered(engine.model)


def gathered(model):
    """A model's parameters, each gathered whole from the tensor ranks' blocks."""
    return {name: gather_slices(p.detach(), getattr(p, "tensor_splits", []))
            for name, p in model.named_parameters()}


def _same(got, want, what):
    assert_close(got, want, rtol=1e-10, atol=1e-10, msg=lambda m: f"{what}: {m}")


def _grads_equal(name, tp, plain):
    params = dict(tp.named_parameters())
    for key, p in plain.named_parameters():
        whole = gather_slices(params[key].grad, params[key].tensor_splits)
        _same(whole, p.grad, f"{name}.{key} grad")


def _built(make_tp, make_plain):
    col_nn.reset_1d_alternation()  # (3d: each layer on its own starts in layout A)
    torch.manual_seed(0)
    plain = make_plain().double()
    torch.manual_seed(0)  # the same draws: every shard a slice of the plain layer's tensor
    return make_tp().double(), plain


def _check(name, make_tp, make_plain, x, in_splits, out_splits):
    tp, plain = _built(make_tp, make_plain)
    floating = x.is_floating_point()
    x_plain = x.clone().requires_grad_(floating)
    x_tp = slice_of(x, in_splits).clone().requires_grad_(floating)
    y_plain, y_tp = plain(x_plain), tp(x_tp)
    g = torch.Generator().manual_seed(11)
    dy = torch.randn(y_plain.shape, generator=g, dtype=y_plain.dtype)
    y_plain.backward(dy)
    y_tp.backward(slice_of(dy, out_splits))
    _same(gather_slices(y_tp.detach(), out_splits), y_plain.detach(), f"{name} output")
    if floating:
        _same(gather_slices(x_tp.grad, in_splits), x_plain.grad, f"{name} input grad")
    _grads_equal(name, tp, plain)
    return name


def _classifier_and_loss(activation, batch):
    tp, plain = _built(lambda: col_nn.Classifier(D, 3), lambda: nn.Linear(D, 3))
    g = torch.Generator().manual_seed(5)
    x, target = torch.randn(B, D, generator=g, dtype=torch.float64), torch.arange(B) % 3
    x_plain, x_tp = x.clone().requires_grad_(), slice_of(x, activation).clone().requires_grad_()
    want = nn.functional.cross_entropy(plain(x_plain), target)
    logits = tp(x_tp)
    _same(gather_slices(logits.detach(), batch), plain(x).detach(), "classifier logits")
    loss = col_nn.CrossEntropyLoss()(logits, target)
    want.backward()
    loss.backward()
    _same(loss.detach(), want.detach(), "classifier loss")
    _same(gather_slices(x_tp.grad, activation), x_plain.grad, "classifier input grad")
    _grads_equal("classifier", tp, plain)
    return "classifier + loss"


class _TiedLM(nn.Module):
    """ids -> embedding -> logits with the same table (the GPT's ends)."""

    def __init__(self):
        super().__init__()
        self.tok = col_nn.Embedding(V, D, vocab_parallel=True)
        self.head = col_nn.Classifier(D, V, bias=False, weight=self.tok.weight)

    def forward(self, ids):
        return self.head(self.tok(ids))


def _vocab_parallel(vocab_logits):
    tp = _built(_TiedLM, lambda: nn.Identity())[0]
    torch.manual_seed(0)
    plain = nn.Embedding(V, D).double()
    nn.Linear(D, V, bias=False)  # the draws the tied classifier makes (and then drops)
    g = torch.Generator().manual_seed(3)
    ids, target = torch.randint(0, V, (B, S), generator=g), torch.randint(0, V, (B, S), generator=g)
    logits_plain = plain(ids) @ plain.weight.t()
    want = nn.functional.cross_entropy(logits_plain.reshape(-1, V), target.reshape(-1))
    logits = tp(ids)
    _same(gather_slices(logits.detach(), vocab_logits), logits_plain.detach(), "vocab logits")
    loss = col_nn.VocabParallelCrossEntropyLoss()(logits, target)
    want.backward()
    loss.backward()
    _same(loss.detach(), want.detach(), "vocab loss")
    _same(gather_slices(tp.tok.weight.grad, tp.tok.weight.tensor_splits), plain.weight.grad,
          "tied table grad")
    return "vocab embedding + classifier + loss"


def check_layers(activation, linear_out, batch, vocab_logits):
    """`activation`: the layout of a block's activations; `linear_out`: a (column) Linear's
    output layout; `batch`: whole-class logits' (samples only); `vocab_logits`: the vocab-parallel
    classifier's."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(B, S, D, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 10, (B, S), generator=g)
    return [
        _check("linear", lambda: col_nn.Linear(D, 2 * D, parallel="column"),
               lambda: nn.Linear(D, 2 * D), x, activation, linear_out),
        _check("layernorm", lambda: col_nn.LayerNorm(D), lambda: nn.LayerNorm(D), x, activation,
               activation),
        _check("embedding", lambda: col_nn.Embedding(10, D), lambda: nn.Embedding(10, D), ids, [],
               activation),
        _classifier_and_loss(activation, batch),
        _vocab_parallel(vocab_logits),
    ]


def check_colossal_classes(suffix, a, b, rows, vocab_logits, other):
    """Colossal-AI's classes of a mode (`suffix`: '2p5D', '3D') with their arguments, against
    the plain layers (test_colossal_layers' checks): `a` the activations' layout, `b` a first
    Linear's output's, `rows` whole-class logits', `vocab_logits` the vocab-parallel logits';
    `other`, another mode's Linear class, is refused. Returns the classes checked."""
    refused = error_message(lambda: getattr(col_nn, other)(8, 8))
    assert refused.startswith(f"[rank {gpc.rank}] {other} is a "), refused
    cls = {name: getattr(col_nn, f"{name}{suffix}") for name in (
        "Linear", "LayerNorm", "Embedding", "VocabParallelEmbedding", "Classifier",
        "VocabParallelClassifier", "CrossEntropyLoss", "VocabParallelCrossEntropyLoss")}
    fans = {"fan_in": cl.D, "fan_out": cl.D}
    cl.compare("Linear", lambda: cls["Linear"](
        cl.D, cl.D, weight_initializer=cl.w_init, bias_initializer=cl.b_init),
        lambda: cl.inited(nn.Linear(cl.D, cl.D), fans, {"fan_in": cl.D}), cl.data("seq"), a, b)
    cl.compare("Linear (the next), dtype, skip_bias_add", lambda: cls["Linear"](
        cl.D, cl.D, dtype=torch.float64, skip_bias_add=True),
        lambda: nn.Linear(cl.D, cl.D).double(), cl.data("seq", torch.float64), b, a,
        call=cl.add_skipped_bias)
    cl.compare("LayerNorm bias=False", lambda: cls["LayerNorm"](cl.D, bias=False),
               lambda: nn.LayerNorm(cl.D, bias=False), cl.data("seq"), a, a)
    for name in ("Embedding", "VocabParallelEmbedding"):
        cl.compare(name, lambda: cls[name](cl.V, cl.D, cl.PAD, weight_initializer=cl.w_init),
                   cl.pad_embedding, cl.data("ids"), [], a)
    cl.compare("Classifier tied", lambda: cl.tie(cls["Embedding"], cls["Classifier"]),
               lambda: cl.tied_plain(nn.Embedding(cl.V, cl.D), {"fan_in": cl.D}), cl.data("ids"),
               [], rows)
    cl.compare("VocabParallelClassifier tied", lambda: cl.tie(
        cls["VocabParallelEmbedding"], cls["VocabParallelClassifier"]),
        lambda: cl.tied_plain(nn.Embedding(cl.V, cl.D), {"fan_in": cl.D}), cl.data("ids"), [],
        vocab_logits)
    logits, target = torch.randn(cl.B, cl.S, cl.V), torch.randint(0, cl.V, (cl.B, cl.S))
    cl.compare_loss("VocabParallelCrossEntropyLoss reduction=False",
                    cls["VocabParallelCrossEntropyLoss"](reduction=False), {"reduction": "none"},
                    logits, target, vocab_logits, vocab_logits[:2])
    weight = torch.linspace(0.5, 2.0, cl.V)
    flat_logits, flat_target = torch.randn(cl.B, cl.V), torch.randint(0, cl.V, (cl.B,))
    cl.compare_loss("CrossEntropyLoss reduction=False, weight",
                    cls["CrossEntropyLoss"](False, weight), {"reduction": "none",
                                                              "weight": weight},
                    flat_logits, flat_target, rows, rows)
    return sorted(cls)


def tiny_gpt_run(config: str, nproc: int) -> tuple[float, str]:
    """(final train loss, sample) of `train_gpt.py --config configs/<config>` shrunk to a tiny
    GPT (global batch 8, 16 tokens, 32 wide, 2 blocks) for 3 steps on `nproc` pooled ranks."""
    text = (ROOT / "configs" / config).read_text()
    for key, value in (("BATCH_SIZE", 8), ("SEQ_LEN", 16), ("DIM", 32), ("DEPTH", 2),
                       ("NUM_EPOCHS", 1)):
        text = re.sub(rf"^{key} = \d+", f"{key} = {value}", text, flags=re.M)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / config
        path.write_text(text)
        out = run_script(ROOT / "train_gpt.py",
                         ["--config", str(path), "--max-steps", "3", "--seed", "5",
                          "--max-bytes", "6000", "--sample", "12"], nproc=nproc, cwd=Path(folder))
    out = out.replace("\r", "\n")
    return (float(re.search(r"final train loss ([0-9.e+-]+)", out).group(1)),
            re.search(r"sample: (.*)", out).group(1))


@functools.lru_cache(maxsize=1)
def tiny_gpt_one_process() -> tuple[float, str]:
    return tiny_gpt_run("gpt_single.py", 1)


class _FeatureSplitEmbeddings(nn.Module):
    """A GPT's embeddings with the token table split by features (nc.nn's choice for a small
    vocabulary), so the tied classifier gives whole logits on every rank."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = col_nn.Embedding(V, D, vocab_parallel=False)
        self.pos = col_nn.Embedding(D, D, vocab_parallel=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids) + self.pos(token_positions(ids, D))


def generate_feature_split(rank, world_size, port, config):
    """generate() of a one-block GPT whose classifier is feature-split (its logits whole): 6
    tokens after an 8-token prompt (rank 0 of 1 without `config`: one process)."""
    if config:
        nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    col_nn.reset_1d_alternation()
    torch.manual_seed(0)
    embeddings = _FeatureSplitEmbeddings()
    model = nn.Sequential(embeddings, Block(D, 2, 2, 0.0, causal=True), col_nn.LayerNorm(D),
                          col_nn.Classifier(D, V, bias=False, weight=embeddings.tok.weight))
    engine, *_ = nc.initialize(model.double(), torch.optim.SGD(model.parameters(), lr=0.1),
                               col_nn.CrossEntropyLoss(), verbose=False)
    return generate(engine, list(range(D)), 6, seed=1)


def embedding_padding(rank, world_size, port, config):
    """nc.nn.Embedding(V, D, padding_idx=0) (feature-split here): its padding row and that row's
    gradient after a backward through ids that use it, gathered whole; and torch's."""
    if config:
        nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    torch.manual_seed(0)
    layer = col_nn.Embedding(V, D, padding_idx=0).double()
    ids = torch.arange(B).remainder(3).repeat(S, 1).t()  # [B, S], id 0 among them
    layer(ids).pow(2).sum().backward()
    splits = getattr(layer.weight, "tensor_splits", [])
    weight = gather_slices(layer.weight.detach(), splits)[0]
    return weight, gather_slices(layer.weight.grad, splits)[0]
