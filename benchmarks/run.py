"""Benchmarks of pytest-precision's overhead: `python benchmarks/run.py [--quick]`.

Prints each benchmark's figure against its target and writes benchmarks/RESULTS.md. Timings are ratios
measured side by side in one process (or one parent process), repetitions interleaved (A, B, A, B, ...)
and medians taken, because the machine may be shared and absolute times mean little.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import importlib
import importlib.util
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from common import SEED, build_model, peak_rss_kib  # noqa: E402  (benchmarks/common.py)

#: The issue's model: a Llama of 8 layers, hidden 256, vocabulary 4096, on 2 x 256 tokens.
FULL = {"layers": 8, "hidden": 256, "intermediate": 688, "heads": 8, "kv_heads": 4, "vocab": 4096, "batch": 2}
FULL_TOKENS = 256
QUICK = {**FULL, "layers": 2, "hidden": 128, "intermediate": 344, "vocab": 1024}
QUICK_TOKENS = 64


@dataclass
class Result:
    name: str
    figure: str
    target: str
    verdict: str  # "met", "MISSED", "n/a"
    notes: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------------------- helpers


def sizes(quick: bool) -> tuple[dict[str, int], int]:
    return (QUICK, QUICK_TOKENS) if quick else (FULL, FULL_TOKENS)


def build_inputs(spec: dict[str, int], tokens: int) -> dict[str, Any]:
    import torch

    generator = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, spec["vocab"], (spec["batch"], tokens), generator=generator)
    return {"input_ids": ids, "labels": ids}


def bare_copy(model: Any, dtype: str) -> Any:
    """A run's model built as compare() builds it: deep copy, floating parameters cast."""
    from pytest_precision.engine.model_build import cast_parameters

    copied = copy.deepcopy(model)
    cast_parameters(copied, dtype)
    copied.eval()
    return copied


def bare_run(model: Any, inputs: dict[str, Any], dtype: str, *, backward: bool = True) -> None:
    import torch

    run_model = bare_copy(model, dtype)
    with torch.set_grad_enabled(backward):
        output = run_model(**inputs)
        if backward:
            output.loss.backward()
    del run_model, output


def interleave(functions: dict[str, Callable[[], Any]], repeats: int, warmup: int = 1) -> dict[str, list[float]]:
    """Time each function `repeats` times, interleaved, after `warmup` untimed rounds; the order alternates
    (A B C, C B A, ...) so that no function always runs right after the same other one.

    Keys: each name (wall-clock seconds), "name (cpu)" (this process's CPU time) and "name (child cpu)" (the
    user + system time of subprocesses it waited for)."""
    times: dict[str, list[float]] = {name: [] for name in functions}
    for round_index in range(warmup + repeats):
        order = list(functions.items())
        for name, function in order if round_index % 2 == 0 else reversed(order):
            gc.collect()
            children = resource.getrusage(resource.RUSAGE_CHILDREN)
            start, cpu_start = time.perf_counter(), time.process_time()
            function()
            elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            if round_index >= warmup:
                times[name].append(elapsed)
                times.setdefault(f"{name} (cpu)", []).append(cpu)
                child = after.ru_utime + after.ru_stime - children.ru_utime - children.ru_stime
                times.setdefault(f"{name} (child cpu)", []).append(child)
    return times


def paired_ratio(times: dict[str, list[float]], numerator: str, denominator: str) -> float:
    """The median over rounds of numerator / denominator within the same round: the two ran back to back, so
    a slow spell of this shared machine moves both, where a ratio of separate medians takes its full swing."""
    return med([a / b for a, b in zip(times[numerator], times[denominator], strict=True)])


def paired_difference(times: dict[str, list[float]], first: str, second: str) -> float:
    """The median over rounds of first - second within the same round (see paired_ratio)."""
    return med([a - b for a, b in zip(times[first], times[second], strict=True)])


def cpu_ratio(times: dict[str, list[float]], numerator: str, denominator: str) -> str:
    """The same ratio on this process's CPU time (all its threads), less sensitive to other processes' load."""
    return f"{med(times[f'{numerator} (cpu)']) / med(times[f'{denominator} (cpu)']):.2f}x"


def med(values: list[float]) -> float:
    return statistics.median(values)


def spread(values: list[float]) -> str:
    return f"median {med(values):.3f} s (min {min(values):.3f}, max {max(values):.3f}, n={len(values)})"


def machine() -> dict[str, str]:
    import torch

    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    import transformers

    return {
        "cpu": cpu,
        "cores (os.cpu_count)": str(os.cpu_count()),
        "cores usable (sched_getaffinity)": str(len(os.sched_getaffinity(0))),
        "load average at start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch intra-op threads": str(torch.get_num_threads()),
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "date (UTC)": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
    }


#: Library functions timed inside compare() (wall time, summed over calls): label -> (module, attribute); an
#: attribute "Class.method" is wrapped on the class. The library is being rewritten: both the old and the new
#: names are listed, and those this checkout lacks are skipped (their rows read "not in this library").
LIBRARY_PARTS = {
    "model build (deepcopy + cast: build_run_model)": ("pytest_precision.engine.compare", "build_run_model"),
    "fp16 loss-scale calibration pass (an extra fp16 run)": (
        "pytest_precision.engine.compare",
        "_calibrate_loss_scale",
    ),
    "reference sink (_ReferenceKeeper.__call__)": ("pytest_precision.engine.compare", "_ReferenceKeeper.__call__"),
    "variant sink (VariantPass.measure)": ("pytest_precision.engine.compare", "VariantPass.measure"),
    "per-tensor metrics (tensor_error, inside the hooks)": ("pytest_precision.engine.compare", "tensor_error"),
    "per-tensor metrics (metrics.tensor_error)": ("pytest_precision.numbers.metrics", "tensor_error"),
    "reference sums (metrics.reference_sums)": ("pytest_precision.engine.compare", "reference_sums"),
    "error sums (metrics.error_sums)": ("pytest_precision.engine.compare", "error_sums"),
    "exact sums (metrics.exact_sums)": ("pytest_precision.engine.compare", "exact_sums"),
    "metrics from the host sums (VariantPass.resolve)": ("pytest_precision.engine.compare", "VariantPass.resolve"),
    "vocabulary KL / top-1 (distribution_stats)": ("pytest_precision.engine.compare", "distribution_stats"),
    "vocabulary KL / top-1 sums (logprobs.distribution_sums)": ("pytest_precision.engine.compare", "distribution_sums"),
    "chosen-token log-probs (chosen_logprobs)": ("pytest_precision.engine.compare", "chosen_logprobs"),
    "log-ratio stats (log_ratio_stats)": ("pytest_precision.engine.compare", "log_ratio_stats"),
    "log-ratio sums (logprobs.log_ratio_sums)": ("pytest_precision.engine.compare", "log_ratio_sums"),
    "host transfer of the run's sums (resolve_pending)": ("pytest_precision.engine.compare", "resolve_pending"),
    "parameter checksum (state_checksum, comparison)": ("pytest_precision.engine.compare", "state_checksum"),
    "parameter checksum (state_checksum, cache key)": ("pytest_precision.engine.references", "state_checksum"),
    "parameter categories (parameter_categories)": ("pytest_precision.engine.compare", "parameter_categories"),
}

