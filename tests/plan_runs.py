"""Live numbers against `nanocolossal plan`: what a rank holds after a steady step (bytes of
distinct storages the Engine reaches), what it handed to collectives in it
(nanocolossal/traffic.py's count_collectives) and its saved activations' peak (memory.py's
SavedBytes); and what the plan of a tests/test_composition.py TABLE row got wrong on them.
Every TABLE row checks its plan (test_composition.py); tests/test_plan.py has the lesson."""
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
    """Two steps of the table's GPT under `config` (SGD, or OPTIMIZER='adamw'): what this rank
    holds after the second (live())."""
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
    optimizer = (torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)
                 if config.get("OPTIMIZER") == "adamw" else tc._layout_sgd(model.parameters()))
    engine, *_ = nc.initialize(model, optimizer, col_nn.VocabParallelCrossEntropyLoss(),
                               verbose=False)
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
    return live(engine, counted, saved)


def live(engine, counted, saved) -> dict:
    """This rank after a step (before zero_grad): bytes of the distinct storages the Engine
    reaches and of its parameters (ZeRO 3: its shard of each unit), elements per collective
    in the step (`counted`, count_collectives'), its saved activations' peak (`saved`)."""
    from nanocolossal.context import gpc
    elements = Counter()
    for name, count in counted.items():
        elements[KIND[name]] += count
    held = list(engine.model.parameters())
    held += [b.local for b in getattr(engine.optimizer, "buffers", [])
             if getattr(b, "local", None) is not None]  # ZeRO 3: my shard of each unit
    params = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held}
    return {"rank": gpc.rank, "pipeline_rank": gpc.pipeline_rank, "data_rank": gpc.data_rank,
            "total": sum(storages(engine).values()), "parameters": sum(params.values()),
            "elements": dict(elements), "saved": saved.peak}


NOT_PLANNED = ("UNUSED", "CAUSAL", "OVERFLOW", "ROUTER_ZERO")  # (activations alike)


def planned(world, config):
    """(model, layout) of a TABLE row as the planner reads it: the table GPT's sizes, SGD,
    float64 (fp32 under AMP), gloo's stand-ins."""
    from dataclasses import replace

    import test_composition as tc

    from nanocolossal.plan.layouts import load
    parallel = config.get("parallel", {})
    tensor = parallel.get("tensor")
    data = world // (parallel.get("pipeline", 1) * (tensor["size"] if tensor else 1))
    cfg = {k: v for k, v in config.items() if k not in NOT_PLANNED}
    cfg.update(VOCAB=tc.VOCAB, SEQ_LEN=tc.SEQ, DIM=tc.DIM, DEPTH=2, HEADS=2, MLP_RATIO=2,
               BATCH_SIZE=tc.GLOBAL // data, OPTIMIZER=config.get("OPTIMIZER", "sgd"),
               PARAM_BYTES=4 if "fp16" in config else 8)
    m, lay = load(cfg, world)
    return m, replace(lay, backend="gloo")


def plan_problems(world, config, lives, exact=True, activations=True) -> list:
    """What the plan of a TABLE row got wrong on its ranks (`lives`: live() of each): (with
    `exact`) model-state bytes or elements per collective not equal, (with `activations`) the
    activation peak more than 5% off SavedBytes'."""
    from nanocolossal.plan.ranks import plan_rank
    m, lay = planned(world, config)
    problems = []
    for r in lives:
        plan = plan_rank(m, lay, r["pipeline_rank"], data_rank=r["data_rank"])
        states = sum(plan.bytes[k] for k in ("parameters", "gradients", "optimizer", "masters",
                                             "routing", "cpu"))
        got = {"parameters": r["parameters"], "states": r["total"], **r["elements"]}
        want = {"parameters": plan.bytes["parameters"], "states": states}
        want.update({k: v for k, v in plan.elements.items() if v})
        if exact and got != want:
            problems.append(f"rank {r['rank']}: live {got} != plan {want}")
        act = plan.bytes["activations"] + plan.bytes["logits"]
        if activations and abs(act - r["saved"]) > 0.05 * r["saved"]:
            problems.append(f"rank {r['rank']}: activations plan {act}, live {r['saved']}")
    return problems


def convnet():
    """A custom model the planner knows nothing of (measured on the meta device), float64."""
    from torch import nn
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Flatten(), nn.Linear(8 * 8 * 8, 10)).double()


def frozen_convnet():
    """convnet() with its convolution frozen (requires_grad=False), as in fine-tuning."""
    model = convnet()
    model[0].requires_grad_(False)
    return model


class _WithUnused(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = convnet()
        self.never = torch.nn.Linear(10, 10).double()

    def forward(self, x):
        return self.net(x)


def unused_convnet():
    """convnet() beside a Linear no forward uses."""
    return _WithUnused()


def convnet_worker(rank, world_size, port, config, micro, build="convnet"):
    """Two steps of convnet() (or another of this file's models, `build`) under `config`,
    `micro` images per micro-step: the same live numbers as gpt_worker's."""
    import nanocolossal as nc
    from nanocolossal.memory import SavedBytes
    from nanocolossal.traffic import count_collectives
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port, timeout=60)
    torch.manual_seed(0)
    model = globals()[build]()
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = nc.initialize(model, torch.optim.SGD(trainable, lr=0.1, momentum=0.9),
                               torch.nn.CrossEntropyLoss(reduction="sum"), verbose=False)
    x = torch.randn(micro, 3, 8, 8, dtype=torch.float64)
    y = torch.randint(0, 10, (micro,))
    for _ in range(2):
        with count_collectives() as counted, SavedBytes(engine.model.parameters()) as saved:
            engine.zero_grad()
            for _ in range(config.get("gradient_accumulation", 1)):
                engine.execute_schedule((x, y))
            engine.step()
    numbers = live(engine, counted, saved)
    buffers = {b.untyped_storage().data_ptr(): b.untyped_storage().nbytes()
               for b in engine.model.buffers()}
    return {**numbers, "parameters": numbers["parameters"] + sum(buffers.values())}
