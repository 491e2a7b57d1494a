"""Helpers for multi-process tests: start N ranks, bound every wait, never leave orphans.

`run_ranks(fn, world_size, *args)` runs `fn(rank, world_size, port, *args)` on N processes,
one thread each, and returns their results in rank order. The processes are pooled (see
rank_pool.py) and forked from a server that imported torch once, so a new world size or a pool that
the last test broke costs milliseconds, not a torch import per rank. A rank that raises fails
the test with its traceback; ranks still running after `timeout` seconds are killed and the
test fails naming them (a hang becomes an error, not a stuck CI). Each child also watches the
test process and exits if it disappears.

`run_ranks_cached(fn, world_size, *args)` is run_ranks for a job whose result depends on its
arguments alone (a one-process reference, a run several tests compare with): it runs once per
pytest process, and each caller gets its own copy of the results.

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

import contextlib
import copy
import io
import multiprocessing
import os
import pickle
import queue
import runpy
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from rank_pool import (
    _CTX,
    _JOB_IDS,
    _POOLS,
    _run_elastic,
    _run_module,
    get_pool,
    kill_tree,
    start_server,
)

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "scripts"

__all__ = ["ROOT", "SCRIPTS", "BackgroundCmd", "free_port", "kill_tree", "one_process", "run_cmd",
           "run_ranks", "run_ranks_cached", "run_script", "start_server", "torchrun_fail_at"]


def _ephemeral_low() -> int:
    """The first port the OS hands out to outgoing connections and bind(port 0)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; macOS starts at 49152, so this stays below it too


_PORTS_FROM = 15000
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_NEXT_PORT = iter(range(int.from_bytes(os.urandom(2), "little"), 1 << 30))


def free_port() -> int:
    """A port nobody listens on right now, for a job's rank-0 store.

    Not bind(port 0): that port lies in the OS's ephemeral range, which it also hands to every
    outgoing connection (gloo's pairs, a store client), so a busy test run can take it in the
    moment between this check and the store's bind (EADDRINUSE). Below that range only an explicit
    bind takes a port, and each pytest-xdist worker draws from its own residue class."""
    span = (_ephemeral_low() - _PORTS_FROM) // _WORKERS * _WORKERS
    if span < 100 * _WORKERS:  # an unusual ephemeral range: let the OS pick after all
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    for _ in range(200):
        port = _PORTS_FROM + (_WORKER + _WORKERS * next(_NEXT_PORT)) % span
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {_PORTS_FROM}..{_PORTS_FROM + span}")


class _PortTaken(AssertionError):
    """Another process bound the free port between free_port() and rank 0's store."""


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 60.0, grace: float = 5.0,
              cuda: bool = False) -> list:
    """Run fn(rank, world_size, port, *args) on `world_size` processes; results by rank. A port
    another process took in the meantime (EADDRINUSE) is retried on a new one, twice at most."""
    for attempt in range(3):
        try:
            return _run_ranks_once(fn, world_size, args, timeout, grace, cuda)
        except _PortTaken:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def launch_rank(rank: int, world_size: int, port: int, config: dict | None = None,
                timeout: float = 30.0) -> None:
    """Join run_ranks' job as `rank` of `world_size` (127.0.0.1:`port`) under `config`, every
    collective bounded by `timeout` seconds."""
    import nanocolossal as nc  # (the ranks import it; the harness alone does not need it)
    nc.launch(dict(config or {}), rank=rank, world_size=world_size, host="127.0.0.1", port=port,
              timeout=timeout)


_CACHED: dict[tuple, list] = {}


def run_ranks_cached(fn: Callable, world_size: int, *args: Any, timeout: float = 60.0) -> list:
    """run_ranks for a job that writes nothing and whose results depend on (fn, world_size, args)
    alone: run once per pytest process, a fresh copy of the results for every call. A job that
    fails is not cached (the next call runs it again and fails again)."""
    key = (fn.__module__, fn.__qualname__, world_size, pickle.dumps(args))
    if key not in _CACHED:
        _CACHED[key] = run_ranks(fn, world_size, *args, timeout=timeout)
    return copy.deepcopy(_CACHED[key])


