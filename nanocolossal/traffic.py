"""Count the elements a piece of code hands to collectives: the traffic formulas of ddp.py and
zero/ checked by code (tests/test_zero_traffic.py) and measured (bench/bench_zero.py).

    with count_collectives() as counted:
        engine.backward(loss)
        engine.step()
    counted            # Counter({"all_reduce": 161, "broadcast": 142}): elements, this rank

Elements, not bytes or seconds: the unit the formulas are written in. What a rank then sends
depends on the algorithm; for the ring that NCCL and the ZeRO paper assume (N ranks):

    all-reduce of n elements        sends 2 n (N-1)/N   (a reduce-scatter, then an all-gather)
    all-gather / reduce-scatter     sends   n (N-1)/N   (n: the whole gathered / reduced tensor)
    broadcast of n from its owner   (the all-gather of zero/comm.py on gloo: N of them, one per
                                     shard, together one all-gather of the whole buffer)
    reduce of n to its owner        (SUMMA's backward, tensor/summa.py)

Counted while the block runs: every call made as `dist.<collective>(...)` (how this library calls
them); a collective imported by name elsewhere is not seen. Not thread-safe (one block at a time).

Before a launch, `nanocolossal plan` computes these elements sent (nanocolossal/plan/traffic.py).
"""
from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any, Callable, Iterator

import torch.distributed as dist

# the collective -> the elements it moves: the tensor reduced or broadcast, the gathered whole
ELEMENTS: dict[str, Callable[..., int]] = {
    "all_reduce": lambda tensor, *a, **k: tensor.numel(),
    "broadcast": lambda tensor, *a, **k: tensor.numel(),
    "reduce": lambda tensor, *a, **k: tensor.numel(),
    "all_gather": lambda outputs, *a, **k: sum(t.numel() for t in outputs),
    "all_gather_into_tensor": lambda output, *a, **k: output.numel(),
    "reduce_scatter": lambda output, inputs, *a, **k: sum(t.numel() for t in inputs),
    "reduce_scatter_tensor": lambda output, input, *a, **k: input.numel(),
    "reduce_scatter_single": lambda output, input, *a, **k: input.numel(),
    "all_to_all_single": lambda output, input, *a, **k: input.numel(),
    # point to point (ring attention, pipeline stages): the elements this rank sends
    "batch_isend_irecv": lambda ops, *a, **k: sum(op.tensor.numel() for op in ops
                                                  if op.op is dist.isend),
}


@contextlib.contextmanager
def count_collectives() -> Iterator[Counter]:
    """Counter of elements handed to each kind of collective while the block runs."""
    counted: Counter = Counter()
    originals = {name: getattr(dist, name) for name in ELEMENTS if hasattr(dist, name)}

    def counting(name: str, call: Callable) -> Callable:
        def counted_call(*args: Any, **kwargs: Any) -> Any:
            counted[name] += ELEMENTS[name](*args, **kwargs)
            return call(*args, **kwargs)
        return counted_call

    for name, call in originals.items():
        setattr(dist, name, counting(name, call))
    try:
        yield counted
    finally:
        for name, call in originals.items():
            setattr(dist, name, call)


def ring_elements(counted: Counter, world_size: int) -> float:
    """Elements one rank sends for `counted` if every collective runs as a ring: an all-reduce
    2 n (N-1)/N, the rest n (N-1)/N (a broadcast as its part of an all-gather)."""
    share = (world_size - 1) / world_size
    return sum(n * share * (2 if name == "all_reduce" else 1) for name, n in counted.items())
