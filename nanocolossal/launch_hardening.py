"""Launch, hardened: a job that cannot start says why, once, within its timeout.

launch.py is the path that works: read the environment, `init_process_group`, `gpc.init`, seed.
This file is what that path needed once it met real clusters, each piece for a failure seen:

- torchrun restarts a failed job with the same store and the same keys, so the new processes
  could read their predecessors' addresses and fail to connect: each attempt gets keys of its
  own (`_agent_store`).
- a rank whose rank 0 never came up would wait *twice* the timeout (torch's client tries again
  after its first timeout) and then print a C++ trace per try: it first polls rank 0's port
  itself, every 20 ms (`_wait_for_rank0`).
- a job of one process meets nobody: its store is in memory (no port, no socket, no name
  lookups, which a DNS server that drops queries would make wait 5 s).
- torch's errors say "EADDRINUSE" or "timed out", as text (their types say little): `_explain`
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

import torch.distributed as dist

from .config import ConfigError, on_load
from .context import gpc, on_destroy


class LaunchError(RuntimeError):
    """The job could not be started; the message says what to change."""


def init_process_group(backend: str, init_method: str, rank: int, world_size: int,
                       timeout: timedelta, where: str) -> None:
    """`torch.distributed.init_process_group`, hardened: a restarted job meets its own attempt,
    an absent rank 0 costs one timeout, and every failure is a LaunchError saying what to do.

    `where` is host:port, for messages (and for polling rank 0)."""
    try:
        if world_size == 1:  # a job of one process meets nobody: no socket, no port to wait on
            store = dist.HashStore()
        else:
            store = _agent_store(timeout) if init_method == "env://" else None
        if store is None and rank != 0:
            _wait_for_rank0(where, timeout)
        meet = dict(store=store) if store is not None else dict(init_method=init_method)
        with _beneath_user_error_hook():
            dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout,
                                    **meet)
    except (RuntimeError, ValueError, OSError) as e:
        raise LaunchError(_explain(e, rank, world_size, timeout, where)) from e


def _agent_store(timeout: timedelta) -> Optional[dist.Store]:
    """Under torchrun, the agent's store with keys of this attempt only, else None.

    torchrun's static rendezvous keeps one store, with the same keys, across restarts, so the
    processes of a restarted job could read their predecessors' addresses and fail to connect.
    Each attempt gets its own key prefix instead."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                           is_master=False, timeout=timeout)
    return dist.PrefixStore(
        f"nanocolossal/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", client
    )


def _wait_for_rank0(where: str, timeout: timedelta) -> None:
    """Poll the port where rank 0 opens the store until it listens.

    torch's own client tries a second time after its timeout, so an absent rank 0 would cost
    twice the timeout (and the error would say once); polling first keeps the wait to one."""
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


def _explain(error: Exception, rank: int, world_size: int, timeout: timedelta,
             where: str) -> str:
    """torch's error as what to change: matched by its text, which is all that tells them apart."""
    text = str(error)
    timed_out = "timed out" in text.lower() or "timeout" in text.lower()
    seconds = f"{timeout.total_seconds():.0f} s"
    if "in use" in text.lower() or "EADDRINUSE" in text:
        hint = f"port at {where} is already in use: choose a free one (--port / --master_port)"
    elif timed_out and rank == 0:  # rank 0 listened, and not everyone came
        hint = (f"could not meet the other processes at {where} within {seconds}: did all "
                f"{world_size} start, and do they agree on world_size={world_size}?")
    elif timed_out:  # this rank found nobody listening, or listening for others
        hint = (f"could not meet the other processes at {where} within {seconds}: is rank 0 "
                f"running, is the host reachable, do all ranks agree on world_size={world_size}?")
    else:
        hint = f"could not join the job at {where}"
    return f"[rank {rank}] {hint} ({type(error).__name__}: {text.splitlines()[0] if text else ''})"


# -- user errors end in one line per rank ----------------------------------------------------

USER_ERRORS = (ConfigError, LaunchError)  # ConfigError includes MissingKeyError (cfg.NAME)
_previous_hook = None  # the excepthook ours replaced, while ours is installed


def install_user_error_hook() -> None:
    """From now on an uncaught user error prints `[rank r] message` alone; anything else goes to
    the hook that was there before, traceback and all. Every launch* (and load_config) calls
    this; calling it again does nothing. gpc.destroy() uninstalls it."""
    global _previous_hook
    if sys.excepthook is not _print_user_error:
        _previous_hook, sys.excepthook = sys.excepthook, _print_user_error


def uninstall_user_error_hook() -> None:
    """Put back the excepthook that install_user_error_hook replaced (if ours is still there)."""
    global _previous_hook
    if sys.excepthook is _print_user_error:
        sys.excepthook, _previous_hook = _previous_hook or sys.__excepthook__, None


on_destroy(uninstall_user_error_hook)  # sys.excepthook as it was before launch
on_load(install_user_error_hook)  # scripts load their config before launch: one line per rank


@contextmanager
def _beneath_user_error_hook() -> Iterator[None]:
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
