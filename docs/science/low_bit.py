"""Low-bit formats on a trained LM: how their error orders, and where fp8's is born. `python docs/science/low_bit.py`

On the bundled trained tiny LM (tests/data/tiny-trained-lm) and its held-out text, or with `--smollm PATH` on a
local copy of SmolLM2-135M (a directory AutoModelForCausalLM.from_pretrained reads; nothing is downloaded), it
prints:

1. the ordering of per-layer and log-prob error of fp32, tf32, bf16, torchao fp8 training (rowwise, tensorwise),
   torchao quantized inference (int8 weight only, int8 dynamic, fp8 weight only) and fp8 weight storage round
   trips, sorted by the head's (last layer's) forward error; 1b. fp8 tensorwise against rowwise on disjoint
   windows of held-out text, to tell their order from batch-to-batch noise;
2. llama.cpp's KL-divergence / Δp / same-top-p table of the same runs;
3. where fp8 training's error is born, by Linear type: each Linear run on the reference's own input
   (isolate=True), median isolated rms_rel per type;
4. whether torchao's rowwise_with_gw_hp recipe lowers the weight-gradient error against rowwise.

The CPU pins of the repository's conftest (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, MKL_CBWR) are set by
importing it before torch, as for the tests. Saved output: docs/science/low_bit_results.txt.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

#: The repository's conftest, imported before torch: it sets the CPU pins torch reads when imported.
conftest = importlib.import_module("conftest")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from pytest_precision import Variant, compare  # noqa: E402

ModelFactory = Callable[[Any, Any], nn.Module]

#: Section 1's variants (built-in names). fp8_rowwise_gw_hp is left out there: its forward casts are rowwise's.
ORDERING_VARIANTS = (
    "fp32",
    "tf32",
    "bf16",
    "fp8_rowwise",
    "fp8_tensorwise",
    "int8_weight_only",
    "int8_dynamic",
    "fp8_weight_only",
    "fp8_e4m3_weights",
    "fp8_e5m2_weights",
)

#: Sections 3 and 4: bf16 (the floor every bf16 model has) and torchao's three fp8 training recipes.
FP8_RECIPES = {
    "bf16": None,
    "fp8_rowwise": "rowwise",
    "fp8_tensorwise": "tensorwise",
    "fp8_gw_hp": "rowwise_with_gw_hp",
}

#: Linear types, by the last component of the module name, in the order printed, with their group.
LINEAR_TYPES = {
    "q_proj": "attention",
    "k_proj": "attention",
    "v_proj": "attention",
    "o_proj": "attention",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
    "lm_head": "head",
}

BLOCK = re.compile(r".*layers\.\d+")
HEAD = "lm_head"


def percent(value: float | None) -> str:
    """A rate as a percentage with 3 decimals ('-' when undefined)."""
    return "-" if value is None else f"{100 * value:.3f}%"


def held_out_windows(tokenizer: Any, batch: int, length: int, count: int) -> list[dict[str, torch.Tensor]]:
    """Up to `count` disjoint `batch` x `length` windows of the trained LM's held-out text (the last 10% of its
    corpus, which it never saw) in `tokenizer`'s tokens. The first is conftest.trained_lm_text_batch's batch."""
    text = (conftest.TRAINED_LM_DIR / "corpus.txt").read_text(encoding="utf-8")
    ids = torch.tensor(tokenizer.encode(text[int(len(text) * 0.9) :], add_special_tokens=False))
    needed = batch * length
    if len(ids) < needed:
        raise SystemExit(f"the held-out text has {len(ids)} tokens, fewer than --batch x --length = {needed}")
    windows = [ids[k * needed : (k + 1) * needed].reshape(batch, length) for k in range(min(count, len(ids) // needed))]
    return [{"input_ids": window, "labels": window.clone()} for window in windows]


def trained_lm() -> tuple[ModelFactory, Any, str]:
    """The bundled trained tiny LM: a factory, its tokenizer and a label."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(conftest.TRAINED_LM_DIR)
    return conftest.load_trained_lm, tokenizer, f"trained tiny LM ({conftest.TRAINED_LM_DIR.relative_to(REPO)})"


