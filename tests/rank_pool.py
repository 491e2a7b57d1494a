"""The machinery behind dist_helpers: pooled rank processes, forked launchers, process trees.

A test's ranks are not fresh interpreters (seconds each to import torch): they are forked from
one server process that imported torch, torchvision and nanocolossal once (`_CTX`, a
multiprocessing forkserver), and stay up as a pool per world size, running one test's job after
another. After each job a rank resets what a fresh process would not have inherited (mostly
`gpc.destroy()`) and must leave nothing running: a thread, socket or child process more than it
started with fails the job (`_left_behind`) -- a process group kept alive by a reference cycle
holds gloo's threads and sockets, and a rank that ran hundreds of such jobs crawls. A job that
fails or overstays kills its pool, so one broken test never poisons the next. Every process
watches the test process and dies with it (`_exit_with_parent`), and `kill_tree` ends a launcher
together with every rank it started.
"""
from __future__ import annotations

import atexit
import contextlib
import gc
import itertools
import multiprocessing as mp
import os
import pickle
import runpy
import signal
import sys
import threading
import time
import traceback
from collections import Counter
from pathlib import Path

# Ranks are forked from one server process that imported these once (a fresh interpreter spends
# seconds importing torch and torchvision). Forking after `import torch` is safe: the server never
# runs an op, so no thread pool or CUDA context exists yet to be copied half-initialized.
# (Windows has no fork server: there the ranks are spawned, each importing torch itself.)
if "forkserver" in mp.get_all_start_methods():
    _CTX = mp.get_context("forkserver")
    # pytest too: every test module a rank unpickles its job from imports it (about a second)
    _CTX.set_forkserver_preload(["torch", "torch.distributed", "torchvision", "tqdm", "pytest",
                                 "nanocolossal", "nanocolossal.trainer"])
else:
    _CTX = mp.get_context("spawn")


def start_server() -> None:
    """Start the rank server now (conftest does, before importing torch itself): its imports then
    overlap with pytest's own instead of delaying the first multi-process test."""
    if _CTX.get_start_method() == "forkserver":
        from multiprocessing import forkserver
        forkserver.ensure_running()


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
    import tqdm

    from nanocolossal.context import gpc
    tqdm.tqdm.monitor_interval = 0  # its monitor thread would outlive the first job's bar
    gc.freeze()  # the server's imports: a collection after each job then walks the job's objects
    while True:
        job = inbox.get()
        if job is None:
            break
        job_id, fn, port, args = job
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        before = _footprint()
        try:
            report = (job_id, rank, True, pickle.dumps(fn(rank, world_size, port, *args)))
        except BaseException:
            report = (job_id, rank, False, traceback.format_exc())
        finally:  # what a fresh process would not have inherited
            gpc.destroy()
            torch.set_default_dtype(torch.float32)
            torch.set_grad_enabled(True)
            os.environ.clear()
            os.environ.update(environ)
        left = _left_behind(before)
        if left and report[2]:
            report = (job_id, rank, False, left)
        results.put(report)
    os._exit(0)  # skip interpreter teardown: nothing left to flush, and it can stall


def _footprint() -> dict[str, list[str]]:
    """What this process runs: its threads (by name), sockets and child processes (Linux's
    /proc; elsewhere Python's threads only)."""
    if not os.path.isdir("/proc/self/task"):
        return {"threads": [t.name for t in threading.enumerate()], "sockets": [], "children": []}
    threads = []
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            threads.append((task / "comm").read_text().strip())
    sockets = []
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            if os.readlink(fd).startswith("socket:"):
                sockets.append(fd.name)
    children = [str(c.pid) for c in mp.active_children()]
    return {"threads": threads, "sockets": sockets, "children": children}


