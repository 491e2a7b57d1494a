"""Launch: turn N independent processes into one job.

Every process of a job needs three things -- its `rank`, the `world_size`, and the `host:port`
where rank 0 listens (the rendezvous) -- plus the config. Launchers differ only in *where*
those come from:

    launch(config, rank, world_size, host, port)  you pass them (get_default_parser)
    launch_from_torch(config)                     torchrun / nanocolossal run: RANK, WORLD_SIZE,
                                                  LOCAL_RANK, MASTER_ADDR, MASTER_PORT
    launch_from_slurm(config, host, port)         srun: SLURM_PROCID, SLURM_NPROCS, SLURM_LOCALID
    launch_from_openmpi(config, host, port)       mpirun: OMPI_COMM_WORLD_RANK/_SIZE/_LOCAL_RANK

All of them then do the same three things (`_launch`):

1. `torch.distributed.init_process_group`: rank 0 opens a TCP store at host:port, the others
   connect and exchange addresses. The result is the *world* group: all W ranks.
2. `gpc.init` builds every other group (context.py): with P pipeline stages and T tensor ranks
   there are D = W / (P * T) replicas of the model, laid out tensor innermost (layout.py):

       rank = data_rank * (P * T) + pipeline_rank * T + tensor_rank

3. Every rank seeds its RNGs alike, so that the replicas' models are born equal (and
   initialize broadcasts them anyway: replicas.py).

Backend: nccl when CUDA is available, else gloo. Device: cuda:local_rank with nccl, cpu with gloo.
Every wait is bounded by `timeout` (config `timeout`, default 300 s). launch_checks.py makes a
failing start say why, in time: an absent rank 0, torch's errors, user errors one line per rank.
"""
from __future__ import annotations

import argparse
import os
import random
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from . import launch_checks
from .config import ConfigLike, load_config
from .context import gpc
from .launch_checks import LaunchError
from .logging import get_dist_logger

DEFAULT_TIMEOUT_S = 300


def launch(config: ConfigLike, rank: int, world_size: int, host: str, port: int,
           backend: Optional[str] = None, local_rank: Optional[int] = None, seed: int = 1024,
           timeout: Optional[float] = None) -> None:
    """Start this process as `rank` of `world_size`, meeting the others at host:port."""
    launch_checks.install_user_error_hook()  # from here, a user error ends in one line
    if not host:
        raise LaunchError(f"[rank {rank}] no host given: pass --host, the rank-0 node's address")
    port = launch_checks.checked_port(port, rank)
    _launch(config, rank, world_size, local_rank, f"tcp://{host}:{port}", f"{host}:{port}",
            backend, seed, timeout)


def launch_from_torch(config: ConfigLike, backend: Optional[str] = None, seed: int = 1024,
                      timeout: Optional[float] = None, allow_single_process: bool = False) -> None:
    """Launch under torchrun (or `nanocolossal run`), which sets everything in the environment.
    With `allow_single_process=True`, a plain `python script.py` runs as a job of one process."""
    launch_checks.install_user_error_hook()
    torchrun_vars = _VARIABLES["torch"][0].values()
    if allow_single_process and not any(var in os.environ for var in torchrun_vars):
        # nobody else joins: the one rank meets itself in memory (_init_process_group)
        _launch(config, 0, 1, 0, "tcp://127.0.0.1:0", "127.0.0.1 (single process)", backend, seed,
                timeout)
        return
    env = _read_env("torch")
    # env://: the workers read MASTER_ADDR/PORT (or use the agent's store: _init_process_group)
    _launch(config, env["rank"], env["world_size"], env["local_rank"], "env://",
            f"{env['host']}:{env['port']}", backend, seed, timeout)


