"""Clipping by the global norm (nanocolossal/clip.py): every rank clips by the norm of the whole
model, each gradient element counted once, whichever ranks hold it."""
import torch
from dist_helpers import run_ranks
from torch.testing import assert_close

import nanocolossal as nc
from nanocolossal import clip
from nanocolossal.context import gpc


def _whole_model_grads():
    g = torch.Generator().manual_seed(0)
    shapes = {"A": (3, 4), "B": (5,), "C": (4,), "D": (6,), "E": (8,)}
    return {name: torch.randn(shape, generator=g, dtype=torch.float64)
            for name, shape in shapes.items()}


def _lesson_worker(rank, world_size, port, max_norm):
    """2 tensor ranks x 2 data ranks. Tensor rank 0 holds A, D; tensor rank 1 holds B, E; both
    hold C alike. D and E are split in halves over the data ranks (as ZeRO splits them)."""
    nc.launch(dict(parallel=dict(tensor=dict(size=2, mode="1d"))), rank=rank,
              world_size=world_size, host="127.0.0.1", port=port)
    full = _whole_model_grads()
    t, d = gpc.tensor_rank, gpc.data_rank
    own = [_param(full["AB"[t]]), _param(full["C"])]
    split = [_param(full["DE"[t]].chunk(2)[d])]
    holders = {id(own[1]): 2}  # C: both tensor ranks hold it
    norm = clip.global_norm(own + split, lambda p: holders.get(id(p), 1),
                            model_group=gpc.other_parts_group,
                            split_over=({id(split[0]): 1.0}, gpc.data_group), acc=torch.float64)
    clip.clip_([p.grad for p in own + split], max_norm, norm)
    return norm, [p.grad for p in own], [p.grad for p in split]


def _param(grad):
    p = torch.nn.Parameter(torch.zeros_like(grad))
    p.grad = grad.clone()
    return p


def test_gloo_global_norm_and_clip_equal_one_process():
    """Four ranks, each holding part of A..E, clip as one process holding all of them: the
    same norm on every rank, and each rank's clipped gradients are its part of the clipped
    whole."""
    whole = _whole_model_grads()
    params = {name: torch.nn.Parameter(torch.zeros_like(g)) for name, g in whole.items()}
    for name, p in params.items():
        p.grad = whole[name].clone()
    expected = torch.nn.utils.clip_grad_norm_(list(params.values()), max_norm=0.5)
    assert_close(clip.one_process_norm(list(whole.values())), expected)
    clipped = {name: p.grad for name, p in params.items()}

    for rank, (norm, own, split) in enumerate(run_ranks(_lesson_worker, 4, 0.5, timeout=30)):
        t, d = rank % 2, rank // 2  # the layout's order: tensor ranks are consecutive
        assert_close(norm, expected)
        assert_close(own, [clipped["AB"[t]], clipped["C"]])
        assert_close(split, [clipped["DE"[t]].chunk(2)[d]])


def test_clip_leaves_gradients_alone_below_max_norm_or_when_told_to_keep():
    grads = [torch.tensor([3.0, 4.0])]
    clip.clip_(grads, 10.0, clip.one_process_norm(grads))
    assert_close(grads, [torch.tensor([3.0, 4.0])])
    clip.clip_(grads, 1.0, clip.one_process_norm(grads), keep=torch.tensor(True))
    assert_close(grads, [torch.tensor([3.0, 4.0])])
    clip.clip_(grads, 1.0, clip.one_process_norm(grads))
    assert_close(grads, [torch.tensor([0.6, 0.8])], rtol=1e-5, atol=1e-6)
