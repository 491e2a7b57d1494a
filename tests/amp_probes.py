"""Mixed precision's probes: which dtype each parameter, activation and loss had, on the models
the AMP x layout tests train (test_amp.py, and test_pipeline.py's stage boundaries).

    MODES               the AMP configs by name ("O1 bf16", "O2 fp16", ...)
    MODELS              a CNN (BatchNorm, GroupNorm, a user's Parameter), a residual MLP that a
                        pipeline can cut, the GPT and its MoE version
    probe_batches()     their batches
    install_probes()    forward hooks: every module's output dtype, by plain-model name
    patch_attention()   attention's scores and softmax dtype, on one process or on the ring
    probed_criterion()  the loss, recording the logits' and the loss's dtype
"""
import sys

import torch
from dist_helpers import ROOT
from torch import nn

import nanocolossal.nn as col_nn
from nanocolossal.amp import AMP_TYPE

sys.path.insert(0, str(ROOT))
from train_gpt import gpt  # noqa: E402

BATCH, SEQ, VOCAB, DIM = 4, 8, 32, 16


MODES = {
    "O1 bf16": dict(mode=AMP_TYPE.TORCH, dtype="bfloat16"),
    "O2 bf16": dict(mode=AMP_TYPE.NAIVE, dtype="bfloat16"),
    "O3 bf16": dict(mode=AMP_TYPE.APEX, opt_level="O3", dtype="bfloat16"),
    "O2 fp16": dict(mode=AMP_TYPE.NAIVE, dtype="float16", initial_scale=2.0 ** 8),
    "O1 fp16": dict(mode=AMP_TYPE.TORCH, dtype="float16", initial_scale=2.0 ** 8),
    "APEX O2 fp16": dict(mode=AMP_TYPE.APEX, opt_level="O2", dtype="float16",
                         initial_scale=2.0 ** 8),
}


# -- models --------------------------------------------------------------------------------------

class Scale(nn.Module):
    """A user's module holding its own nn.Parameter (no torch layer inside)."""

    def __init__(self, channels):
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, channels).view(1, channels, 1, 1))

    def forward(self, x):
        return x * self.gain


class Residual(nn.Module):
    def __init__(self, body):
        super().__init__()
        self.body = body

    def forward(self, x):
        return x + self.body(x)


def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.GroupNorm(2, 8), Scale(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))


def _mlp():
    """Pipeline-cuttable, with a residual whose stream is half under O1 autocast."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16),
                         Residual(nn.Sequential(nn.Linear(16, 16), nn.GELU())),
                         Residual(nn.Sequential(nn.Linear(16, 16), nn.GELU())),
                         nn.Linear(16, 5))


def _moe_args():
    return dict(num_experts=2, top_k=2, capacity_factor_train=2.0, capacity_factor_eval=2.0)


def _gpt(moe=False):
    torch.manual_seed(0)
    return gpt(vocab=VOCAB, seq_len=SEQ, dim=DIM, depth=2, heads=2, mlp_ratio=2,
               moe=_moe_args() if moe else None)


MODELS = {"cnn": _cnn, "mlp": _mlp, "gpt": _gpt, "gpt_moe": lambda: _gpt(True)}


def probe_batches(model, steps=3, seed=7, side=6):
    g = torch.Generator().manual_seed(seed)
    if model == "cnn":
        return [(torch.randn(BATCH, 3, side, side, generator=g),
                 torch.randint(0, 5, (BATCH,), generator=g)) for _ in range(steps)]
    if model == "mlp":
        return [(torch.randn(BATCH, 6, generator=g), torch.randint(0, 5, (BATCH,), generator=g))
                for _ in range(steps)]
    return [tuple(torch.randint(0, VOCAB, (2, BATCH, SEQ), generator=g).unbind(0))
            for _ in range(steps)]


# -- probes: what dtype each activation had --------------------------------------------------------

def _first_float(out):
    from nanocolossal.moe.router import Routing
    if isinstance(out, Routing):
        return out.probs
    if torch.is_tensor(out):
        return out if out.is_floating_point() else None
    if isinstance(out, (tuple, list)):
        for o in out:
            f = _first_float(o)
            if f is not None:
                return f
    return None


def install_probes(model, seen):
    """Forward hooks on every module of the plain model (before any wrapping): name -> dtypes of
    its output; attention's scores / softmax dtypes, whichever path computes them."""
    handles = []
    for name, module in model.named_modules():
        def hook(m, args, out, name=name or "<model>"):
            f = _first_float(out)
            if f is not None:
                seen.setdefault(f"out {name}", set()).add(str(f.dtype))
        handles.append(module.register_forward_hook(hook))
    return handles


def patch_attention(seen):
    """Record the dtype attention's scores and softmax are computed in: one process's
    Attention.attend (q k^T under the current autocast) or the ring's _RingAttention.apply."""
    from nanocolossal.nn import transformer
    from nanocolossal.tensor import ring_attention as ring

    attend, apply = transformer.Attention.attend, ring._RingAttention.apply

    def spy_attend(self, q, k, v):
        scores = q[..., :2, :] @ k[..., :2, :].transpose(-2, -1)
        seen.setdefault("attention scores", set()).add(str(scores.dtype))
        seen.setdefault("attention softmax", set()).add(str(scores.softmax(-1).dtype))
        return attend(self, q, k, v)

    def spy_apply(q, k, v, *rest):
        # inside, scores and the online softmax are computed in q's dtype (autocast is off)
        seen.setdefault("attention scores", set()).add(str(q.dtype))
        seen.setdefault("attention softmax", set()).add(str(q.dtype))
        return apply(q, k, v, *rest)

    transformer.Attention.attend = spy_attend
    ring._RingAttention.apply = spy_apply

    def undo():
        transformer.Attention.attend = attend
        ring._RingAttention.apply = apply
    return undo


def probed_criterion(model_name, seen):
    crit = nn.CrossEntropyLoss() if model_name in ("cnn", "mlp") else \
        col_nn.VocabParallelCrossEntropyLoss()

    def hook(m, args, out):
        seen.setdefault("criterion logits", set()).add(str(args[0].dtype))
        seen.setdefault("loss", set()).add(str(out.dtype))
    crit.register_forward_hook(hook)
    return crit
