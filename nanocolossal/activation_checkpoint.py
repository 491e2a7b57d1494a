"""Activation checkpointing: keep a block's input, not its activations; compute them again in
backward (Chen et al. 2016, "Training deep nets with sublinear memory cost"; Colossal-AI's
`colossalai.utils.checkpoint`, torchtitan's full / selective AC).

From a forward to its backward, training holds every tensor an op saved for its gradient: the
activations. nn/transformer.py's Block of width d with h heads on b sequences of s tokens
(fp32, fused attention, no dropout) saves A = 4·(16·b·s·d + 4·b·s + b·h·s) bytes, counted
from live saved tensors on the CPU: each LayerNorm's input and output (the next Linear's input), its
mean and 1/std; q, k, v; the attention output and its log-sum-exp; GELU's input and output
(4·b·s·d each). Explicit attention adds the b·h·s² softmax, dropout a mask per dropout. The
block's input is only x = 4·b·s·d bytes. `checkpoint(fn, *args)` keeps the inputs, runs fn twice:

    forward    fn(*args) without autograd: nothing saved; keep args, the RNG and autocast state
    backward   fn(*args) again with autograd, under the forward's RNG and autocast state (the same
               dropout masks, the same dtypes); backpropagate through this copy; hand the args'
               gradients on. The RNG is then put back as backward found it (the next step's
               masks must not depend on whether we recomputed), and so are the buffers of
               the modules fn ran (BatchNorm counts each batch once in its statistics)

One micro-batch through L checkpointed blocks (F forward, R recompute, B backward):

    forward    F1 F2 .. FL                           held: L inputs x
    backward   RL BL  R(L-1) B(L-1) .. R1 B1         + one block's A while its R and B run

Who holds what: a pipeline stage of L blocks with k micro-batches in flight (P - r under 1F1B,
M under GPipe) holds at its peak, in saved tensors,

    without checkpointing    k·L·A
    'full'                   k·L·x + A - x        (the recomputation's input is the kept x)
    saved                    (k·L - 1)·(A - x)    ~ 94% of k·L·A for large k·L (A/x ~ 16)

for one more forward per block (~1/3 more compute: a backward costs about two forwards).
(bench/bench_activation_checkpoint.py, k·L = 4 blocks: 0.28 of the bytes; the head's logits,
never checkpointed, come on top of both.)

ACTIVATION_CHECKPOINT in the config, read by nn/transformer.py's Block (block_mode):

    'full'       each block recomputed whole, as above
    'selective'  only attention's core, softmax(q k^T / sqrt(d)) v, recomputed from q, k, v
                 (Megatron's selective recomputation, Korthikanti et al. 2022; torchtitan's):
                 drop what is big and cheap to recompute, the b·h·s² scores of explicit
                 attention (4 to 12 bytes each in fp32, with dropout); the fused kernel never
                 holds them (it drops only the log-sum-exp), nor does ring attention
    N            every N-th block whole (blocks N-1, 2N-1, ...: torchtitan's per-layer option)

Composes: tensor and sequence parallelism run a block's forward collectives again in its
recomputation -- every rank of the group recomputes the same block at the same point of
backward, so they still pair up. AMP: the forward's autocast state is restored. ZeRO 3: a Block
checkpointed inside itself recomputes while its unit is gathered for its backward (nothing is
gathered again); one checkpointed from outside, checkpoint(block, x), is gathered again by its
forward pre-hook as backward reaches it -- at the same point on every rank -- and may run once
per forward. MoE: a block whose MLP is an MoE layer is not recomputed whole (its load-balancing
loss is a by-product of the forward, which runs without autograd here): 'selective' only.

Written on torch.autograd.Function, Colossal-AI's and Megatron's way: the recomputation is a
backward of its own inside the outer one (torch.autograd.grad is refused: check_backward), so
each call accumulates its parameters' gradients once: a layer used by two calls gets two
gradients in one outer backward, which DDP and ZeRO 1/2 refuse, naming the remedy (checkpoint
the two uses together). A block whose inputs need no gradient (the first, reading data) still
has parameters that do: an empty tensor that needs one (_ANCHOR) keeps the function in the
graph, or its backward would never run.

Before a launch, `nanocolossal plan` computes these activation bytes and bubbles
(nanocolossal/plan/activations.py).
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator, Optional

import torch
from torch.nn.modules.module import register_module_forward_pre_hook

from .activation_checkpoint_checks import check_backward
from .config import is_positive_int
from .config_checks import check_activation_checkpoint
from .context import gpc

_ANCHOR = torch.empty(0, requires_grad=True)  # puts the function in the graph (docstring)


class _Replay:
    """What a forward ran under, to run it again alike: the CPU and CUDA generators, the tensor-
    parallel dropout's (tensor/base.py), autocast; the buffers of the modules it runs, put back."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.gpus = sorted({t.device.index for t in tensors if t.is_cuda})
        self.cpu = torch.get_rng_state()
        self.cuda = [torch.cuda.get_rng_state(d) for d in self.gpus]
        self.dropout = {d: g.get_state() for d, g in gpc.dropout_generators.items()}
        kinds = {"cpu", *(t.device.type for t in tensors)}
        self.autocast = {k: (torch.is_autocast_enabled(k), torch.get_autocast_dtype(k))
                         for k in kinds}

    @contextmanager
    def __call__(self) -> Iterator[None]:
        live = dict(gpc.dropout_generators)
        self.kept: dict[torch.nn.Module, list[torch.Tensor]] = {}

        def keep(module: torch.nn.Module, args: Any) -> None:  # its buffers before it runs again
            if module not in self.kept:
                self.kept[module] = [b.clone() for b in module.buffers(recurse=False)]
        watch = register_module_forward_pre_hook(keep)
        with torch.random.fork_rng(devices=self.gpus), ExitStack() as autocast:
            torch.set_rng_state(self.cpu)
            for device, state in zip(self.gpus, self.cuda):
                torch.cuda.set_rng_state(state, device)
            gpc.dropout_generators.clear()  # one first made after the forward: made again alike
            for device, state in self.dropout.items():
                gpc.dropout_generators[device] = torch.Generator(device).set_state(state)
            for kind, (enabled, dtype) in self.autocast.items():
                autocast.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
            try:
                yield
            finally:
                watch.remove()
                gpc.dropout_generators.clear()
                gpc.dropout_generators.update(live)

    @torch.no_grad()
    def put_back_buffers(self) -> None:
        """After the recomputation's backward (which may read them, as BatchNorm does)."""
        for module, kept in self.kept.items():
            for buffer, before in zip(module.buffers(recurse=False), kept):
                buffer.copy_(before)


