"""Helpers for multi-process tests: start N ranks, bound every wait, never leave orphans.

`run_ranks(fn, world_size, *args)` runs `fn(rank, world_size, port, *args)` on N processes,
one thread each, and returns their results in rank order. The processes are pooled (see
`_Pool`) and forked from a server that imported torch once, so a new world size or a pool that
the last test broke costs milliseconds, not a torch import per rank. A rank that raises fails
the test with its traceback; ranks still running after `timeout` seconds are killed and the
test fails naming them (a hang becomes an error, not a stuck CI). Each child also watches the
test process and exits if it disappears.

`run_script(script, args, nproc, cwd)` runs a training script on pooled ranks as torchrun would
start it, and returns what the ranks printed.

`run_cmd(argv, timeout)` runs a launcher (torchrun, mpirun, nanocolossal run) and kills it and
every process it started if it overstays; `BackgroundCmd(argv)` starts one and lets the test do
other work (a reference run on the pool) before `finish(timeout)`. A `python -m` launcher is
forked from the same server rather than started afresh (see BackgroundCmd).

Both hide GPUs from the ranks unless asked (`cuda=True`): the gloo tests are CPU tests, and on a
machine with one GPU two ranks would otherwise both pick nccl and ask for cuda:0 and cuda:1.
"""
from __future__ import annotations

import atexit
import contextlib
import io
import itertools
import multiprocessing as mp
import os
import pickle
import queue
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
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


def _exit_with_parent(kill_children: bool = False) -> None:
    """Die with the test process (a forked rank's OS parent is the fork server, not the test),
    taking the processes this one started along if asked."""
    parent = mp.parent_process()

    def watch() -> None:
        parent.join()  # returns when the test process is gone
        if kill_children:
            kill_tree(os.getpid())
        os._exit(3)
    threading.Thread(target=watch, daemon=True).start()


# Ranks are forked from one server process that imported these once (a fresh interpreter spends
# seconds importing torch and torchvision). Forking after `import torch` is safe: the server never
# runs an op, so no thread pool or CUDA context exists yet to be copied half-initialized.
# (Windows has no fork server: there the ranks are spawned, each importing torch itself.)
if "forkserver" in mp.get_all_start_methods():
    _CTX = mp.get_context("forkserver")
    _CTX.set_forkserver_preload(["torch", "torch.distributed", "torchvision", "tqdm",
                                 "nanocolossal", "nanocolossal.trainer"])
else:
    _CTX = mp.get_context("spawn")


def start_server() -> None:
    """Start the rank server now (conftest does, before importing torch itself): its imports then
    overlap with pytest's own instead of delaying the first multi-process test."""
    if _CTX.get_start_method() == "forkserver":
        from multiprocessing import forkserver
        forkserver.ensure_running()


class _Pool:
    """`world_size` ranks that outlive one test: tests borrow them one after another.

    The ranks stay up and run one job after another, each with a fresh process group and the
    environment as it was. A job that fails or overstays kills the pool, and the next test gets a
    fresh one: one broken test never poisons the next."""

    def __init__(self, world_size: int, cuda: bool) -> None:
        self.results = _CTX.Queue()
        self.inboxes = [_CTX.Queue() for _ in range(world_size)]
        # the server's environment is the one it started with: send this test's own
        environ = dict(os.environ)
        if not cuda:  # set before the job imports anything that may ask torch.cuda
            environ["CUDA_VISIBLE_DEVICES"] = ""
        self.procs = [_CTX.Process(target=_serve, args=(r, world_size, self.inboxes[r],
                                                        self.results, environ),
                                   daemon=True) for r in range(world_size)]
        for p in self.procs:
            p.start()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)


