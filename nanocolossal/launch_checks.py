"""Launch's checks: a job that cannot start says why, once, within its timeout.

launch.py is the path that works: read the environment, `init_process_group`, `gpc.init`, seed.
This file is what that path met on real clusters, each piece for a failure seen:

- the arguments and the environment, checked before any rank waits for another: a rank outside
  the world, a world the layout does not divide, a missing variable, a port that is no port, a
  backend without its devices -- each a message that says what to change.
- a rank whose rank 0 never came up would wait *twice* the timeout (torch's client tries again
  after its first timeout) and then print a C++ trace per try: it first polls rank 0's port
  itself, every 5 ms (`wait_for_rank0`).
- torch's errors say "EADDRINUSE" or "timed out", as text (their types say little): `explained`
  matches that text and says what to change -- another port, start the other ranks, agree on
  world_size.
- a user error (a bad config, a key the config lacks, a launcher misused) is not a bug: from N
  processes, N tracebacks bury the one line that says what to change. `install_user_error_hook`
  makes such an error end the script with `[rank r] message` alone (exit code 1, as any uncaught
  error); every other error keeps its traceback.
"""
from __future__ import annotations

import os
import socket
import sys
import time
from contextlib import contextmanager
from datetime import timedelta
from types import TracebackType
from typing import Iterator, Optional

import torch

from .config import ON_LOAD, Config, ConfigError, is_positive_int
from .config_checks import check_world
from .context import gpc, on_destroy


class LaunchError(RuntimeError):
    """The job could not be started; the message says what to change."""


# -- the arguments and the environment -------------------------------------------------------

@contextmanager
def ranked(rank: int) -> Iterator[None]:
    """A ConfigError raised inside names this rank (gpc does not know it yet)."""
    try:
        yield
    except ConfigError as e:
        raise ConfigError(f"[rank {rank}] {e}") from None


def check_launch(cfg: Config, rank: int, world_size: int, backend: str) -> None:
    """This rank, world size, parallel layout and backend fit together."""
    if gpc.is_initialized:
        raise LaunchError(f"[rank {gpc.rank}] already launched; call gpc.destroy() before "
                          f"launching again")
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise LaunchError(f"{name} must be an integer, got {value!r}; pass --{name}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise LaunchError(f"[rank {rank}] rank must be in [0, world_size={world_size}); check "
                          f"--rank/--world_size")
    check_world(cfg, world_size)  # a world that does not fit the layout
    if backend not in ("nccl", "gloo"):
        raise LaunchError(f"[rank {rank}] unknown backend {backend!r}; "
                          "use 'nccl' (GPUs) or 'gloo' (CPU)")
    if backend == "nccl" and not torch.cuda.is_available():
        raise LaunchError(f"[rank {rank}] backend 'nccl' needs CUDA, which is not available here; "
                          f"use --backend gloo (or leave it unset)")


def check_gpu(rank: int, local_rank: int) -> None:
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise LaunchError(f"[rank {rank}] local_rank {local_rank} needs GPU {local_rank}, but this "
                          f"node has {count} visible GPU(s); start at most {count} processes per "
                          f"node (--nproc_per_node {count}) or check CUDA_VISIBLE_DEVICES")


def checked_port(port, rank: int) -> int:
    if isinstance(port, str) and port.isdigit():
        port = int(port)
    if not is_positive_int(port) or port > 65535:
        raise LaunchError(f"[rank {rank}] port must be an integer in 1..65535, got {port!r}; "
                          f"pass --port")
    return port


def check_host_port(host: Optional[str], port, rank: int, launcher: str) -> None:
    if not host or not port:
        raise LaunchError(f"[rank {rank}] launch_from_{launcher} needs the rank-0 node's address: "
                          f"pass --host <node> --port <port> (or set MASTER_ADDR and MASTER_PORT)")


def check_env(found: dict[str, str], launcher: str, command: str) -> None:
    """Every {role: variable} set ("A|B": neither was), as an integer but the host: one error
    lists all that is missing and the fix."""
    missing = [var.replace("|", " (or ") + (")" if "|" in var else "")
               for var in found.values() if var not in os.environ]
    if missing:
        raise LaunchError(f"launch_from_{launcher}: environment variable(s) {', '.join(missing)} "
                          f"not set. Start this script with {command}")
    for role, var in found.items():
        try:
            if role != "host":
                int(os.environ[var])
        except ValueError:
            raise LaunchError(f"launch_from_{launcher}: {var}={os.environ[var]!r} is not an "
                              f"integer") from None