#: The parts "where the time goes" adds up (benchmarks 7 and 8): category -> the LIBRARY_PARTS labels in it.
#: A category's time is its functions' own time: minus whatever timed function ran inside them (the sinks
#: minus the metric, log-prob and KL work they call), so the categories do not overlap.
CATEGORIES = {
    "copy (model build: build_run_model)": ["model build (deepcopy + cast: build_run_model)"],
    "hooks (the sinks, excluding the metric / log-prob / KL work inside them)": [
        "reference sink (_ReferenceKeeper.__call__)",
        "variant sink (VariantPass.measure)",
    ],
    "metrics (per-tensor error)": [
        "per-tensor metrics (tensor_error, inside the hooks)",
        "per-tensor metrics (metrics.tensor_error)",
        "reference sums (metrics.reference_sums)",
        "error sums (metrics.error_sums)",
        "exact sums (metrics.exact_sums)",
        "metrics from the host sums (VariantPass.resolve)",
    ],
    "log-probs (chosen-token log-probs, log-ratio stats)": [
        "chosen-token log-probs (chosen_logprobs)",
        "log-ratio stats (log_ratio_stats)",
        "log-ratio sums (logprobs.log_ratio_sums)",
    ],
    "KL / top-1 (full-vocabulary distributions)": [
        "vocabulary KL / top-1 (distribution_stats)",
        "vocabulary KL / top-1 sums (logprobs.distribution_sums)",
    ],
    "host transfer (resolve_pending)": ["host transfer of the run's sums (resolve_pending)"],
}
MODEL_FORWARD = "model forward (incl. fw capture hooks)"
MODEL_BACKWARD = "backward (incl. bw/grad hooks and their metrics)"
HAND_COPY = "hand-written copies (bare_copy)"


@dataclass
class Timings:
    """What timed_parts measured: per label, inclusive seconds, own seconds (inclusive minus the timed calls
    nested inside), calls; and the labels whose function exists in this checkout."""

    inclusive: dict[str, float] = field(default_factory=dict)
    own: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    found: set[str] = field(default_factory=set)


def _resolve(module: str, name: str) -> tuple[Any, str] | None:
    """(owner, attribute) for "module", "attr" or "module", "Class.attr"; None where it does not exist."""
    try:
        owner: Any = importlib.import_module(module)
    except ImportError:
        return None
    *path, attribute = name.split(".")
    for part in path:
        owner = getattr(owner, part, None)
        if owner is None:
            return None
    return (owner, attribute) if hasattr(owner, attribute) else None


