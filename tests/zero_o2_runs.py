"""ZeRO x AMP O2 runs on the dyadic grid (zero_models.py), recorded and compared with one
process's O2 run: the pieces test_zero_fp16.py and test_zero3_o2.py build
their training loops from.

    inject_overflow()   the last sample overflows fp16 in one gradient element (one rank's shard)
    micro_step()        this rank's share of a micro-batch: backward, then step
    end_of_step()       record a step: taken or skipped, the loss scale, the clipped norm
    record_o2_state()   record the parameters, masters, optimizer state and scaler
    compare_o2_runs()   compare_runs, plus the losses and the scaler's state
    trainer_run()       a worker: PartNet trained by the Trainer (LossHook, checkpoints, resume)
"""
import pytest
import torch
from run_records import compare_runs
from zero_models import LinearLoss, PartNet, grouped_adamw

import nanocolossal as nc
from nanocolossal.context import gpc
from nanocolossal.metrics import all_reduce_mean


def inject_overflow(xs, cs):
    """The last sample overflows fp16 in b.weight[0, 3]'s gradient: one rank's shard only."""
    xs[-1, 9], cs[-1] = 60000.0, 0.0
    cs[-1, 7] = 0.25


def micro_step(engine, rank, world, xs, cs):
    """This rank's share of xs: backward, then step; (the loss averaged over ranks, stepped)."""
    n = len(xs)
    mine = slice(rank * n // world, (rank + 1) * n // world)
    engine.zero_grad()
    loss = engine.criterion(engine(xs[mine]), cs[mine])
    engine.backward(loss)
    return all_reduce_mean(loss.item()), engine.step()


def end_of_step(engine, out, took):
    out["took"].append(took)
    out["scales"].append(engine.optimizer.loss_scale)
    out["norms"].append(engine.last_grad_norm if engine.clip_grad_norm else None)


def record_o2_state(engine, out):
    state = engine.optimizer.state_dict()  # a collective under ZeRO: one process's O2 state
    out["state"] = {f"param.{k}": v.detach().double().clone()
                    for k, v in engine.model.state_dict().items()}
    out["state"].update({f"master.{i}": m.double() for i, m in enumerate(state["masters"])})
    for i, s in state["optimizer"]["state"].items():
        out["state"].update({f"{k}.{i}": torch.as_tensor(v).double() for k, v in s.items()})
    out["scaler"] = state["scaler"]
    return out


def compare_o2_runs(ref, runs, rtol=0.0, atol=0.0, loss_rtol=1e-3):
    """compare_runs on steps, scales, norms and state (exact by default); the losses (half
    forwards summed in another order) to `loss_rtol`; the scaler's state exactly."""
    compare_runs(ref, runs, rtol=rtol, atol=atol, norms=any(n is not None for n in ref["norms"]))
    for run in runs:
        assert run["loss_values"] == pytest.approx(ref["loss_values"], rel=loss_rtol)
        assert run["scaler"] == ref["scaler"]


def trainer_run(rank, world, port, config, ckpt=None, max_steps=None, resume=False):
    from torch.utils.data import TensorDataset

    from nanocolossal.trainer import Trainer, hooks
    engine_config = dict(config)
    nc.launch(engine_config, rank=rank, world_size=world, host="127.0.0.1", port=port)
    model = PartNet()
    g = torch.Generator().manual_seed(11)
    train_set = TensorDataset(torch.randint(-8, 9, (32, 10), generator=g) / 8,
                              torch.randint(-2, 3, (32, 12), generator=g) / 4)
    test_set = TensorDataset(torch.randint(-8, 9, (8, 10), generator=g) / 8,
                             torch.randint(-2, 3, (8, 12), generator=g) / 4)
    per = 4 // gpc.data_size  # 4 samples a batch
    engine, train, test, _ = nc.initialize(
        model, grouped_adamw(model), LinearLoss(),
        nc.get_dataloader(train_set, shuffle=True, seed=5, drop_last=True, batch_size=per),
        nc.get_dataloader(test_set, batch_size=per), verbose=False)
    trainer, last = Trainer(engine), hooks.LastLossHook()
    saving = [] if ckpt is None else [hooks.SaveCheckpointHook(ckpt, every_steps=2)]
    assert not resume or trainer.resume(ckpt)
    trainer.fit(train, 2, test, hooks=[hooks.LossHook(), last, *saving], max_steps=max_steps)
    return dict(metrics=trainer.states["metrics"], last=last.value, step=trainer.cur_step,
                state={k: v.detach().clone() for k, v in engine.model.state_dict().items()},
                opt=engine.optimizer.state_dict())
