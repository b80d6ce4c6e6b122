"""Mutation check of the test suite: plant one realistic one-line bug at a time, see whether a test fails.

    python scripts/mutation_check.py                 # every mutant in scripts/mutants.py
    python scripts/mutation_check.py --only 3 17     # some of them, by number
    python scripts/mutation_check.py --list          # what each mutant plants, and the tests it runs

Each mutant replaces one exact snippet of a module (it must occur exactly once, or the mutant is reported
stale) in a copy of the working tree under a temporary folder, then runs the mutant's tests there with
`pytest -x`. A mutant is killed when pytest exits non-zero; it survived when every selected test passed.
The working tree itself is never modified. Run by hand (it takes minutes); the score goes in the notes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from mutants import MUTANTS, Mutant, tests_for  # noqa: E402


@dataclass(frozen=True)
class Outcome:
    mutant: Mutant
    verdict: str  # killed, survived, timeout, stale
    seconds: float
    detail: str = ""


def copy_tree(destination: Path) -> None:
    """The tracked and untracked-but-not-ignored files of the working tree, copied to `destination`."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True, capture_output=True
    ).stdout.split(b"\0")
    for raw in listed:
        if not raw:
            continue
        relative = Path(os.fsdecode(raw))
        source = ROOT / relative
        if not source.is_file():
            continue
        target = destination / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)


def run_mutant(tree: Path, mutant: Mutant, workers: int, timeout: float) -> Outcome:
    path = tree / mutant.module
    original = path.read_text(encoding="utf-8")
    count = original.count(mutant.find)
    if count != 1:
        return Outcome(mutant, "stale", 0.0, f"snippet found {count} times")
    path.write_text(original.replace(mutant.find, mutant.replace, 1), encoding="utf-8")
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests_for(mutant)]
    if workers > 1:
        command += ["-n", str(workers)]
    environment = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    started = time.monotonic()
    try:
        result = subprocess.run(command, cwd=tree, env=environment, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Outcome(mutant, "timeout", time.monotonic() - started)
    finally:
        path.write_text(original, encoding="utf-8")
    seconds = time.monotonic() - started
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    last = lines[-1] if lines else result.stderr.strip()[-200:]
    if result.returncode == 0:
        return Outcome(mutant, "survived", seconds, last)
    failed = next((line for line in lines if line.startswith(("FAILED", "ERROR"))), last)
    return Outcome(mutant, "killed", seconds, failed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", type=int, nargs="*", help="mutant numbers to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("-n", "--workers", type=int, default=2, help="pytest-xdist workers per mutant (default 2)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per mutant (default 600)")
    arguments = parser.parse_args(argv)
    chosen = [(i, m) for i, m in enumerate(MUTANTS, 1) if not arguments.only or i in arguments.only]
    if arguments.list:
        for index, mutant in chosen:
            print(f"{index:3d} {mutant.module}: {mutant.why}\n      tests: {' '.join(tests_for(mutant))}")
        return 0
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="precision-mutation-") as folder:
        tree = Path(folder)
        copy_tree(tree)
        for index, mutant in chosen:
            outcome = run_mutant(tree, mutant, arguments.workers, arguments.timeout)
            outcomes.append(outcome)
            print(f"{index:3d} {outcome.verdict:8s} {outcome.seconds:6.1f}s  {mutant.module}: {mutant.why}", flush=True)
            if outcome.verdict != "killed":
                print(f"      {outcome.detail}", flush=True)
    counted = [o for o in outcomes if o.verdict != "stale"]
    killed = sum(o.verdict in ("killed", "timeout") for o in counted)
    stale = len(outcomes) - len(counted)
    score = 100.0 * killed / len(counted) if counted else 0.0
    print(f"\nmutation score: {killed} / {len(counted)} killed ({score:.1f}%)" + (f"; {stale} stale" if stale else ""))
    for outcome in counted:
        if outcome.verdict == "survived":
            print(f"  survived: {outcome.mutant.module}: {outcome.mutant.why}")
    return 0 if killed == len(counted) and not stale else 1


if __name__ == "__main__":
    sys.exit(main())
