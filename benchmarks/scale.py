"""How compare()'s time and peak memory grow with model size: `python benchmarks/scale.py [--quick]`.

`compare(model, inputs, ["tf32"])` (the fp32 reference plus one variant computing like fp32 on a CPU without
fast tf32/bf16 matmuls) against the hand-written equivalent: two fresh fp32 copies of the model, each run
forward+backward (forward only under no_grad for the forward-only row). The plugin's share of a row is
(compare - hand) / compare, for wall time (median of paired, order-alternating rounds) and for the growth of
the peak resident set of a fresh subprocess per measurement (as benchmark 4 of run.py). Tables:

1. depth (4-32 layers), 2. sequence length (1 x 256 to 1 x 4096 tokens), 3. vocabulary (4096-131072);
4. on paper: what a compare of a Llama-2-7B-shaped model holds on one 80 GB GPU, from the bytes the
   reference keeps per tensor (measured here with `pytest_precision.reference`) and the bytes autograd saves
   for backward per token and layer (measured on a small probe with saved_tensors_hooks).

benchmarks/run.py calls `scale.bench_scale(quick, repeats, sections)`: it returns plain dicts
{"name", "figure", "target", "verdict", "notes"} and appends markdown sections to `sections`.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import common  # noqa: E402  (benchmarks/common.py: the model and the peak-memory reader)

SEED = 0
#: The 8-layer Llama of run.py (hidden 256, vocabulary 4096), batch and tokens per row below.
BASE = {"layers": 8, "hidden": 256, "intermediate": 688, "heads": 8, "kv_heads": 4, "vocab": 4096}
QUICK_BASE = {**BASE, "layers": 2, "hidden": 128, "intermediate": 344, "vocab": 1024}
VARIANT = "tf32"
#: Wall-clock seconds one row's timed rounds should take at most (full run): rounds are cut to fit, never
#: below MIN_ROUNDS.
ROW_BUDGET_S = 20.0
WANTED_ROUNDS = 3
MIN_ROUNDS = 2
#: Percentage points a share may rise from the smallest to the largest row and still count as flat (noise).
FLAT_TOLERANCE_PP = 3.0
#: A row: (label, spec, batch, tokens, backward).
Row = tuple[str, dict[str, int], int, int, bool]


def tables(quick: bool) -> dict[str, list[Row]]:
    base = QUICK_BASE if quick else BASE
    if quick:
        return {
            "depth": [(f"{n} layers", {**base, "layers": n}, 2, 64, True) for n in (1, 2, 4)],
            "sequence": [
                ("1 x 64", base, 1, 64, True),
                ("1 x 256", base, 1, 256, True),
                ("1 x 512, forward only", base, 1, 512, False),
            ],
            "vocabulary": [(f"vocab {v}", {**base, "vocab": v}, 2, 64, True) for v in (1024, 4096, 8192)],
        }
    return {
        "depth": [(f"{n} layers", {**base, "layers": n}, 2, 256, True) for n in (4, 8, 16, 32)],
        "sequence": [
            ("1 x 256", base, 1, 256, True),
            ("1 x 1024", base, 1, 1024, True),
            ("1 x 4096, forward only", base, 1, 4096, False),
        ],
        "vocabulary": [(f"vocab {v}", {**base, "vocab": v}, 2, 256, True) for v in (4096, 16384, 49152, 131072)],
    }


# --------------------------------------------------------------------------------------------- helpers
# Small copies of run.py's helpers (run.py is edited concurrently and builds with 1024 positions at most).


def build_model(spec: dict[str, int], positions: int = 4096) -> Any:
    """run.py's Llama, with room for `positions` tokens."""
    return common.build_model(spec, positions)


def build_inputs(vocab: int, batch: int, tokens: int) -> dict[str, Any]:
    import torch

    ids = torch.randint(0, vocab, (batch, tokens), generator=torch.Generator().manual_seed(SEED))
    return {"input_ids": ids, "labels": ids}


def hand_run(model: Any, inputs: dict[str, Any], *, backward: bool) -> None:
    """One run written by hand: a fresh fp32 copy (deepcopy + cast, as compare builds it), forward (+ backward)."""
    import torch

    from pytest_precision.engine.model_build import cast_parameters

    run_model = copy.deepcopy(model)
    cast_parameters(run_model, "float32")
    run_model.eval()
    with torch.set_grad_enabled(backward):
        output = run_model(**inputs)
        if backward:
            output.loss.backward()
    del run_model, output


