"""ZeRO beside pipeline and tensor parallelism: the models, batches and SGD, one process's run
on them, and the pipeline workers that save and resume -- used by test_zero_checkpoint_files.py,
test_pipeline.py (a weight two chunks of a stage share) and test_zero3_o2.py.

    STEPS, GLOBAL             steps of a run; samples per step (over data ranks and micro-batches)
    F64, BF16, AMP_MODES      the tolerances (float64; bf16) and the bf16 AMP configs by O level
    tied_model()              8 layers: a table W read by the first and (as the classifier) the
                              seventh, so tied across stages; a parameter nothing uses
    tied_batch()              a step's batch for it
    sgd()                     SGD with momentum and weight decay
    cloned_state()            a copy of a model's state_dict
    one_process_sgd()         one process on the whole batches: the states after each step, norms
    pipeline_engine()         nc.launch, then tied_model cut into 2 stages through nc.initialize
    train_pipeline()          steps of this data rank's share through the pipeline schedule
    check_states()            every rank's state against one process's; the stages hold it all
    pipeline_save_worker()    a worker: train the pipeline some steps, save a checkpoint
    pipeline_resume_worker()  a worker: load that checkpoint, train on to STEPS
    VOCAB, tied_lm()          a vocab-parallel embedding tied to its classifier (tensor 1d)
"""
import torch
from dist_helpers import launch_rank
from models import clip_one_process
from torch import nn
from torch.nn import functional as F
from torch.testing import assert_close

import nanocolossal as nc
import nanocolossal.nn as col_nn
from nanocolossal import amp
from nanocolossal.amp import AMP_TYPE
from nanocolossal.checkpoint import load_checkpoint, save_checkpoint
from nanocolossal.context import gpc
from nanocolossal.pipeline import build_pipeline_model

STEPS = 3
GLOBAL = 16  # samples per step, split over the data replicas, then into 2 micro-batches
F64 = {"rtol": 1e-9, "atol": 1e-11}
# bf16 keeps 8 bits: sums in another order (per micro-batch, per rank) round differently
BF16 = {"rtol": 1e-2, "atol": 1e-3}
AMP_MODES = {"O1": {"mode": AMP_TYPE.TORCH, "dtype": "bfloat16"},
             "O2": {"mode": AMP_TYPE.NAIVE, "dtype": "bfloat16"}}


# -- a model with a weight tied across stages and a parameter nothing uses ----------------------

class Embed(nn.Module):
    """Stage 0's use of the shared table W [8, 6]: tanh(x W^T)."""

    def __init__(self, w: nn.Parameter) -> None:
        super().__init__()
        self.w = w

    def forward(self, x):
        return torch.tanh(x @ self.w.t())


class Head(nn.Module):
    """The last stage's use of the same table: h W (the classifier tied to the embedding)."""

    def __init__(self, w: nn.Parameter) -> None:
        super().__init__()
        self.w = w

    def forward(self, h):
        return h @ self.w


class WithUnused(nn.Module):
    """A Linear, beside a parameter no micro-batch ever uses (one process: grad None, never
    stepped, so weight decay and momentum leave it alone)."""

    def __init__(self, dtype) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8, dtype=dtype)
        self.never = nn.Parameter(torch.randn(5, dtype=dtype))

    def forward(self, h):
        return torch.tanh(self.lin(h))


def tied_model(dtype=torch.float64):
    """8 layers: Embed(W), WithUnused, Linear, Tanh, Linear, Tanh, Head(W), Linear(6, 3)."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(8, 6, dtype=dtype) * 0.5)
    return nn.Sequential(Embed(w), WithUnused(dtype), nn.Linear(8, 8, dtype=dtype), nn.Tanh(),
                         nn.Linear(8, 8, dtype=dtype), nn.Tanh(), Head(w),
                         nn.Linear(6, 3, dtype=dtype))


def tied_batch(step, n, dtype=torch.float64):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, 6, generator=g).to(dtype), torch.randint(0, 3, (n,), generator=g)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-2)


def cloned_state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def one_process_sgd(steps=STEPS, clip=None, opt_level=None, dtype=torch.float64,
                    make_model=tied_model):
    """One process, the whole batch of every step: the states after each step and the gradient
    norms."""
    model = make_model(dtype)
    opt = sgd(model.parameters())
    if opt_level:
        model, opt = amp.initialize(model, opt, opt_level, dtype=torch.bfloat16,
                                    device_type="cpu")
    states, norms = [], []
    for step in range(steps):
        x, y = tied_batch(step, GLOBAL, dtype)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        opt.backward(loss) if opt_level else loss.backward()
        if clip:
            norms.append(clip_one_process(model, opt, clip, opt_level))
        opt.step()
        states.append(cloned_state(model))
    return states, norms


def train_pipeline(engine, first, last):
    norms = []
    for step in range(first, last):
        x, y = tied_batch(step, GLOBAL, next(engine.model.parameters()).dtype
                          if not gpc.config.get("fp16") else torch.float32)
        n = GLOBAL // gpc.data_size
        mine = slice(gpc.data_rank * n, (gpc.data_rank + 1) * n)
        engine.zero_grad()
        engine.execute_schedule((x[mine], y[mine]))
        assert engine.step()
        norms.append(engine.last_grad_norm)
    return norms


def pipeline_engine(rank, world_size, port, extra, partition, chunks, dtype=torch.float64):
    config = {"parallel": {"pipeline": 2}, "NUM_MICRO_BATCHES": 2, "NUM_CHUNKS": chunks, **extra}
    launch_rank(rank, world_size, port, config)
    stage = build_pipeline_model(tied_model(dtype), num_chunks=chunks, partition=partition)
    engine, *_ = nc.initialize(stage, sgd(stage.parameters()), nn.CrossEntropyLoss(),
                               verbose=False)
    return engine


def check_states(results, expected, tolerance):
    seen = set()
    for rank, (state, *_) in enumerate(results):
        for key, value in state.items():
            assert_close(value, expected[key], msg=lambda m: f"rank {rank} {key}: {m}",
                         **tolerance)
        seen |= set(state)
    assert seen == set(expected), "the stages hold the whole model"


# -- checkpoints: pipeline x data x ZeRO saved, then loaded into another layout -----------------

def pipeline_resume_worker(rank, world_size, port, extra, path, first):
    engine = pipeline_engine(rank, world_size, port, extra, [3, 5], 1)
    load_checkpoint(path, engine.model, engine.optimizer)
    train_pipeline(engine, first, STEPS)
    return (cloned_state(engine.model),)


def pipeline_save_worker(rank, world_size, port, extra, path, steps):
    engine = pipeline_engine(rank, world_size, port, extra, [3, 5], 1)
    train_pipeline(engine, 0, steps)
    save_checkpoint(path, 1, engine.model, engine.optimizer)
    return (cloned_state(engine.model),)


# -- a vocab-parallel embedding tied to its classifier ------------------------------------------

VOCAB = 16


def tied_lm(dtype=None):
    """ids -> vocab-split embedding -> column, row Linear -> LayerNorm -> the embedding's own
    table as classifier (vocab-split logits under 1d). ZeRO 3: one Parameter in two units."""
    col_nn.reset_1d_alternation()
    torch.manual_seed(0)
    emb = col_nn.Embedding(VOCAB, 8, vocab_parallel=True)
    return nn.Sequential(emb, col_nn.Linear(8, 16), nn.Tanh(), col_nn.Linear(16, 8),
                         col_nn.LayerNorm(8),
                         col_nn.Classifier(8, VOCAB, bias=False, weight=emb.weight))
