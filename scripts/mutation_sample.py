"""A random sample of mutmut's generated mutants, run and scored (docs/contributing.md, "Mutation testing").

    OMP_NUM_THREADS=1 python scripts/mutation_sample.py --sample 300 --seed 34
    python scripts/mutation_sample.py --report          # the verdicts of the last sample, without running

mutmut 3 mutates every module of `[tool.mutmut] only_mutate` in pyproject.toml, but running every mutant of a
large set takes hours on 2 cores. This script lets mutmut generate them all and collect which tests reach each
function (`mutmut run` with a filter that matches nothing does both and stops), draws a seeded random sample of
the mutant names, runs only those (`mutmut run NAME ...`), and prints the sample's verdicts per module with the
survivors' names (`mutmut show NAME` prints one's diff). The sample and its verdicts are saved in
mutants/sample.json, so `--report` after a re-run of the survivors (`mutmut run NAME ...`, once tests are added)
scores the same mutants, each by its newest verdict.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MUTANTS = ROOT / "mutants"
SAMPLE_FILE = MUTANTS / "sample.json"
#: mutmut's exit-code verdicts (mutmut.stats.status_by_exit_code), the ones a run of ours can give.
VERDICTS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped", 36: "timeout"}
NOTHING = "__generate_only__"


def _mutmut(*args: str) -> int:
    """Run mutmut from the repository root with OpenMP at one thread (torch's pool deadlocks in forked workers)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    mutmut = Path(sys.executable).with_name("mutmut")
    return subprocess.call([str(mutmut), *args], cwd=ROOT, env=env)


def _meta_files() -> list[Path]:
    return sorted(MUTANTS.rglob("*.py.meta"))


def all_mutants() -> dict[str, tuple[str, int | None]]:
    """Every generated mutant name -> (its module, its exit code: None when not run yet)."""
    found: dict[str, tuple[str, int | None]] = {}
    for meta in _meta_files():
        module = str(meta.relative_to(MUTANTS).with_suffix(""))
        for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
            found[name] = (module, code)
    return found


def generate() -> None:
    """Generate every mutant and collect mutmut's test statistics; the filter matches no mutant, so none runs."""
    _mutmut("run", NOTHING)  # exits non-zero on purpose after generating ("nothing matches")
    if not _meta_files():
        sys.exit("mutmut generated no mutants: check [tool.mutmut] in pyproject.toml")
    if not (MUTANTS / "mutmut-stats.json").is_file():
        sys.exit("mutmut could not collect its test statistics (a selected test failed in mutants/: see above)")


def draw(size: int, seed: int) -> list[str]:
    names = sorted(all_mutants())
    sample = sorted(random.Random(seed).sample(names, min(size, len(names))))
    SAMPLE_FILE.write_text(json.dumps({"seed": seed, "population": len(names), "sample": sample}, indent=1))
    return sample


def report() -> int:
    saved = json.loads(SAMPLE_FILE.read_text())
    mutants = all_mutants()
    by_module: dict[str, Counter[str]] = defaultdict(Counter)
    survivors: list[str] = []
    # mutmut forgets every verdict when its configuration changes (a test file added to the selection): the
    # verdicts of earlier runs are kept in the sample file, and a mutant's newest verdict wins.
    kept: dict[str, str] = saved.setdefault("verdicts", {})
    for name in saved["sample"]:
        module, code = mutants.get(name, ("(gone)", None))
        verdict = kept.get(name, "not run") if code is None else VERDICTS.get(code, "suspicious")
        kept[name] = verdict
        by_module[module][verdict] += 1
        if verdict in ("survived", "no tests", "suspicious", "not run"):
            survivors.append(f"{verdict:9} {name}")
    total: Counter[str] = Counter()
    print(f"sample of {len(saved['sample'])} from {saved['population']} mutants (seed {saved['seed']})")
    for module, counts in sorted(by_module.items()):
        total.update(counts)
        print(f"  {module:40} " + ", ".join(f"{v} {n}" for v, n in sorted(counts.items())))
    scored = total["killed"] + total["timeout"] + total["survived"] + total["no tests"] + total["suspicious"]
    killed = total["killed"] + total["timeout"]
    print(f"total: {dict(total)}; killed {killed} / {scored} ({100 * killed / max(scored, 1):.1f}%)")
    print("\n".join(survivors))
    SAMPLE_FILE.write_text(json.dumps(saved, indent=1))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sample", type=int, default=300, help="how many mutants to draw (default 300)")
    parser.add_argument("--seed", type=int, default=34, help="the draw's seed (default 34)")
    parser.add_argument("--report", action="store_true", help="print the last sample's verdicts; run nothing")
    args = parser.parse_args()
    if args.report:
        return report()
    generate()
    sample = draw(args.sample, args.seed)
    _mutmut("run", *sample)
    return report()


if __name__ == "__main__":
    sys.exit(main())
