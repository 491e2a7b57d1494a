"""Plant each bug of mutations.py in a copy of the repository and run the tests meant to catch it.

    python tests/mutations/run.py                       # every mutation
    python tests/mutations/run.py --only ddp-no-mean    # some of them
    python tests/mutations/run.py --json out.json       # also write the results
    python tests/mutations/run.py --baseline            # the same tests, nothing planted

For each mutation the repository (nanocolossal/, tests/, the scripts and configs the tests
import; not .git, .venv or data) is copied into a fresh temporary folder, `old` is replaced by
`new` there (a mutation whose `old` is not found exactly once is STALE: the code moved on, fix
the table), and `python -m pytest -x -q -n 0 -p no:cacheprovider <tests>` runs in that folder with
PYTHONPATH pointing at it, under a wall-clock limit. The working tree is never touched.

    CAUGHT   the tests failed: the suite notices this bug
    MISSED   the tests passed: a gap (write the test), or an equivalent mutation (replace it)
    TIMEOUT  the tests ran past the limit (a hang is noticed, but slowly: prefer a failure)
    STALE    `old` not found exactly once
    NOTESTS  the selection collected no test (a renamed test: fix the table)
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))

from mutations import MUTATIONS  # noqa: E402

IGNORE = shutil.ignore_patterns(".git", ".venv", "build", "dist", "data", "__pycache__",
                                "*.egg-info", ".pytest_cache", "*.pt", "mutations", ".whl")


def copy_repo(dest: Path) -> None:
    """The repository as the tests see it, without history, environments or the mutations."""
    shutil.copytree(ROOT, dest, ignore=IGNORE, dirs_exist_ok=True)


def plant(repo: Path, mutation: dict) -> str | None:
    """Apply the substitution in `repo`; an error message if `old` is not there exactly once."""
    path = repo / mutation["file"]
    if not path.is_file():
        return f"{mutation['file']} does not exist"
    text = path.read_text()
    found = text.count(mutation["old"])
    if found != 1:
        return f"`old` found {found} times in {mutation['file']}"
    path.write_text(text.replace(mutation["old"], mutation["new"]))
    return None


def first_failure(output: str) -> str:
    """The first test pytest reports as failed or errored (or the collection error)."""
    for line in output.splitlines():
        m = re.match(r"(FAILED|ERROR) (.+?)(?: - |$)", line)  # (a parameter id may hold spaces)
        if m:
            return m.group(2)
    return ""


def run_tests(repo: Path, tests: list[str], limit: float) -> tuple[str, float, str, str]:
    """(status, seconds, catching test, output tail) of pytest on `tests` inside `repo`."""
    env = dict(os.environ, PYTHONPATH=str(repo), PYTHONDONTWRITEBYTECODE="1")
    argv = [sys.executable, "-m", "pytest", "-x", "-q", "-n", "0", "-p", "no:cacheprovider",
            *tests]  # (-n 0: in order, in one process; the first failure is the catching test)
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=repo, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=limit)
        status = {0: "MISSED", 5: "NOTESTS"}.get(proc.returncode, "CAUGHT")
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # pytest, its fork server and the pooled ranks
        output, _ = proc.communicate()
        status = "TIMEOUT"
    seconds = time.monotonic() - start
    return status, seconds, first_failure(output) if status == "CAUGHT" else "", output[-3000:]


def run_one(mutation: dict, limit: float, baseline: bool) -> dict:
    result = {k: mutation[k] for k in ("id", "idea", "file", "bug")}
    result["tests"] = mutation["tests"]
    with tempfile.TemporaryDirectory(prefix="nc-mutation-") as tmp:
        repo = Path(tmp)
        copy_repo(repo)
        problem = plant(repo, mutation)
        if problem:
            return {**result, "status": "STALE", "seconds": 0.0, "caught_by": "",
                    "output": problem}
        if baseline:  # the same copy, the bug taken out again
            copy_repo(repo)
        status, seconds, caught_by, output = run_tests(repo, mutation["tests"], limit)
    if baseline:
        status = {"MISSED": "PASSES", "CAUGHT": "FAILS"}.get(status, status)
    return {**result, "status": status, "seconds": round(seconds, 1), "caught_by": caught_by,
            "output": output}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="ID", help="run these mutations only")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per mutation")
    parser.add_argument("--baseline", action="store_true",
                        help="run each mutation's tests with nothing planted (they must pass)")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    args = parser.parse_args()

    chosen = MUTATIONS
    if args.only:
        unknown = set(args.only) - {m["id"] for m in MUTATIONS}
        if unknown:
            parser.error(f"unknown mutation(s): {', '.join(sorted(unknown))}")
        chosen = [m for m in MUTATIONS if m["id"] in args.only]
    if args.list:
        for m in chosen:
            print(f"{m['id']:28} {m['idea']:22} {m['file']}")
        return 0

    results, start = [], time.monotonic()
    for i, mutation in enumerate(chosen, 1):
        result = run_one(mutation, args.timeout, args.baseline)
        results.append(result)
        print(f"[{i:2}/{len(chosen)}] {result['status']:8} {result['seconds']:6.1f} s  "
              f"{result['id']:28} {result['caught_by']}", flush=True)
        if args.json:  # after each one: a long run interrupted keeps what it found
            Path(args.json).write_text(json.dumps(results, indent=1))
    total = time.monotonic() - start

    print(f"\n{'id':28} {'idea':22} {'status':8} {'s':>6}  caught by")
    for r in results:
        print(f"{r['id']:28} {r['idea']:22} {r['status']:8} {r['seconds']:6.1f}  {r['caught_by']}")
    counts: dict[str, int] = {}
    for r in results:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    print(f"\n{len(results)} mutations: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
          + f"; {total:.0f} s")
    for r in results:
        if r["status"] not in ("CAUGHT", "PASSES"):
            print(f"\n--- {r['id']} ({r['status']}) ---\n{r['output'][-1500:]}")
    good = {"PASSES"} if args.baseline else {"CAUGHT"}
    return 0 if all(r["status"] in good for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
