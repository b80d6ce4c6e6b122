"""The mutants of scripts/mutation_check.py: realistic one-line bugs where mutmut cannot plant one.

Generated mutants come from mutmut (see docs/contributing.md, "Mutation testing"). mutmut 3 does not mutate
decorated functions (context managers such as capture's hooks and run isolation, properties, hook
implementations), module or class-level code, or code that only runs in child processes; the mutants below
sit there. Each replaces one exact snippet (it must occur exactly once in its module) and names the tests
that must fail, fastest first: `pytest -x` stops at the first failure.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    module: str
    find: str
    replace: str
    why: str
    tests: tuple[str, ...] = ()


def tests_for(mutant: Mutant) -> list[str]:
    """The mutant's test files that exist, in order."""
    return [t for t in mutant.tests if (ROOT / t).exists()]


def _m(module: str, find: str, replace: str, why: str, *tests: str) -> Mutant:
    return Mutant(f"pytest_precision/{module}", find, replace, why, tuple(tests))


MUTANTS: list[Mutant] = [
    _m(
        "engine/capture.py",
        "if trace.forward is None and finite_in and not _all_finite(output):",
        "if trace.forward is None and not _all_finite(output):",
        "non-finite origin blamed on a module whose inputs were non-finite",
        "tests/engine/test_run_isolation.py",
        "tests/engine/test_compare.py",
        "tests/engine/test_repeats_and_nonfinite.py",
        "tests/engine/test_models_that_work.py",
        "tests/engine/test_language_models.py",
    ),
    _m(
        "engine/variants.py",
        'return "float32" if self.autocast else self.dtype',
        "return self.dtype",
        "autocast casts weights",
        "tests/engine/test_variants.py",
        "tests/engine/test_compare.py",
    ),
    _m(
        "gate/tolerance.py",
        "return math.isinf(self.rtol) or math.isinf(self.atol)",
        "return math.isinf(self.rtol) and math.isinf(self.atol)",
        "rtol=inf alone not unbounded",
        "tests/gate/test_tolerance.py",
        "tests/gate/test_gate_rules.py",
        "tests/plugin/test_plugin_gate.py",
        "tests/plugin/test_plugin_gate_trust.py",
    ),
    _m(
        "engine/isolation.py",
        "        stack.enter_context(torch.inference_mode(False))\n",
        "",
        "the caller's inference_mode leaks into the runs",
        "tests/engine/test_run_isolation.py",
        "tests/engine/test_compare.py",
        "tests/engine/test_repeats_and_nonfinite.py",
    ),
    _m(
        "engine/isolation.py",
        "                stack.enter_context(torch.autocast(device_type=device_type, enabled=False))",
        "                pass",
        "the caller's autocast leaks into the runs",
        "tests/engine/test_run_isolation.py",
        "tests/engine/test_compare.py",
        "tests/engine/test_repeats_and_nonfinite.py",
    ),
    _m(
        "engine/isolated.py",
        "                return _placed(args, kwargs, slot, alias)",
        "                return None",
        "bw_isolated measured against the whole gradient at the input, residual path included",
        "tests/engine/test_isolated_error.py",
    ),
    _m(
        "engine/compare.py",
        '            absent = (LOGITS_KIND,) if variant.arrangement is None else (LOGITS_KIND, "loss", *GRADIENT_KINDS)',
        "            absent = (LOGITS_KIND,)",
        "an arrangement variant reports its (never computed) backward rows as missing",
        "tests/engine/test_arrangements.py",
        "tests/engine/test_compare.py",
    ),
    _m(
        "plugin/__init__.py",
        "        if stale and not precision_session.prune and (precision_session.fail_stale or precision_session.strict):",
        "        if stale and not precision_session.prune and precision_session.fail_stale:",
        "--precision-strict does not fail on stale baselines",
        "tests/plugin/test_plugin_review_workflow.py",
    ),
    _m(
        "engine/reference_run.py",
        '        runner.progress = RunProgress(progress, reference_variant.name, "reference", 1, progress_total)',
        '        runner.progress = RunProgress(progress, reference_variant.name, "variant", 1, progress_total)',
        "the reference run is announced as a variant",
        "tests/engine/test_progress.py",
    ),
    _m(
        "reports/environment.py",
        '    status = git("status", "--porcelain", "--untracked-files=no")',
        '    status = git("status", "--porcelain")',
        "untracked files (a new baseline not yet added) make the checkout dirty",
        "tests/plugin/test_plugin_review_workflow.py",
    ),
]