# -- meeting the others ----------------------------------------------------------------------

def wait_for_rank0(where: str, timeout: timedelta) -> None:
    """Poll the port where rank 0 opens the store until it listens (or `timeout` passes)."""
    host, port = where.rsplit(":", 1)
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listened at {where} (timed out)") from None
            time.sleep(0.005)  # every 5 ms: a job's start waits for this poll


@contextmanager
def explained(rank: int, world_size: int, timeout: timedelta, where: str) -> Iterator[None]:
    """torch's error in meeting the others as a LaunchError saying what to change."""
    try:
        yield
    except (RuntimeError, ValueError, OSError) as error:
        text = str(error)
        timed_out = "timed out" in text.lower() or "timeout" in text.lower()
        seconds = timeout.total_seconds()
        meet = f"could not meet the other processes at {where} within {seconds:.0f} s"
        agree = f"agree on world_size={world_size}?"
        if "in use" in text.lower() or "EADDRINUSE" in text:
            hint = f"port at {where} is already in use: choose a free one (--port / --master_port)"
        elif timed_out and rank == 0:  # rank 0 listened, and not everyone came
            hint = f"{meet}: did all {world_size} start, and do they {agree}"
        elif timed_out:  # this rank found nobody listening, or listening for others
            hint = f"{meet}: is rank 0 running, is the host reachable, do all ranks {agree}"
        else:
            hint = f"could not join the job at {where}"
        first = text.splitlines()[0] if text else ""
        raise LaunchError(f"[rank {rank}] {hint} ({type(error).__name__}: {first})") from error


# -- user errors end in one line per rank ----------------------------------------------------

USER_ERRORS = (ConfigError, LaunchError)  # ConfigError includes MissingKeyError (cfg.NAME)
_previous_hook = None  # the excepthook ours replaced, while ours is installed


def install_user_error_hook() -> None:
    """Install the module docstring's hook (calling again does nothing). Every launch* and
    load_config call this; gpc.destroy() uninstalls it."""
    global _previous_hook
    if sys.excepthook is not _print_user_error:
        _previous_hook, sys.excepthook = sys.excepthook, _print_user_error


def uninstall_user_error_hook() -> None:
    """Put back the excepthook that install_user_error_hook replaced (if ours is still there)."""
    global _previous_hook
    if sys.excepthook is _print_user_error:
        sys.excepthook, _previous_hook = _previous_hook or sys.__excepthook__, None


on_destroy(uninstall_user_error_hook)  # sys.excepthook as it was before launch
ON_LOAD.append(install_user_error_hook)  # scripts load their config before launch


@contextmanager
def beneath_user_error_hook() -> Iterator[None]:
    """torch's init_process_group wraps sys.excepthook to start every line it prints with
    "[rankN]: ". Let it wrap the hook beneath ours: a bug's traceback gets torch's prefix, and a
    user error keeps its one line (not "[rank0]: [rank 0] ...")."""
    global _previous_hook
    ours = sys.excepthook is _print_user_error
    if ours:
        sys.excepthook = _previous_hook
    try:
        yield
    finally:
        if ours:
            _previous_hook, sys.excepthook = sys.excepthook, _print_user_error


def _print_user_error(kind: type[BaseException], error: BaseException,
                      tb: Optional[TracebackType]) -> None:
    """The hook: a user error as `[rank r] message`, anything else to the hook beneath."""
    if not issubclass(kind, USER_ERRORS):
        return (_previous_hook or sys.__excepthook__)(kind, error, tb)
    message = str(error)
    if not message.startswith("[rank "):  # launch's own messages name the rank already
        message = f"[rank {_rank()}] {message}"
    print(message, file=sys.stderr, flush=True)


def _rank() -> str:
    """This process's rank: gpc's once launched; before that (a script loads its config first)
    the launcher's variable, else gpc's default 0."""
    if not gpc.is_initialized:
        for var in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
            if os.environ.get(var, "").isdigit():
                return os.environ[var]
    return str(gpc.rank)
