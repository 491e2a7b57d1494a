import json
import os
import shutil
import socket
import sys
import time

import pytest
import torch
import torch.distributed as dist
from dist_helpers import SCRIPTS, free_port, run_cmd, run_ranks

import nanocolossal as nc
from nanocolossal.config import ConfigError
from nanocolossal.context import gpc

pytestmark = pytest.mark.timeout(120)


def _describe() -> dict:
    """What a rank knows after launch, plus proof that the world group connects everyone."""
    total = torch.tensor([gpc.rank + 1.0])
    dist.all_reduce(total)
    return dict(rank=gpc.rank, world_size=gpc.world_size, local_rank=gpc.local_rank,
                backend=gpc.backend,
                device=str(gpc.device), sum=total.item(), batch=gpc.config.get("BATCH_SIZE"),
                seed_draw=torch.rand(1).item(), timeout=gpc.timeout.total_seconds())


def _explicit_worker(rank, world_size, port):
    args = nc.get_default_parser().parse_args(
        ["--rank", str(rank), "--world_size", str(world_size), "--host", "127.0.0.1", "--port",
         str(port), "--backend", "gloo"])
    nc.launch(config={"BATCH_SIZE": 4, "timeout": 45}, rank=args.rank, world_size=args.world_size,
              host=args.host, port=args.port, backend=args.backend)
    return _describe()


def test_gloo_launch_explicit_with_default_parser():
    out = run_ranks(_explicit_worker, 2)
    assert [o["rank"] for o in out] == [0, 1]
    for o in out:
        assert o["world_size"] == 2 and o["backend"] == "gloo" and o["device"] == "cpu"
        assert o["sum"] == 3.0 and o["batch"] == 4 and o["timeout"] == 45
    assert out[0]["seed_draw"] == out[1]["seed_draw"], "every rank must be seeded the same"


def _slurm_worker(rank, world_size, port):
    os.environ.update(SLURM_PROCID=str(rank), SLURM_NTASKS=str(world_size), SLURM_LOCALID=str(rank))
    nc.launch_from_slurm(config={"BATCH_SIZE": 2}, host="127.0.0.1", port=port)
    return _describe()


def test_gloo_launch_from_slurm():
    out = run_ranks(_slurm_worker, 2)
    assert [(o["rank"], o["local_rank"], o["world_size"],
             o["sum"]) for o in out] == [(0, 0, 2, 3.0), (1, 1, 2, 3.0)]


def _probes(output: str) -> list[dict]:
    probes = [json.loads(line.split("PROBE ", 1)[1]) for line in output.splitlines()
              if "PROBE " in line]
    return sorted(probes, key=lambda p: p["rank"])


def test_deep_launch_from_torch_under_torchrun(tmp_path):
    config = tmp_path / "config.py"
    config.write_text("BATCH_SIZE = 32\n")
    result = run_cmd([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                      "--master_port", str(free_port()), str(SCRIPTS / "launch_probe.py"),
                      "--mode", "torch", "--config", str(config)], timeout=90)
    assert result.returncode == 0, result.stdout
    probes = _probes(result.stdout)
    assert [(p["rank"], p["local_rank"], p["world_size"], p["sum"],
             p["batch_size"]) for p in probes] == \
        [(0, 0, 2, 3.0, 32), (1, 1, 2, 3.0, 32)]
    assert "launched 2 process(es): backend gloo" in result.stdout


def test_deep_launch_under_torch_distributed_launch():
    """Seed 004's command: the deprecated launcher passes --local-rank to the script."""
    result = run_cmd([sys.executable, "-m", "torch.distributed.launch", "--nproc_per_node", "2",
                      "--master_port", str(free_port()), str(SCRIPTS / "launch_probe.py"),
                      "--mode", "torch"],
                     timeout=90)
    assert result.returncode == 0, result.stdout
    probes = _probes(result.stdout)
    assert [(p["rank"], p["local_rank"], p["world_size"],
             p["sum"]) for p in probes] == [(0, 0, 2, 3.0), (1, 1, 2, 3.0)]