def launch_from_slurm(config: ConfigLike, host: Optional[str] = None, port: Optional[int] = None,
                      backend: Optional[str] = None, seed: int = 1024,
                      timeout: Optional[float] = None) -> None:
    """Launch under `srun`: SLURM_PROCID, SLURM_NPROCS (or SLURM_NTASKS), SLURM_LOCALID."""
    _launch_from_variables(config, "slurm", host, port, backend, seed, timeout)


def launch_from_openmpi(config: ConfigLike, host: Optional[str] = None, port: Optional[int] = None,
                        backend: Optional[str] = None, seed: int = 1024,
                        timeout: Optional[float] = None) -> None:
    """Launch under `mpirun`: OMPI_COMM_WORLD_RANK, _SIZE and _LOCAL_RANK."""
    _launch_from_variables(config, "openmpi", host, port, backend, seed, timeout)


# Where each launcher puts rank and size ("A|B": A, else B), and how to start a script under it
_VARIABLES = {
    "torch": ({"rank": "RANK", "world_size": "WORLD_SIZE", "local_rank": "LOCAL_RANK",
               "host": "MASTER_ADDR", "port": "MASTER_PORT"},
              "`torchrun --nproc_per_node N script.py` or `nanocolossal run --nproc_per_node N "
              "script.py`"),
    "slurm": ({"rank": "SLURM_PROCID", "world_size": "SLURM_NPROCS|SLURM_NTASKS",
               "local_rank": "SLURM_LOCALID"},
              "`srun python script.py --host <first node> --port 29500`"),
    "openmpi": ({"rank": "OMPI_COMM_WORLD_RANK", "world_size": "OMPI_COMM_WORLD_SIZE",
                 "local_rank": "OMPI_COMM_WORLD_LOCAL_RANK"},
                "`mpirun -np N python script.py --host <rank-0 node> --port 29500`"),
}


def _launch_from_variables(config: ConfigLike, launcher: str, host: Optional[str],
                           port: Optional[int], backend: Optional[str], seed: int,
                           timeout: Optional[float]) -> None:
    """Rank and size from the launcher's variables; host:port passed, else MASTER_ADDR/_PORT."""
    launch_checks.install_user_error_hook()
    env = _read_env(launcher)
    host = host or os.environ.get("MASTER_ADDR")
    port = port or os.environ.get("MASTER_PORT")
    launch_checks.check_host_port(host, port, env["rank"], launcher)
    port = launch_checks.checked_port(port, env["rank"])
    _launch(config, env["rank"], env["world_size"], env["local_rank"], f"tcp://{host}:{port}",
            f"{host}:{port}", backend, seed, timeout)


def _launch(config: ConfigLike, rank: int, world_size: int, local_rank: Optional[int],
            init_method: str, where: str, backend: Optional[str], seed: int,
            timeout: Optional[float]) -> None:
    """What every launcher does once it knows who this process is."""
    backend = (backend or ("nccl" if torch.cuda.is_available() else "gloo")).lower()
    with launch_checks.ranked(rank):  # what can fail alone fails before waiting for the others
        cfg = load_config(config)
        launch_checks.check_launch(cfg, rank, world_size, backend)
    local_rank = default_local_rank(rank, local_rank)
    device = _pick_device(backend, rank, local_rank)
    seconds = timeout if timeout is not None else cfg.get("timeout", DEFAULT_TIMEOUT_S)
    wait = timedelta(seconds=seconds)
    if cfg.get("debug"):  # torch then checks that every collective matches across ranks
        gpc.set_job_env("TORCH_DISTRIBUTED_DEBUG", "DETAIL")

    _init_process_group(backend, init_method, rank, world_size, wait, where)  # 1. the world
    gpc.init(cfg, rank, world_size, local_rank, device, backend, wait)        # 2. the groups
    _seed_everything(seed)                                                    # 3. equal models
    split = (f"sequence {gpc.sequence_size}" if gpc.sequence_size > 1 else
             f"tensor {gpc.tensor_size}{' ' + gpc.tensor_mode if gpc.tensor_mode else ''}")
    get_dist_logger().info(
        f"launched {world_size} process(es): backend {backend}, device {device.type}, pipeline "
        f"{gpc.pipeline_size} x {split} x data {gpc.data_size}, timeout {seconds:g} s"
        f"{', debug mode' if cfg.get('debug') else ''}")