def smollm(path: Path) -> tuple[ModelFactory, Any, str]:
    """SmolLM2-135M from the local directory `path`: a factory, its tokenizer and a label. Nothing is downloaded:
    `path` must hold the config, the weights and the tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def factory(dtype: Any = None, device: Any = "cpu") -> nn.Module:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32, local_files_only=True)
        return model.to(device).eval()

    return factory, AutoTokenizer.from_pretrained(path, local_files_only=True), f"SmolLM2-135M ({path})"


def linear_names(model: nn.Module) -> list[str]:
    """The names of the model's nn.Linear modules, in definition order."""
    return [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]


def fp8_training_names(model: nn.Module) -> list[str]:
    """The Linears fp8 training converts by default: all but the head, both dimensions multiples of 16."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name != HEAD and not (module.in_features % 16 or module.out_features % 16)
    ]


def linear_type(name: str) -> str:
    """The Linear type of a module name ('q_proj', ..., 'lm_head')."""
    return name.rsplit(".", 1)[-1]


def int8_gemm_error() -> int:
    """The largest |error| of torch._int_mm (the int8 gemm torchao's int8 dynamic quantization runs on CPU)
    against the exact product, on random int8 operands of the full range: 0 where the kernel is exact."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (64, 256), dtype=torch.int8, generator=generator)
    b = torch.randint(-127, 128, (256, 64), dtype=torch.int8, generator=generator)
    return int((torch._int_mm(a, b).long() - a.long() @ b.long()).abs().max())


def print_header(label: str, inputs: dict[str, torch.Tensor]) -> None:
    """The command, versions, CPU pins and input shape."""
    import torchao

    print(f"$ python {' '.join(sys.argv)}    # torch {torch.__version__}, torchao {torchao.__version__}")
    pins = ", ".join(f"{name}={os.environ.get(name)}" for name in conftest.CPU_PINS)
    print(f"model: {label}; held-out text, input_ids {tuple(inputs['input_ids'].shape)}; CPU pins: {pins}")
    print("error: rms_rel against the fp32 reference; fw: forward outputs; logprob: chosen-token log-probabilities")


def section(title: str) -> None:
    print(f"\n{title}\n{'-' * len(title)}")


def ordering_table(report: Any, variants: Iterable[str]) -> list[str]:
    """Section 1's rows: per variant, the median and max fw rms_rel over the blocks, the head's fw rms_rel and
    the logprob rms_rel and mean KL, sorted by the head's error."""
    rows = []
    for variant in variants:
        blocks = [r.rms_rel for r in report.records(variant, "fw") if BLOCK.fullmatch(r.name)]
        logprob = report.get(variant, "logprob", "logprob")
        head = report.get(variant, HEAD, "fw").rms_rel
        rows.append((head, variant, statistics.median(blocks), max(blocks), logprob.rms_rel, logprob.kl_mean))
    rows.sort(key=lambda row: row[0])
    lines = [f"  {'variant':<18}{'blocks med':>12}{'blocks max':>12}{'lm_head':>10}{'logprob':>10}{'KL mean':>11}"]
    for head, variant, median, largest, logprob_rms, kl in rows:
        lines.append(
            f"  {variant:<18}{percent(median):>12}{percent(largest):>12}{percent(head):>10}"
            f"{percent(logprob_rms):>10}{kl:>11.3e}"
        )
    return lines


def ordering_notes(report: Any) -> list[str]:
    """What sets a number of section 1 apart from the format it names: a tf32 that computes as fp32, an int8
    gemm that is not exact here."""
    notes = [
        "  fw of fp8_rowwise_gw_hp = fp8_rowwise (same forward casts); lm_head is high precision in every low-bit",
        "  variant (torchao's recipes keep the head out): its error is propagated from the blocks, plus bf16's.",
        "  int8_weight_only, int8_dynamic, fp8_weight_only: torchao quantize_, forward only (no backward rows).",
    ]
    if report.get("tf32", HEAD, "fw").rms_rel == 0:
        notes.append("  tf32 is bit-identical to fp32 here: these CPU matmuls have no TF32 path.")
    error = int8_gemm_error()
    if error:
        isa = os.environ.get("ONEDNN_MAX_CPU_ISA")
        notes += [
            f"  CAVEAT int8_dynamic: its int8 gemm (torch._int_mm) is not exact with ONEDNN_MAX_CPU_ISA={isa}: max",
            f"  |error| {error} on random full-range int8 64x256 @ 256x64. Without VNNI, pairs of u8*s8 products are",
            "  summed in saturating int16; its rows hold that overflow on top of int8 rounding. On a CPU with VNNI,",
            "  ONEDNN_MAX_CPU_ISA=AVX2_VNNI (or unset) runs an exact int8 gemm.",
        ]
    return notes


def window_spread(
    factory: ModelFactory, windows: Sequence[dict[str, torch.Tensor]], pair: tuple[str, str]
) -> list[str]:
    """Section 1b: the two variants' lm_head fw rms_rel and mean KL on each held-out window (forward only), and
    in how many windows the first is below the second."""
    first, second = pair
    lines = [f"  {'window':<8}" + "".join(f"{f'{v} lm_head':>24}{f'{v} KL':>22}" for v in pair)]
    below = {"lm_head": 0, "KL": 0}
    for index, inputs in enumerate(windows):
        report = compare(factory, inputs, list(pair), backward=False)
        head = {v: report.get(v, HEAD, "fw").rms_rel for v in pair}
        kl = {v: report.get(v, "logprob", "logprob").kl_mean for v in pair}
        below["lm_head"] += head[first] < head[second]
        below["KL"] += kl[first] < kl[second]
        lines.append(f"  {index:<8}" + "".join(f"{percent(head[v]):>24}{kl[v]:>22.3e}" for v in pair))
    lines.append(
        f"  {first} below {second}: lm_head in {below['lm_head']} of {len(windows)} windows, "
        f"KL mean in {below['KL']} of {len(windows)}"
    )
    return lines


def isolation_variants() -> list[Variant]:
    """bf16 and the three fp8 training recipes, each with isolated rows."""
    return [
        Variant(f"{name}_iso", dtype="bfloat16", fp8_training=recipe, isolate=True)
        for name, recipe in FP8_RECIPES.items()
    ]


def birth_notes(linears: int, converted: int) -> list[str]:
    """What section 3's tables hold, and what each fp8 training recipe casts."""
    return [
        f"  {linears} Linear modules, {converted} of them in fp8. The head (lm_head) is excluded from fp8 by default,",
        "  as torchao's recipes keep it in high precision: its row is the same bf16 error in every column.",
        "  fw_isolated: each module's forward on the reference's input; bw_isolated: its input gradient from the",
        "  reference's output gradient. The recipes (torchao.float8.config): tensorwise casts input and weight to",
        "  e4m3 and grad_output to e5m2, one scale per tensor; rowwise casts all three to e4m3, one power-of-2",
        "  scale per row; gw_hp (rowwise_with_gw_hp) is rowwise with grad_input's weight scaled per tensor and",
        "  grad_weight = input @ grad_output in high precision (bf16 here).",
    ]


def by_type(report: Any, variant: str, kind: str) -> dict[str, list[float]]:
    """rms_rel of the variant's `kind` rows of Linear modules, by Linear type."""
    values: dict[str, list[float]] = {}
    for record in report.records(variant, kind):
        if linear_type(record.name) in LINEAR_TYPES:
            values.setdefault(linear_type(record.name), []).append(record.rms_rel)
    return values


def birth_table(report: Any, kind: str) -> list[str]:
    """Section 3's rows for one isolated kind: median rms_rel per Linear type and per group, per variant."""
    names = list(FP8_RECIPES)
    per_variant = {name: by_type(report, f"{name}_iso", kind) for name in names}
    counts = {t: len(per_variant["bf16"].get(t, [])) for t in LINEAR_TYPES}
    lines = [f"  {kind:<16}{'n':>3}" + "".join(f"{name:>16}" for name in names)]
    for group in dict.fromkeys(LINEAR_TYPES.values()):
        types = [t for t, g in LINEAR_TYPES.items() if g == group and counts[t]]
        rows = [(t, [t]) for t in types] + ([(group, types)] if len(types) > 1 else [])
        for label, members in rows:
            n = sum(counts[t] for t in members)
            cells = []
            for name in names:
                values = [v for t in members for v in per_variant[name].get(t, [])]
                cells.append(percent(statistics.median(values)) if values else "-")
            lines.append(f"  {label:<16}{n:>3}" + "".join(f"{cell:>16}" for cell in cells))
    return lines


def gradient_table(report: Any, fp8_linears: Sequence[str]) -> list[str]:
    """Section 4's rows: median and max grad (propagated) and grad_isolated (born in the module) rms_rel over the
    weights of the Linears that take fp8, per variant."""
    weights = {f"{name}.weight" for name in fp8_linears}
    header = f"  {'variant':<16}{'grad med':>11}{'grad max':>11}{'grad_iso med':>14}{'grad_iso max':>14}"
    lines = [header]
    for name in FP8_RECIPES:
        cells = []
        for kind in ("grad", "grad_isolated"):
            values = [r.rms_rel for r in report.records(f"{name}_iso", kind) if r.name in weights]
            cells += [percent(statistics.median(values)), percent(max(values))]
        lines.append(f"  {name:<16}{cells[0]:>11}{cells[1]:>11}{cells[2]:>14}{cells[3]:>14}")
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--smollm", type=Path, help="local directory of SmolLM2-135M (config, weights, tokenizer)")
    parser.add_argument("--batch", type=int, default=4, help="sequences of held-out text (default 4)")
    parser.add_argument("--length", type=int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument("--windows", type=int, default=8, help="held-out windows of section 1b (default 8)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    factory, tokenizer, label = smollm(args.smollm) if args.smollm else trained_lm()
    windows = held_out_windows(tokenizer, args.batch, args.length, args.windows)
    inputs = windows[0]
    if not args.smollm:
        expected = conftest.trained_lm_text_batch(batch=args.batch, length=args.length)["input_ids"]
        assert torch.equal(inputs["input_ids"], expected), "window 0 is not conftest.trained_lm_text_batch's batch"
    print_header(label, inputs)

    report = compare(factory, inputs, list(ORDERING_VARIANTS))
    section("1. Ordering: forward error per block, at the head (lm_head) and of log-probs, sorted by lm_head")
    print("\n".join(ordering_table(report, ORDERING_VARIANTS)))
    print("\n".join(ordering_notes(report)))

    section("1b. Is fp8 tensorwise vs rowwise a real order? The same pair on disjoint held-out windows")
    print("\n".join(window_spread(factory, windows, ("fp8_tensorwise", "fp8_rowwise"))))

    section("2. llama.cpp's KL-divergence statistics (variant against the fp32 reference), window 0")
    print(report.format_kl_divergence())

    model = factory(None, "cpu")
    linears, fp8_linears = linear_names(model), fp8_training_names(model)
    isolated = compare(factory, inputs, isolation_variants(), modules=[re.escape(name) for name in linears])
    converted = isolated.runs["fp8_rowwise_iso"].lowbit["modules"]
    assert converted == len(fp8_linears), f"torchao converted {converted} Linears, expected {len(fp8_linears)}"
    section("3. Where fp8 training's error is born: median isolated rms_rel per Linear type")
    print("\n".join(birth_notes(len(linears), converted)))
    for kind in ("fw_isolated", "bw_isolated"):
        print()
        print("\n".join(birth_table(isolated, kind)))

    section("4. Does rowwise_with_gw_hp lower the weight-gradient error? (weights of the fp8 Linears)")
    print("\n".join(gradient_table(isolated, fp8_linears)))
    print("  grad: the full backward's error (propagated); grad_iso: the error the module's own weight-gradient")
    print("  gemm adds, on the reference's input and output gradient (window 0, as section 3).")
    print(f"\nelapsed: {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
