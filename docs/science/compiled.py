"""Compiled bf16 against eager bf16: how large the difference is, where it is born. `python docs/science/compiled.py`

On two models: (a) the bundled trained tiny LM (tests/data/tiny-trained-lm) on its held-out text, and (b) a
Llama of SmolLM2-135M's shape (hidden 576, intermediate 1536, 9 heads, 3 KV heads, vocabulary 49152, tied head)
cut to 4 layers, with random weights (torch.manual_seed(0); nothing is downloaded) on 2 x 64 random tokens; with
`--smollm PATH`, a local copy of SmolLM2-135M instead (a directory AutoModelForCausalLM.from_pretrained reads),
cut to `--layers` layers, on the trained LM's held-out text in its own tokens. For each it prints:

1. per block (each decoder layer, the head, the log-probabilities), the error against the fp32 reference of
   eager bf16 and of three regional-compiled bf16 variants: bf16_compiled (Inductor), bf16_compiled_aot_eager
   (AOTAutograd and decompositions, eager kernels) and bf16_compiled_emulated (Inductor with
   emulate_precision_casts): forward, backward (the gradient at each block's input) and parameter gradients
   (median and max over each block's parameters);
2. compiled against eager, by hand and not through the plugin: each compiled copy's block outputs against eager
   bf16's (not against fp32), propagated (each copy runs its own forward) and isolated (each compiled block on
   eager's input for it), next to bf16's own error;
3. where the compiled difference is born: the isolated forward error of each block (compare(isolate=True):
   each block on the reference's input) per variant, and what the ratios say: whether Inductor's bf16 is more or
   less accurate than eager, whether decompositions (aot_eager) move the numbers, whether rounding intermediates
   as eager does (emulate_precision_casts) brings Inductor back to eager;
4. what compiling cost: report.compile_costs per variant, and by hand each copy's first (compiling) forward
   against its second.

The CPU pins of the repository's conftest (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, MKL_CBWR) are set by
importing it before torch, as for the tests. Inductor compiles into a fresh cache directory (TORCHINDUCTOR_CACHE_DIR,
removed at the end; `--cache-dir` to keep one): compile seconds are a cold cache's, and no kernel compiled for
another CPU capability is reused (Inductor's FX graph cache key does not hold the vector ISA; see
docs/concepts/compiled.md). Needs a C++ compiler for Inductor. Saved output: docs/science/compiled_results.txt.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

#: The repository's conftest, imported before torch: it sets the CPU pins torch reads when imported.
conftest = importlib.import_module("conftest")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from pytest_precision import compare  # noqa: E402

#: The variants compared, by built-in name, and their short column labels.
VARIANTS = {
    "bf16": "bf16",
    "bf16_compiled": "inductor",
    "bf16_compiled_aot_eager": "aot_eager",
    "bf16_compiled_emulated": "emulated",
}
COMPILED = [v for v in VARIANTS if v != "bf16"]
#: Section 2's compiled copies: the torch.compile arguments each built-in variant uses.
BY_HAND: dict[str, dict[str, Any]] = {
    "bf16_compiled": {"backend": "inductor"},
    "bf16_compiled_aot_eager": {"backend": "aot_eager"},
    "bf16_compiled_emulated": {"backend": "inductor", "options": {"emulate_precision_casts": True}},
}
BLOCK = re.compile(r"model\.layers\.\d+")
HEAD = "lm_head"
#: SmolLM2-135M's configuration (HuggingFaceTB/SmolLM2-135M), all but its 30 layers.
SMOLLM2_135M = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
}
#: Why (b) runs 2 x 64 tokens by default, said under its title.
SLOW_HEAD = (
    "64 tokens per row, not 128: with oneDNN pinned to AVX2 (no bf16 instructions) a bf16 backward of this model "
    "takes 14 s at 2 x 64 tokens and 27 s at 2 x 128 (fp32: 3 s), nearly all of it in bf16 matmuls; every variant "
    "runs two (propagated and isolated), so --smollm-length 128 adds about 2 minutes"
)
#: Ratios within this of 1 count as "the same numbers" in section 3's conclusions.
SAME = 0.01


def percent(value: float | None) -> str:
    """A relative error as a percentage with 3 decimals ('-' when undefined, '0' when exactly zero)."""
    if value is None:
        return "-"
    return "0" if value == 0 else f"{100 * value:.3f}%"


def section(title: str) -> None:
    print(f"\n{title}\n{'-' * len(title)}")


def table(header: Sequence[str], rows: Sequence[Sequence[str]], first: int = 16, width: int = 12) -> list[str]:
    """Left-aligned first column, the others right-aligned."""
    lines = ["  " + f"{header[0]:<{first}}" + "".join(f"{h:>{width}}" for h in header[1:])]
    lines += ["  " + f"{row[0]:<{first}}" + "".join(f"{c:>{width}}" for c in row[1:]) for row in rows]
    return lines


# --- the models ------------------------------------------------------------------------------------------------


class Subject:
    """One model of the study: an fp32 model (or a factory), its inputs and a label."""

    def __init__(self, label: str, model: Any, inputs: dict[str, torch.Tensor], note: str) -> None:
        self.label, self.model, self.inputs, self.note = label, model, inputs, note

    def fp32(self) -> nn.Module:
        model = (
            self.model(None, "cpu") if callable(self.model) and not isinstance(self.model, nn.Module) else self.model
        )
        return model.float().eval()


def trained_lm(batch: int, length: int) -> Subject:
    inputs = conftest.trained_lm_text_batch(batch=batch, length=length)
    label = f"(a) trained tiny LM ({conftest.TRAINED_LM_DIR.relative_to(REPO)})"
    return Subject(
        label, conftest.load_trained_lm, inputs, f"held-out text, input_ids {tuple(inputs['input_ids'].shape)}"
    )


def smollm_shaped(layers: int, batch: int, length: int) -> Subject:
    """SmolLM2-135M's shape, `layers` layers, random weights from torch.manual_seed(0), random tokens (seed 0)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SMOLLM2_135M, num_hidden_layers=layers)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (batch, length), generator=generator)
    label = f"(b) SmolLM2-135M-shaped Llama, {layers} layers, RANDOM weights (torch.manual_seed(0); no model hub here)"
    note = f"random tokens (seed 0), input_ids {tuple(ids.shape)}" + (f"; {SLOW_HEAD}" if length == 64 else "")
    return Subject(label, model, {"input_ids": ids, "labels": ids.clone()}, note)


