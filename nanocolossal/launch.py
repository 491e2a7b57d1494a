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
2. `gpc.init` builds every other group (context.py). With P pipeline stages and T tensor ranks
   there are D = W / (P * T) replicas of the model, and ranks are laid out tensor innermost:

       rank = data_rank * (P * T) + pipeline_rank * T + tensor_rank

   data      D ranks, P * T apart: one per replica, same stage and slice; averages gradients
   pipeline  P ranks, T apart: one replica's stages; passes activations and their gradients
   tensor    T consecutive ranks: one stage of one replica; runs every layer's collectives
   row, col  mode='2d' only: the T = q * q tensor ranks as a q x q grid (tensor_rank =
             row * q + col); a row group splits the hidden dimension, a column group the batch
             ('2.5d': each of its stacked grids, and depth groups across them; '3d': a group
             along each axis of the q x q x q cube)
   model     P * T consecutive ranks: one whole replica (global gradient norm, checkpoints)
   gradient  the ranks holding the same parameters: the data group, or with mode='sequence'
             (whose T ranks split the sequence, not the weights) data x sequence ranks

3. Every rank seeds its RNGs alike, so that the replicas' models are born equal (and
   initialize broadcasts them anyway: replicas.py).

Backend: nccl when CUDA is available, else gloo. Device: cuda:local_rank with nccl, cpu with
gloo. Every wait is bounded by `timeout` (config `timeout`, default 300 s). What makes a start
that fails say why, in time -- torchrun restarts, an absent rank 0, torch's error texts, user
errors as one line per rank -- is in launch_hardening.py.
"""
from __future__ import annotations

import argparse
import os
import random
from datetime import timedelta
from typing import Optional

import torch

from .config import Config, ConfigError, ConfigLike, is_positive_int, load_config
from .context import gpc
from .launch_hardening import LaunchError, init_process_group, install_user_error_hook
from .logging import get_dist_logger

DEFAULT_TIMEOUT_S = 300


def launch(config: ConfigLike, rank: int, world_size: int, host: str, port: int,
           backend: Optional[str] = None, local_rank: Optional[int] = None, seed: int = 1024,
           timeout: Optional[float] = None) -> None:
    """Start this process as `rank` of `world_size`, meeting the others at host:port."""
    install_user_error_hook()  # from here, a user error ends in one line, without a traceback
    if not host:
        raise LaunchError(f"[rank {rank}] no host given: pass --host "
                          "with the address of the rank-0 node")
    port = _check_port(port, rank)
    _launch(config, rank, world_size, local_rank, f"tcp://{host}:{port}", f"{host}:{port}",
            backend, seed, timeout)


def launch_from_torch(config: ConfigLike, backend: Optional[str] = None, seed: int = 1024,
                      timeout: Optional[float] = None, allow_single_process: bool = False) -> None:
    """Launch under torchrun (or `nanocolossal run`), which sets everything in the environment.

    With `allow_single_process=True`, a script started as plain `python script.py` (none of the
    torchrun variables set) runs as a job of one process instead of failing.
    """
    install_user_error_hook()
    if allow_single_process and not any(var in os.environ for var in _TORCHRUN_VARS.values()):
        # nobody else joins: the one rank meets itself in an in-memory store (a HashStore,
        # launch_hardening.py), so no port is opened and no name is looked up
        _launch(config, 0, 1, 0, "tcp://127.0.0.1:0", "127.0.0.1 (single process)", backend, seed,
                timeout)
        return
    env = _read_env(_TORCHRUN_VARS, "torch",
                    "`torchrun --nproc_per_node N script.py` or `nanocolossal run --nproc_per_node "
                    "N script.py`")
    # env://: the workers read MASTER_ADDR/PORT (or use the agent's store, see launch_hardening)
    _launch(config, env["rank"], env["world_size"], env["local_rank"], "env://",
            f"{env['host']}:{env['port']}", backend, seed, timeout)


def launch_from_slurm(config: ConfigLike, host: Optional[str] = None, port: Optional[int] = None,
                      backend: Optional[str] = None, seed: int = 1024,
                      timeout: Optional[float] = None) -> None:
    """Launch under `srun`: rank and world size come from SLURM_PROCID and
    SLURM_NPROCS/SLURM_NTASKS."""
    _launch_from_variables(config, {"rank": "SLURM_PROCID",
                                    "world_size": "SLURM_NPROCS|SLURM_NTASKS",
                                    "local_rank": "SLURM_LOCALID"},
                           "slurm", "`srun python script.py --host <first node> --port 29500`",
                           host, port, backend, seed, timeout)


def launch_from_openmpi(config: ConfigLike, host: Optional[str] = None, port: Optional[int] = None,
                        backend: Optional[str] = None, seed: int = 1024,
                        timeout: Optional[float] = None) -> None:
    """Launch under `mpirun`: rank, size and local rank come from OMPI_COMM_WORLD_*."""
    _launch_from_variables(config, {"rank": "OMPI_COMM_WORLD_RANK",
                                    "world_size": "OMPI_COMM_WORLD_SIZE",
                                    "local_rank": "OMPI_COMM_WORLD_LOCAL_RANK"},
                           "openmpi",
                           "`mpirun -np N python script.py --host <rank-0 node> --port 29500`",
                           host, port, backend, seed, timeout)


def _launch_from_variables(config: ConfigLike, names: dict, launcher: str, how: str,
                           host: Optional[str], port: Optional[int], backend: Optional[str],
                           seed: int, timeout: Optional[float]) -> None:
    """A launcher that names rank and size in its own variables; the script passes host:port."""
    install_user_error_hook()
    env = _read_env(names, launcher, how)
    host, port = _host_port(host, port, env["rank"], launcher)
    _launch(config, env["rank"], env["world_size"], env["local_rank"], f"tcp://{host}:{port}",
            f"{host}:{port}", backend, seed, timeout)


def _launch(config: ConfigLike, rank: int, world_size: int, local_rank: Optional[int],
            init_method: str, where: str, backend: Optional[str], seed: int,
            timeout: Optional[float]) -> None:
    """What every launcher does once it knows who this process is."""
    cfg = _checked_config(config, rank, world_size)  # what can fail alone fails before waiting
    local_rank = default_local_rank(rank, local_rank)
    backend = _pick_backend(backend, rank)
    device = _pick_device(backend, rank, local_rank)
    seconds = timeout if timeout is not None else cfg.get("timeout", DEFAULT_TIMEOUT_S)
    wait = timedelta(seconds=seconds)
    if cfg.get("debug"):  # torch then checks that every collective matches across ranks
        gpc.set_job_env("TORCH_DISTRIBUTED_DEBUG", "DETAIL")

    init_process_group(backend, init_method, rank, world_size, wait, where)  # 1. the world group
    gpc.init(cfg, rank, world_size, local_rank, device, backend, wait)       # 2. the other groups
    _seed_everything(seed)                                                   # 3. equal models
    get_dist_logger().info(
        f"launched {world_size} process(es): backend {backend}, device {device.type}, "
        f"pipeline {gpc.pipeline_size} x {'sequence' if gpc.sequence_size > 1 else 'tensor'} "
        f"{gpc.tensor_size}{' ' + gpc.tensor_mode if gpc.tensor_size > 1 else ''} x data "
        f"{gpc.data_size}, timeout {seconds:g} s{', debug mode' if cfg.get('debug') else ''}")


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    try:
        import numpy as np
        np.random.seed(seed)
    except ImportError:
        pass


# -- the arguments, checked: each mistake a message that says what to change ------------------

def get_default_parser() -> argparse.ArgumentParser:
    """The arguments `launch` needs; add your own with `parser.add_argument`."""
    parser = argparse.ArgumentParser(add_help=True)
    parser.add_argument("--config", type=str, default=None, help="path to the config .py file")
    parser.add_argument("--host", type=str, default=None, help="address of the rank-0 node")
    parser.add_argument("--port", type=int, default=None, help="free port on the rank-0 node")
    parser.add_argument("--rank", type=int, default=None, help="global rank of this process")
    parser.add_argument("--world_size", type=int, default=None,
                        help="number of processes in the job")
    # torch.distributed.launch passes --local-rank (newer) or --local_rank (older): accept both
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None,
                        help="rank on this node (selects the GPU)")
    parser.add_argument("--backend", type=str, default=None,
                        help="nccl or gloo (default: nccl with CUDA, else gloo)")
    parser.add_argument("--debug", action="store_true",
                        help="config debug=True: TORCH_DISTRIBUTED_DEBUG=DETAIL and a barrier "
                             "after each epoch (on gloo it names ranks that do not arrive)")
    return parser


def _checked_config(config: ConfigLike, rank: int, world_size: int) -> Config:
    """The loaded config, once this rank, world size and parallel layout fit together."""
    try:
        cfg = load_config(config)
    except ConfigError as e:
        raise ConfigError(f"[rank {rank}] {e}") from None
    if gpc.is_initialized:
        raise LaunchError(f"[rank {gpc.rank}] already launched; call gpc.destroy() before "
                          f"launching again")
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise LaunchError(f"{name} must be an integer, got {value!r}; pass --{name}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise LaunchError(f"[rank {rank}] rank must be in [0, world_size={world_size}); check "
                          f"--rank/--world_size")
    try:
        gpc.parallel_sizes(cfg, world_size)  # a world that does not fit the layout
    except ConfigError as e:
        raise ConfigError(f"[rank {rank}] {e}") from None
    return cfg


def _pick_backend(backend: Optional[str], rank: int) -> str:
    if backend is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    backend = backend.lower()
    if backend not in ("nccl", "gloo"):
        raise LaunchError(f"[rank {rank}] unknown backend {backend!r}; "
                          "use 'nccl' (GPUs) or 'gloo' (CPU)")
    if backend == "nccl" and not torch.cuda.is_available():
        raise LaunchError(f"[rank {rank}] backend 'nccl' needs CUDA, which is not available here; "
                          f"use --backend gloo (or leave it unset)")
    return backend


def _pick_device(backend: str, rank: int, local_rank: int) -> torch.device:
    if backend != "nccl":
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise LaunchError(f"[rank {rank}] local_rank {local_rank} needs GPU {local_rank}, but this "
                          f"node has {count} visible GPU(s); start at most {count} processes per "
                          f"node (--nproc_per_node {count}) or check CUDA_VISIBLE_DEVICES")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


# Where launchers put this process's rank on its node.
_LOCAL_RANK_VARS = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK")


def default_local_rank(rank: int, local_rank: Optional[int] = None, env: Optional[dict] = None,
                       gpus: Optional[int] = None) -> int:
    """This process's rank on its node: given, else the launcher's, else rank % GPUs per node.

    Not the global rank: on every node but the first that names a device that does not exist
    (rank 8 of a job on 8-GPU nodes would ask for cuda:8)."""
    if local_rank is not None:
        return local_rank
    env = os.environ if env is None else env
    for var in _LOCAL_RANK_VARS:
        if env.get(var, "").isdigit():
            return int(env[var])
    gpus = (torch.cuda.device_count() if torch.cuda.is_available() else 0) if gpus is None else gpus
    return rank % gpus if gpus > 0 else rank  # CPU processes: no device to pick, keep the rank


def _check_port(port, rank: int) -> int:
    if isinstance(port, str) and port.isdigit():
        port = int(port)
    if not is_positive_int(port) or port > 65535:
        raise LaunchError(f"[rank {rank}] port must be an integer "
                          f"in 1..65535, got {port!r}; pass --port")
    return port


_TORCHRUN_VARS = {"rank": "RANK", "world_size": "WORLD_SIZE", "local_rank": "LOCAL_RANK",
                  "host": "MASTER_ADDR", "port": "MASTER_PORT"}


def _read_env(names: dict[str, str], launcher: str, command: str) -> dict[str, int | str]:
    """Read {role: "VAR" or "VAR|ALTERNATIVE"}; one error lists all that is missing and the fix."""
    values: dict[str, int | str] = {}
    missing = []
    for role, spelling in names.items():
        var = next((v for v in spelling.split("|") if v in os.environ), None)
        if var is None:
            missing.append(spelling.replace("|", " (or ") + (")" if "|" in spelling else ""))
            continue
        raw = os.environ[var]
        try:
            values[role] = raw if role == "host" else int(raw)
        except ValueError:
            raise LaunchError(f"launch_from_{launcher}: {var}={raw!r} is not an integer") from None
    if missing:
        raise LaunchError(f"launch_from_{launcher}: environment variable(s) {', '.join(missing)} "
                          f"not set. Start this script with {command}")
    return values


def _host_port(host: Optional[str], port: Optional[int], rank: int,
               launcher: str) -> tuple[str, int]:
    """host/port arguments, else MASTER_ADDR/MASTER_PORT, else a clear error."""
    host = host or os.environ.get("MASTER_ADDR")
    port = port or os.environ.get("MASTER_PORT")
    if not host or not port:
        raise LaunchError(f"[rank {rank}] launch_from_{launcher} needs the rank-0 node's address: "
                          f"pass --host <node> --port <port> (or set MASTER_ADDR and MASTER_PORT)")
    return host, _check_port(port, rank)
