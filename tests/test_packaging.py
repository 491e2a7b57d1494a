"""The package as users install it: a wheel (non-editable) must hold every module.

A hand-written package list once shipped a wheel without nanocolossal/pipeline; the editable
install used in development hid it. Here the wheel is built, installed into a clean venv (no
editable finder, no source tree on the path: torch & co. come from the test venv through a
.pth line) and every module is imported from there.
"""
import os
import pkgutil
import re
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest
from dist_helpers import ROOT

import nanocolossal

pytestmark = pytest.mark.timeout(240)


def _all_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(nanocolossal.__path__, "nanocolossal.")
                  if not m.name.endswith("__main__"))


def test_editable_install_imports_every_module():
    for name in _all_modules():
        __import__(name)
    assert len(_all_modules()) > 15


def test_wheel_in_a_clean_venv_imports_every_module(tmp_path):
    src = tmp_path / "src"  # a copy: setuptools would otherwise reuse a stale build/ of the tree
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", "build",
                                                             "*.egg-info", "__pycache__",
                                                             "data", "bench"))
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(wheels), str(src)], check=True, cwd=tmp_path)
    wheel = next(wheels.glob("nanocolossal-*.whl"))
    env_dir = tmp_path / "clean"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                    "-q", str(wheel)], check=True, cwd=tmp_path)
    site = Path(subprocess.check_output([str(python), "-c",
                                         "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                        text=True).strip())
    (site / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")  # torch, not nanocolossal
    modules = _all_modules()
    code = ("import importlib, nanocolossal, sys\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "print(nanocolossal.__file__)")
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # a checkout on the path
    out = subprocess.run([str(python), "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         env=clean)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(str(site)), (
        f"imported from {out.stdout.strip()}, not the wheel"
    )


def test_the_readme_reading_order_names_files_that_exist_with_their_line_counts():
    """The README's reading order is how a learner finds the code: every file it names exists
    and has the number of lines it states (a name without a folder is in the row's last named
    folder, or at the top). Regenerate the counts with `wc -l` when a file changes."""
    package = ROOT / "nanocolossal"
    lines = (ROOT / "README.md").read_text().splitlines()
    rows = lines[lines.index("| file | lines | what it teaches |") + 2:]
    checked = 0
    for row in rows:
        if not row.startswith("| `"):
            break
        names_cell, counts_cell = row.split(" | ")[:2]
        folder, stated = "", [int(n) for n in counts_cell.split(", ")]
        counted = []
        for name in re.findall(r"`([^`]+)`", names_cell):
            if "/" in name.rstrip("/"):
                folder = str(Path(name).parent)
            elif folder and (package / folder / name).exists():
                name = f"{folder}/{name}"
            path = package / name
            files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
            assert path.exists(), f"README names {name}, which does not exist"
            counted.append(sum(len(f.read_text().splitlines()) for f in files))
        assert counted == stated, f"README row {names_cell}: stated {stated}, counted {counted}"
        checked += 1
    assert checked > 20