def _run_ranks_once(fn: Callable, world_size: int, args: tuple, timeout: float, grace: float,
                    cuda: bool) -> list:
    pool = get_pool(world_size, cuda)
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
        message = "\n".join(f"--- rank {r}: {msg}" for r, msg in sorted(errors.items()))
        taken = any("EADDRINUSE" in m or "address already in use" in m for m in errors.values())
        raise (_PortTaken if taken and not done else AssertionError)(message)
    return [pickle.loads(done[r]) for r in range(world_size)]


def one_process(fn: Callable, *args: Any, timeout: float = 60.0) -> Any:
    """fn's result on one rank, run once per distinct (fn, args) in a test session
    (run_ranks_cached): the one-process reference that several tests or cases compare with."""
    return run_ranks_cached(fn, 1, *args, timeout=timeout)[0]


def _script_job(rank: int, world_size: int, port: int, script: str, args: list, cwd: str,
                env: dict) -> str:
    """A pooled rank runs a script as torchrun would start it: its variables, argv and folder."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0", **env)
    argv, path, here = sys.argv, list(sys.path), os.getcwd()
    sys.argv, sys.path[0:0] = [script, *args], [str(Path(script).parent)]
    os.chdir(cwd)
    # a torchrun rank may start processes of its own (a DataLoader's workers) as a fresh
    # interpreter would: not as a daemon (a pooled rank is one), by fork (not via pytest's server)
    multiprocessing.current_process().daemon = False
    start_method = multiprocessing.get_start_method()
    multiprocessing.set_start_method("fork", force=True)
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
        multiprocessing.current_process().daemon = True
        multiprocessing.set_start_method(start_method, force=True)
    return out.getvalue()


def run_script(script: Path, args: list[str], nproc: int, cwd: Path, timeout: float = 150.0,
               env: dict | None = None) -> str:
    """Run a training script on `nproc` pooled ranks, as `torchrun --nproc_per_node nproc` would
    (with `env` added to the environment); the ranks' outputs in rank order. Tests of torchrun
    itself (restarts, exit codes) use run_cmd."""
    return "".join(run_ranks(_script_job, nproc, str(script), list(args), str(cwd), env or {},
                             timeout=timeout))


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
                 cuda: bool = False, target: Callable | None = None):
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        if not cuda:
            full_env["CUDA_VISIBLE_DEVICES"] = ""
        self.argv = argv
        if target is None and argv[:2] == [sys.executable, "-m"] and \
                _CTX.get_start_method() == "forkserver":
            target, argv = _run_module, argv[2:]
        if target is not None:  # forked from the rank server
            fd, self.out_path = tempfile.mkstemp(prefix="launcher-", suffix=".log")
            os.close(fd)
            self.proc = _CTX.Process(target=target, args=(argv, full_env, str(cwd), self.out_path))
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


def torchrun_fail_at(script: Path, args: list[str], fail_at: str, cwd: Path, nproc: int = 2,
                     max_restarts: int = 1) -> BackgroundCmd:
    """`torchrun --max-restarts R --nproc_per_node N scripts/fail_at.py SPEC script args` in the
    background: torchrun's agent with forked workers (rank_pool._run_elastic), or the real
    command where there is no fork server."""
    port = str(free_port())
    if _CTX.get_start_method() != "forkserver":
        return BackgroundCmd([sys.executable, "-m", "torch.distributed.run",
                              f"--max-restarts={max_restarts}", "--nproc_per_node", str(nproc),
                              "--master_port", port, str(SCRIPTS / "fail_at.py"), fail_at,
                              str(script), *args], cwd=cwd)
    return BackgroundCmd([str(nproc), str(max_restarts), port, fail_at, str(script), *args],
                         cwd=cwd, target=_run_elastic)