def smollm_local(path: Path, layers: int, batch: int, length: int) -> Subject:
    """SmolLM2-135M from the local directory `path`, its first `layers` layers, on the trained LM's held-out text in
    its own tokens. Nothing is downloaded."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pytest_precision.inputs import from_text

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    text = (conftest.TRAINED_LM_DIR / "corpus.txt").read_text(encoding="utf-8")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    ids = from_text(tokenizer, text[int(len(text) * 0.9) :], batch, length)
    label = f"(b) SmolLM2-135M ({path}), first {layers} layers"
    return Subject(
        label, model, {"input_ids": ids, "labels": ids.clone()}, f"held-out text, input_ids {tuple(ids.shape)}"
    )


def blocks_of(report: Any) -> list[str]:
    """The decoder layers, in execution order."""
    return [r.name for r in report.records("bf16", "fw") if BLOCK.fullmatch(r.name)]


def short(name: str) -> str:
    return name.replace("model.layers.", "layer ")


# --- section 1 -------------------------------------------------------------------------------------------------


def value(report: Any, variant: str, name: str, kind: str) -> float | None:
    try:
        return report.get(variant, name, kind).rms_rel
    except (KeyError, LookupError):
        return None


def per_block_table(report: Any, kind: str, names: Sequence[str]) -> list[str]:
    rows = []
    for name in names:
        row_kind = "logprob" if name == "logprob" else kind
        rows.append([short(name)] + [percent(value(report, v, name, row_kind)) for v in VARIANTS])
    return table([kind, *VARIANTS.values()], rows)


def grad_groups(report: Any) -> dict[str, list[str]]:
    """Parameters by block (a tied head's weight is recorded once, under the embedding)."""
    groups: dict[str, list[str]] = {}
    for record in report.records("bf16", "grad"):
        match = BLOCK.match(record.name)
        group = match.group(0) if match else record.name.rsplit(".", 1)[0]
        groups.setdefault(group, []).append(record.name)
    order = [g for g in groups if BLOCK.fullmatch(g)] + [g for g in groups if not BLOCK.fullmatch(g)]
    return {g: groups[g] for g in order}


def grad_table(report: Any) -> list[str]:
    rows = []
    for group, names in grad_groups(report).items():
        cells = [f"{short(group)} ({len(names)})"]
        for variant in VARIANTS:
            values = [v for v in (value(report, variant, n, "grad") for n in names) if v is not None]
            cells.append(f"{percent(statistics.median(values))} / {percent(max(values))}" if values else "-")
        rows.append(cells)
    return table(["grad med / max", *VARIANTS.values()], rows, first=26, width=20)


# --- section 2 -------------------------------------------------------------------------------------------------


def first_tensor(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        return first_tensor(output[0])
    return first_tensor(output.logits if hasattr(output, "logits") else output[0])


def rms_diff(obtained: torch.Tensor, expected: torch.Tensor) -> float:
    """rms(obtained - expected) / rms(expected), in float64."""
    a, b = obtained.detach().double(), expected.detach().double()
    return float((a - b).norm() / b.norm())


def regions(model: nn.Module) -> list[str]:
    """What the plugin compiles by default: embedding, each decoder layer, final norm, head."""
    from pytest_precision.engine.capture import default_module_names

    return default_module_names(model)


class ByHand:
    """An eager bf16 copy of the model and, per compiled variant, a bf16 copy whose regions' forwards are
    torch.compile'd, each block's output captured with forward hooks."""

    def __init__(self, model: nn.Module, inputs: dict[str, torch.Tensor]) -> None:
        self.eager = copy.deepcopy(model).to(torch.bfloat16)
        self.names = regions(self.eager)
        self.inputs = {**inputs, "use_cache": False}
        self.outputs: dict[str, torch.Tensor] = {}
        self.calls: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}
        self.timing: dict[str, tuple[float, float, int, int]] = {}

    def _hooks(self, model: nn.Module, record_inputs: bool) -> list[Any]:
        handles = []
        for name in self.names:
            module = model.get_submodule(name)
            handles.append(
                module.register_forward_hook(
                    lambda _m, _a, out, name=name: self.outputs.__setitem__(name, first_tensor(out).detach())
                )
            )
            if record_inputs:
                handles.append(
                    module.register_forward_pre_hook(
                        lambda _m, args, kwargs, name=name: self.calls.__setitem__(name, (args, kwargs)),
                        with_kwargs=True,
                    )
                )
        return handles

    def _forward(self, label: str, model: nn.Module, record_inputs: bool = False) -> dict[str, torch.Tensor]:
        """Two forwards with gradients on (the graphs a training step compiles), timed; the second's outputs."""
        from torch._dynamo.utils import counters

        handles = self._hooks(model, record_inputs)
        seconds = []
        hits, misses = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
        try:
            with torch.enable_grad():
                for _ in range(2):
                    self.outputs = {}
                    start = time.perf_counter()
                    model(**self.inputs)
                    seconds.append(time.perf_counter() - start)
                    if len(seconds) == 1:
                        hits = counters["inductor"]["fxgraph_cache_hit"] - hits
                        misses = counters["inductor"]["fxgraph_cache_miss"] - misses
        finally:
            for handle in handles:
                handle.remove()
        self.timing[label] = (seconds[0], seconds[1], hits, misses)
        return self.outputs

    def run(self) -> dict[str, dict[str, tuple[float, float]]]:
        """{variant: {block: (propagated, isolated) rms difference against eager bf16}}."""
        import torch._dynamo
        import torch._dynamo.config as dynamo_config

        eager = self._forward("bf16", self.eager, record_inputs=True)
        differences: dict[str, dict[str, tuple[float, float]]] = {}
        limit = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
        saved = getattr(dynamo_config, limit)
        try:
            # Every decoder layer's forward is one code object: one cache entry per layer and variant.
            setattr(dynamo_config, limit, max(saved, len(self.names) + 8))
            for variant, arguments in BY_HAND.items():
                torch._dynamo.reset()
                compiled = copy.deepcopy(self.eager)
                executed: dict[str, int] = dict.fromkeys(self.names, 0)
                for name in self.names:
                    module = compiled.get_submodule(name)
                    module.forward = torch.compile(module.forward, backend=counted(name, arguments, executed))
                outputs = self._forward(variant, compiled)
                eager_regions = [name for name, count in executed.items() if not count]
                if eager_regions:
                    raise SystemExit(f"{variant}: regions ran eager, not compiled: {', '.join(eager_regions)}")
                isolated = {}
                with torch.enable_grad():
                    for name in self.names:
                        args, kwargs = self.calls[name]
                        isolated[name] = first_tensor(compiled.get_submodule(name)(*args, **kwargs)).detach()
                differences[variant] = {
                    name: (rms_diff(outputs[name], eager[name]), rms_diff(isolated[name], eager[name]))
                    for name in self.names
                }
        finally:
            setattr(dynamo_config, limit, saved)
            torch._dynamo.reset()
        return differences


def counted(region: str, arguments: dict[str, Any], executed: dict[str, int]) -> Callable[..., Any]:
    """The dynamo backend `arguments` name (Inductor built as torch.compile builds it, with its options), its
    compiled graphs counted in `executed[region]` when they run: a region that ran none ran eager."""
    import torch._dynamo

    if arguments["backend"] == "inductor":
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        # As the plugin does: the vector width explicit, so that it enters Inductor's FX graph cache key (which
        # leaves out the ISA ATEN_CPU_CAPABILITY picks), and the kernels compare() compiled are found again.
        options = {**arguments.get("options", {}), "cpp.simdlen": pick_vec_isa().bit_width()}
        inner = torch._TorchCompileInductorWrapper(None, options, None)  # type: ignore[attr-defined]
    else:
        inner = torch._dynamo.lookup_backend(arguments["backend"])

    def backend(graph: Any, example_inputs: Any) -> Callable[..., Any]:
        compiled = inner(graph, example_inputs)

        def run(*args: Any) -> Any:
            executed[region] += 1
            return compiled(*args)

        return run

    return backend


def against_eager_table(
    differences: dict[str, dict[str, tuple[float, float]]], report: Any, names: Sequence[str]
) -> list[str]:
    header = ["block", "bf16 vs fp32"]
    for variant in BY_HAND:
        header += [f"{VARIANTS[variant]}", f"{VARIANTS[variant]} iso"]
    header += ["inductor/bf16"]
    rows = []
    for name in names:
        own = value(report, "bf16", name, "fw")
        cells = [short(name), percent(own)]
        for variant in BY_HAND:
            propagated, isolated = differences[variant][name]
            cells += [percent(propagated), percent(isolated)]
        inductor = differences["bf16_compiled"][name][0]
        cells.append(f"{inductor / own:.2f}" if own else "-")
        rows.append(cells)
    return table(header, rows, first=10, width=14)


# --- section 3 -------------------------------------------------------------------------------------------------


def ratio_text(ratios: Sequence[float]) -> str:
    if f"{min(ratios):.3f}" == f"{max(ratios):.3f}":
        return f"{ratios[0]:.3f} in every block"
    return f"median {statistics.median(ratios):.3f}, from {min(ratios):.3f} to {max(ratios):.3f}"


def row_deviation(report: Any, variant: str, kinds: Sequence[str]) -> tuple[float, str]:
    """The largest |rms_rel / eager bf16's rms_rel - 1| over the variant's rows of `kinds`, and that row."""
    worst, where = 0.0, "-"
    for record in report.records("bf16"):
        if record.kind not in kinds or not record.rms_rel:
            continue
        obtained = value(report, variant, record.name, record.kind)
        if obtained is None:
            continue
        deviation = abs(obtained / record.rms_rel - 1)
        if deviation > worst:
            worst, where = deviation, f"{record.name} {record.kind}"
    return worst, where


def birth_conclusions(
    report: Any, names: Sequence[str], differences: dict[str, dict[str, tuple[float, float]]]
) -> list[str]:
    """What the numbers say, computed from them: each statement is a comparison of this run's numbers, and says so
    when it does not hold."""
    iso = {v: [value(report, v, n, "fw_isolated") for n in names] for v in VARIANTS}
    ratio = {v: [a / b for a, b in zip(iso[v], iso["bf16"], strict=True)] for v in COMPILED}
    isolated_diff = {v: [differences[v][n][1] for n in names] for v in BY_HAND}
    blocks = [i for i, n in enumerate(names) if BLOCK.fullmatch(n)]
    lines = []

    # Inductor against eager, per decoder layer and at the head.
    inductor = [ratio["bf16_compiled"][i] for i in blocks]
    below, above = sum(r < 1 for r in inductor), sum(r > 1 for r in inductor)
    if below == len(inductor):
        verdict = "MORE accurate than eager bf16 in every decoder layer"
    elif above == len(inductor):
        verdict = "LESS accurate than eager bf16 in every decoder layer"
    else:
        verdict = f"more accurate than eager in {below}, less in {above}, of {len(inductor)} decoder layers"
    lines.append(f"- Inductor's bf16 (bf16_compiled) is {verdict}: isolated fw error / eager's {ratio_text(inductor)}.")
    others = [i for i in range(len(names)) if i not in blocks]
    for i in others:
        same_bits = isolated_diff["bf16_compiled"][i] == 0
        lines.append(
            f"  {names[i]}: Inductor's error / eager's {ratio['bf16_compiled'][i]:.3f}"
            + ("; bit-identical to eager (one matmul: nothing to fuse)" if same_bits else "")
        )
    fw_ratio = [
        value(report, "bf16_compiled", n, "fw") / value(report, "bf16", n, "fw") for n in (names[i] for i in blocks)
    ]
    bw_names = [r.name for r in report.records("bf16", "bw") if BLOCK.fullmatch(r.name)]
    bw_ratio = [value(report, "bf16_compiled", n, "bw") / value(report, "bf16", n, "bw") for n in bw_names]
    lines.append(
        f"  propagated, Inductor's error / eager's: fw {ratio_text(fw_ratio)}; bw (block inputs' gradients) "
        f"{ratio_text(bw_ratio)}."
    )

    # aot_eager: do decompositions move the numbers?
    aot = isolated_diff["bf16_compiled_aot_eager"]
    deviation, where = row_deviation(report, "bf16_compiled_aot_eager", ("fw", "bw", "grad", "logprob"))
    if max(aot) == 0 and deviation == 0:
        claim = (
            "aot_eager MATCHES eager: each block's output is bit-identical to eager's and every fw, bw, grad and "
            "logprob row equals eager's, so decompositions do not move the numbers"
        )
    elif all(abs(r - 1) <= SAME for r in ratio["bf16_compiled_aot_eager"]):
        claim = (
            f"aot_eager is NOT bit-identical to eager (largest isolated difference {percent(max(aot))}; rows up to "
            f"{deviation:.1%} apart, {where}) but its isolated errors are within {SAME:.0%} of eager's: decompositions "
            "move the rounding, not its size"
        )
    else:
        claim = (
            f"aot_eager does NOT match eager: decompositions move the numbers (rows up to {deviation:.1%} apart, "
            f"{where})"
        )
    lines.append(f"- {claim}.")

    # emulate_precision_casts: is the difference the rounding of fused intermediates?
    emulated = isolated_diff["bf16_compiled_emulated"]
    identical = sum(d == 0 for d in emulated)
    largest, inductor_largest = max(emulated), max(isolated_diff["bf16_compiled"])
    back = all(abs(r - 1) <= SAME for r in ratio["bf16_compiled_emulated"])
    if back and largest <= 0.1 * inductor_largest:
        claim = (
            "emulate_precision_casts BRINGS Inductor BACK to eager's numbers: its isolated errors are eager's "
            f"(ratio {ratio_text(ratio['bf16_compiled_emulated'])}), its blocks bit-identical to eager's in "
            f"{identical} of {len(emulated)} (largest isolated difference {percent(largest)}, against Inductor's "
            f"{percent(inductor_largest)}): the difference is fusion keeping intermediates in fp32"
        )
    elif back:
        claim = (
            f"emulate_precision_casts gives eager's error sizes but not eager's numbers (isolated difference up to "
            f"{percent(largest)}, Inductor's {percent(inductor_largest)}): rounding intermediates explains the "
            "accuracy gap, reordering within fused kernels remains"
        )
    else:
        claim = (
            "emulate_precision_casts does NOT bring Inductor back to eager's error (isolated error / eager's "
            f"{ratio_text(ratio['bf16_compiled_emulated'])})"
        )
    lines.append(f"- {claim}.")
    deviation, where = row_deviation(report, "bf16_compiled_emulated", ("bw", "grad"))
    lines.append(
        f"  In backward, emulated's bw and grad rows are within {deviation:.1%} of eager's (largest: {where})"
        + ("." if deviation else ": the same numbers.")
    )
    return lines


def birth_table(report: Any, names: Sequence[str]) -> list[str]:
    rows = []
    for name in names:
        cells = [short(name)] + [percent(value(report, v, name, "fw_isolated")) for v in VARIANTS]
        base = value(report, "bf16", name, "fw_isolated")
        cells += [f"{value(report, v, name, 'fw_isolated') / base:.3f}" if base else "-" for v in COMPILED]
        rows.append(cells)
    header = ["fw_isolated", *VARIANTS.values(), *(f"{VARIANTS[v]}/bf16" for v in COMPILED)]
    return table(header, rows, first=10, width=15)


# --- section 4 -------------------------------------------------------------------------------------------------


def cost_lines(report: Any, timing: dict[str, tuple[float, float, int, int]]) -> list[str]:
    rows = []
    for variant in COMPILED:
        cost = report.compile_costs[variant]
        hits, misses = cost.get("fx_cache_hits", 0), cost.get("fx_cache_misses", 0)
        fx = f"{hits}/{misses}" if VARIANTS[variant] != "aot_eager" else "-"
        rows.append(
            [
                variant,
                str(cost["runs"]),
                f"{cost['compile_seconds']:.1f}",
                f"{cost['run_seconds']:.1f}",
                f"{cost['compile_seconds'] / cost['run_seconds']:.0%}",
                str(cost["compilations"]),
                fx,
            ]
        )
    header = ["compare()", "runs", "compile s", "run s", "compiling", "graphs", "fx hit/miss"]
    lines = table(header, rows, first=26, width=12)
    lines.append(
        "  by hand (section 2's copies), one forward with gradients on: the first call, which compiles (in the"
    )
    lines.append("  same Inductor cache as compare(): FX graph cache hits/misses), and the second")
    for label, (first, second, hits, misses) in timing.items():
        fx = f"   fx {hits}/{misses}" if "compiled" in label and "aot_eager" not in label else ""
        lines.append(f"    {label:<26}{first:>8.2f} s  /{second:>7.3f} s{fx}")
    return lines


# --- main ------------------------------------------------------------------------------------------------------


def study(subject: Subject) -> None:
    print(f"\n{'=' * 100}\n{subject.label}\n{subject.note}\n{'=' * 100}")
    report = compare(subject.model, subject.inputs, list(VARIANTS), isolate=True)
    names = blocks_of(report)
    for variant in COMPILED:
        compiled = report.runs[variant].compiled
        options = "".join(f", {key}={option}" for key, option in compiled["options"].items())
        isa = f", CPU code for {compiled['cpu_isa']}" if compiled.get("cpu_isa") else ""
        print(
            f"  {variant}: {compiled['scope']}, backend {compiled['backend']}{options}{isa}; "
            f"{len(compiled['regions'])} regions, {compiled['graph_breaks']} graph breaks"
        )

    section("1. Per block: rms_rel against the fp32 reference (fw: block output; bw: gradient at the block's input)")
    print("\n".join(per_block_table(report, "fw", [*names, HEAD, "logprob"])))
    print()
    print("\n".join(per_block_table(report, "bw", ["logits", HEAD, *reversed(names)])))
    print()
    print("\n".join(grad_table(report)))

    section("2. Compiled against eager bf16 (by hand): rms of the difference over rms of eager bf16's block output")
    model = subject.fp32()
    by_hand = ByHand(model, subject.inputs)
    differences = by_hand.run()
    print("\n".join(against_eager_table(differences, report, [*names, HEAD])))
    print("  <variant>: each copy runs its own forward (the difference propagated); <variant> iso: the compiled block")
    print("  on eager bf16's input for it (the difference the block adds). bf16 vs fp32: eager bf16's own error")
    print("  (section 1's fw). inductor/bf16: Inductor's propagated difference to eager over bf16's own error.")

    section("3. Where the compiled difference is born: isolated fw rms_rel (each block on the fp32 reference's input)")
    print("\n".join(birth_table(report, [*names, HEAD])))
    print("\n".join(birth_conclusions(report, [*names, HEAD], differences)))

    section("4. What compiling cost (cold Inductor cache at this model's first compiled run)")
    print("\n".join(cost_lines(report, by_hand.timing)))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--smollm", type=Path, help="local directory of SmolLM2-135M (config, weights, tokenizer)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of model (b) (default 4)")
    parser.add_argument("--batch", type=int, default=4, help="sequences of held-out text for (a) (default 4)")
    parser.add_argument("--length", type=int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument("--smollm-batch", type=int, default=2, help="sequences for (b) (default 2)")
    parser.add_argument(
        "--smollm-length", type=int, default=64, help="tokens per sequence for (b) (default 64; see SLOW_HEAD)"
    )
    parser.add_argument(
        "--cache-dir", type=Path, help="Inductor cache directory to use and keep (default: a fresh one)"
    )
    args = parser.parse_args(argv)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    started = time.perf_counter()
    fresh = None
    if args.cache_dir is None:
        fresh = tempfile.mkdtemp(prefix="compiled-science-inductor-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = fresh
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(args.cache_dir.resolve())

    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    print(f"$ python {' '.join(sys.argv)}    # torch {torch.__version__}, transformers {transformers.__version__}")
    pins = ", ".join(f"{name}={os.environ.get(name)}" for name in conftest.CPU_PINS)
    print(f"CPU pins: {pins}; Inductor vector ISA {pick_vec_isa()}, C++ compiler {get_cpp_compiler()}")
    cache = "a fresh directory (cold)" if fresh else os.environ["TORCHINDUCTOR_CACHE_DIR"]
    print(f"Inductor cache: {cache}; {torch.get_num_threads()} threads")
    print("error: rms_rel (rms of the difference over rms of the expected tensor), against the fp32 reference unless")
    print("said otherwise. Variants: bf16 (eager), inductor = bf16_compiled, aot_eager = bf16_compiled_aot_eager,")
    print("emulated = bf16_compiled_emulated (Inductor, emulate_precision_casts=True); all regional: embedding, each")
    print("decoder layer, final norm and head compiled on their own.")
    try:
        subjects: list[Callable[[], Subject]] = [
            lambda: trained_lm(args.batch, args.length),
            (
                (lambda: smollm_local(args.smollm, args.layers, args.smollm_batch, args.smollm_length))
                if args.smollm
                else (lambda: smollm_shaped(args.layers, args.smollm_batch, args.smollm_length))
            ),
        ]
        for make in subjects:
            study(make())
    finally:
        if fresh is not None:
            shutil.rmtree(fresh, ignore_errors=True)
    print(f"\nelapsed: {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