def hand(model: Any, inputs: dict[str, Any], *, backward: bool) -> None:
    """The hand-written equivalent of compare(model, inputs, ["tf32"]): reference and variant, both fp32."""
    hand_run(model, inputs, backward=backward)
    hand_run(model, inputs, backward=backward)


def plugin(model: Any, inputs: dict[str, Any], *, backward: bool) -> Any:
    from pytest_precision import compare

    return compare(model, inputs, [VARIANT], backward=backward)


def interleave(functions: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    """Wall-clock seconds of each function per round, the order alternating (A B, B A, ...)."""
    times: dict[str, list[float]] = {name: [] for name in functions}
    for index in range(rounds):
        order = list(functions.items())
        for name, function in order if index % 2 == 0 else reversed(order):
            gc.collect()
            start = time.perf_counter()
            function()
            times[name].append(time.perf_counter() - start)
    return times


def share(plugin_value: float, hand_value: float) -> float:
    return (plugin_value - hand_value) / plugin_value if plugin_value > 0 else float("nan")


# ---------------------------------------------------------------------------------------------- time


def time_row(row: Row, rounds_wanted: int, budget_s: float) -> dict[str, Any]:
    """Paired rounds of compare and the hand-written runs; the untimed warm-up round sizes the rounds."""
    label, spec, batch, tokens, backward = row
    model = build_model(spec, tokens)
    inputs = build_inputs(spec["vocab"], batch, tokens)
    functions = {
        "compare": lambda: plugin(model, inputs, backward=backward),
        "hand": lambda: hand(model, inputs, backward=backward),
    }
    start = time.perf_counter()
    interleave(functions, 1)  # warm-up (allocator, lazy imports), timing one round
    round_s = time.perf_counter() - start
    rounds = max(MIN_ROUNDS, min(rounds_wanted, int(budget_s // max(round_s, 1e-3))))
    times = interleave(functions, rounds)
    shares = [share(c, h) for c, h in zip(times["compare"], times["hand"], strict=True)]
    return {
        "label": label,
        "compare_s": statistics.median(times["compare"]),
        "hand_s": statistics.median(times["hand"]),
        "share": statistics.median(shares),
        "ratio": statistics.median([c / h for c, h in zip(times["compare"], times["hand"], strict=True)]),
        "rounds": rounds,
        "round_s": round_s,
    }


# -------------------------------------------------------------------------------------------- memory


def memory_child(request: str) -> None:
    """In a fresh subprocess: the growth of the peak resident set over one measured call."""
    import torch

    import pytest_precision.engine.compare  # noqa: F401  (imported before the baseline, in both modes)

    job = json.loads(request)
    spec, batch, tokens, backward = job["spec"], job["batch"], job["tokens"], job["backward"]
    if job.get("threads"):
        torch.set_num_threads(job["threads"])
    model = build_model(spec, tokens)
    inputs = build_inputs(spec["vocab"], batch, tokens)
    # Warm the allocator and lazy imports with a tiny run, so both modes start from the same state.
    hand_run(model, {k: v[:, :8] for k, v in inputs.items()}, backward=True)
    gc.collect()
    before = common.peak_rss_kib()
    if job["mode"] == "compare":
        plugin(model, inputs, backward=backward)
    else:
        hand(model, inputs, backward=backward)
    after = common.peak_rss_kib()
    print(json.dumps({"before_kib": before, "after_kib": after, "torch": torch.__version__}))


def memory_row(row: Row, threads: int | None) -> dict[str, float]:
    """Peak-RSS growth (MiB) of compare and of the hand-written runs, each in a fresh subprocess (the two run
    side by side: a process's peak does not depend on its neighbour's)."""
    _, spec, batch, tokens, backward = row
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    children = {}
    for mode in ("compare", "hand"):
        job = {"mode": mode, "spec": spec, "batch": batch, "tokens": tokens, "backward": backward, "threads": threads}
        command = [sys.executable, str(Path(__file__).resolve()), "--_memory-child", json.dumps(job)]
        children[mode] = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env
        )
    growth = {}
    for mode, child in children.items():
        stdout, stderr = child.communicate()
        if child.returncode != 0:
            raise RuntimeError(f"memory child {mode} failed:\n{stderr[-2000:]}")
        data = json.loads(stdout.strip().splitlines()[-1])
        growth[mode] = (data["after_kib"] - data["before_kib"]) / 1024
    return growth


# ------------------------------------------------------------------------------------- tables 1-3


TITLES = {
    "depth": "depth (hidden 256, vocabulary 4096, 2 x 256 tokens)",
    "sequence": "sequence length (8 layers, vocabulary 4096)",
    "vocabulary": "vocabulary (8 layers, 2 x 256 tokens)",
}


def measure_table(
    rows: list[Row], quick: bool, repeats: int, threads: int | None, memory_rows: set[int] | None
) -> list[dict[str, Any]]:
    """Time and memory of each row; memory only of the rows whose index is in `memory_rows` (None: all)."""
    measured = []
    for index, row in enumerate(rows):
        begun = time.perf_counter()
        timing = time_row(row, max(WANTED_ROUNDS, repeats), 5.0 if quick else ROW_BUDGET_S)
        nan = float("nan")
        measure = memory_rows is None or index in memory_rows
        memory = memory_row(row, threads) if measure else {"compare": nan, "hand": nan}
        timing.update(
            memory_compare=memory["compare"],
            memory_hand=memory["hand"],
            memory_share=share(memory["compare"], memory["hand"]),
            row_s=time.perf_counter() - begun,
        )
        print(
            f"  {row[0]}: time share {100 * timing['share']:.1f}%, memory share "
            f"{100 * timing['memory_share']:.1f}% ({timing['row_s']:.0f} s)",
            flush=True,
        )
        measured.append(timing)
    return measured


def trend(values: list[float]) -> tuple[bool | None, str]:
    """Whether a share (fractions, smallest row first) stays flat or shrinks: the largest row's share is at
    most the smallest row's plus FLAT_TOLERANCE_PP percentage points."""
    values = [v for v in values if v == v]  # rows not measured (NaN) left out
    if len(values) < 2:
        return None, "not measured (fewer than 2 rows)"
    first, last = 100 * values[0], 100 * values[-1]
    if last <= first - FLAT_TOLERANCE_PP:
        return True, f"shrinks ({first:.1f}% -> {last:.1f}%)"
    if last <= first + FLAT_TOLERANCE_PP:
        return True, f"flat within {FLAT_TOLERANCE_PP:.0f} pp ({first:.1f}% -> {last:.1f}%)"
    return False, f"GROWS ({first:.1f}% -> {last:.1f}%)"


def table_markdown(measured: list[dict[str, Any]]) -> str:
    lines = [
        "| row | compare s | hand s | ratio | time share | rounds "
        "| compare MiB | hand MiB | MiB ratio | memory share |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in measured:
        if m["memory_compare"] == m["memory_compare"]:
            ratio = m["memory_compare"] / m["memory_hand"] if m["memory_hand"] > 0 else float("nan")
            memory = (
                f"{m['memory_compare']:.0f} | {m['memory_hand']:.0f} | {ratio:.2f}x | {100 * m['memory_share']:.1f}%"
            )
        else:
            memory = "- | - | - | -"
        lines.append(
            f"| {m['label']} | {m['compare_s']:.3f} | {m['hand_s']:.3f} | {m['ratio']:.2f}x | "
            f"{100 * m['share']:.1f}% | {m['rounds']} | {memory} |"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------ table 4: on paper

GB = 1e9
#: Llama-2-7B's shape.
SEVEN_B = {"layers": 32, "hidden": 4096, "intermediate": 11008, "heads": 32, "kv_heads": 32, "vocab": 32000}


def llama_parameters(spec: dict[str, int]) -> int:
    """Parameters of a LlamaForCausalLM (untied head, no biases)."""
    return llama_parameter_counts(spec)[0]


def llama_parameter_counts(spec: dict[str, int]) -> tuple[int, int, int]:
    """(all parameters, one decoder layer's, the root's: embedding + final norm + untied lm_head)."""
    hidden, inter, head_dim = spec["hidden"], spec["intermediate"], spec["hidden"] // spec["heads"]
    kv = spec["kv_heads"] * head_dim
    layer = hidden * hidden * 2 + hidden * kv * 2 + 3 * hidden * inter + 2 * hidden
    root = 2 * spec["vocab"] * hidden + hidden
    return spec["layers"] * layer + root, layer, root


def kept_bytes(spec: dict[str, int], batch: int, tokens: int) -> dict[str, Any]:
    """What pytest_precision.reference keeps for one model: bytes per kind, grouped, and the dedup'd total."""
    from pytest_precision import reference

    model = build_model(spec, tokens)
    ref = reference(model, build_inputs(spec["vocab"], batch, tokens))
    groups: dict[str, int] = {}
    counts: dict[str, int] = {}
    for (name, kind), tensor in ref.stored.items():
        if kind == "grad":
            group = "grad (all parameters)"
        elif name == "logits":
            group = f"logits {kind}"
        elif ".layers." in f".{name}":
            group = f"{kind} decoder layers"
        else:
            group = f"{kind} {name}"
        groups[group] = groups.get(group, 0) + tensor.numel() * tensor.element_size()
        counts[group] = counts.get(group, 0) + 1
    stored_count = len(ref.stored)
    nbytes = ref.nbytes
    del ref, model
    gc.collect()
    return {"groups": groups, "counts": counts, "nbytes": nbytes, "tensors": stored_count}


def kept_formula(spec: dict[str, int], batch: int, tokens: int) -> dict[str, int]:
    """The reference's kept bytes by the rule read from the code (fp32, default modules): fw of the
    embedding, every block, the final norm and the head (the head's output is the logits: one storage);
    bw at the inputs of every block, the final norm and the head (the embedding's input is token ids:
    none) and at the logits; every parameter's grad; the chosen-token log-probs and the loss."""
    n, hidden, vocab, layers = batch * tokens, spec["hidden"], spec["vocab"], spec["layers"]
    return {
        "fw": 4 * n * hidden * (layers + 2),
        "bw": 4 * n * hidden * (layers + 2),
        "grad": 4 * llama_parameters(spec),
        "logits": 4 * n * vocab,
        "logits bw": 4 * n * vocab,
        "logprob + loss": 4 * batch * (tokens - 1) + 4,
    }


def saved_activation_rates(dtype_name: str) -> dict[str, dict[str, float]]:
    """Bytes autograd saves for backward, per token, on a small Llama probe, per layer and outside the layers,
    per size class: {"layer": {class: bytes per token per unit of that size}, "fixed": {...}}.

    Classes are the saved tensor's elements per token: hidden, kv (kv_heads x head_dim), intermediate,
    vocabulary, heads (per-head statistics), head_dim (RoPE cos/sin), 1. Parameters (and views of them) are
    not activations and are skipped; a storage saved twice counts once."""
    import torch

    probe = {"layers": 1, "hidden": 256, "intermediate": 688, "heads": 8, "kv_heads": 4, "vocab": 1000}
    tokens = 96  # distinct from every size above, so the classes cannot be confused
    dims = {"hidden": 256, "kv": 128, "intermediate": 688, "vocabulary": 1000, "heads": 8, "head_dim": 32, "1": 1}
    totals = {}
    for layers in (1, 2):
        model = build_model({**probe, "layers": layers}).to(getattr(torch, dtype_name))
        inputs = build_inputs(probe["vocab"], 1, tokens)
        parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen: dict[int, Any] = {}

        def pack(tensor: Any, parameters: set[int] = parameters, seen: dict[int, Any] = seen) -> Any:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in parameters and storage.data_ptr() not in seen:
                seen[storage.data_ptr()] = (storage.nbytes(), tensor.element_size())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            output = model(**inputs)
        output.loss.backward()
        per_class: dict[str, float] = {}
        for nbytes, size in seen.values():
            per_token = nbytes / size / tokens
            name = next((k for k, v in dims.items() if v == per_token), "other")
            unit = dims.get(name, 1)
            per_class[name] = per_class.get(name, 0.0) + nbytes / tokens / unit
        totals[layers] = per_class
        del model, output
    classes = set(totals[1]) | set(totals[2])
    layer = {c: totals[2].get(c, 0.0) - totals[1].get(c, 0.0) for c in classes}
    fixed = {c: totals[1].get(c, 0.0) - layer[c] for c in classes}
    return {"layer": {c: v for c, v in layer.items() if v}, "fixed": {c: v for c, v in fixed.items() if v}}


def activations_bytes(rates: dict[str, dict[str, float]], spec: dict[str, int], n_tokens: int) -> tuple[float, float]:
    """Bytes saved for backward: (outside the layers, per layer)."""
    head_dim = spec["hidden"] // spec["heads"]
    dims = {
        "hidden": spec["hidden"],
        "kv": spec["kv_heads"] * head_dim,
        "intermediate": spec["intermediate"],
        "vocabulary": spec["vocab"],
        "heads": spec["heads"],
        "head_dim": head_dim,
        "1": 1,
        "other": 1,
    }
    per_layer = sum(rate * dims[c] for c, rate in rates["layer"].items())
    fixed = sum(rate * dims[c] for c, rate in rates["fixed"].items())
    return n_tokens * fixed, n_tokens * per_layer


def phase_peak(
    weights: float,
    activations: tuple[float, float],
    grads: tuple[float, float, float],
    layers: int,
    kept: float,
    kept_per_layer: float,
) -> float:
    """The peak of one run's backward: weights + `kept` throughout, activations freed layer by layer (last
    first) while the gradients fill in (head, then each layer, then the embedding) and `kept_per_layer` more
    is kept per layer; the largest point of that scan (the forward's end is below backward's start)."""
    fixed_act, layer_act = activations
    head, layer_grad, embedding = grads
    points = [
        fixed_act + (layers - k) * layer_act + head + k * (layer_grad + kept_per_layer) for k in range(layers + 1)
    ]
    points.append(head + layers * (layer_grad + kept_per_layer) + embedding)
    return weights + kept + max(points)


def describe_rates(rates: dict[str, dict[str, float]]) -> str:
    def terms(part: dict[str, float]) -> str:
        return " + ".join(f"{v:g} x {c}" for c, v in sorted(part.items(), key=lambda item: -item[1]))

    return f"per layer {terms(rates['layer'])}; outside the layers {terms(rates['fixed'])}"


def paper_7b(depth_rows: list[Row], sections: list[str]) -> list[dict[str, Any]]:
    """Table 4: measured kept bytes (checked against the formula), then the 7B arithmetic."""
    check_lines = [
        "| model | tensors kept | measured bytes (nbytes) | formula bytes | match |",
        "|---|---|---|---|---|",
    ]
    all_match = True
    detail = ""
    for label, spec, batch, tokens, _ in depth_rows:
        kept = kept_bytes(spec, batch, tokens)
        formula = kept_formula(spec, batch, tokens)
        # nbytes counts the head's fw once (it is the logits' storage): the formula lists the logits once.
        predicted = sum(formula.values())
        match = predicted == kept["nbytes"]
        all_match &= match
        check_lines.append(
            f"| {label}, {batch} x {tokens} tokens | {kept['tensors']} | {kept['nbytes']:,} | {predicted:,} | "
            f"{'yes' if match else 'NO'} |"
        )
        if not detail:
            detail = "\n".join(
                f"| {group} | {kept['counts'][group]} | {size:,} |" for group, size in sorted(kept["groups"].items())
            )
            detail_label = f"{label}, {batch} x {tokens} tokens"
    fp32_rates, bf16_rates = saved_activation_rates("float32"), saved_activation_rates("bfloat16")

    rows_out: list[dict[str, Any]] = []
    parts = []
    spec = SEVEN_B
    params = llama_parameters(spec)
    layers, hidden, vocab = spec["layers"], spec["hidden"], spec["vocab"]
    head_params, embedding_params = vocab * hidden + hidden, vocab * hidden
    layer_params = (params - head_params - embedding_params) // layers
    for n_tokens in (4096, 1024):
        kept = kept_formula(spec, 1, n_tokens)
        fw_logits = kept["fw"] + kept["logits"] + kept["logprob + loss"]
        captured = fw_logits + kept["bw"] + kept["logits bw"]
        weights32, weights16 = 4 * params, 2 * params
        act32 = activations_bytes(fp32_rates, spec, n_tokens)
        act16 = activations_bytes(bf16_rates, spec, n_tokens)
        total32, total16 = act32[0] + layers * act32[1], act16[0] + layers * act16[1]
        grads32 = (4 * head_params, 4 * layer_params, 4 * embedding_params)
        grads16 = (2 * head_params, 2 * layer_params, 2 * embedding_params)
        bw_layer = 4 * n_tokens * hidden
        # Reference phase. Without offload the fw captures and the logits are held from the forward on, the
        # bw at the logits, the head and the final norm from backward's start, one bw per layer after;
        # the gradients are the reference model's own (kept as its grad captures), on the GPU until the
        # model is freed also with offload (which copies each to the host when accumulated).
        ref = {
            False: phase_peak(
                weights32, act32, grads32, layers, fw_logits + kept["logits bw"] + 2 * bw_layer, bw_layer
            ),
            True: phase_peak(weights32, act32, grads32, layers, 0.0, 0.0),
        }
        # Variant phase: the reference model is gone; its captures stay (on the GPU without offload; with
        # offload one at a time on the GPU, the largest: the logits or lm_head's gradient).
        largest = max(4 * n_tokens * vocab, 4 * vocab * hidden)
        var = {
            False: phase_peak(weights16, act16, grads16, layers, captured + kept["grad"], 0.0),
            True: phase_peak(weights16, act16, grads16, layers, largest, 0.0),
        }
        hand_peak = max(phase_peak(weights32, act32, grads32, layers, 0.0, 0.0), var[True] - largest)
        bound_no = weights32 + total32 + kept["grad"] + captured
        peak = {off: max(ref[off], var[off]) for off in (False, True)}
        fits = {off: "yes" if peak[off] <= 80 * GB else "no" for off in (False, True)}
        parts.append(
            f"""\
| 1 x {n_tokens} tokens, GB | no offload | offload |
|---|---|---|
| **reference phase** (fp32 forward+backward) | | |
| fp32 model copy (weights) | {weights32 / GB:.1f} | {weights32 / GB:.1f} |
| fp32 activations saved for backward (at its start) | {total32 / GB:.1f} | {total32 / GB:.1f} |
| fp32 parameter gradients (= the kept grad captures): at backward's start (head) / end | \
{grads32[0] / GB:.1f} / {kept["grad"] / GB:.1f} | {grads32[0] / GB:.1f} / {kept["grad"] / GB:.1f} |
| kept fw + logits (+ bw at the logits, head, norm from backward's start, one bw per layer after) | \
{fw_logits / GB:.1f} (+ {(kept["logits bw"] + kept["bw"]) / GB:.1f}) | 0 (host) |
| phase peak (scan over backward) | {ref[False] / GB:.1f} | {ref[True] / GB:.1f} |
| **variant phase** (bf16 forward+backward) | | |
| kept reference tensors: fp32 grads + fw + bw + logits | {(kept["grad"] + captured) / GB:.1f} | \
{largest / GB:.1f} (one at a time) |
| bf16 model copy (weights) | {weights16 / GB:.1f} | {weights16 / GB:.1f} |
| bf16-run activations saved for backward (at its start) | {total16 / GB:.1f} | {total16 / GB:.1f} |
| bf16 parameter gradients: at backward's start / end | {grads16[0] / GB:.1f} / {weights16 / GB:.1f} | \
{grads16[0] / GB:.1f} / {weights16 / GB:.1f} |
| phase peak (scan over backward) | {var[False] / GB:.1f} | {var[True] / GB:.1f} |
| **compare() peak** (larger phase) | **{peak[False] / GB:.1f}** | **{peak[True] / GB:.1f}** |
| fits in 80 GB (less the CUDA context, fragmentation, workspaces) | {fits[False]} | {fits[True]} |
| hand-written fp32 run, then bf16 run, nothing kept | {hand_peak / GB:.1f} | {hand_peak / GB:.1f} |
| plugin's share of the peak | {100 * share(peak[False], hand_peak):.0f}% | {100 * share(peak[True], hand_peak):.0f}% |
| upper bound (everything of the reference phase at once) | {bound_no / GB:.1f} | {(bound_no - captured) / GB:.1f} |
"""
        )
        rows_out.append(
            {
                "name": f"scale 7B on one 80 GB GPU, 1 x {n_tokens} tokens (paper)",
                "figure": f"peak {peak[False] / GB:.0f} GB (no offload) / {peak[True] / GB:.0f} GB (offload)",
                "target": "<= 80 GB",
                "verdict": "met" if peak[True] <= 80 * GB else "MISSED",
                "notes": [
                    f"reference phase {ref[False] / GB:.0f} / {ref[True] / GB:.0f} GB, variant phase "
                    f"{var[False] / GB:.0f} / {var[True] / GB:.0f} GB (no offload / offload); hand-written "
                    f"{hand_peak / GB:.0f} GB"
                ],
            }
        )
    n = 4096
    kept7 = kept_formula(spec, 1, n)
    sections.append(
        "\n".join(
            [
                "#### 4. A Llama-2-7B-shaped compare on one 80 GB GPU, on paper",
                "",
                "What the reference keeps, read from the code (reference_run._ReferenceKeeper, capture.capture) and "
                "measured with `pytest_precision.reference(model, inputs)` (fp32 reference, default modules: "
                "embedding, every decoder layer, final norm, lm_head): per tensor, the tensor itself as produced "
                "(no copy when no in-place write touched it, else a clone; with offload a host copy): "
                "fw = each module's output, bw = the gradient at each module's input (none for the embedding, "
                "whose input is token ids), plus the gradient at the logits, grad = every parameter's "
                "gradient (the reference model's own `.grad` tensors, kept after the model is freed), the "
                "logits (one storage with lm_head's fw), the chosen-token log-probs and the loss, all fp32. "
                "With N = batch x tokens, H hidden, V vocabulary, L layers, P parameters, in bytes:",
                "",
                "    kept = 4 N H (L + 2)  [fw]  +  4 N H (L + 2)  [bw]  +  4 P  [grad]  +  4 N V  [logits]"
                "  +  4 N V  [bw at the logits]  +  4 (N - batch) + 4  [log-probs, loss]",
                "",
                "Checked against `Reference.nbytes` on the depth models: "
                + ("every one matches exactly." if all_match else "**a mismatch: see the table**."),
                "",
                *check_lines,
                "",
                f"By group ({detail_label}; bytes as numel x element size, the logits' storage counted under "
                "both `fw lm_head` and `logits logits`):",
                "",
                "| group | tensors | bytes |",
                "|---|---|---|",
                detail,
                "",
                "Activations autograd saves for backward, measured on a 1- and 2-layer probe (hidden 256, "
                "kv 4 x 32, intermediate 688, vocabulary 1000, 96 tokens) with `saved_tensors_hooks`, "
                "parameters excluded, each storage once, in bytes per token per unit of the named size "
                "(CPU kernels: SDPA saves q, k, v, its output and a per-head log-sum-exp, no T x T matrix, as "
                "flash / memory-efficient attention on a GPU; RMSNorm saves an fp32 copy of its input also in "
                "a bf16 model; the loss saves fp32 log-softmax of the logits):",
                "",
                f"- fp32 model: {describe_rates(fp32_rates)}",
                f"- bf16 model: {describe_rates(bf16_rates)}",
                "",
                f"Llama-2-7B shape: 32 layers, hidden 4096, intermediate 11008, 32 heads (kv 32), vocabulary "
                f"32000, untied head: P = {params / 1e9:.3f} B parameters; fp32 reference + one bf16 variant "
                f"(weights cast to bf16), backward on. Kept by the reference at 1 x {n} tokens: fw "
                f"{kept7['fw'] / GB:.2f} GB, bw {kept7['bw'] / GB:.2f} GB, grad {kept7['grad'] / GB:.2f} GB, "
                f"logits {kept7['logits'] / GB:.2f} GB, bw at the logits {kept7['logits bw'] / GB:.2f} GB.",
                "",
                "compare() runs the reference first and frees its model copy (deleted at the end of the run), "
                "then the variant, so the peak is the larger of the two phases. Assumptions: the caller's fp32 "
                f"model stays on the host (`device='cuda'`; on the GPU it adds {4 * params / GB:.1f} GB to both "
                "phases); no activation checkpointing (compare() switches it off); the per-tensor metrics work "
                "in chunks (a few MiB of float64 temporaries); the CUDA context, the allocator's fragmentation, "
                "kernel workspaces and the transient copies of the loss (logits upcast, log-softmax during "
                "the forward) are not counted. Each phase's peak is a scan over its backward: all activations "
                "saved at its start, then layer by layer (last first) their activations freed while their "
                "gradients (and, without offload, the reference's bw captures) fill in; the last row adds up "
                "everything of the reference phase at once. offload=None chooses offload on CUDA for a model over "
                "1 GiB of parameters, so a 7B compare offloads by default. In GB (1e9 bytes):",
                "",
                *parts,
                "Reading: "
                + " ".join(
                    row["figure"].replace("peak", f"{row['name'].split(', ')[1].split(' (')[0]}:")
                    + "; "
                    + row["notes"][0]
                    + "."
                    for row in rows_out
                ),
            ]
        )
    )
    return rows_out


# ----------------------------------------------------------------------------------------------- main


def bench_scale(quick: bool, repeats: int, sections: list[str], threads: int | None = 1) -> list[dict[str, Any]]:
    """Tables 1-3 (measured) and 4 (on paper); markdown appended to `sections`, a list of result dicts
    {"name", "figure", "target", "verdict", "notes"} returned. `repeats`: timed rounds wanted per row (at
    least 3 are run, fewer only where a row's rounds would pass its budget, never fewer than 2). `threads`:
    torch intra-op threads for the measurements (restored afterwards; None: leave torch's setting): one by
    default, because on this shared 2-core machine the other load makes 2-thread OpenMP runs stall by up to
    50x on small models, which drowns the figures; the memory subprocesses use the same setting."""
    import torch

    started = time.perf_counter()
    previous_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _bench_scale(quick, repeats, sections, threads, started)
    finally:
        torch.set_num_threads(previous_threads)


def _bench_scale(
    quick: bool, repeats: int, sections: list[str], threads: int | None, started: float
) -> list[dict[str, Any]]:
    import torch

    results: list[dict[str, Any]] = []
    lines = [
        "### Scale: compare() against the hand-written runs as the model grows",
        "",
        f'`compare(model, inputs, ["{VARIANT}"])` (fp32 reference + one variant computing like fp32 on this '
        "CPU: bf16 and fp16 matmuls run ~11x slower than fp32 here, which would hide the plugin's share; on a "
        "GPU the variant is faster than fp32, so the share there is at least what is shown) against the "
        "hand-written equivalent: two fresh fp32 copies (deepcopy + cast, as compare builds them), each "
        "forward+backward (forward-only row: `backward=False`, hand-written forwards under `no_grad`). Llama, "
        "hidden 256, intermediate 688, 8 heads / 4 kv heads, untied head, seed 0"
        + (" (QUICK sizes: hidden 128, vocabulary 1024, fewer tokens)" if quick else "")
        + ".",
        "",
        "- time: wall clock, one untimed warm-up round, then paired rounds in alternating order (compare, "
        f"hand / hand, compare); figures are medians over rounds, share = (compare - hand) / compare within "
        f"a round; {WANTED_ROUNDS} rounds unless a round is too long for the row's budget "
        f"(~{ROW_BUDGET_S:.0f} s), never fewer than {MIN_ROUNDS} (the `rounds` column).",
        "- memory: growth of the peak resident set (`VmHWM`) over the measured call, in a fresh subprocess "
        "per measurement after building the model and a tiny warm-up run (as benchmark 4), one subprocess "
        "per mode and row (the two modes' subprocesses side by side): the allocator's peak moves by tens of "
        "MiB between runs, so small rows are noisy."
        + (" QUICK: memory of the last depth row only (subprocesses take ~10 s each here)." if quick else ""),
        f"- flat: the largest row's share is at most the smallest row's + {FLAT_TOLERANCE_PP:.0f} percentage "
        f"points. torch {torch.__version__}, {torch.get_num_threads()} intra-op thread(s) (see bench_scale); "
        f"load average at the start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} "
        "cores (other processes' load moves single rounds by tens of percent).",
        "",
    ]
    depth_rows: list[Row] = []
    for number, (key, rows) in enumerate(tables(quick).items(), start=1):
        print(f"scale table {number}: {key}", flush=True)
        if key == "depth":
            depth_rows = rows
        memory_rows = ({len(rows) - 1} if key == "depth" else set()) if quick else None
        measured = measure_table(rows, quick, repeats, threads, memory_rows)
        # The trend compares like with like: rows run as the first one (a forward-only row is listed apart).
        alike = [m for m, row in zip(measured, rows, strict=True) if row[4] == rows[0][4]]
        apart = [m["label"] for m in measured if m not in alike]
        time_flat, time_trend = trend([m["share"] for m in alike])
        memory_flat, memory_trend = trend([m["memory_share"] for m in alike])
        if apart:
            time_trend += f" over the forward+backward rows ({', '.join(apart)}: apart, no trend)"
            memory_trend += " over the forward+backward rows"
        lines += [
            f"#### {number}. {TITLES[key]}",
            "",
            table_markdown(measured),
            "",
            f"Plugin's time share: {time_trend}. Peak-memory share: {memory_trend}. Row wall times: "
            + ", ".join(f"{m['label']} {m['row_s']:.0f} s" for m in measured)
            + f". Load average after the table: {' '.join(f'{x:.2f}' for x in os.getloadavg())}.",
            "",
        ]
        for what, ok, text in (("time", time_flat, time_trend), ("peak memory", memory_flat, memory_trend)):
            results.append(
                {
                    "name": f"scale {key}: plugin's {what} share",
                    "figure": text if ok is None else text.split(" (", 1)[1].split(")", 1)[0],
                    "target": "flat or shrinking",
                    "verdict": "n/a" if ok is None else "met" if ok else "MISSED",
                    "notes": [text],
                }
            )
    sections.append("\n".join(lines))
    print("scale table 4: 7B on paper", flush=True)
    results += paper_7b(depth_rows, sections)
    print(f"scale: {time.perf_counter() - started:.0f} s", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run (< 1 minute)")
    parser.add_argument("--_memory-child", dest="memory_child", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.memory_child:
        memory_child(arguments.memory_child)
        return
    sections: list[str] = []
    started = time.perf_counter()
    results = bench_scale(arguments.quick, 1 if arguments.quick else 2, sections)
    print()
    print("\n\n".join(sections))
    print()
    for result in results:
        print(f"- {result['name']}: {result['figure']} (target {result['target']}: {result['verdict']})")
    print(f"\ntook {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
