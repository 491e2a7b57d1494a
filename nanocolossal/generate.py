"""Sampling from a language model in any layout: what a reader wants to see it learned.

Each new token is one forward of the last SEQ_LEN tokens (a full window, so every forward has the
same shapes -- the pipeline exchanges shapes once). The logits of the last position are split by
vocabulary (1d: over the tensor group, 2d: along the grid row) and are gathered (a feature-split
classifier's are whole on every rank already); one rank that holds them picks the token (top-k
sampling at a temperature, from a generator of its own seeded alike everywhere, so the training RNG
does not move) and broadcasts it, so every rank continues from the same text. A pipeline runs the
window as a forward-only batch of `batch` copies (one per micro-batch), and the stage that holds the
last part picks (the last rank; rank 0 under zbv, whose parts come back up a V). Under sequence
parallelism each rank runs its zig-zag share of the window; the last token is the end of stripe
2N-1, which sequence rank 0 holds, last, whatever the window's length (sequence.py,
tensor/zigzag.py): the rank that picks is the same one.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .context import gpc
from .engine import Engine, PipelineEngine
from .sequence import even_shares, split_batch
from .tensor.comm import gather
from .tensor.layers_2d import tensor_batch_shares

# where a vocab-split classifier's logits lie (3d: layout B, the vocabulary over the cube's y)
SPLIT_OVER = {"1d": "tensor_group", "2d": "tensor_row_group", "2.5d": "tensor_row_group",
              "3d": "tensor_y_group"}


def _whole_logits(logits: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
    """The last position's logits of the first sample, gathered where a vocab-parallel classifier
    (one with `predictions`, as hooks.AccuracyHook finds it) split them by vocabulary."""
    last = logits[:1, -1]
    split = next((m for m in model.modules() if callable(getattr(m, "predictions", None))), None)
    if split is not None and last.shape[-1] == split.weight.shape[0]:  # my classes only
        last = gather(last, -1, getattr(gpc, SPLIT_OVER[gpc.tensor_mode]))
    return last[0]


def pick(logits: torch.Tensor, generator: torch.Generator, top_k: int = 10,
         temperature: float = 0.8) -> int:
    """Sample among the `top_k` likeliest tokens, sharpened by `temperature`."""
    top = torch.topk(logits.float() / temperature, top_k)
    choice = torch.multinomial(top.values.softmax(-1).cpu(), 1, generator=generator)
    return int(top.indices[choice])


@torch.no_grad()
def next_token(engine: Engine, window: torch.Tensor, batch: int, generator: torch.Generator) -> int:
    ids = window.unsqueeze(0).repeat(batch * tensor_batch_shares(), 1)  # a copy per batch share
    if gpc.sequence_size > 1:  # my tokens
        ids = split_batch(ids, gpc.sequence_size, gpc.sequence_rank, even_shares())
    holder = gpc.pipeline_size - 1
    if isinstance(engine, PipelineEngine):
        holder = engine.schedule.output_rank()
        output, _, _ = engine.execute_schedule((ids, torch.zeros_like(ids)), forward_only=True,
                                               return_loss=False)
    else:
        output = engine(ids)
    token = torch.zeros((), dtype=torch.long, device=gpc.device)
    if gpc.pipeline_rank == holder:
        token.fill_(pick(_whole_logits(output, engine.model), generator))
    if gpc.world_size > 1:  # the first rank of the holding stage decides for everyone
        dist.broadcast(token, src=holder * gpc.tensor_size)
    return int(token)


def generate(engine: Engine, prompt: list[int], new_tokens: int, batch: int = 1,
             seed: int = 0) -> list[int]:
    """`new_tokens` sampled tokens after `prompt` (whose length is the model's window)."""
    engine.eval()
    generator = torch.Generator().manual_seed(seed)
    ids = list(prompt)
    for _ in range(new_tokens):
        ids.append(next_token(engine, torch.tensor(ids[-len(prompt):]), batch, generator))
    return ids[len(prompt):]