class CheckpointFunction(torch.autograd.Function):
    """fn's forward without autograd; in backward, fn again with it (the module docstring)."""

    @staticmethod
    def forward(ctx: Any, fn: Callable, anchor: torch.Tensor, *args: Any) -> Any:
        ctx.fn, ctx.replay = fn, _Replay([a for a in args if torch.is_tensor(a)])
        ctx.others = [None if torch.is_tensor(a) else a for a in args]  # non-tensors as given
        ctx.save_for_backward(*(a if torch.is_tensor(a) else None for a in args))
        with torch.no_grad():
            return fn(*args)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        check_backward()
        args = [other if a is None else a.detach().requires_grad_(need)
                for a, other, need in zip(ctx.saved_tensors, ctx.others, ctx.needs_input_grad[2:])]
        with ctx.replay(), torch.enable_grad():
            outputs = ctx.fn(*args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads)
                 if torch.is_tensor(o) and o.requires_grad and g is not None]
        if pairs:  # the parameters' gradients accumulate in .grad, as in any backward
            torch.autograd.backward(*zip(*pairs))
        ctx.replay.put_back_buffers()
        return (None, None, *(a.grad if torch.is_tensor(a) else None for a in args))


def checkpoint(fn: Callable, *args: Any) -> Any:
    """fn(*args), its activations computed again in backward instead of kept."""
    if not torch.is_grad_enabled():  # evaluation: nothing would be kept anyway
        return fn(*args)
    return CheckpointFunction.apply(fn, _ANCHOR, *args)


# -- the config key (activation_checkpoint_checks.py checks it) -----------------------------------

def block_mode(index: Optional[int]) -> Optional[str]:
    """What transformer block number `index` recomputes: 'full', 'selective' or None."""
    mode = gpc.config.get("ACTIVATION_CHECKPOINT")
    check_activation_checkpoint(gpc.config)  # (a gpc.config changed by hand too)
    if not is_positive_int(mode):
        return mode
    if index is None:
        raise ValueError(f"[rank {gpc.rank}] ACTIVATION_CHECKPOINT={mode} recomputes one block "
                         f"in {mode}: build each Block with index=i, its place in the stack")
    return "full" if index % mode == mode - 1 else None