@contextlib.contextmanager
def timed_parts(model_class: Any, parts: dict[str, tuple[str, str]], *, hand_written: bool = False) -> Any:
    """Wrap library functions, the model class's forward and Tensor.backward with wall-clock timers.

    Nothing in the library changes: attributes of its modules (or classes) are swapped for timing wrappers,
    then restored. Inclusive times: forward includes the forward hooks, backward the backward hooks and their
    metrics. Own times subtract the timed calls nested inside (a stack of the running timers; on CPU the
    backward hooks run on the calling thread). `hand_written` also times this module's bare_copy.
    Yields a Timings, filled as the calls return.
    """
    import torch

    timings = Timings()
    targets: dict[str, tuple[Any, str]] = {}
    for label, (module, name) in parts.items():
        resolved = _resolve(module, name)  # the library is edited concurrently: time what exists
        if resolved is not None:
            targets[label] = resolved
    targets[MODEL_FORWARD] = (model_class, "forward")
    targets[MODEL_BACKWARD] = (torch.Tensor, "backward")
    if hand_written:
        targets[HAND_COPY] = (sys.modules[__name__], "bare_copy")
    stack: list[float] = []  # per running timer: the inclusive seconds of the timed calls nested in it

    def wrap(label: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            stack.append(0.0)
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                nested = stack.pop()
                if stack:
                    stack[-1] += elapsed
                timings.inclusive[label] = timings.inclusive.get(label, 0.0) + elapsed
                timings.own[label] = timings.own.get(label, 0.0) + elapsed - nested
                timings.calls[label] = timings.calls.get(label, 0) + 1

        return timed

    originals: list[tuple[Any, str, Any, bool]] = []
    wrapped: set[tuple[int, str]] = set()
    for label, (owner, name) in targets.items():
        if (id(owner), name) in wrapped:  # two labels for one attribute (an old and a new name): time it once
            continue
        wrapped.add((id(owner), name))
        timings.found.add(label)
        own_attribute = not isinstance(owner, type) or name in owner.__dict__
        original = owner.__dict__[name] if isinstance(owner, type) and own_attribute else getattr(owner, name)
        originals.append((owner, name, original, own_attribute))
        setattr(owner, name, wrap(label, original))
    try:
        yield timings
    finally:
        for owner, name, original, own_attribute in reversed(originals):
            if own_attribute:
                setattr(owner, name, original)
            else:
                delattr(owner, name)  # it was inherited: the class's own wrapper goes


def breakdown(function: Callable[[], Any], model_class: Any, parts: dict[str, tuple[str, str]]) -> str:
    """A markdown table of where one call of `function` spends its time (inclusive times; rows overlap)."""
    gc.collect()
    with timed_parts(model_class, parts) as timings:
        start = time.perf_counter()
        function()
        total = time.perf_counter() - start
    rows = [f"| total (one call, timers on) | {total:.3f} | 100% |"]
    rows += [
        f"| {label} | {seconds:.3f} | {100 * seconds / total:.1f}% |" for label, seconds in timings.inclusive.items()
    ]
    return "| part (inclusive; rows overlap) | seconds | share |\n|---|---|---|\n" + "\n".join(rows)


def where_time_goes(
    call: Callable[[], Any], hand_written: Callable[[], Any], model_class: Any, rounds: int = 1
) -> tuple[str, dict[str, float]]:
    """Where one call of `call` (a compare()) spends its time, by CATEGORIES, against `hand_written` (the bare
    runs it is compared with), both under the same timers, interleaved `rounds` times (medians per part).

    "anything else" = the call's total - the hand-written runs' model forward+backward (copies excluded) - the
    categories; it holds what the hooks cost inside the model beyond the sinks (hook dispatch, the capture
    code), the Python around the runs, and the difference between the two measurements of the model's own
    work (noise). Returns the markdown table and the shares of the call (category -> fraction)."""
    measured: dict[str, list[Timings]] = {"call": [], "hand": []}
    totals: dict[str, list[float]] = {"call": [], "hand": []}
    for round_index in range(rounds):
        order = [("call", call), ("hand", hand_written)]
        for key, function in order if round_index % 2 == 0 else reversed(order):
            gc.collect()
            with timed_parts(model_class, LIBRARY_PARTS, hand_written=key == "hand") as timings:
                start = time.perf_counter()
                function()
                totals[key].append(time.perf_counter() - start)
            measured[key].append(timings)

    def median_of(key: str, labels: list[str], kind: str = "own") -> float:
        return med([sum(getattr(t, kind).get(label, 0.0) for label in labels) for t in measured[key]])

    model_labels = [MODEL_FORWARD, MODEL_BACKWARD]
    total = med(totals["call"])
    hand_total = med(totals["hand"])
    hand_model = median_of("hand", model_labels, "inclusive")
    call_model = median_of("call", model_labels)  # own time: the sinks and the work inside them subtracted
    found = set().union(*(t.found for t in measured["call"]))
    rows: list[tuple[str, float, float | None]] = [
        ("total (one call, timers on)", total, hand_total),
        ("model forward+backward (compare: excluding the timed parts inside it)", call_model, hand_model),
    ]
    shares: dict[str, float] = {}
    listed = 0.0
    missing = []
    for category, labels in CATEGORIES.items():
        if not found.intersection(labels):
            missing.append(category)
            continue
        seconds = median_of("call", labels)
        hand = median_of("hand", [HAND_COPY], "inclusive") if category.startswith("copy") else None
        rows.append((category, seconds, hand))
        shares[category] = seconds / total
        listed += seconds
    other = total - hand_model - listed
    shares["anything else"] = other / total
    rows.append(("anything else (total - hand-written model fwd+bwd - the parts above)", other, None))
    rows.append(
        (
            "  of which: the model's fwd+bwd beyond the hand-written one (hook dispatch, capture)",
            call_model - hand_model,
            None,
        )
    )
    rows.append(("  of which: outside the model and the parts above", other - (call_model - hand_model), None))
    lines = [
        "| part | compare() s | share of the call | hand-written s |",
        "|---|---|---|---|",
    ]
    for label, seconds, hand in rows:
        hand_cell = "" if hand is None else f"{hand:.3f}"
        lines.append(f"| {label} | {seconds:.3f} | {100 * seconds / total:.1f}% | {hand_cell} |")
    if missing:
        lines.append(f"| not in this library (no function to time): {'; '.join(missing)} | | | |")
    return "\n".join(lines), shares


def section(text: str) -> str:
    """Strip the 12-space indentation of the f-string templates below (interpolated lines have none)."""
    return "\n".join(line[12:] if line.startswith(" " * 12) else line for line in text.splitlines())


# ------------------------------------------------------------------------------------ 1: fwd + bwd


def bench_compare_backward(quick: bool, repeats: int, sections: list[str]) -> list[Result]:
    from pytest_precision import compare

    spec, tokens = sizes(quick)
    model = build_model(spec)
    inputs = build_inputs(spec, tokens)
    variants = ["bf16", "fp16"]
    scale_report = compare(model, inputs, variants)
    scale = _loss_scale_of(scale_report, "fp16")

    def bare() -> None:
        for dtype in ("float32", "bfloat16", "float16"):
            bare_run(model, inputs, dtype)

    functions = {
        "bare": bare,
        "compare": lambda: compare(model, inputs, variants),
        "compare_calibrate": lambda: compare(model, inputs, variants, loss_scale="calibrate"),
    }
    # Each round takes ~20 s and this machine's load moves a round by +-10%: more rounds than elsewhere.
    times = interleave(functions, max(repeats, 4), warmup=0)  # the loss-scale probe above warmed everything up
    ratio = paired_ratio(times, "compare", "bare")
    ratio_calibrate = paired_ratio(times, "compare_calibrate", "bare")

    table = breakdown(lambda: compare(model, inputs, variants), type(model), LIBRARY_PARTS)
    bare_table = breakdown(bare, type(model), {})
    sections.append(
        section(
            f"""\
            ### 1. compare(fp32 + bf16 + fp16, backward) against bare forward+backward

            Model: LlamaForCausalLM {spec["layers"]} layers, hidden {spec["hidden"]}, intermediate
            {spec["intermediate"]}, {spec["heads"]} heads / {spec["kv_heads"]} kv heads, vocabulary {spec["vocab"]},
            {spec["batch"]} x {tokens} tokens, seed {SEED}. Bare = for fp32, bf16, fp16: `copy.deepcopy` +
            `cast_parameters` + forward with labels + `loss.backward()`, no hooks (3 runs). compare() runs the
            fp32 reference, bf16 and fp16, the fp16 loss scale ({scale}) sized from the reference's gradients.

            - bare: {spread(times["bare"])}
            - compare (default): {spread(times["compare"])} -> **{ratio:.2f}x**
            - for scale, compare with `loss_scale="calibrate"` (an extra unscaled fp16 forward+backward, the
              rule before this benchmark: 1.85x then): {spread(times["compare_calibrate"])} -> {ratio_calibrate:.2f}x

            Where one default compare() call spends its time (wall-clock timers wrapped around library functions,
            the model class's `forward` and `Tensor.backward` for one call; no library code changed):

            {table}

            The bare runs under the same timers:

            {bare_table}
            """
        )
    )
    notes = [
        f"on process CPU time: {cpu_ratio(times, 'compare', 'bare')}",
        f'with loss_scale="calibrate" (one more fp16 pass): {ratio_calibrate:.2f}x',
    ]
    return [
        Result("1 compare fwd+bwd vs bare (K=2)", f"{ratio:.2f}x", "<= 1.10x", _verdict(ratio <= 1.10), notes),
    ]


def _loss_scale_of(report: Any, variant: str) -> float | None:
    """The fp16 loss scale a report recorded, wherever this version keeps it."""
    document = report.to_dict()
    found: list[float] = []

    def walk(value: Any, path: tuple[str, ...]) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                if key == "loss_scale" and isinstance(item, (int, float)) and variant in path:
                    found.append(float(item))
                walk(item, (*path, str(key)))
        elif isinstance(value, list):
            for item in value:
                walk(item, path)

    walk(document, ())
    return found[0] if found else None


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


# ------------------------------------------------------------------------------- 2: reference cache


def bench_reference_cache(quick: bool, repeats: int, sections: list[str]) -> list[Result]:
    from pytest_precision import compare

    spec, tokens = sizes(quick)
    model = build_model(spec)
    inputs = build_inputs(spec, tokens)
    variants = ["bf16", "fp16", "bf16_fp32_head", "fp16_fp32_head"]
    fp16_scale = _loss_scale_of(compare(model, inputs, ["fp16"]), "fp16")  # also warms everything up
    scales = {v: fp16_scale for v in variants if v.startswith("fp16")}
    # The cache module was added as pytest_precision.reference, then renamed references (same API).
    found = [n for n in REFERENCE_MODULES if importlib.util.find_spec(n) is not None]
    available = bool(found)
    cached_suites: dict[str, Callable[[], Any]] = {}
    how = ""
    if available:
        cached_suites, how = _cached_suites(found[0], model, inputs, variants, scales)

    from pytest_precision.engine.variants import BUILTIN_VARIANTS

    def ideal() -> None:
        bare_run(model, inputs, "float32")
        for name in variants:
            variant = BUILTIN_VARIANTS[name]
            if variant.fp32_modules:
                _bare_variant(model, inputs, variant)
            else:
                bare_run(model, inputs, variant.weight_dtype)

    def uncached() -> None:  # the test module: one test per variant, each running its own reference
        for name in variants:
            compare(model, inputs, [name], loss_scale=scales.get(name))

    functions: dict[str, Callable[[], Any]] = {"ideal": ideal, "uncached": uncached}
    functions.update(cached_suites)
    times = interleave(functions, max(repeats, 4), warmup=0)  # the loss-scale probe above warmed up
    uncached_ratio = paired_ratio(times, "uncached", "ideal")
    lines = [
        "### 2. A test module parametrized over 4 variants, with and without the reference cache",
        "",
        f"Variants {', '.join(variants)}; same model and inputs as benchmark 1. Each parametrized test is one",
        "`compare(model, inputs, [variant])` in this process (fp16 loss scales given, as the plugin passes them",
        "from a baseline). Ideal = one bare fp32 forward+backward plus the four variants, each bare (deepcopy,",
        "cast; the fp32-head variants built by the library's `build_run_model`, no hooks).",
        "",
        f"- ideal: {spread(times['ideal'])}",
        f"- suite without cache: {spread(times['uncached'])} -> {uncached_ratio:.2f}x of ideal",
    ]
    results = []
    if "cached" not in cached_suites:
        reason = (
            "neither `pytest_precision.engine.references` nor `pytest_precision.reference` exists in this checkout"
            if not available
            else f"`pytest_precision.reference` exists but the cached suite failed: {how}"
        )
        lines += [f"- suite with cache: **not available**: {reason}.", ""]
        results.append(Result("2 cached 4-variant suite vs ideal", "not available", "<= 1.10x", "n/a", [reason]))
    else:
        cached_ratio = paired_ratio(times, "cached", "ideal")
        lines += [
            "- suite with cache (one `ReferenceCache` per suite, as the `precision` fixture keeps one per session;",
            f"  each test `compare(model, inputs, [variant], cache=cache)`): {spread(times['cached'])} ->",
            f"  **{cached_ratio:.2f}x** of ideal",
        ]
        results.append(
            Result(
                "2 cached 4-variant suite vs ideal", f"{cached_ratio:.2f}x", "<= 1.10x", _verdict(cached_ratio <= 1.10)
            )
        )
    if "explicit" in cached_suites:
        explicit_ratio = paired_ratio(times, "explicit", "ideal")
        lines.append(
            "- suite with an explicit `ref = pytest_precision.reference(model, inputs)` and "
            f"`compare(ref, variants=[variant])`: {spread(times['explicit'])} -> **{explicit_ratio:.2f}x** of ideal"
        )
        results.append(
            Result(
                "2c explicit Reference suite vs ideal",
                f"{explicit_ratio:.2f}x",
                "<= 1.10x",
                _verdict(explicit_ratio <= 1.10),
            )
        )
    if how:
        lines.append(f"- problems: {how}")
    lines.append("")
    results.append(Result("2b uncached 4-variant suite vs ideal", f"{uncached_ratio:.2f}x", "(for scale)", "n/a"))
    sections.append("\n".join(lines))
    return results


def _bare_variant(model: Any, inputs: dict[str, Any], variant: Any, *, pin_backend: bool = False) -> None:
    """One bare run of `variant` built as compare() builds it; `pin_backend`: under its matmul precision and
    backend flags too (pinned_backend sets and restores torch flags, nothing else)."""
    import torch

    from pytest_precision.engine.backend_flags import pinned_backend
    from pytest_precision.engine.model_build import build_run_model

    flags = pinned_backend(variant, "cpu") if pin_backend else contextlib.nullcontext()
    with flags:
        run_model = build_run_model(model, variant, torch.device("cpu"))
        output = run_model(**inputs)
        output.loss.backward()
    del run_model, output


REFERENCE_MODULES = ("pytest_precision.engine.references", "pytest_precision.reference")


def _cached_suites(
    module_name: str, model: Any, inputs: dict[str, Any], variants: list[Any], scales: dict[Any, float | None]
) -> tuple[dict[str, Callable[[], Any]], str]:
    """Suites using the reference cache (`pytest_precision.reference`), each probed once; {} and why if none work.

    - cached: what the `precision` fixture does: one ReferenceCache per session (here: per suite, so each suite
      starts cold), every test calling compare(model, inputs, [variant], cache=cache).
    - explicit: `ref = pytest_precision.reference(model, inputs)` once, then compare(ref, variants=[variant]).
    """
    from pytest_precision import compare

    module = importlib.import_module(module_name)
    cache_class = getattr(module, "ReferenceCache", None)
    build = getattr(module, "reference", None)

    def cached() -> None:
        assert cache_class is not None
        cache = cache_class()
        for name in variants:
            compare(model, inputs, [name], cache=cache, loss_scale=scales.get(name))

    def explicit() -> None:
        assert build is not None
        ref = build(model, inputs)
        for name in variants:
            compare(ref, variants=[name], loss_scale=scales.get(name))

    suites: dict[str, Callable[[], Any]] = {}
    errors = []
    for name, suite, needed in (("cached", cached, cache_class), ("explicit", explicit, build)):
        if needed is None:
            errors.append(f"{name}: missing API")
            continue
        suites[name] = suite  # not probed (a full suite is long): a failure fails the benchmark
    return suites, "; ".join(errors)


# --------------------------------------------------------------------------------- 3: torch.ao.ns


def bench_numeric_suite(quick: bool, repeats: int, sections: list[str]) -> list[Result]:
    import torch
    from torch.ao.ns._numeric_suite import compare_model_outputs, get_matching_activations, prepare_model_outputs
    from torch.ao.ns.fx.utils import compute_sqnr
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

    from pytest_precision import compare
    from pytest_precision.engine.capture import select_modules

    spec, tokens = sizes(quick)
    model = build_model(spec)
    inputs = build_inputs(spec, tokens)
    ids = inputs["input_ids"]
    same_types = {torch.nn.Embedding, LlamaDecoderLayer, LlamaRMSNorm, torch.nn.Linear}

    # What the stock compare_model_outputs logs on this model: leaf modules of its allow list only.
    probe_float, probe_low = bare_copy(model, "float32"), bare_copy(model, "bfloat16")
    with torch.no_grad():
        stock = compare_model_outputs(probe_float, probe_low, ids)
    stock_names = sorted(stock)
    stock_sqnr = [compute_sqnr(v["float"][0], v["quantized"][0]) for v in stock.values()]
    del probe_float, probe_low, stock

    def numeric_suite() -> dict[str, Any]:
        float_model, low_model = bare_copy(model, "float32"), bare_copy(model, "bfloat16")
        with torch.no_grad():
            # compare_model_outputs' float-model prepare() takes no non-leaf list, so it cannot log decoder
            # layers; its own two steps, with the non-leaf list on both sides, log the same modules as compare().
            prepare_model_outputs(float_model, low_model, allow_list=same_types)
            for module in (float_model, low_model):
                _observe_non_leaf(module, same_types)
            float_model(**inputs)  # the same call compare() makes (ids and labels: both compute the loss)
            low_model(**inputs)
            pairs = get_matching_activations(float_model, low_model)
            return {
                name: compute_sqnr(pair["float"][0], pair["quantized"][0].float())
                for name, pair in pairs.items()
                if name != "model"  # _find_match quirks: keep module names only
            }

    chosen = numeric_suite()
    library_modules = select_modules(model, None)
    functions = {
        "numeric_suite": numeric_suite,
        "compare_forward": lambda: compare(model, inputs, ["bf16"], backward=False),
    }
    times = interleave(functions, max(repeats, 15))  # ~0.2 s each and noisy: many rounds
    ratio = paired_ratio(times, "compare_forward", "numeric_suite")
    table = breakdown(lambda: compare(model, inputs, ["bf16"], backward=False), type(model), LIBRARY_PARTS)
    ns_table = breakdown(numeric_suite, type(model), {})
    sections.append(
        section(
            f"""\
            ### 3. Forward-only compare() against torch.ao.ns compare_model_outputs + compute_sqnr

            The eager numeric suite (`torch.ao.ns._numeric_suite`) accepts a non-quantized second model: it
            only attaches `OutputLogger` observers through eager `prepare()` and runs both models. But
            `compare_model_outputs` logs **leaf** modules of its allow list only (its float-model `prepare`
            takes no `observer_non_leaf_module_list`), so on this Llama the stock call with its default allow
            list logged {len(stock_names)} modules ({", ".join(stock_names[:4])}, ...: every `nn.Linear`,
            none of the decoder layers). And `compute_sqnr` returns None unless both tensors are float32
            ({sum(s is None for s in stock_sqnr)} of {len(stock_sqnr)} stock pairs gave None: the bf16 side),
            so the bf16 activations are upcast with `.float()` before it.

            Closest equivalent on the same modules as compare()'s default ({len(library_modules)}: embedding,
            the {spec["layers"]} decoder layers, final norm, lm_head): the two steps inside
            `compare_model_outputs` run by hand, `prepare_model_outputs(float, bf16, allow_list={{Embedding,
            LlamaDecoderLayer, LlamaRMSNorm, Linear}})`, the decoder layers given observers the way
            `observer_non_leaf_module_list` does (`insert_activation_post_process`), both models run under
            `torch.no_grad()` on the same inputs as compare() (ids and labels), `get_matching_activations`, then
            `compute_sqnr` on each of the {len(chosen)}
            logged pairs (the allow list also catches the per-layer norms and linears: the suite cannot
            restrict by name). Both sides build their models the same way (deepcopy + cast).
            compare() side: `compare(model, inputs, ["bf16"], backward=False)` (fp32 reference + bf16).

            - numeric suite: {spread(times["numeric_suite"])}
            - compare(backward=False): {spread(times["compare_forward"])} -> **{ratio:.2f}x**

            Where one forward-only compare() call spends its time (timers as in benchmark 1):

            {table}

            The numeric suite under the same timers:

            {ns_table}

            compare() also computes the chosen-token log-probs and the full-vocabulary KL / top-1 agreement,
            and ~20 metrics per tensor where SQNR is one number. That work (the metrics, KL / top-1 and
            log-prob rows above, ~15% of the call) is what the two sides differ by: beyond it both run the same two
            forwards, so the figure sits at parity and lands on either side of 1.0x from run to run on this machine
            (0.88x-1.03x over the runs listed in benchmarks/README.md).
            """
        )
    )
    cpu = cpu_ratio(times, "compare_forward", "numeric_suite")
    return [
        Result(
            "3 compare(backward=False) vs ao.ns",
            f"{ratio:.2f}x",
            "<= 1.0x",
            _verdict(ratio <= 1.0),
            [f"on process CPU time: {cpu}"],
        )
    ]


def _observe_non_leaf(module: Any, types: set[type]) -> None:
    """Give non-leaf modules of `types` an output observer, as prepare()'s observer_non_leaf_module_list."""
    from torch.ao.quantization.quantize import _observer_forward_hook

    for child in module.modules():
        if type(child) in types and next(child.children(), None) is not None:
            if hasattr(child, "activation_post_process"):
                continue
            child.activation_post_process = child.qconfig.activation()
            child.register_forward_hook(_observer_forward_hook, prepend=True)


# ------------------------------------------------------------------------------------- 4: memory


def memory_child(mode: str, quick: bool) -> None:
    """Run in a fresh subprocess: peak RSS growth (ru_maxrss) of one measurement."""
    import torch

    from pytest_precision import compare
    from pytest_precision.engine.capture import capture, select_modules

    spec, tokens = sizes(quick)
    model = build_model(spec)
    inputs = build_inputs(spec, tokens)
    # Warm the allocator and lazy imports with a tiny run, so both modes start from the same state.
    bare_run(model, {k: v[:, :8] for k, v in inputs.items()}, "float32", backward=False)
    gc.collect()
    before = peak_rss_kib()
    if mode == "compare":
        compare(model, inputs, ["bf16", "fp16"])
    elif mode == "ideal":
        stored: dict[tuple[str, str], Any] = {}

        def keep(name: str, kind: str, tensor: Any) -> None:
            stored[(name, kind)] = tensor.detach().clone()

        reference = bare_copy(model, "float32")
        with capture(reference, select_modules(reference, None), keep, backward=True):
            output = reference(**inputs)
            keep("logits", "logits", output.logits)
            output.loss.backward()
        del reference, output
        gc.collect()
        variant = bare_copy(model, "bfloat16")
        output = variant(**inputs)
        output.loss.backward()
        del variant, output
        captured = sum(t.numel() * t.element_size() for t in stored.values())
        print(json.dumps({"captured_bytes": captured}), file=sys.stderr)
    elif mode == "bare_variant":
        bare_run(model, inputs, "bfloat16")
    elif mode == "bare_reference":
        bare_run(model, inputs, "float32")
    after = peak_rss_kib()
    print(json.dumps({"mode": mode, "before_kib": before, "after_kib": after, "torch": torch.__version__}))


def bench_memory(quick: bool, repeats: int, sections: list[str]) -> list[Result]:
    modes = ["compare", "ideal", "bare_reference", "bare_variant"]
    peaks: dict[str, list[float]] = {mode: [] for mode in modes}
    captured = 0
    for _ in range(1 if quick else 3):  # the allocator's peak moves by tens of MiB from run to run
        for mode in modes:
            command = [sys.executable, str(Path(__file__).resolve()), "--_memory-child", mode]
            if quick:
                command.append("--quick")
            done = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT)
            data = json.loads(done.stdout.strip().splitlines()[-1])
            peaks[mode].append((data["after_kib"] - data["before_kib"]) / 1024)
            for line in done.stderr.splitlines():
                if line.startswith('{"captured_bytes"'):
                    captured = json.loads(line)["captured_bytes"]
    growth = {mode: med(values) for mode, values in peaks.items()}
    # ru_maxrss only grows: work whose peak stays below the start-up peak (imports, model build) reads 0.
    ratio = growth["compare"] / growth["ideal"] if growth["ideal"] > 0 else float("nan")  # 0: see the method
    sections.append(
        section(
            f"""\
            ### 4. Peak memory of compare() against one bare variant run plus the reference captures

            Method: each measurement in a fresh subprocess (`run.py --_memory-child MODE`): build the model and
            inputs, one tiny warm-up forward, then the peak resident set before and after the measured work;
            the figure is the growth of the peak, median over {len(peaks["compare"])} runs. The peak is
            `VmHWM` from /proc/self/status: `getrusage().ru_maxrss` is inherited by a child across fork + exec
            on Linux, so in a subprocess of this (large) benchmark process it started above every child's own
            peak and read 0 growth. tracemalloc would not see torch's CPU allocations. Modes:

            - compare: `compare(model, inputs, ["bf16", "fp16"])`: peak growth {growth["compare"]:.1f} MiB
            - ideal: fp32 reference run (deepcopy + forward + backward) streaming the same tensors through the
              library's `capture()` into clones ({captured / 2**20:.1f} MiB of captures: fw, bw, grad, logits),
              model freed, then one bare bf16 variant forward+backward with the captures held: peak growth
              {growth["ideal"]:.1f} MiB
            - bare fp32 forward+backward alone: {growth["bare_reference"]:.1f} MiB;
              bare bf16 forward+backward alone: {growth["bare_variant"]:.1f} MiB

            compare / ideal = **{ratio:.2f}x**. The ideal's peak is usually the fp32 reference run itself (a
            full fp32 model copy, its activations and gradients), which compare() cannot avoid either.
            """
        )
    )
    return [
        Result(
            "4 peak memory compare vs ideal",
            f"{ratio:.2f}x ({growth['compare']:.0f} / {growth['ideal']:.0f} MiB)",
            "~1.0x (no number given)",
            "n/a",
        )
    ]


