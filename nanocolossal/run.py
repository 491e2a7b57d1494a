"""`nanocolossal run`: start a job on one node or many with a single command.

torchrun must be started once on *every* node, each told its --node_rank. This wrapper does that:

    nanocolossal run --nproc_per_node 4 train.py                  # this node, 4 processes
    nanocolossal run --nproc_per_node 4 --host h1,h2 --master_addr h1 train.py
    nanocolossal run --nproc_per_node 4 --hostfile hosts --master_addr h1 --exclude h2 train.py

One node: torchrun's own entry point (what `python -m torch.distributed.run` calls) runs in
this process, and its outcome is our exit code. Several
nodes: one `ssh host 'cd $PWD && python -m torch.distributed.run --nnodes K --node_rank i ...'`
per node, all started at once; if one fails the rest are stopped.
`--dry-run` prints the commands instead. The scripts call `launch_from_torch`. `nanocolossal plan
...` (before a launch: will it fit?) is plan/cli.py's, which imports no torch.

A hostfile lists one host name per line (blank lines and `# comments` are ignored).
"""
from __future__ import annotations

import argparse
import os
import shlex
import socket
import subprocess
import sys
import time
from typing import Optional, Sequence

LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nanocolossal run",
                                description="Launch a distributed training script.")
    p.add_argument("--nproc_per_node", type=int, required=True, help="processes (GPUs) per node")
    p.add_argument("--master_addr", help="rank-0 node (required with several hosts)")
    p.add_argument("--master_port", type=int, default=29500, help="free port on the rank-0 node")
    hosts = p.add_mutually_exclusive_group()
    hosts.add_argument("--host", help="comma-separated host names")
    hosts.add_argument("--hostfile", help="file with one host name per line")
    p.add_argument("--include", help="with --hostfile: use only these hosts")
    p.add_argument("--exclude", help="with --hostfile: leave out these hosts")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("script", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return p


def _names(text: str) -> list[str]:
    return [h.strip() for h in text.split(",") if h.strip()]


def parse_hostfile(path: str) -> list[str]:
    """Host names, one per line; '#' starts a comment. Duplicates and empty files are errors."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise SystemExit(f"nanocolossal run: cannot read hostfile {path!r}: {e.strerror}")
    hosts = []
    for number, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if len(line.split()) != 1:
            raise SystemExit(f"nanocolossal run: {path}:{number}: expected one host name per line, "
                             f"got {line!r}")
        if line in hosts:
            raise SystemExit(f"nanocolossal run: {path}:{number}: host {line!r} is listed twice")
        hosts.append(line)
    if not hosts:
        raise SystemExit(f"nanocolossal run: hostfile {path!r} lists no hosts")
    return hosts


def select_hosts(args: argparse.Namespace) -> list[str]:
    """The hosts to run on, after --include/--exclude; [] means this node only."""
    if (args.include or args.exclude) and not args.hostfile:
        raise SystemExit("nanocolossal run: --include/--exclude need --hostfile")
    if args.include and args.exclude:
        raise SystemExit("nanocolossal run: use either --include or --exclude, not both")
    if args.host:
        hosts = _names(args.host)
        if len(set(hosts)) != len(hosts):
            raise SystemExit(f"nanocolossal run: --host lists a host twice: {args.host}")
        return hosts
    if not args.hostfile:
        return []
    hosts = parse_hostfile(args.hostfile)
    for flag in ("include", "exclude"):
        chosen = _names(getattr(args, flag) or "")
        unknown = [h for h in chosen if h not in hosts]
        if unknown:
            raise SystemExit(f"nanocolossal run: --{flag} names {unknown}, which are not in "
                             f"{args.hostfile} ({hosts})")
        if chosen:
            hosts = [h for h in hosts if (h in chosen) == (flag == "include")]
    if not hosts:
        raise SystemExit("nanocolossal run: no hosts left after --include/--exclude")
    return hosts


def torchrun_args(args: argparse.Namespace, nnodes: int = 1, node_rank: int = 0) -> list[str]:
    master = args.master_addr or "127.0.0.1"
    return ["-m", "torch.distributed.run", f"--nproc_per_node={args.nproc_per_node}",
            f"--nnodes={nnodes}", f"--node_rank={node_rank}", f"--master_addr={master}",
            f"--master_port={args.master_port}", args.script, *args.script_args]


def build_commands(args: argparse.Namespace) -> list[list[str]]:
    """One argv per node: torchrun locally, or ssh + torchrun for each remote host."""
    if args.nproc_per_node < 1:
        raise SystemExit(f"nanocolossal run: --nproc_per_node {args.nproc_per_node}: must be >= 1")
    hosts = select_hosts(args)
    if len(hosts) <= 1 and all(h in LOCAL_NAMES or h == socket.gethostname() for h in hosts):
        return [[sys.executable, *torchrun_args(args)]]
    if len(hosts) > 1:
        if not args.master_addr:
            raise SystemExit("nanocolossal run: several hosts need --master_addr <one of them> "
                             "(the rank-0 node)")
        if args.master_addr in LOCAL_NAMES or args.master_addr.startswith("127."):
            raise SystemExit(f"nanocolossal run: --master_addr {args.master_addr} cannot be "
                             f"reached from the other hosts; give the rank-0 node's name or IP "
                             f"address (e.g. {hosts[0]})")
    elif not args.master_addr:
        args.master_addr = hosts[0]
    cwd = os.getcwd()
    commands = []
    for node_rank, host in enumerate(hosts):
        remote = shlex.join([sys.executable, *torchrun_args(args, len(hosts), node_rank)])
        commands.append(["ssh", host, f"cd {shlex.quote(cwd)} && {remote}"])
    return commands


def run_commands(commands: list[list[str]]) -> int:
    """Run them all at once; if one fails, stop the others. Returns the first failure's code."""
    procs = [subprocess.Popen(cmd) for cmd in commands]
    code = 0
    try:
        while any(p.poll() is None for p in procs):
            failed = [p for p in procs if p.returncode not in (None, 0)]
            if failed:
                code = failed[0].returncode
                break
            time.sleep(0.2)
    except KeyboardInterrupt:
        code = 130
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
    return code or next((p.returncode for p in procs if p.returncode), 0)


def run_here(torchrun_argv: list[str]) -> int:
    """torchrun in this process: a child `python -m torch.distributed.run` would spend two
    seconds importing torch again before starting a worker. 0, 1 if a worker failed, or
    128 + the signal that stopped the job."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun
    try:
        torchrun(torchrun_argv)
    except ChildFailedError as e:  # torchrun's table of which rank failed, and how
        print(e, file=sys.stderr)
        return 1
    except SignalException as e:
        return 128 + int(e.sigval)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plan"]:  # `nanocolossal plan ...`: bytes, traffic and bubble (plan/)
        from .plan import main as plan
        return plan(argv[1:])
    if argv[:1] == ["run"]:  # `nanocolossal run ...` and `python -m nanocolossal.run ...` both work
        argv = argv[1:]
    args = build_parser().parse_args(argv)
    commands = build_commands(args)
    if args.dry_run:
        for cmd in commands:
            print(shlex.join(cmd))
        return 0
    if len(commands) == 1 and commands[0][:3] == [sys.executable, "-m", "torch.distributed.run"]:
        return run_here(commands[0][3:])
    return run_commands(commands)


if __name__ == "__main__":
    sys.exit(main())
