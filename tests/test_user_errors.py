"""A user error ends a script with its message alone, one line per rank; a bug keeps its traceback.

The script tests run `python -m script` as a launcher test does (BackgroundCmd: forked from the
rank server, which then hands an uncaught error to sys.excepthook and exits 1, as the
interpreter does): the hook, which does this, runs only when an error leaves a program.
"""
import os
import subprocess
import sys
import textwrap

import pytest
from dist_helpers import BackgroundCmd, free_port

from nanocolossal import launch_checks
from nanocolossal.config import ConfigError, MissingKeyError
from nanocolossal.launch_checks import LaunchError

pytestmark = pytest.mark.timeout(60)

LAUNCH = "nc.launch({config}, rank=0, world_size=1, host='127.0.0.1', port={port})"


def _run(tmp_path, body: str) -> subprocess.CompletedProcess:
    """Run `body` as a script of one rank in tmp_path, where x.py is a config without NUM_EPOCHS;
    its output (stdout and stderr together) is returned as `stderr`."""
    (tmp_path / "x.py").write_text("BATCH_SIZE = 8\n")
    (tmp_path / "script.py").write_text("import nanocolossal as nc\n" + textwrap.dedent(body))
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    result = BackgroundCmd([sys.executable, "-m", "script"], env, tmp_path).finish(50)
    return subprocess.CompletedProcess(result.args, result.returncode, "", result.stdout)


@pytest.mark.parametrize("body, message", [
    (LAUNCH.format(config="dict(parallel=dict(pipeline=2))", port="{port}"),
     "[rank 0] world size 1 is not divisible by pipeline x tensor = 2 x 1 = 2; launch a multiple "
     "of 2 processes or change parallel"),
    # as the scripts do: the config is loaded (and checked) before launch
    ("cfg = nc.load_config(dict(parallel=dict(tensor=dict(size=2, mode='2d'))))\n"
     + LAUNCH.format(config="cfg", port="{port}"),
     "[rank 0] parallel.tensor size 2 is not a perfect square, which mode='2d' needs (a q x q "
     "grid); use size 1 or 4"),
    (LAUNCH.format(config="'x.py'", port="{port}") + "\nprint(nc.gpc.config.NUM_EPOCHS)\n",
     "[rank 0] x.py has no NUM_EPOCHS: add e.g. NUM_EPOCHS = 10"),
    # a size the layers cannot split is refused alike, at load (here) or when the model is built
    ("nc.load_config(dict(SEQ_LEN=6, parallel=dict(tensor=dict(size=2, mode='sequence'))))\n",
     "[rank 0] sequence length SEQ_LEN = 6 does not split into 2 x 2 zig-zag stripes for 2 "
     "sequence-parallel ranks; use a multiple of 4 (nearest: 4, 8)"),
], ids=["world-not-divisible", "2d-not-square", "missing-key", "ring-seq-len"])
def test_gloo_user_error_ends_in_one_line_without_traceback(tmp_path, body, message):
    result = _run(tmp_path, body.format(port=free_port()))
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    # the one line that is the error (the log's INFO lines come before it, on stdout)
    assert [line for line in result.stderr.splitlines() if line.startswith("[rank")] == [message], \
        result.stderr


def test_deep_a_bug_after_launch_keeps_its_traceback(tmp_path):
    result = _run(tmp_path, LAUNCH.format(config="'x.py'", port=free_port()) + "\n1 / 0\n")
    assert result.returncode == 1
    # torch's own hook prefixes each line with the rank
    assert "Traceback" in result.stderr and "ZeroDivisionError" in result.stderr, result.stderr


# -- the hook itself, in this process ---------------------------------------------------------

@pytest.fixture
def hook(monkeypatch):
    """Install the hook over a recorder of what it passes on; the test's end uninstalls it."""
    passed_on = []
    monkeypatch.setattr(sys, "excepthook", lambda *args: passed_on.append(args[0]))
    launch_checks.install_user_error_hook()
    launch_checks.install_user_error_hook()  # twice is once
    yield passed_on
    launch_checks.uninstall_user_error_hook()
    assert sys.excepthook is not launch_checks._print_user_error


def test_user_errors_print_their_rank_and_message_and_bugs_are_passed_on(hook, capsys,
                                                                         monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    for error in (ConfigError("bad"), MissingKeyError("x.py has no A: add e.g. A = 1"),
                  LaunchError("[rank 2] port in use"), ValueError("a bug"), KeyboardInterrupt()):
        sys.excepthook(type(error), error, None)
    assert capsys.readouterr().err.splitlines() == [
        "[rank 0] bad", "[rank 0] x.py has no A: add e.g. A = 1", "[rank 2] port in use"]
    assert hook == [ValueError, KeyboardInterrupt]


def test_before_launch_the_rank_is_the_launchers(hook, capsys, monkeypatch):
    """A script loads its config before launch: under torchrun, RANK says whose error it is."""
    monkeypatch.setenv("RANK", "3")
    sys.excepthook(ConfigError, ConfigError("bad"), None)
    assert capsys.readouterr().err == "[rank 3] bad\n"
