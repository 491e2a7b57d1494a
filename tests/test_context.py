import os

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_ranks

import nanocolossal as nc
from nanocolossal.context import gpc

pytestmark = pytest.mark.timeout(120)


def test_gpc_describes_one_process_before_launch():
    assert (gpc.rank, gpc.world_size, gpc.local_rank) == (0, 1, 0)
    assert (gpc.data_rank, gpc.data_size, gpc.pipeline_rank, gpc.pipeline_size) == (0, 1, 0, 1)
    assert gpc.device == torch.device("cpu") and not gpc.is_initialized
    assert gpc.is_first_stage() and gpc.is_last_stage() and gpc.prev_rank == gpc.next_rank == 0


def _groups_worker(rank, world_size, port):
    nc.launch({"parallel": {"pipeline": 2}}, rank=rank, world_size=world_size, host="127.0.0.1",
              port=port)
    # Membership as torch sees it, and proof by reduction
    # that the groups really connect those ranks.
    in_data = torch.tensor([float(rank)])
    dist.all_reduce(in_data, group=gpc.data_group)
    in_pipe = torch.tensor([float(rank)])
    dist.all_reduce(in_pipe, group=gpc.pipeline_group)
    shard = list(nc.get_dataloader(list(range(10)), shuffle=True, batch_size=100))[0].tolist()
    return dict(rank=gpc.rank, data_rank=gpc.data_rank, data_size=gpc.data_size,
                pipeline_rank=gpc.pipeline_rank,
                pipeline_size=gpc.pipeline_size, first=gpc.is_first_stage(),
                last=gpc.is_last_stage(), prev=gpc.prev_rank, next=gpc.next_rank,
                data_ranks=dist.get_process_group_ranks(gpc.data_group),
                pipeline_ranks=dist.get_process_group_ranks(gpc.pipeline_group),
                data_sum=in_data.item(), pipe_sum=in_pipe.item(), shard=shard)


def test_gloo_four_ranks_pipeline_two_layout_and_groups():
    out = run_ranks(_groups_worker, 4)
    expected = {  # rank = data_rank * P + pipeline_rank, P = 2
        0: dict(data_rank=0, pipeline_rank=0, data_ranks=[0, 2], pipeline_ranks=[0, 1], prev=1,
                next=1),
        1: dict(data_rank=0, pipeline_rank=1, data_ranks=[1, 3], pipeline_ranks=[0, 1], prev=0,
                next=0),
        2: dict(data_rank=1, pipeline_rank=0, data_ranks=[0, 2], pipeline_ranks=[2, 3], prev=3,
                next=3),
        3: dict(data_rank=1, pipeline_rank=1, data_ranks=[1, 3], pipeline_ranks=[2, 3], prev=2,
                next=2),
    }
    for o in out:
        want = expected[o["rank"]]
        assert {k: o[k] for k in want} == want
        assert o["data_size"] == 2 and o["pipeline_size"] == 2
        assert o["first"] == (o["pipeline_rank"] == 0) and o["last"] == (o["pipeline_rank"] == 1)
        assert o["data_sum"] == sum(want["data_ranks"])
        assert o["pipe_sum"] == sum(want["pipeline_ranks"])
    # The sampler shards by *data* rank: both stages of a pipeline read the same samples,
    # and the two pipelines together read each sample once.
    assert out[0]["shard"] == out[1]["shard"] and out[2]["shard"] == out[3]["shard"]
    assert sorted(out[0]["shard"] + out[2]["shard"]) == list(range(10))


def _destroy_worker(rank, world_size, port):
    nc.launch({}, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    gpc.destroy()
    return (gpc.rank, gpc.world_size, dist.is_initialized())


def test_deep_destroy_returns_to_single_process_defaults():
    assert run_ranks(_destroy_worker, 2) == [(0, 1, False), (0, 1, False)]


def test_gloo_destroy_forgets_what_the_job_left_in_other_modules(tmp_path, monkeypatch):
    """A second job in the same process (a pooled test rank, a notebook) starts as a fresh
    process would: nothing the first job set survives gpc.destroy()."""
    import logging
    import sys

    from dist_helpers import free_port

    from nanocolossal import data, launch_checks
    from nanocolossal.nn import layers
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG", raising=False)
    nc.launch({"debug": True}, rank=0, world_size=1, host="127.0.0.1", port=free_port())
    assert os.environ["TORCH_DISTRIBUTED_DEBUG"] == "DETAIL"
    assert sys.excepthook is launch_checks._print_user_error
    layers._state["next_is_row"] = True   # the job built a column-parallel Linear
    data._announced.add(("CIFAR-10", "/data"))   # and said once that it used a stand-in
    logger = nc.get_dist_logger()
    logger.set_level("WARNING")
    logger.log_to_file(str(tmp_path / "job1.log"))
    gpc.destroy()
    # (torch's init_process_group wraps sys.excepthook for good: ours is what must be gone)
    assert "TORCH_DISTRIBUTED_DEBUG" not in os.environ
    assert sys.excepthook is not launch_checks._print_user_error
    assert layers._state["next_is_row"] is False and not data._announced
    plain = logging.getLogger("nanocolossal")
    assert plain.level == logging.INFO
    assert not any(isinstance(h, logging.FileHandler) for h in plain.handlers)


def test_gloo_destroy_leaves_a_debug_level_the_user_chose(monkeypatch):
    from dist_helpers import free_port
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "INFO")
    nc.launch({"debug": True}, rank=0, world_size=1, host="127.0.0.1", port=free_port())
    gpc.destroy()
    assert os.environ["TORCH_DISTRIBUTED_DEBUG"] == "INFO"


def test_destroy_forgets_the_cpu_half_type():
    cpu_half = pytest.importorskip("nanocolossal.cpu_half")
    cpu_half._cache["dtype"] = None  # the last job's rank 0's answer
    gpc.destroy()
    assert not cpu_half._cache
