"""The MoE GPT's batches, optimizer, Engine and checkpoint round trip: what test_moe_train.py and
test_moe_pipeline.py train their one-process and parallel runs with.

    BATCH, SEQ, VOCAB, STEPS   the global batch, sequence length, vocabulary and steps
    moe_batches()              STEPS batches of (ids, next ids)
    moe_optimizer()            SGD with momentum
    engine_and_share()         the Engine and this data rank's slice of a batch
    save_and_load_back()       save the engine's checkpoint, load it into a fresh model, compare
"""
import torch

import nanocolossal as nc
import nanocolossal.nn as col_nn
from nanocolossal.amp import MixedPrecisionOptimizer
from nanocolossal.checkpoint import load_checkpoint, save_checkpoint
from nanocolossal.context import gpc

BATCH, SEQ, VOCAB, STEPS = 4, 8, 32, 3


def moe_batches():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (2, BATCH, SEQ), generator=g).unbind(0) for _ in range(STEPS)]


def moe_optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def engine_and_share(model):
    """The Engine (SGD, vocab-parallel cross-entropy) and this data rank's slice of a batch."""
    per = BATCH // gpc.data_size
    engine, *_ = nc.initialize(model, moe_optimizer(model),
                               col_nn.VocabParallelCrossEntropyLoss(), verbose=False)
    return engine, slice(gpc.data_rank * per, (gpc.data_rank + 1) * per)


def save_and_load_back(path, engine, fresh):
    """Save the engine's model and SGD optimizer, load them into `fresh` (resuming: each rank
    reads the file of its experts) and check the model and the momenta came back equal."""
    save_checkpoint(path, 0, engine.model, engine.optimizer)
    optimizer = MixedPrecisionOptimizer(moe_optimizer(fresh))  # what the Engine's optimizer saved
    load_checkpoint(path, fresh, optimizer)
    state = engine.model.state_dict()
    for name, p in fresh.state_dict().items():
        assert torch.equal(p, state[name]), name
    momenta = [optimizer.optimizer.state[p]["momentum_buffer"] for p in fresh.parameters()]
    assert all(torch.equal(a, engine.optimizer.optimizer.state[p]["momentum_buffer"])
               for a, p in zip(momenta, engine.model.parameters()))
