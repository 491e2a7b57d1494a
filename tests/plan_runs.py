"""Live numbers for tests/test_plan.py: one GPT of tests/test_composition.py's TABLE trained on
gloo ranks, and what each rank then holds (bytes of distinct storages the Engine reaches) and
handed to collectives in a steady step (nanocolossal/traffic.py's count_collectives)."""
from __future__ import annotations

from collections import Counter

import torch

# count_collectives' names -> the planner's five (gloo's zero/comm.py gathers by broadcasts)
KIND = {"all_reduce": "all_reduce", "broadcast": "all_gather", "all_gather": "all_gather",
        "all_gather_into_tensor": "all_gather", "reduce_scatter": "reduce_scatter",
        "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
        "batch_isend_irecv": "p2p", "all_to_all_single": "all_to_all", "reduce": "all_reduce"}


def storages(root) -> dict:
    """data pointer -> bytes of every tensor storage reachable from `root` through nanocolossal's
    and torch's objects, dicts, lists and Parameters' .grad (each storage once)."""
    seen, found, stack = set(), {}, [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            st = obj.untyped_storage()
            if st.nbytes():
                found[st.data_ptr()] = st.nbytes()
            if obj.is_leaf and obj.grad is not None:
                stack.append(obj.grad)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
            stack.extend(k for k in obj if isinstance(k, torch.Tensor))
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__") and (
                type(obj).__module__.startswith(("nanocolossal", "torch", "train_gpt"))):
            stack.append(vars(obj))
    return found


def gpt_worker(rank, world_size, port, config):
    """Two steps of the table's GPT under `config`; this rank's storages after the second step
    (before zero_grad), the second step's collectives, and its saved activations' peak."""
    import test_composition as tc

    import nanocolossal as nc
    import nanocolossal.nn as col_nn
    from nanocolossal.context import gpc
    from nanocolossal.memory import SavedBytes
    from nanocolossal.pipeline import build_pipeline_model
    from nanocolossal.sequence import split_batch
    from nanocolossal.traffic import count_collectives
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port, timeout=60)
    model = tc._table_gpt(config)
    if gpc.pipeline_size > 1:
        model = build_pipeline_model(model, num_chunks=config.get("NUM_CHUNKS", 1),
                                     partition="uniform")
    engine, *_ = nc.initialize(model, tc._layout_sgd(model.parameters()),
                               col_nn.VocabParallelCrossEntropyLoss(), verbose=False)
    accum = config.get("gradient_accumulation", 1)
    n = tc.GLOBAL // gpc.data_size // accum
    for step in range(2):
        x, y = tc._tokens(step)
        with count_collectives() as counted, SavedBytes(engine.model.parameters()) as saved:
            for m in range(accum):
                lo = (gpc.data_rank * accum + m) * n
                batch = (x[lo:lo + n], y[lo:lo + n])
                if gpc.sequence_size > 1:
                    batch = split_batch(batch, gpc.sequence_size, gpc.sequence_rank)
                engine.zero_grad()
                engine.execute_schedule(batch)
                engine.step()
    elements = Counter()
    for name, count in counted.items():
        elements[KIND[name]] += count
    params = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
              for p in engine.model.parameters() if p.untyped_storage().nbytes()}
    for buffer in getattr(engine.optimizer, "buffers", []):
        if getattr(buffer, "local", None) is not None:  # ZeRO 3: my shard of the unit
            params[buffer.local.untyped_storage().data_ptr()] = buffer.local.untyped_storage(
            ).nbytes()
    return {"rank": rank, "pipeline_rank": gpc.pipeline_rank, "data_rank": gpc.data_rank,
            "total": sum(storages(engine).values()), "parameters": sum(params.values()),
            "elements": dict(elements), "saved": saved.peak}


def convnet():
    """A custom model the planner knows nothing of (measured on the meta device), float64."""
    from torch import nn
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Flatten(), nn.Linear(8 * 8 * 8, 10)).double()


def convnet_worker(rank, world_size, port, config, micro):
    """Two steps of convnet() under `config`, `micro` images per micro-step: the same live
    numbers as gpt_worker's."""
    import nanocolossal as nc
    from nanocolossal.memory import SavedBytes
    from nanocolossal.traffic import count_collectives
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port, timeout=60)
    torch.manual_seed(0)
    model = convnet()
    engine, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               torch.nn.CrossEntropyLoss(reduction="sum"), verbose=False)
    x = torch.randn(micro, 3, 8, 8, dtype=torch.float64)
    y = torch.randint(0, 10, (micro,))
    for _ in range(2):
        with count_collectives() as counted, SavedBytes(engine.model.parameters()) as saved:
            engine.zero_grad()
            for _ in range(config.get("gradient_accumulation", 1)):
                engine.execute_schedule((x, y))
            engine.step()
    elements = Counter()
    for name, count in counted.items():
        elements[KIND[name]] += count
    held = [*engine.model.parameters(), *engine.model.buffers()]
    held += [b.local for b in getattr(engine.optimizer, "buffers", [])
             if getattr(b, "local", None) is not None]  # ZeRO 3: my shard of each unit
    params = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held}
    return {"rank": rank, "total": sum(storages(engine).values()),
            "parameters": sum(n for n in params.values() if n), "elements": dict(elements),
            "saved": saved.peak}