def _left_behind(before: dict[str, list[str]]) -> str:
    """'' if the job left this rank as it found it; else what it left running (after a garbage
    collection: a cycle of Python objects holding a process group is freed by it). A thread that
    is ending (gloo's loop, after its last socket closed) gets a second to finish."""
    gc.collect()
    for _ in range(20):
        after = _footprint()
        extra = {kind: len(after[kind]) - len(before[kind]) for kind in after}
        if all(n <= 0 for n in extra.values()):
            return ""
        time.sleep(0.05)
    names = Counter(after["threads"]) - Counter(before["threads"])
    names.update(t.name for t in threading.enumerate())  # Python's own names, where it started them
    return (f"the job left {extra['threads']} thread(s) ({dict(names)}), {extra['sockets']} "
            f"socket(s) and {extra['children']} child process(es) running on this rank: "
            "something still holds a process group (a hook C++ keeps whose closure reaches the "
            "model?), or a patch of a module was not undone")


# (world size, cuda) -> its ranks, most recently used last
_POOLS: dict[tuple[int, bool], _Pool] = {}
_MAX_POOLS = 5  # every world size the suite uses (1, 2, 3, 4, 8) stays up: forks share pages
_JOB_IDS = itertools.count()


def get_pool(world_size: int, cuda: bool) -> _Pool:
    key = (world_size, cuda)
    pool = _POOLS.pop(key, None)
    if pool is not None and not pool.alive():
        pool.close()
        pool = None
    while len(_POOLS) >= _MAX_POOLS:
        _POOLS.pop(next(iter(_POOLS))).close()
    _POOLS[key] = pool or _Pool(world_size, cuda)
    return _POOLS[key]


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


def _become_launcher(env: dict, cwd: str, out_path: str) -> None:
    """A process forked from the rank server turns into a launcher a test started: its own
    session, output to `out_path`, the command's environment and folder."""
    os.setsid()  # its own process group, as start_new_session gives a Popen: one kill ends all
    _exit_with_parent(kill_children=True)  # and no launcher or rank outlives a killed pytest
    out = os.open(out_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(out, 1)  # the processes it starts inherit these, as they would a Popen's pipe
    os.dup2(out, 2)
    sys.stdout.reconfigure(line_buffering=True)  # what PYTHONUNBUFFERED gives a fresh python
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)


@contextlib.contextmanager
def _as_interpreter():
    """What the interpreter does with an uncaught error (its hook, exit code 1) and at exit."""
    try:
        yield
    except Exception:
        sys.excepthook(*sys.exc_info())
        sys.stderr.flush()
        raise SystemExit(1) from None
    finally:
        atexit._run_exitfuncs()  # the interpreter would; a multiprocessing child skips them


def _run_module(argv: list[str], env: dict, cwd: str, out_path: str) -> None:
    """`python -m argv[0] argv[1:]`, in a process forked from the rank server (see BackgroundCmd).
    """
    _become_launcher(env, cwd, out_path)
    sys.argv, sys.path[0:0] = list(argv), [cwd]  # -m puts the working directory first
    with _as_interpreter():
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)


def _run_elastic(argv: list[str], env: dict, cwd: str, out_path: str) -> None:
    """`torchrun --max-restarts R --nproc_per_node N --master_port P tests/scripts/fail_at.py
    SPEC script args` as torchrun runs it -- its elastic agent (`elastic_launch`), a static
    rendezvous at the port -- but with workers forked from this process, which imported torch,
    instead of fresh interpreters: a start or a restart costs a fork, not seconds of imports.
    argv: [N, R, P, SPEC, script, *args]."""
    nproc, restarts, port, spec, script, *args = argv
    _become_launcher(env, cwd, out_path)
    import torch._dynamo  # noqa: F401 -- each worker's optimizer would import it (seconds)
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=int(nproc), run_id="test",
                          rdzv_backend="static", rdzv_endpoint=f"127.0.0.1:{port}",
                          rdzv_configs={"rank": 0}, max_restarts=int(restarts),
                          monitor_interval=0.1, start_method="fork")
    with _as_interpreter():
        elastic_launch(config, _fail_at_worker)(spec, script, args)


def _fail_at_worker(spec: str, script: str, args: list) -> None:
    import torch
    torch.set_num_threads(1)  # what OMP_NUM_THREADS=1 gives a fresh interpreter torchrun starts
    sys.path.insert(0, str(Path(__file__).parent / "scripts"))
    import fail_at
    fail_at.run(spec, script, args)