# -------------------------------------------------------------------------------- 5: import time


def bench_import(quick: bool, repeats: int, sections: list[str]) -> list[Result]:
    with tempfile.TemporaryDirectory() as pycache:
        return _bench_import(quick, repeats, sections, pycache)


def _bench_import(quick: bool, repeats: int, sections: list[str], pycache: str) -> list[Result]:
    # As after `pip install`, which byte-compiles the package: the checkout's modules would otherwise be
    # compiled from source at every start where PYTHONDONTWRITEBYTECODE is set (it is on this machine), which
    # costs tens of ms. The bytecode goes to a temp prefix (not into the checkout); the first, untimed run of
    # each command writes it.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONPYCACHEPREFIX": pycache}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    subprocess.run([sys.executable, "-c", "import pytest, pytest_precision.plugin"], env=env, check=True)
    code = "import pytest; import pytest_precision.plugin; import sys; print('torch' in sys.modules)"
    plugin_us: list[float] = []
    torch_loaded = None
    for _ in range(max(3, repeats)):
        done = subprocess.run(
            [sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True, env=env, check=True
        )
        torch_loaded = done.stdout.strip() == "True"
        for line in done.stderr.splitlines():
            parts = [p.strip() for p in line.removeprefix("import time:").split("|")]
            if len(parts) == 3 and parts[2] == "pytest_precision.plugin":
                plugin_us.append(float(parts[1]))
    plugin_ms = med(plugin_us) / 1000

    with tempfile.TemporaryDirectory() as directory:
        Path(directory, "test_empty.py").write_text("def test_nothing():\n    pass\n")
        base = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_empty.py"]
        # The entry point registers the plugin as "precision", and `-p pytest_precision.plugin` next to it is
        # refused ("Plugin already registered under a different name"): block the entry point by its name and
        # load the module by -p, so that the only difference between the two commands is the plugin.
        commands = {
            "with plugin": [*base, "-p", "no:precision", "-p", "pytest_precision.plugin"],
            "without plugin": [*base, "-p", "no:precision"],
        }
        note = " (`-p no:precision -p pytest_precision.plugin`: see run.py)"

        def runner(command: list[str]) -> Callable[[], object]:
            return lambda: subprocess.run(command, cwd=directory, capture_output=True, check=True, env=env)

        # A pytest start varies by +-100 ms here: many interleaved rounds in alternating order, and the median
        # of the paired differences; the first round warms the file cache.
        times = interleave({name: runner(command) for name, command in commands.items()}, 3 if quick else 41)
    delta_ms = paired_difference(times, "with plugin", "without plugin") * 1000
    cpu_delta_ms = paired_difference(times, "with plugin (child cpu)", "without plugin (child cpu)") * 1000
    min_delta_ms = (min(times["with plugin"]) - min(times["without plugin"])) * 1000
    sections.append(
        section(
            f"""\
            ### 5. Plugin import time

            Both with bytecode compiled, as a pip install leaves it (`PYTHONPYCACHEPREFIX` to a temp dir,
            written by an untimed first run; see run.py).

            - `python -X importtime -c "import pytest; import pytest_precision.plugin"` in a fresh subprocess
              (pytest imported first, so the figure is the plugin's own cost): cumulative
              **{plugin_ms:.1f} ms** for `pytest_precision.plugin` (median of {len(plugin_us)}); `'torch' in
              sys.modules` afterwards: **{torch_loaded}**.
            - `pytest -q -p no:cacheprovider test_empty.py` on a one-test empty file in a temp dir{note}:
              with `-p pytest_precision.plugin` {spread(times["with plugin"])}, with `-p no:precision`
              {spread(times["without plugin"])}: the plugin adds **{delta_ms:.0f} ms** of wall-clock time (median
              of the per-round differences; {cpu_delta_ms:.0f} ms of the child's CPU time, user + system; the
              fastest runs differ by {min_delta_ms:.0f} ms).
            """
        )
    )
    return [
        Result("5 plugin import (importtime)", f"{plugin_ms:.1f} ms", "< 50 ms", _verdict(plugin_ms < 50)),
        Result("5 torch imported by plugin", str(torch_loaded), "False", _verdict(torch_loaded is False)),
        Result(
            "5 pytest run, plugin on - off",
            f"{delta_ms:.0f} ms",
            "< 50 ms",
            _verdict(delta_ms < 50),
            [f"on the child's CPU time: {cpu_delta_ms:.0f} ms; fastest runs: {min_delta_ms:.0f} ms"],
        ),
    ]


# -------------------------------------------------------------------------------------- 6: xdist

SUITE = """\
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def small_llama():
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=344, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def model():
    return small_llama()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("variant", ["bf16", "fp16"])
def test_variant(precision, model, variant, seed):
    ids = torch.randint(0, 512, (2, TOKENS), generator=torch.Generator().manual_seed(seed))
    report = precision.run(model, {"input_ids": ids, "labels": ids}, variants=[variant], loss_scale=1024.0)
    assert report.get(variant, "lm_head").rms_rel < 0.05
"""


def bench_xdist(quick: bool, repeats: int, sections: list[str]) -> list[Result]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    layers, tokens = (2, 64) if quick else (2, 128)
    with tempfile.TemporaryDirectory() as directory:
        source = SUITE.replace("LAYERS", str(layers)).replace("TOKENS", str(tokens))
        Path(directory, "test_suite.py").write_text(source)
        base = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_suite.py"]
        check = subprocess.run(base, cwd=directory, capture_output=True, text=True, env=env)
        if check.returncode != 0:
            raise RuntimeError(f"the 8-test suite failed:\n{check.stdout[-3000:]}\n{check.stderr[-2000:]}")

        def runner(command: list[str], extra_env: dict[str, str] | None = None) -> Callable[[], object]:
            run_env = {**env, **(extra_env or {})}
            return lambda: subprocess.run(command, cwd=directory, capture_output=True, check=True, env=run_env)

        functions = {
            "serial": runner(base),
            "-n 2": runner([*base, "-n", "2"]),
            # One intra-op thread per worker: two workers on two cores without oversubscription.
            "-n 2, 1 thread each": runner([*base, "-n", "2"], {"OMP_NUM_THREADS": "1"}),
        }
        times = interleave(functions, 1 if quick else 2, warmup=0)  # the check run above warmed the file caches
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch, transformers"], check=True, env=env)
        import_seconds = time.perf_counter() - start
    speedup = paired_ratio(times, "serial", "-n 2")
    speedup_one_thread = paired_ratio(times, "serial", "-n 2, 1 thread each")
    sections.append(
        section(
            f"""\
            ### 6. An 8-test precision suite, `-n 2` against serial

            A temp-dir test module of 8 tests (2 variants x 4 input seeds), each `precision.run` of a
            {layers}-layer Llama (hidden 128, vocabulary 512, 2 x {tokens} tokens) against its fp32 reference,
            fp16 loss scale given. Whole `pytest` subprocesses timed, interleaved.

            - serial: {spread(times["serial"])}
            - `-n 2`: {spread(times["-n 2"])} -> speed-up **{speedup:.2f}x**
            - `-n 2` with `OMP_NUM_THREADS=1` (one intra-op thread per worker): {spread(times["-n 2, 1 thread each"])}
              -> speed-up {speedup_one_thread:.2f}x
            - `python -c "import torch, transformers"` in a fresh process: {import_seconds:.2f} s

            Why not 2x: the machine has {os.cpu_count()} cores and torch's intra-op pool already uses both in
            the serial run ({_threads()} threads), so two workers split the same two cores, and with their own
            {_threads()}-thread pools each they oversubscribe them (one thread per worker is the row above); each
            xdist worker also starts a Python interpreter and imports torch and transformers (the last row), paid
            on top of the controller's start-up; and 8 tests give each worker only 4 tests to amortise that over.
            On a machine with more cores than one test's threads use, or with one GPU per worker
            (`--precision-gpu`), the workers do not compete.
            """
        )
    )
    return [
        Result(
            "6 8-test suite -n 2 vs serial",
            f"{speedup:.2f}x speed-up",
            "report (>1x not expected)",
            "n/a",
            [f"with one intra-op thread per worker: {speedup_one_thread:.2f}x"],
        )
    ]


def _threads() -> int:
    import torch

    return torch.get_num_threads()


# ------------------------------------------------- 7 / 8: one variant against the hand-written equivalent

#: SmolLM2-135M's configuration (random weights): 30 layers, a 49152-word vocabulary, tied embeddings.
SMOL = {"layers": 30, "hidden": 576, "intermediate": 1536, "heads": 9, "kv_heads": 3, "vocab": 49152, "batch": 1}
SMOL_TOKENS = 512
SMOL_QUICK = {**SMOL, "layers": 2, "vocab": 8192}
SMOL_QUICK_TOKENS = 32

#: Why fp16 stays out of benchmarks 7-9 (the sections say it).
NO_FP16 = (
    "fp16 is kept out of these figures: this CPU has no fast fp16 kernels, so an fp16 forward+backward takes "
    "many times the fp32 one (its backward dominates any figure it is in), and the plugin's fp16-only work "
    "(the loss scale) is benchmark 1's."
)
#: The CPU caveat of benchmarks 7-9.
AVX2 = (
    "This CPU has AVX2 but no AVX-512 BF16 / AMX: torch computes bf16 matmuls ~11x slower than fp32 here "
    "(8-layer Llama fwd+bwd: fp32 ~0.4 s, bf16 ~7.5 s), exactly like fp16. A slow variant run hides the "
    "plugin's fixed cost in the ratio; on a GPU bf16 runs faster than fp32 and the same cost shows more. "
    'Hence the "GPU-shaped" figure: the same call with `tf32`, a built-in variant that keeps fp32 weights and '
    'sets the fp32 matmul precision to "high" (TF32; oneDNN on this CPU computes it as fp32), so the variant '
    "runs at fp32 speed and the plugin's cost shows at least as much as it would on a GPU."
)


def build_smol(spec: dict[str, int]) -> Any:
    """SmolLM2-135M's LlamaConfig (its layer count and vocabulary from `spec`), random weights, seed 0."""
    # rope_theta: transformers 5 files it under rope_parameters
    return build_model(spec, 2048, tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000)


@dataclass
class Pair:
    """compare() with one variant against its hand-written equivalent, timed in paired rounds."""

    label: str
    times: dict[str, list[float]]
    ratio: float
    overhead_ms: float

    def line(self) -> str:
        return (
            f"- {self.label}: hand-written {spread(self.times['hand-written'])}; compare "
            f"{spread(self.times['compare'])} -> **{self.ratio:.2f}x**, overhead **{self.overhead_ms:+.0f} ms** "
            f"(process CPU time: {cpu_ratio(self.times, 'compare', 'hand-written')})"
        )


def one_variant_pair(
    label: str,
    model: Any,
    inputs: dict[str, Any],
    variant: str,
    hand_dtypes: tuple[str, ...],
    *,
    backward: bool,
    rounds: int,
) -> tuple[Pair, Callable[[], Any], Callable[[], Any]]:
    """Time compare(model, inputs, [variant]) against bare runs of `hand_dtypes` (fresh copies), `rounds`
    paired rounds, order alternating, after one untimed warm-up round;
    the ratio and the overhead are the medians of the per-round ratios and differences."""
    from pytest_precision import compare

    def hand_written_on(batch: dict[str, Any]) -> Callable[[], None]:
        def run() -> None:
            for dtype in hand_dtypes:
                bare_run(model, batch, dtype, backward=backward)

        return run

    def compare_on(batch: dict[str, Any]) -> Callable[[], Any]:
        return lambda: compare(model, batch, [variant], backward=backward)

    functions = {"hand-written": hand_written_on(inputs), "compare": compare_on(inputs)}
    # One full-size warm-up round: on this machine the first one or two full-size forward+backward passes of a
    # process ran ~7x slower than later ones (8-layer fp32: 8 s, then 1.1 s, whichever side ran them).
    times = interleave(functions, rounds, warmup=1)
    pair = Pair(
        label,
        times,
        paired_ratio(times, "compare", "hand-written"),
        paired_difference(times, "compare", "hand-written") * 1000,
    )
    return pair, functions["compare"], functions["hand-written"]


def _pair_result(name: str, pair: Pair, target: float) -> Result:
    return Result(
        name,
        f"{pair.ratio:.2f}x ({pair.overhead_ms:+.0f} ms)",
        f"<= {target:.2f}x",
        _verdict(pair.ratio <= target),
        [f"n={len(pair.times['compare'])} paired rounds; {cpu_ratio(pair.times, 'compare', 'hand-written')} on CPU"],
    )


def _share_note(shares: dict[str, float]) -> str:
    return ", ".join(f"{category.split(' (')[0]} {100 * share:.1f}%" for category, share in shares.items())


WHERE = (
    "Where the time goes: one call of each side under wall-clock timers wrapped around the library's functions "
    "(`LIBRARY_PARTS` in run.py; names this library lacks are skipped), the model class's `forward` and "
    "`Tensor.backward`. Each part is its functions' own time (the timed calls nested inside subtracted: the "
    "hooks row is the sinks without the metric, log-prob and KL work they call). The timers add a few "
    "microseconds per timed call, and the two sides are separate calls: on this shared machine a few % of "
    "noise lands in the anything-else row."
)


def bench_one_variant(quick: bool, repeats: int, sections: list[str]) -> list[Result]:
    spec, tokens = sizes(quick)
    model = build_model(spec)
    inputs = build_inputs(spec, tokens)
    bf16, bf16_call, bf16_hand = one_variant_pair(
        "bf16 (fp32 reference + bf16 variant; hand-written: fp32 copy + bf16 copy)",
        model,
        inputs,
        "bf16",
        ("float32", "bfloat16"),
        backward=True,
        rounds=1 if quick else max(repeats, 4),  # ~16 s a round here
    )
    tf32, tf32_call, tf32_hand = one_variant_pair(
        "tf32, GPU-shaped (fp32 reference + tf32 variant; hand-written: fp32 copy + fp32 copy)",
        model,
        inputs,
        "tf32",
        ("float32", "float32"),
        backward=True,
        rounds=2 if quick else 11,  # ~2 s a round: rounds are cheap, the ratio noisy
    )
    bf16_table, bf16_shares = where_time_goes(bf16_call, bf16_hand, type(model))
    tf32_table, tf32_shares = where_time_goes(tf32_call, tf32_hand, type(model), rounds=1 if quick else 3)
    sections.append(
        section(
            f"""\
            ### 7. One-variant compare() against the hand-written equivalent ({spec["layers"]}-layer Llama)

            Model and inputs of benchmark 1 ({spec["layers"]} layers, hidden {spec["hidden"]}, vocabulary
            {spec["vocab"]}, {spec["batch"]} x {tokens} tokens). compare side: `compare(model, inputs,
            [variant])`, forward+backward, every default (module selection, log-probs, KL). Hand-written side:
            `bare_run` per model: a fresh `copy.deepcopy` + `cast_parameters`, forward with labels,
            `loss.backward()`, no hooks. Paired rounds, order alternating (`interleave`); the ratio is the
            median of the per-round ratios, the overhead the median of the per-round differences.

            {bf16.line()}
            {tf32.line()}

            {AVX2} {NO_FP16}

            {WHERE}

            bf16 ({len(bf16.times["compare"])} rounds above; one call each here):

            {bf16_table}

            tf32, GPU-shaped (median of {1 if quick else 3} interleaved calls of each side):

            {tf32_table}
            """
        )
    )
    return [
        _pair_result(f"7 1-variant bf16 fwd+bwd vs hand ({spec['layers']}L)", bf16, 1.10),
        _pair_result(f"7 1-variant tf32 (GPU-shaped) vs hand ({spec['layers']}L)", tf32, 1.10),
        Result("7 where tf32's call goes", _share_note(tf32_shares), "-", "n/a"),
        Result("7 where bf16's call goes", _share_note(bf16_shares), "-", "n/a"),
    ]


def bench_smol(quick: bool, repeats: int, sections: list[str]) -> list[Result]:
    spec, tokens = (SMOL_QUICK, SMOL_QUICK_TOKENS) if quick else (SMOL, SMOL_TOKENS)
    start = time.perf_counter()
    model = build_smol(spec)
    built = time.perf_counter() - start
    inputs = build_inputs(spec, tokens)
    pairs: list[tuple[Pair, Callable[[], Any], Callable[[], Any]]] = [
        one_variant_pair(
            "tf32 forward+backward, GPU-shaped (hand-written: fp32 copy + fp32 copy)",
            model,
            inputs,
            "tf32",
            ("float32", "float32"),
            backward=True,
            rounds=1 if quick else 3,  # ~25 s a round here
        ),
        one_variant_pair(
            "tf32 forward only, GPU-shaped (`backward=False`; hand-written: 2 fp32 forwards, `bare_run(..., "
            "backward=False)`)",
            model,
            inputs,
            "tf32",
            ("float32", "float32"),
            backward=False,
            rounds=1 if quick else 5,
        ),
        one_variant_pair(
            "bf16 forward only (`backward=False`; hand-written: fp32 + bf16 forwards)",
            model,
            inputs,
            "bf16",
            ("float32", "bfloat16"),
            backward=False,
            rounds=1 if quick else 3,  # ~22 s a round here
        ),
    ]
    tables = [where_time_goes(call, hand, type(model)) for _, call, hand in pairs]
    names = ["tf32 fwd+bwd", "tf32 fwd only", "bf16 fwd only"]
    parts = "\n\n".join(f"{name}:\n\n{table}" for name, (table, _) in zip(names, tables, strict=True))
    sections.append(
        section(
            f"""\
            ### 8. One-variant compare() against hand-written: {spec["layers"]} layers, vocabulary {spec["vocab"]}

            SmolLM2-135M's configuration with random weights (seed {SEED}): `LlamaConfig(vocab_size=49152,
            hidden_size=576, intermediate_size=1536, num_hidden_layers={spec["layers"]}, num_attention_heads=9,
            num_key_value_heads=3, max_position_embeddings=2048, tie_word_embeddings=True, rms_norm_eps=1e-5,
            rope_theta=100000)`, {spec["batch"]} x {tokens} random tokens with labels (model built in
            {built:.1f} s). Method as benchmark 7.

            {pairs[0][0].line()}
            {pairs[1][0].line()}
            {pairs[2][0].line()}

            bf16 forward+backward is not measured: one bare bf16 forward+backward of this model took 127 s here
            (fp32: 6-18 s on the same loaded machine; the bf16 backward's matmuls run ~11x slower than fp32's),
            so one paired round would take ~5 minutes and be dominated by those kernels. bf16 is measured
            forward-only; the tf32 rows give the GPU-shaped figure with and without backward. {AVX2}
            {NO_FP16}

            {WHERE}

            {parts}
            """
        )
    )
    results = [
        _pair_result(f"8 1-variant {name} vs hand ({spec['layers']}L, V={spec['vocab']})", pair, 1.10)
        for name, (pair, _, _) in zip(names, pairs, strict=True)
    ]
    results += [
        Result(f"8 where {name}'s call goes", _share_note(shares), "-", "n/a")
        for name, (_, shares) in zip(names, tables, strict=True)
    ]
    return results


# ------------------------------------------------------ 9: a 4-variant suite of fp32-speed variants


def bench_fp32_speed_suite(quick: bool, repeats: int, sections: list[str]) -> list[Result]:
    from pytest_precision import BUILTIN_VARIANTS, Variant, compare

    spec, tokens = sizes(quick)
    model = build_model(spec)
    inputs = build_inputs(spec, tokens)
    variants = [
        BUILTIN_VARIANTS["tf32"],
        BUILTIN_VARIANTS["fp32_eager"],
        BUILTIN_VARIANTS["fp32_sdpa"],
        Variant(name="fp32_b", dtype="float32", matmul_precision="medium"),
    ]
    for variant in variants:  # each runs, on the first 16 tokens
        compare(model, {key: value[:, :16] for key, value in inputs.items()}, [variant])
    found = [n for n in REFERENCE_MODULES if importlib.util.find_spec(n) is not None]
    if not found:
        raise RuntimeError("neither pytest_precision.engine.references nor pytest_precision.reference exists")
    suites, how = _cached_suites(found[0], model, inputs, variants, {})
    if how:
        raise RuntimeError(how)

    def ideal() -> None:
        bare_run(model, inputs, "float32")
        for variant in variants:
            _bare_variant(model, inputs, variant, pin_backend=True)

    functions: dict[str, Callable[[], Any]] = {"ideal": ideal, **suites}
    times = interleave(functions, 2 if quick else 5, warmup=1)  # warm-up: see one_variant_pair
    ratios = {name: paired_ratio(times, name, "ideal") for name in suites}
    overheads = {name: paired_difference(times, name, "ideal") * 1000 for name in suites}
    names = ", ".join(f"`{v.name}`" for v in variants)
    sections.append(
        section(
            f"""\
            ### 9. A 4-variant suite sharing one reference, fp32-speed variants (GPU-shaped), against the ideal

            Variants {names} (the last `Variant(name="fp32_b", dtype="float32", matmul_precision="medium")`):
            all keep fp32 weights and run at fp32 speed on this CPU (attention implementations, fp32 matmul
            precision "high" / "medium", which oneDNN computes as fp32 here), so that, as on a GPU, the variant
            runs are not slower than the reference and the suite's fixed costs show. Same model and inputs as
            benchmark 1. Each test is one `compare(..., variants=[v])`. Ideal = one bare fp32 forward+backward
            plus each variant bare, built as compare() builds it (`model_build.build_run_model`: deepcopy,
            cast, attention implementation) and run under the same matmul precision (the library's
            `pinned_backend`, which only sets and restores the torch flags), no hooks. {len(times["ideal"])}
            paired rounds, order alternating.

            - ideal: {spread(times["ideal"])}
            - one `ref = pytest_precision.reference(model, inputs)`, each test `compare(ref, variants=[v])`:
              {spread(times["explicit"])} -> **{ratios["explicit"]:.2f}x** of ideal ({overheads["explicit"]:+.0f} ms)
            - one `ReferenceCache` (as the `precision` fixture keeps one per session), each test
              `compare(model, inputs, [v], cache=cache)`: {spread(times["cached"])} ->
              **{ratios["cached"]:.2f}x** of ideal ({overheads["cached"]:+.0f} ms)

            {NO_FP16} Benchmark 2 is the same suite with bf16 / fp16 variants.
            """
        )
    )
    return [
        Result(
            f"9 4 fp32-speed variants, {label} vs ideal",
            f"{ratios[name]:.2f}x ({overheads[name]:+.0f} ms)",
            "<= 1.05x",
            _verdict(ratios[name] <= 1.05),
        )
        for name, label in (("explicit", "one Reference"), ("cached", "ReferenceCache"))
    ]


# ----------------------------------------------------------------------------- 10: scale (scale.py)


def bench_scale(quick: bool, repeats: int, sections: list[str]) -> list[Result]:
    """Time and peak memory against depth, sequence length and vocabulary; the 7B-on-80-GB estimate."""
    benchmarks_dir = str(Path(__file__).resolve().parent)
    if benchmarks_dir not in sys.path:
        sys.path.insert(0, benchmarks_dir)
    import scale as scale_benchmark

    rows = scale_benchmark.bench_scale(quick, repeats, sections)
    return [Result(f"10 {r['name']}", r["figure"], r["target"], r["verdict"], list(r["notes"])) for r in rows]


# ------------------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes and few repeats: a smoke run")
    parser.add_argument("--only", help="comma-separated benchmark numbers to run (default: all)")
    parser.add_argument("--_memory-child", dest="memory_child", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.memory_child:
        memory_child(arguments.memory_child, arguments.quick)
        return

    quick = arguments.quick
    repeats = 1 if quick else 2
    benchmarks = {
        "1": bench_compare_backward,
        "2": bench_reference_cache,
        "3": bench_numeric_suite,
        "4": bench_memory,
        "5": bench_import,
        "6": bench_xdist,
        "7": bench_one_variant,
        "8": bench_smol,
        "9": bench_fp32_speed_suite,
        "10": bench_scale,
    }
    chosen = arguments.only.split(",") if arguments.only else list(benchmarks)
    info = machine()
    results: list[Result] = []
    sections: list[str] = []
    started = time.perf_counter()
    for key in chosen:
        print(f"benchmark {key} ...", flush=True)
        begun = time.perf_counter()
        try:
            results += benchmarks[key](quick, repeats, sections)
        except Exception as error:
            results.append(Result(f"{key} (failed)", f"{type(error).__name__}", "-", "ERROR", [str(error)[:500]]))
            sections.append(f"### {key}. failed\n\n```\n{type(error).__name__}: {error}\n```\n")
        print(f"  done in {time.perf_counter() - begun:.0f} s", flush=True)
    elapsed = time.perf_counter() - started

    table = _table(results)
    print()
    print(table)
    command = (
        "python benchmarks/run.py"
        + (" --quick" if quick else "")
        + (f" --only {arguments.only}" if arguments.only else "")
    )
    machine_lines = "\n".join(f"- {key}: {value}" for key, value in info.items())
    notes = "\n".join(f"- {r.name}: {note}" for r in results for note in r.notes)
    RESULTS.write_text(
        f"# Benchmark results\n\nCommand: `{command}` (from the repository root, venv python; "
        f"took {elapsed:.0f} s{', QUICK sizes: not the issue figures' if quick else ''}).\n\n"
        "Time ratios are medians over interleaved rounds of the ratio within a round (A and B ran back to back), "
        "so they need not equal the ratio of the two medians listed with them.\n\n"
        f"## Machine\n\n{machine_lines}\n\n## Figures against targets\n\n{table}\n\n"
        + (f"Notes:\n\n{notes}\n\n" if notes else "")
        + "## Details\n\n"
        + "\n\n".join(s.strip() for s in sections)
        + "\n"
    )
    print(f"\nwrote {RESULTS.relative_to(ROOT)} ({elapsed:.0f} s)")


def _table(results: list[Result]) -> str:
    header = ["benchmark", "figure", "target", "verdict"]
    rows = [[r.name, r.figure, r.target, r.verdict] for r in results]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(4)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True)) + " |"

    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


if __name__ == "__main__":
    main()
