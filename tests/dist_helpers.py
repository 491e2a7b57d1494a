"""Helpers for multi-process tests: start N ranks, bound every wait, never leave orphans.

`run_ranks(fn, world_size, *args)` runs `fn(rank, world_size, port, *args)` in N fresh
(spawned) processes, one thread each, and returns their results in rank order. A rank that
raises fails the test with its traceback; ranks still running after `timeout` seconds are
killed and the test fails naming them (a hang becomes an error, not a stuck CI). Each child
also watches its parent and exits if the test process disappears.

`run_cmd(argv, timeout)` runs a launcher (torchrun, mpirun, nanocolossal run) in its own
process group and kills the whole group if it overstays.

Both hide GPUs from the ranks unless asked (`cuda=True`): the gloo tests are CPU tests, and on a
machine with one GPU two ranks would otherwise both pick nccl and ask for cuda:0 and cuda:1.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import subprocess
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "scripts"


def free_port() -> int:
    """A port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exit_with_parent(parent: int) -> None:
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(3)
    threading.Thread(target=watch, daemon=True).start()


def _entry(fn: Callable, rank: int, world_size: int, port: int, args: tuple, parent: int, results) -> None:
    _exit_with_parent(parent)
    import torch
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        results.put((rank, True, pickle.dumps(fn(rank, world_size, port, *args))))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        from nanocolossal.context import gpc
        gpc.destroy()
        results.close()
        results.join_thread()
    os._exit(0)  # skip interpreter teardown: nothing left to flush, and it can stall


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 60.0, grace: float = 5.0,
              cuda: bool = False) -> list:
    """Run fn(rank, world_size, port, *args) on `world_size` processes; results by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, args, os.getpid(), results), daemon=True)
             for r in range(world_size)]
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not cuda:  # set before the children start: a test module may ask torch.cuda while it is imported
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        for p in procs:
            p.start()
    finally:
        if hidden is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = hidden
    done: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(done) + len(errors) < world_size:
            now = time.monotonic()
            if now > deadline:
                missing = sorted(set(range(world_size)) - set(done) - set(errors))
                errors.update({r: f"still running after {timeout:.0f} s (hang?)" for r in missing})
                break
            try:
                rank, ok, payload = results.get(timeout=0.2)
                (done if ok else errors)[rank] = payload
                if not ok:  # peers blocked on the failed rank get a moment, then are killed
                    deadline = min(deadline, time.monotonic() + grace)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in done and r not in errors and p.exitcode not in (None, 0):
                        errors[r] = f"died with exit code {p.exitcode} before reporting"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
    if errors:
        raise AssertionError("\n".join(f"--- rank {r}: {msg}" for r, msg in sorted(errors.items())))
    return [pickle.loads(done[r]) for r in range(world_size)]


def run_cmd(argv: list[str], timeout: float, env: dict | None = None, cwd: Path = ROOT,
            cuda: bool = False) -> subprocess.CompletedProcess:
    """Run a launcher command with a deadline; its whole process group dies on timeout."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    if not cuda:
        full_env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.Popen(argv, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{' '.join(argv)} did not finish within {timeout} s; output:\n{out}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(argv, proc.returncode, out, None)
