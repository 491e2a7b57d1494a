import json
import re
import shlex
import sys
from pathlib import Path

import pytest
from dist_helpers import SCRIPTS, BackgroundCmd, free_port, run_cmd

from nanocolossal.run import main

pytestmark = pytest.mark.timeout(120)


def _console_script() -> list[str]:
    """The installed `nanocolossal` entry point (next to this Python), else the module."""
    script = Path(sys.executable).parent / "nanocolossal"
    return [str(script)] if script.exists() else [sys.executable, "-m", "nanocolossal.run"]


def test_deep_nanocolossal_run_starts_two_ranks():
    with BackgroundCmd([*_console_script(), "run", "--nproc_per_node", "2", "--master_port",
                        str(free_port()), str(SCRIPTS / "launch_probe.py"), "--mode",
                        "torch"]) as job:
        result = job.finish(timeout=90)
    assert result.returncode == 0, result.stdout
    probes = sorted((json.loads(line.split("PROBE ", 1)[1])
                     for line in result.stdout.splitlines() if "PROBE " in line),
                    key=lambda p: p["rank"])
    assert [(p["rank"], p["world_size"], p["sum"]) for p in probes] == [(0, 2, 3.0), (1, 2, 3.0)]
    assert probes[0]["pid"] != probes[1]["pid"]
    # torchrun ran inside `nanocolossal run`, not as a third process importing torch again
    assert [p["parent"] for p in probes] == [job.proc.pid] * 2


def test_deep_nanocolossal_run_fails_when_a_rank_fails(tmp_path):
    script = tmp_path / "fail_on_rank1.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    result = run_cmd([sys.executable, "-m", "nanocolossal.run", "--nproc_per_node", "2",
                      "--master_port", str(free_port()), str(script)], timeout=90)
    assert result.returncode == 1, result.stdout
    # torchrun's failure table, without a traceback of the launcher itself
    assert re.search(r"rank\s*:\s*1 .*\n.*exitcode\s*:\s*3", result.stdout), result.stdout
    assert "Traceback" not in result.stdout, result.stdout


def _dry_run(capsys, *argv) -> list[list[str]]:
    assert main(["run", "--dry-run", *argv]) == 0
    return [shlex.split(line) for line in capsys.readouterr().out.splitlines()]


def test_dry_run_single_node_is_torchrun(capsys):
    [cmd] = _dry_run(capsys, "--nproc_per_node", "4", "--master_port", "29505", "train.py", "--lr",
                     "0.1")
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--nproc_per_node=4" in cmd and "--master_port=29505" in cmd and "--nnodes=1" in cmd
    assert cmd[-3:] == ["train.py", "--lr", "0.1"]


def _remote(cmd: list[str]) -> tuple[str, list[str]]:
    """(host, torchrun argv) from `ssh host 'cd DIR && python -m torch.distributed.run ...'`."""
    assert cmd[0] == "ssh"
    cd, remote = cmd[2].split(" && ", 1)
    assert cd.startswith("cd ")
    return cmd[1], shlex.split(remote)


def test_dry_run_two_hosts_makes_one_ssh_command_per_node(capsys):
    commands = _dry_run(capsys, "--nproc_per_node", "4", "--host", "host1,host2", "--master_addr",
                        "host1", "train.py", "--epochs", "2")
    assert len(commands) == 2
    for node_rank, (cmd, host) in enumerate(zip(commands, ["host1", "host2"])):
        got_host, argv = _remote(cmd)
        assert got_host == host
        for flag in ["--nproc_per_node=4", "--nnodes=2", f"--node_rank={node_rank}",
                     "--master_addr=host1"]:
            assert flag in argv
        assert argv[-3:] == ["train.py", "--epochs", "2"]


def test_dry_run_hostfile_with_include_and_exclude(tmp_path, capsys):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# our cluster\nnode1\nnode2  # flaky GPU\n\nnode3\nnode4\n")
    common = ["--nproc_per_node", "2", "--hostfile", str(hostfile), "--master_addr", "node1"]
    assert [_remote(c)[0] for c in _dry_run(capsys, *common,
                                            "t.py")] == ["node1", "node2", "node3", "node4"]
    included = _dry_run(capsys, *common, "--include", "node1,node3", "t.py")
    assert [_remote(c)[0] for c in included] == ["node1", "node3"]
    assert "--nnodes=2" in _remote(included[1])[1] and "--node_rank=1" in _remote(included[1])[1]
    excluded = _dry_run(capsys, *common, "--exclude", "node2", "t.py")
    assert [_remote(c)[0] for c in excluded] == ["node1", "node3", "node4"]


@pytest.mark.parametrize("args, message", [
    (["--host", "h1,h2", "--master_addr", "localhost"],
     "--master_addr localhost cannot be reached"),
    (["--host", "h1,h2", "--master_addr", "127.0.0.1"],
     "--master_addr 127.0.0.1 cannot be reached"),
    (["--host", "h1,h2"], "several hosts need --master_addr"),
    (["--host", "h1,h1", "--master_addr", "h1"], "lists a host twice"),
    (["--include", "h1"], "--include/--exclude need --hostfile"),
    (["--hostfile", "HOSTS", "--include", "node9", "--master_addr", "node1"],
     r"--include names \['node9'\]"),
    (["--hostfile", "HOSTS", "--include", "node1", "--exclude", "node2"],
     "either --include or --exclude"),
    (["--hostfile", "HOSTS", "--exclude", "node1,node2", "--master_addr", "node1"],
     "no hosts left"),
    (["--hostfile", "MISSING"], "cannot read hostfile"),
    (["--hostfile", "DUPLICATE"], "host 'node1' is listed twice"),
    (["--hostfile", "EMPTY"], "lists no hosts"),
    (["--hostfile", "SLOTS"], "expected one host name per line"),
])
def test_run_bad_arguments_are_clear_errors(tmp_path, args, message):
    files = {"HOSTS": "node1\nnode2\n", "DUPLICATE": "node1\nnode1\n", "EMPTY": "# nothing\n",
             "SLOTS": "node1 slots=4\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    args = [str(tmp_path / a) if a in (*files, "MISSING") else a for a in args]
    with pytest.raises(SystemExit, match=message):
        main(["run", "--nproc_per_node", "2", *args, "--dry-run", "train.py"])


def test_run_module_is_runnable_and_documented():
    result = run_cmd([sys.executable, "-m", "nanocolossal.run", "--help"], timeout=60)
    assert (
        result.returncode == 0
        and "--nproc_per_node" in result.stdout
        and "--hostfile" in result.stdout
    )
