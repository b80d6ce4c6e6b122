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

#: The issue's model: a Llama of 8 layers, hidden 256, vocabulary 4096, on 2 x 256 tokens.
FULL = {"layers": 8, "hidden": 256, "intermediate": 688, "heads": 8, "kv_heads": 4, "vocab": 4096, "batch": 2}
FULL_TOKENS = 256
QUICK = {**FULL, "layers": 2, "hidden": 128, "intermediate": 344, "vocab": 1024}
QUICK_TOKENS = 64
SEED = 0


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


def build_model(spec: dict[str, int]) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=spec["vocab"],
        hidden_size=spec["hidden"],
        intermediate_size=spec["intermediate"],
        num_hidden_layers=spec["layers"],
        num_attention_heads=spec["heads"],
        num_key_value_heads=spec["kv_heads"],
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    model.eval()
    return model


def build_inputs(spec: dict[str, int], tokens: int) -> dict[str, Any]:
    import torch

    generator = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, spec["vocab"], (spec["batch"], tokens), generator=generator)
    return {"input_ids": ids, "labels": ids}


def bare_copy(model: Any, dtype: str) -> Any:
    """A run's model built as compare() builds it: deep copy, floating parameters cast."""
    from pytest_precision.model_build import cast_parameters

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


#: Library functions timed inside compare() (inclusive wall time, summed over calls): (module, attribute).
LIBRARY_PARTS = {
    "model build (deepcopy + cast: build_run_model)": ("pytest_precision.comparison", "build_run_model"),
    "fp16 loss-scale calibration pass (an extra fp16 run)": ("pytest_precision.comparison", "_calibrate_loss_scale"),
    "per-tensor metrics (tensor_error, inside the hooks)": ("pytest_precision.comparison", "tensor_error"),
    "vocabulary KL / top-1 (distribution_stats)": ("pytest_precision.comparison", "distribution_stats"),
    "chosen-token log-probs (chosen_logprobs)": ("pytest_precision.comparison", "chosen_logprobs"),
    "log-ratio stats (log_ratio_stats)": ("pytest_precision.comparison", "log_ratio_stats"),
    "parameter checksum (state_checksum, comparison)": ("pytest_precision.comparison", "state_checksum"),
    "parameter checksum (state_checksum, cache key)": ("pytest_precision.references", "state_checksum"),
    "parameter categories (parameter_categories)": ("pytest_precision.comparison", "parameter_categories"),
}


@contextlib.contextmanager
def timed_parts(model_class: Any, parts: dict[str, tuple[str, str]]) -> Any:
    """Wrap library functions, the model class's forward and Tensor.backward with wall-clock timers.

    Nothing in the library changes: module attributes are swapped for timing wrappers, then restored.
    Times are inclusive (forward includes the forward hooks, backward the backward hooks and their metrics).
    """
    import torch

    totals: dict[str, float] = {}
    originals: list[tuple[Any, str, Any]] = []
    targets: dict[str, tuple[Any, str]] = {}
    for label, (module, name) in parts.items():
        with contextlib.suppress(ImportError):  # the library is edited concurrently: time what exists
            targets[label] = (importlib.import_module(module), name)
    targets["model forward (incl. fw capture hooks)"] = (model_class, "forward")
    targets["backward (incl. bw/grad hooks and their metrics)"] = (torch.Tensor, "backward")

    def wrap(label: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                totals[label] = totals.get(label, 0.0) + time.perf_counter() - start

        return timed

    for label, (owner, name) in targets.items():
        if not hasattr(owner, name):
            continue
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        originals.append((owner, name, original))
        setattr(owner, name, wrap(label, original))
    try:
        yield totals
    finally:
        for owner, name, original in reversed(originals):
            setattr(owner, name, original)


def breakdown(function: Callable[[], Any], model_class: Any, parts: dict[str, tuple[str, str]]) -> str:
    """A markdown table of where one call of `function` spends its time."""
    gc.collect()
    with timed_parts(model_class, parts) as totals:
        start = time.perf_counter()
        function()
        total = time.perf_counter() - start
    rows = [f"| total (one call, timers on) | {total:.3f} | 100% |"]
    rows += [f"| {label} | {seconds:.3f} | {100 * seconds / total:.1f}% |" for label, seconds in totals.items()]
    return "| part (inclusive; rows overlap) | seconds | share |\n|---|---|---|\n" + "\n".join(rows)


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

    from pytest_precision.variants import BUILTIN_VARIANTS

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
            "neither `pytest_precision.references` nor `pytest_precision.reference` exists in this checkout"
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


def _bare_variant(model: Any, inputs: dict[str, Any], variant: Any) -> None:
    import torch

    from pytest_precision.model_build import build_run_model

    run_model = build_run_model(model, variant, torch.device("cpu"))
    output = run_model(**inputs)
    output.loss.backward()
    del run_model, output


REFERENCE_MODULES = ("pytest_precision.references", "pytest_precision.reference")


def _cached_suites(
    module_name: str, model: Any, inputs: dict[str, Any], variants: list[str], scales: dict[str, float | None]
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
    from pytest_precision.capture import select_modules

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


def peak_rss_kib() -> int:
    """This process's peak resident set: VmHWM, not ru_maxrss, which a child inherits from its parent across
    fork + exec (the parent here holds GiBs after benchmarks 1-3, hiding every child's own peak)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def memory_child(mode: str, quick: bool) -> None:
    """Run in a fresh subprocess: peak RSS growth (ru_maxrss) of one measurement."""
    import torch

    from pytest_precision import compare
    from pytest_precision.capture import capture, select_modules

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

        def runner(command: list[str]) -> Callable[[], None]:
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

        def runner(command: list[str], extra_env: dict[str, str] | None = None) -> Callable[[], None]:
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