@pytest.mark.skipif(shutil.which("mpirun") is None,
                    reason="mpirun not installed (apt-get install openmpi-bin)")
def test_deep_launch_from_openmpi_under_mpirun():
    port = free_port()
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    result = run_cmd(["mpirun", "-np", "2", "--oversubscribe", *root, sys.executable,
                      str(SCRIPTS / "launch_probe.py"),
                      "--mode", "openmpi", "--host", "127.0.0.1", "--port", str(port)], timeout=90)
    assert result.returncode == 0, result.stdout
    probes = _probes(result.stdout)
    assert [(p["rank"], p["local_rank"], p["world_size"],
             p["sum"]) for p in probes] == [(0, 0, 2, 3.0), (1, 1, 2, 3.0)]


# ---- bad inputs: each one a clear error, none of them waiting on a peer ----------------------

@pytest.mark.parametrize("launcher, variables, command", [
    (nc.launch_from_torch, ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"],
     "torchrun --nproc_per_node"),
    (nc.launch_from_slurm, ["SLURM_PROCID", "SLURM_NPROCS (or SLURM_NTASKS)", "SLURM_LOCALID"],
     "srun"),
    (nc.launch_from_openmpi,
     ["OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"], "mpirun"),
])
def test_missing_environment_variables_are_listed_with_the_command(
    monkeypatch, launcher, variables, command
):
    for var in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID",
                "SLURM_NPROCS",
                "SLURM_NTASKS", "SLURM_LOCALID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_RANK"]:
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(nc.LaunchError) as info:
        launcher({})
    message = str(info.value)
    for var in variables:
        assert var in message
    assert command in message


def test_launch_from_openmpi_without_host_says_pass_host(monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(nc.LaunchError, match=r"\[rank 1\].*--host <node> --port <port>"):
        nc.launch_from_openmpi({})


def test_launch_rejects_world_not_divisible_by_pipeline_before_waiting():
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"\[rank 0\] world size 3 is not "
                                          r"divisible by pipeline x tensor = 2 x 1"):
        nc.launch({"parallel": {"pipeline": 2}}, rank=0, world_size=3, host="127.0.0.1",
                  port=free_port(), timeout=30)
    assert time.monotonic() - start < 5 and not dist.is_initialized()


def test_launch_rejects_bad_rank_and_backend():
    with pytest.raises(nc.LaunchError, match=r"rank must be in \[0, world_size=2\)"):
        nc.launch({}, rank=2, world_size=2, host="127.0.0.1", port=free_port())
    with pytest.raises(nc.LaunchError, match="unknown backend 'mpi'"):
        nc.launch({}, rank=0, world_size=1, host="127.0.0.1", port=free_port(), backend="mpi")
    with pytest.raises(nc.LaunchError, match="port must be an integer"):
        nc.launch({}, rank=0, world_size=1, host="127.0.0.1", port=None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_launch_nccl_without_cuda_says_use_gloo():
    with pytest.raises(nc.LaunchError, match="needs CUDA.*--backend gloo"):
        nc.launch({}, rank=0, world_size=1, host="127.0.0.1", port=free_port(), backend="nccl")


def test_launch_local_rank_beyond_gpu_count(monkeypatch):
    # Simulate a node with one GPU and a job that starts a second process on it.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(nc.LaunchError,
                       match=r"\[rank 1\] local_rank 1 needs GPU 1, but this node has 1 visible"):
        nc.launch({}, rank=1, world_size=2, host="127.0.0.1", port=free_port(), local_rank=1)
    assert not dist.is_initialized()


def test_gloo_launch_port_already_in_use():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(nc.LaunchError,
                           match=rf"\[rank 0\] port at 127.0.0.1:{port} is already in use"):
            nc.launch({}, rank=0, world_size=2, host="127.0.0.1", port=port, timeout=10)
    assert not dist.is_initialized()


