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


def test_every_file_by_idea_names_files_that_exist_with_their_line_counts():
    """docs/files.md, every file in reading order, is how a learner finds the rest of the code:
    every file it names exists and has the number of lines it states (a name without a folder
    is in the row's last named folder, or at the top). Regenerate the counts with `wc -l`."""
    package = ROOT / "nanocolossal"
    lines = (ROOT / "docs" / "files.md").read_text().splitlines()
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


def _span(path: Path, name: str) -> int:
    """Lines of top-level function or class `name` (or `Class.method`) in `path`, decorators,
    def and docstring included; `__doc__`: the module's docstring."""
    import ast
    body = ast.parse(path.read_text()).body
    if name == "__doc__":
        return body[0].end_lineno - body[0].lineno + 1
    node = None
    for part in name.split("."):
        node = next((n for n in body if getattr(n, "name", None) == part), None)
        assert node is not None, f"README's first reading names {name}, not in {path.name}"
        body = node.body
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    return node.end_lineno - first + 1


def test_the_first_reading_names_functions_that_exist_with_their_line_counts():
    """The README's first reading, the book: each row names the functions and classes to read
    (`file.py`: `name`, `Class.method`; files apart by ';'), with their lines (a test checks
    them: regenerate from this test's message); all of it at most about 2,500 lines."""
    package = ROOT / "nanocolossal"
    lines = (ROOT / "README.md").read_text().splitlines()
    rows = lines[lines.index("| step | read | lines | what it teaches |") + 2:]
    counted_rows, total = [], 0
    for row in rows:
        if not row.startswith("| "):
            break
        _, read, stated = row.split(" | ")[:3]
        counted, folder = 0, ""
        for part in read.split("; "):  # a file without a folder: in the row's last named one
            file, *names = re.findall(r"`([^`]+)`", part)
            if "/" in file:
                folder = str(Path(file).parent)
            elif folder and (package / folder / file).exists():
                file = f"{folder}/{file}"
            counted += sum(_span(package / file, name) for name in names)
        counted_rows.append((read, int(stated), counted))
        total += counted
    wrong = [(read, stated, counted) for read, stated, counted in counted_rows if stated != counted]
    assert not wrong, f"stated, counted: {wrong}"
    assert len(counted_rows) >= 10 and total <= 2600, (len(counted_rows), total)


def _import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its text: at the top, inside a
    function, or for annotations alone under TYPE_CHECKING (a circle is a circle to a reader)."""
    import ast
    modules = {".".join(f.relative_to(package.parent).with_suffix("").parts)
               .removesuffix(".__init__"): f for f in package.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, file in modules.items():
        here = name if file.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom):
                depth = len(here.split(".")) - node.level + 1
                parts = here.split(".")[:depth] if node.level else []
                target = ".".join(parts + ([node.module] if node.module else []))
                for alias in node.names:  # a submodule named, or a name from a module
                    edges.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules
                              else target)
            elif isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names)
        graph[name] = {e for e in edges if e in modules and e != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(component) > 1:
                found.append(sorted(component))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_package_imports_without_a_circle():
    """Every module imports in one direction (zero/optimizer.py -> checkpoint/zero.py,
    formulas.py -> plan/ranks.py, never back), function-level and type-only imports included."""
    assert _circles(_import_graph(ROOT / "nanocolossal")) == []
