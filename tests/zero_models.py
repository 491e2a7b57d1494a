"""The ZeRO tests' small models, their batches and optimizer, and the one-process runs they are
compared with.

Net's runs (test_zero.py, test_zero3.py, test_zero_traffic.py, test_zero_checkpoint_files.py):

    B, STEPS           samples per rank per micro-batch; steps of the sweeps
    Net                141 parameters, a branch used on even steps only, a layer never used
    net_batch()        a step's batch of (inputs, class labels)
    grouped_adamw()    AdamW with two param groups (weights, biases): two flat buffers
    train_single()     one process on the whole batch of each step
    train_engine()     an Engine on this rank's slices of the same batches
    launch_net()       nc.launch, then Net and grouped_adamw through nc.initialize
    zero_config()      the config of a ZeRO run (accumulation, clip, bf16, no overlap)

The dyadic grid, exact under AMP O2 (test_zero_fp16.py, test_zero3_o2.py;
zero_o2_runs.py):

    DyadicNet          121 parameters: Linear layers under a linear loss, exact however the
                       batch is split
    PartNet            DyadicNet with a layer only the first samples reach, and a LayerNorm
    LinearLoss         (out * c).sum() / batch
    dyadic_batch()     a step's inputs on a 1/8 grid and coefficients on a 1/4 grid
"""
import torch
from torch import nn

import nanocolossal as nc
from nanocolossal.amp import AMP_TYPE
from nanocolossal.context import gpc

B = 3  # samples per rank per micro-batch
# steps of the sweeps: `side` is used on steps 0 and 2 and skipped on step 1, so its optimizer
# state must survive a step without a gradient (more steps repeat the pattern)
STEPS = 3


class Net(nn.Module):
    """141 parameters (odd: padding; parameters straddle shards), a branch used on even steps
    only and a layer never used."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(6, 7), nn.Linear(7, 5)
        self.side, self.never = nn.Linear(7, 5), nn.Linear(3, 3)
        self.use_side = True

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h) + self.side(h) if self.use_side else self.b(h)


def grouped_adamw(model):
    """Two param groups with different lr and weight decay (two flat buffers)."""
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return torch.optim.AdamW([{"params": weights, "weight_decay": 0.1},
                              {"params": biases, "lr": 0.03, "weight_decay": 0.01}], lr=0.02)


def net_batch(step, n):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, 6, generator=g), torch.randint(0, 5, (n,), generator=g)


def train_single(model, opt, steps, first=0, n=8, clip=0.0, bf16=False):
    norms = []
    for step in range(first, first + steps):
        model.use_side = step % 2 == 0
        xs, ys = net_batch(step, n)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = model(xs)
        nn.functional.cross_entropy(out.float(), ys).backward()
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
    return norms


def train_engine(engine, steps, rank, world_size, accum, first=0):
    """Each step: the global batch of world_size * accum * B samples, this rank's slices."""
    norms = []
    for step in range(first, first + steps):
        engine.model.use_side = step % 2 == 0
        xs, ys = net_batch(step, world_size * accum * B)
        for micro in range(accum):
            lo = (micro * world_size + rank) * B
            engine.zero_grad()
            engine.backward(engine.criterion(engine(xs[lo:lo + B]), ys[lo:lo + B]))
            stepped = engine.step()
        assert stepped
        if engine.clip_grad_norm:
            norms.append(engine.last_grad_norm)
        if engine.optimizer.level == 2:  # only the shard's segments of the gradients are kept
            assert all(p.grad is None for p in engine.model.parameters())
    return norms


def launch_net(rank, world_size, port, config):
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    model = Net()
    engine, *_ = nc.initialize(model, grouped_adamw(model), nn.CrossEntropyLoss(), verbose=False)
    return engine


def zero_config(zero: dict, accum: int, clip: float, bf16: bool, overlap: bool) -> dict:
    if not overlap:
        zero = {**zero, "overlap_communication": False}
    config = {"zero": zero, "gradient_accumulation": accum}
    if clip:
        config["clip_grad_norm"] = clip
    if bf16:
        config["fp16"] = dict(mode=AMP_TYPE.TORCH, dtype="bfloat16")
    return config


# -- the dyadic grid ---------------------------------------------------------------------------

class DyadicNet(nn.Module):
    """121 parameters (odd: padding, parameters straddling shards), a branch used on even steps
    only and a layer never used.

    Exact on purpose: parallel Linear layers under a linear loss have gradients x^T c that do not
    depend on the weights; with inputs on a 1/8 grid, c on a 1/4 grid and powers of two for the
    batch and the loss scale, every half-precision gradient is exact however the batch is split,
    so any difference is ZeRO's, not rounding's."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(6, 7), nn.Linear(4, 5)
        self.side, self.never = nn.Linear(6, 5), nn.Linear(3, 3)
        self.use_side = True

    def forward(self, x):
        h = self.b(x[:, 6:]) + self.side(x[:, :6]) if self.use_side else self.b(x[:, 6:])
        return torch.cat([self.a(x[:, :6]), h], dim=1)


class PartNet(DyadicNet):
    """DyadicNet whose `side` layer sees only the first `side_rows` samples of the global batch
    (rank 0's when side_rows is the samples per rank): on the other ranks it gets no gradient at
    all; `ln` (fp32 under O2) adds to some outputs when present."""

    def __init__(self, side_rows=None, norm=False) -> None:
        super().__init__()
        self.side_rows = side_rows
        self.ln = nn.LayerNorm(4) if norm else None

    def forward(self, x):
        if self.side_rows is None:
            out = super().forward(x)
        else:
            h = self.b(x[:, 6:])
            k = max(0, min(x.shape[0], self.side_rows - gpc.data_rank * x.shape[0]))
            if k:
                h = torch.cat([h[:k] + self.side(x[:k, :6]), h[k:]])
            out = torch.cat([self.a(x[:, :6]), h], dim=1)
        if self.ln is not None:
            out = torch.cat([out[:, :8], out[:, 8:] + self.ln(x[:, 6:]).to(out.dtype)], dim=1)
        return out


class LinearLoss(nn.Module):
    def forward(self, out, c):
        return (out * c).sum() / out.shape[0]


def dyadic_batch(step, n):
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randint(-8, 9, (n, 10), generator=g) / 8,
            torch.randint(-2, 3, (n, 12), generator=g) / 4)
