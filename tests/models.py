"""The small models, data shares and one-process clip that tests of several ideas use.

A test file keeps what only its own idea needs in view; what two ideas share lives here (what
two files of one idea share: zero_models.py, sequence_runs.py, ...), so no test file imports
another:

    tensor_model()           nc.nn layers (patch embedding, LayerNorm, Linear, Classifier): the
                             plain model alone, its 1d or 2d version under parallel.tensor
    tensor_pipeline_model()  nc.nn Linear 6-8-6-8-6 and a Classifier: 1d-ready, 4 cut points
    clip_one_process()       one process's clip: torch's, or nc.amp's under AMP
    epoch_shards()           the samples each data rank's DistributedSampler gives in an epoch
    my_share()               this data rank's rows of each whole batch
    error_message()          the message a layer or a layout refuses a shape with
"""
import torch
from torch import nn

import nanocolossal as nc
import nanocolossal.nn as col_nn
from nanocolossal.context import gpc


class TokenMean(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=1)


def tensor_model(batchnorm=False):
    """nc.nn layers only: the plain model alone, its 1d or 2d version under parallel.tensor."""
    col_nn.reset_1d_alternation()
    torch.manual_seed(0)
    layers = [col_nn.PatchEmbedding(4, 2, 1, 4), col_nn.LayerNorm(4), col_nn.Linear(4, 8),
              nn.Tanh(), col_nn.Linear(8, 4), TokenMean()]
    if batchnorm:  # 1d: on the whole (replicated) [batch, 4] activation; 2d has no BatchNorm
        layers.append(nn.BatchNorm1d(4))
    return nn.Sequential(*layers, col_nn.Classifier(4, 3))


def tensor_pipeline_model():
    """Column, row, column, row, classifier: 1d-ready, cut as [2, 2, 2, 3] into 2 x 2 chunks."""
    col_nn.reset_1d_alternation()
    torch.manual_seed(0)
    return nn.Sequential(col_nn.Linear(6, 8), nn.Tanh(), col_nn.Linear(8, 6), nn.Tanh(),
                         col_nn.Linear(6, 8), nn.Tanh(), col_nn.Linear(8, 6), nn.Tanh(),
                         col_nn.Classifier(6, 3))


def clip_one_process(model, opt, clip, opt_level=None):
    """torch's clip_grad_norm_, or nc.amp's under AMP (unscaled, fp32 masters); the norm."""
    if opt_level:
        return opt.clip_grad_norm(clip)
    return torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item()


def epoch_shards(data, epoch, seed, replicas=2):
    """The sample indices each data replica's DistributedSampler (shuffled with `seed`) gives in
    `epoch`."""
    shards = []
    for r in range(replicas):
        sampler = nc.DistributedSampler(data, num_replicas=replicas, rank=r, shuffle=True,
                                        seed=seed)
        sampler.set_epoch(epoch)
        shards.append(list(sampler))
    return shards


def my_share(batches):
    """This data rank's contiguous rows of each whole (x, y) batch."""
    per = batches[0][0].shape[0] // gpc.data_size
    mine = slice(gpc.data_rank * per, (gpc.data_rank + 1) * per)
    return [(x[mine], y[mine]) for x, y in batches]


def error_message(build):
    """The message of the ValueError / TypeError / RuntimeError `build()` raises, or "no error"."""
    try:
        build()
    except (ValueError, TypeError, RuntimeError) as e:
        return str(e)
    return "no error"