def _serve(rank: int, world_size: int, inbox, results, environ: dict) -> None:
    """A pooled rank: runs jobs until told to stop, cleaning up after each as a fresh process."""
    _exit_with_parent()
    os.environ.clear()
    os.environ.update(environ)
    import torch

    from nanocolossal.context import gpc
    from nanocolossal.nn import reset_1d_alternation
    while True:
        job = inbox.get()
        if job is None:
            break
        job_id, fn, port, args = job
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        try:
            report = (job_id, rank, True, pickle.dumps(fn(rank, world_size, port, *args)))
        except BaseException:
            report = (job_id, rank, False, traceback.format_exc())
        finally:  # what a fresh process would not have inherited
            gpc.destroy()
            reset_1d_alternation()
            torch.set_default_dtype(torch.float32)
            torch.set_grad_enabled(True)
            os.environ.clear()
            os.environ.update(environ)
        results.put(report)
    os._exit(0)  # skip interpreter teardown: nothing left to flush, and it can stall


# (world size, cuda) -> its ranks, most recently used last
_POOLS: dict[tuple[int, bool], _Pool] = {}
_MAX_POOLS = 4  # the four latest world sizes stay up (forks: pages shared until written)
_JOB_IDS = itertools.count()


def _pool(world_size: int, cuda: bool) -> _Pool:
    key = (world_size, cuda)
    pool = _POOLS.pop(key, None)
    if pool is not None and not pool.alive():
        pool.close()
        pool = None
    while len(_POOLS) >= _MAX_POOLS:
        _POOLS.pop(next(iter(_POOLS))).close()
    _POOLS[key] = pool or _Pool(world_size, cuda)
    return _POOLS[key]


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 60.0, grace: float = 5.0,
              cuda: bool = False) -> list:
    """Run fn(rank, world_size, port, *args) on `world_size` processes; results by rank."""
    pool = _pool(world_size, cuda)
    job, port = next(_JOB_IDS), free_port()
    for inbox in pool.inboxes:
        inbox.put((job, fn, port, args))
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
                job_id, rank, ok, payload = pool.results.get(timeout=0.2)
                if job_id != job:
                    continue
                (done if ok else errors)[rank] = payload
                if not ok:  # peers blocked on the failed rank get a moment, then are killed
                    deadline = min(deadline, time.monotonic() + grace)
            except queue.Empty:
                for r, p in enumerate(pool.procs):
                    if r not in done and r not in errors and not p.is_alive():
                        errors[r] = f"died with exit code {p.exitcode} before reporting"
    finally:
        # failed, hung or interrupted (pytest-timeout): start afresh next time
        if errors or len(done) < world_size:
            _POOLS.pop((world_size, cuda), None)
            pool.close()
    if errors:
        raise AssertionError("\n".join(f"--- rank {r}: {msg}" for r, msg in sorted(errors.items())))
    return [pickle.loads(done[r]) for r in range(world_size)]