def test_gloo_launch_of_one_process_opens_no_port():
    """One process meets nobody: its store is in memory, so even a busy port does not stop it."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        nc.launch({}, rank=0, world_size=1, host="127.0.0.1", port=busy.getsockname()[1])
        store = dist.distributed_c10d._get_default_store()
        assert isinstance(getattr(store, "underlying_store", store), dist.HashStore)
        assert dist.get_world_size() == 1


def test_deep_launch_without_rank0_times_out_with_a_clear_error(capfd):
    start = time.monotonic()
    with pytest.raises(nc.LaunchError,
                       match=r"\[rank 1\] could not meet the other processes .* within 2 s"):
        nc.launch({}, rank=1, world_size=2, host="127.0.0.1", port=free_port(), timeout=2)
    # the wait is the timeout asked for, not torch's client retrying after a random delay (up
    # to 4 s), and our one-line error is all that is said: no C++ trace of each try
    assert time.monotonic() - start < 3.5
    assert "c10d" not in capfd.readouterr().err


def test_deep_launch_of_rank0_alone_asks_whether_the_others_started():
    with pytest.raises(nc.LaunchError, match=r"\[rank 0\] could not meet the other processes "
                                             r".* within 1 s: did all 2 start"):
        nc.launch({}, rank=0, world_size=2, host="127.0.0.1", port=free_port(), timeout=1)


def _logging_worker(rank, world_size, port):
    import contextlib
    import io
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        nc.launch({}, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
        logger = nc.get_dist_logger()
        logger.info("only rank zero says this")
        logger.info("everyone says this", ranks=None)
        logger.warning("a warning")
    return buffer.getvalue()


def test_gloo_logger_labels_ranks_and_filters_info():
    out = run_ranks(_logging_worker, 2)
    assert (
        "[rank 0] INFO nanocolossal: launched 2 process(es)" in out[0] and "launched" not in out[1]
    )
    assert "only rank zero says this" in out[0] and "only rank zero" not in out[1]
    for rank, text in enumerate(out):
        assert f"[rank {rank}] INFO nanocolossal: everyone says this" in text
        assert f"[rank {rank}] WARNING nanocolossal: a warning" in text


def test_gloo_launch_from_torch_can_run_as_a_single_process(monkeypatch):
    for var in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"]:
        monkeypatch.delenv(var, raising=False)
    nc.launch_from_torch({"BATCH_SIZE": 3}, allow_single_process=True)
    assert (gpc.rank, gpc.world_size, gpc.config.BATCH_SIZE) == (0, 1, 3) and dist.is_initialized()
    gpc.destroy()
    monkeypatch.setenv("RANK", "0")  # half a torchrun environment is still an error
    with pytest.raises(nc.LaunchError, match="WORLD_SIZE"):
        nc.launch_from_torch({}, allow_single_process=True)


def test_default_parser_has_the_launch_arguments_and_debug():
    args = nc.get_default_parser().parse_args(["--rank", "1", "--world_size", "2", "--host", "h",
                                               "--port", "29500", "--debug"])
    got = (args.rank, args.world_size, args.host, args.port, args.debug, args.backend)
    assert got == (1, 2, "h", 29500, True, None)


def test_local_rank_defaults_on_two_nodes_of_two_gpus(monkeypatch):
    """Ranks 2 and 3 live on the second node: they use its cuda:0 and cuda:1, not cuda:2/3."""
    from nanocolossal.launch import _pick_device, default_local_rank
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    for var in ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    devices = [_pick_device("nccl", r, default_local_rank(r)) for r in range(4)]
    assert [str(d) for d in devices] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    # a launcher's own local rank wins over the guess; an explicit argument over both
    assert [default_local_rank(r, env={"SLURM_LOCALID": str(r - 2)}) for r in (2, 3)] == [0, 1]
    assert default_local_rank(3, env={"LOCAL_RANK": "1"}) == 1
    assert default_local_rank(3, local_rank=0, env={"LOCAL_RANK": "1"}) == 0
    assert default_local_rank(5, env={}, gpus=0) == 5  # CPU: no device to choose