def _init_process_group(backend: str, init_method: str, rank: int, world_size: int,
                        timeout: timedelta, where: str) -> None:
    """The world group. A job of one process meets itself in memory (no socket, no port, no
    name lookup). Under torchrun the ranks meet in the agent's store, under keys of this attempt:
    a restarted job keeps the store, and its predecessors' keys would send it to dead addresses.
    `where` is host:port, for messages (and for polling rank 0)."""
    with launch_checks.explained(rank, world_size, timeout, where):  # torch's errors: what to do
        store = None
        if world_size == 1:
            store = dist.HashStore()
        elif init_method == "env://" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                  is_master=False, timeout=timeout)
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            store = dist.PrefixStore(f"nanocolossal/attempt_{attempt}", agent)
        if store is None and rank != 0:
            launch_checks.wait_for_rank0(where, timeout)  # an absent rank 0: one timeout, not two
        meet = dict(store=store) if store is not None else dict(init_method=init_method)
        with launch_checks.beneath_user_error_hook():
            dist.init_process_group(backend, rank=rank, world_size=world_size,
                                    timeout=timeout, **meet)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    try:
        import numpy as np
        np.random.seed(seed)
    except ImportError:
        pass


def get_default_parser() -> argparse.ArgumentParser:
    """The arguments `launch` needs; add your own with `parser.add_argument`."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", help="path to the config .py file")  # (None when absent)
    parser.add_argument("--host", help="address of the rank-0 node")
    parser.add_argument("--port", type=int, help="free port on the rank-0 node")
    parser.add_argument("--rank", type=int, help="global rank of this process")
    parser.add_argument("--world_size", type=int, help="number of processes in the job")
    # torch.distributed.launch passes --local-rank (newer) or --local_rank (older): accept both
    parser.add_argument("--local_rank", "--local-rank", type=int, help="rank on this node (= GPU)")
    parser.add_argument("--backend", help="nccl or gloo (default: nccl with CUDA, else gloo)")
    parser.add_argument("--debug", action="store_true",
                        help="config debug=True: TORCH_DISTRIBUTED_DEBUG=DETAIL and a barrier "
                             "after each epoch (on gloo it names ranks that do not arrive)")
    return parser


def _pick_device(backend: str, rank: int, local_rank: int) -> torch.device:
    if backend != "nccl":
        return torch.device("cpu")
    launch_checks.check_gpu(rank, local_rank)
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def default_local_rank(rank: int, local_rank: Optional[int] = None, env: Optional[dict] = None,
                       gpus: Optional[int] = None) -> int:
    """This process's rank on its node: given, else the launcher's, else rank % GPUs per node
    (not the global rank: rank 8 of a job on 8-GPU nodes would ask for cuda:8)."""
    if local_rank is not None:
        return local_rank
    env = os.environ if env is None else env
    for var in (names["local_rank"] for names, _ in _VARIABLES.values()):
        if env.get(var, "").isdigit():
            return int(env[var])
    gpus = (torch.cuda.device_count() if torch.cuda.is_available() else 0) if gpus is None else gpus
    return rank % gpus if gpus > 0 else rank  # CPU processes: no device to pick, keep the rank


def _read_env(launcher: str) -> dict[str, int | str]:
    """The launcher's variables, as {role: value} ("A|B": A if set, else B)."""
    names, command = _VARIABLES[launcher]
    found = {role: next((var for var in spelling.split("|") if var in os.environ), spelling)
             for role, spelling in names.items()}
    launch_checks.check_env(found, launcher, command)  # all set, integers but the host
    return {role: os.environ[var] if role == "host" else int(os.environ[var])
            for role, var in found.items()}