def _script_job(rank: int, world_size: int, port: int, script: str, args: list, cwd: str) -> str:
    """A pooled rank runs a script as torchrun would start it: its variables, argv and folder."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0")
    argv, path, here = sys.argv, list(sys.path), os.getcwd()
    sys.argv, sys.path[0:0] = [script, *args], [str(Path(script).parent)]
    os.chdir(cwd)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise RuntimeError(f"{script} exited with {e.code}; its "
                               f"output:\n{out.getvalue()}") from None
    except BaseException as e:
        raise RuntimeError(f"{script} raised; its output:\n{out.getvalue()}") from e
    finally:
        sys.argv, sys.path[:] = argv, path
        os.chdir(here)
    return out.getvalue()


def run_script(script: Path, args: list[str], nproc: int, cwd: Path, timeout: float = 150.0) -> str:
    """Run a training script on `nproc` pooled ranks, as `torchrun --nproc_per_node nproc` would;
    the ranks' outputs in rank order. Tests of torchrun itself (restarts, exit codes) use run_cmd.
    """
    return "".join(run_ranks(_script_job, nproc, str(script), list(args), str(cwd),
                             timeout=timeout))


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants. Its process group is not enough: torchrun
    starts every rank in a session of its own, and a SIGKILLed agent cannot stop them."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):  # (no /proc, as on macOS: the group only)
        with contextlib.suppress(OSError, IndexError):
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(stat.parent.name))
    tree, i = [pid], 0
    while i < len(tree):  # collect the whole tree first: killed parents' children get reparented
        tree += children.get(tree[i], [])
        i += 1
    for p in tree[::-1]:  # the root last: it may be this very process
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _run_module(argv: list[str], env: dict, cwd: str, out_path: str) -> None:
    """`python -m argv[0] argv[1:]`, in a process forked from the rank server (see BackgroundCmd).
    """
    os.setsid()  # its own process group, as start_new_session gives a Popen: one kill ends all
    _exit_with_parent(kill_children=True)  # and no launcher or rank outlives a killed pytest
    out = os.open(out_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(out, 1)  # the processes it starts inherit these, as they would a Popen's pipe
    os.dup2(out, 2)
    sys.stdout.reconfigure(line_buffering=True)  # what PYTHONUNBUFFERED gives a fresh python
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv, sys.path[0:0] = list(argv), [cwd]  # -m puts the working directory first
    try:
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    finally:
        atexit._run_exitfuncs()  # the interpreter would; a multiprocessing child skips them


def run_cmd(argv: list[str], timeout: float, env: dict | None = None, cwd: Path = ROOT,
            cuda: bool = False) -> subprocess.CompletedProcess:
    """Run a launcher command with a deadline; it and all it started die if it overstays."""
    return BackgroundCmd(argv, env, cwd, cuda).finish(timeout)


class BackgroundCmd:
    """Start a launcher command in the background, so a test can do other work meanwhile.

    A `python -m module ...` command (torchrun, torch.distributed.launch, nanocolossal.run) runs
    in a process forked from the rank server, which imported torch already: `runpy` runs the
    module as `-m` would, minus the 3 s a fresh interpreter spends importing torch. What such a
    launcher starts (the ranks) are fresh interpreters, as always. Other commands (mpirun, an
    installed console script) start as they are."""

    def __init__(self, argv: list[str], env: dict | None = None, cwd: Path = ROOT,
                 cuda: bool = False):
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        if not cuda:
            full_env["CUDA_VISIBLE_DEVICES"] = ""
        self.argv = argv
        if argv[:2] == [sys.executable, "-m"] and _CTX.get_start_method() == "forkserver":
            fd, self.out_path = tempfile.mkstemp(prefix="launcher-", suffix=".log")
            os.close(fd)
            self.proc = _CTX.Process(target=_run_module,
                                     args=(argv[2:], full_env, str(cwd), self.out_path))
            self.proc.start()
        else:
            self.out_path = None
            self.proc = subprocess.Popen(argv, cwd=cwd, env=full_env, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True,
                                         start_new_session=True)

    def _wait(self, timeout: float | None) -> tuple[str, int | None]:
        """(output so far, exit code or None if still running after `timeout`)."""
        if self.out_path is None:
            try:
                out, _ = self.proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                return "", None
            return out, self.proc.returncode
        self.proc.join(timeout)
        return Path(self.out_path).read_text(errors="replace"), self.proc.exitcode

    def finish(self, timeout: float) -> subprocess.CompletedProcess:
        """Wait for the command; kill it and all it started if it overstays (or the test fails)."""
        try:
            out, code = self._wait(timeout)
            if code is None:
                kill_tree(self.proc.pid)
                out, _ = self._wait(None)
                raise AssertionError(f"{' '.join(self.argv)} did not finish within {timeout} s; "
                                     f"output:\n{out}")
        finally:
            self.__exit__()
        return subprocess.CompletedProcess(self.argv, code, out, None)

    def __enter__(self) -> "BackgroundCmd":
        return self

    def __exit__(self, *exc) -> None:
        # a test that failed before finish() must not leave the command (or its ranks) running
        # (only while it runs: a finished one's pid may already be another process's)
        if self.out_path is None:
            if self.proc.poll() is None:
                kill_tree(self.proc.pid)
                self.proc.communicate()
        else:
            if self.proc.is_alive():
                kill_tree(self.proc.pid)
                self.proc.join()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.out_path)
