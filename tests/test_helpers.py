"""The test harness's own promise: a launcher that overstays is killed with every rank it
started (torchrun puts each rank in a session of its own, so killing its group is not enough)."""
import os
import sys
import time

import pytest
import torch
from dist_helpers import free_port, run_cmd

# a rank that records its pid and then never finishes
SLEEPER = ("import os, sys, time\n"
           "open(sys.argv[1] + '/' + str(os.getpid()), 'w').close()\n"
           "time.sleep(60)\n")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, not reaped
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process states from /proc")
@pytest.mark.timeout(60)
def test_a_timed_out_launcher_leaves_no_rank_behind(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    pids = tmp_path / "pids"
    pids.mkdir()
    with pytest.raises(AssertionError, match="did not finish within 4 s"):
        run_cmd([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                 "--master_port", str(free_port()), str(script), str(pids)], timeout=4)
    ranks = [int(p.name) for p in pids.iterdir()]
    assert len(ranks) == 2, "both ranks should have started within the 4 s"
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in ranks), f"ranks {ranks} outlived their launcher"


def _rank_of_a_job(rank, world_size, port):
    import nanocolossal as nc
    nc.launch({}, rank=rank, world_size=world_size, host="127.0.0.1", port=port, timeout=20)
    return rank


@pytest.mark.timeout(60)
def test_deep_a_port_taken_before_the_ranks_bind_it_is_retried_on_another(monkeypatch):
    """free_port() only finds a port nobody listens on *now*: another process may bind it before
    rank 0's store does (EADDRINUSE). run_ranks then runs the job again on a new port."""
    import socket

    import dist_helpers
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    monkeypatch.setattr(dist_helpers, "free_port", lambda: next(ports, None) or free_port())
    try:
        assert dist_helpers.run_ranks(_rank_of_a_job, 2, timeout=30, grace=1.0) == [0, 1]
    finally:
        taken.close()


def test_free_ports_lie_below_the_range_the_os_lends_to_outgoing_connections():
    """An outgoing connection (a gloo pair of another test's ranks) can take any port of the OS's
    ephemeral range at any moment; a port below it is taken only by an explicit bind. Each
    pytest-xdist worker draws from its own residue class, so two workers never pick the same."""
    import dist_helpers
    ports = [free_port() for _ in range(50)]
    assert all(dist_helpers._PORTS_FROM <= p < dist_helpers._ephemeral_low() for p in ports)
    assert {p % dist_helpers._WORKERS for p in ports} == {
        (dist_helpers._PORTS_FROM + dist_helpers._WORKER) % dist_helpers._WORKERS}
    assert len(set(ports)) == len(ports)


def test_no_test_module_defines_a_top_level_name_twice():
    """A second `def _worker` further down a file silently replaces the first for every test that
    runs it (pyflakes only flags a redefinition of a name not used in between)."""
    import ast
    from pathlib import Path
    twice = {}
    for path in sorted(Path(__file__).parent.glob("*.py")):
        seen = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                if node.name in seen:
                    twice.setdefault(path.name, []).append(node.name)
                seen.add(node.name)
    assert not twice, twice


# -- a job leaves its ranks as it found them ----------------------------------------------------

class _KeepsItsLastOutput(torch.nn.Module):
    """Stores its last output, graph and all, as an MoE layer stores its aux loss."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                       torch.nn.Linear(8, 2))
        self.last = None

    def forward(self, x):
        self.last = self.net(x)
        return self.last


LEAN_JOBS = {  # config -> the features whose hooks live in C++ (autograd), out of gc's sight
    "ddp": {},
    "zero2": {"zero": {"level": 2}},
    "zero3": {"zero": {"level": 3}},
}


def _threads_at_the_start_of_a_job(rank, world_size, port, feature):
    threads = len(os.listdir("/proc/self/task"))
    import nanocolossal as nc
    nc.launch(LEAN_JOBS[feature], rank=rank, world_size=world_size, host="127.0.0.1", port=port,
              timeout=20)
    model = _KeepsItsLastOutput()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, *_ = nc.initialize(model, optimizer, torch.nn.MSELoss(), verbose=False)
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    for _ in range(2):
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))
        engine.step()
    return threads


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
@pytest.mark.timeout(120)
def test_gloo_pooled_ranks_run_job_after_job_and_keep_no_thread_of_them():
    """A pooled rank runs job after job: each must end with its process groups gone, or their
    threads (gloo's loops, the store's) and sockets pile up until the rank crawls. A model whose
    hooks C++ holds (DDP's, ZeRO-3's) must be freed with the job, even when it keeps a graph."""
    import dist_helpers
    counts = [dist_helpers.run_ranks(_threads_at_the_start_of_a_job, 2, feature)
              for _ in range(25) for feature in LEAN_JOBS]
    assert counts[3:] == [counts[3]] * len(counts[3:]), counts  # (the first jobs start helpers)


_KEPT = []


def _keeps_its_process_group(rank, world_size, port):
    import nanocolossal as nc
    from nanocolossal.context import gpc
    nc.launch({}, rank=rank, world_size=world_size, host="127.0.0.1", port=port, timeout=20)
    _KEPT.append(gpc.data_group)


@pytest.mark.timeout(60)
def test_gloo_a_job_that_keeps_a_process_group_fails_naming_what_it_left():
    import dist_helpers
    with pytest.raises(AssertionError, match=r"rank 0: the job left \d+ thread\(s\)"):
        dist_helpers.run_ranks(_keeps_its_process_group, 2)
    assert dist_helpers.run_ranks(_rank_of_a_job, 2) == [0, 1]  # the next job: fresh ranks
