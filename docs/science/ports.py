"""Two implementations of one model: torchtune's Llama against transformers'. `python docs/science/ports.py`

On the repository's tiny Llama (conftest.tiny_llama(layers=2): hidden 64, 4 heads, 2 KV heads, vocabulary 256,
rms_norm_eps 1e-6, random weights, torch.manual_seed(0)) and 2 x 16 random tokens, with the module selection of
tests/engine/test_port_torchtune.py (every block, its norms, attention, MLP and their projections), it prints:

(a) the port check of the faithful torchtune port (pytest_precision.ports.torchtune_llama) in fp32: does every row
    agree with transformers' fp32 to rounding, and the largest row, in units u = 2^-24 (fp32's unit roundoff);
(b) five port bugs, planted one at a time in a copy of torchtune's model (the planting code of the test file): the
    row the port check names first, its rms_rel, in units u and in multiples of the limit (1e-4); and every row
    before it, to show that the divergence starts there;
(c) the precision check at block level: torchtune in bf16 against transformers in bf16, each against the fp32
    reference, with the ratio; the loss and the logits' gradient over eight batches, to tell a real ratio from a
    lucky one;
(d) a precision bug (RMSNorm computed in bf16, where transformers upcasts to fp32): it passes the port check and the
    ratio gate names its first norm.

The CPU pins of the repository's conftest (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, MKL_CBWR) are set by importing it
before torch, as for the tests. Needs torchtune (0.6.1 was run). Saved output: docs/science/ports_results.txt.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

#: The repository's conftest, imported before torch: it sets the CPU pins torch reads when imported.
conftest = importlib.import_module("conftest")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from pytest_precision import PrecisionReport, Variant, compare  # noqa: E402
from pytest_precision.ports import Port, torchtune_llama  # noqa: E402
from pytest_precision.reports.ports import FP32_ROUNDOFF, PORT_CHECK_LIMIT, port_verdict, ratio_rows  # noqa: E402

#: The module selection of tests/engine/test_port_torchtune.py.
MODULES = [
    r"model\.embed_tokens",
    r"model\.layers\.\d+",
    r"model\.layers\.\d+\.(input_layernorm|post_attention_layernorm|self_attn|mlp)",
    r"model\.layers\.\d+\.self_attn\.[qkvo]_proj",
    r"model\.layers\.\d+\.mlp\.(gate|up|down)_proj",
    r"model\.norm",
    "lm_head",
]
PORT = torchtune_llama()
#: ratio_rows leaves the loss row out unless its factor names "loss": every row here, the loss included.
WITH_LOSS = {"*": 2.0, "loss": 2.0}


def batch(seed: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


# --- the planted bugs: the code of tests/engine/test_port_torchtune.py ----------------------------------------------


def planted(bug: Callable[[nn.Module], None], name: str) -> Port:
    """The torchtune port whose model, built as torchtune builds it, then gets `bug`."""
    build = PORT.model

    def buggy(reference: nn.Module) -> nn.Module:
        other = build(reference)
        bug(other)
        return other

    return dataclasses.replace(PORT, model=buggy, name=name)


def norm_epsilon(other: nn.Module) -> None:
    other.layers[1].sa_norm.eps = 1e-5  # the reference's rms_norm_eps is 1e-6


def rotary_base(other: nn.Module) -> None:
    from torchtune.modules import RotaryPositionalEmbeddings

    for layer in other.layers:
        rope = layer.attn.pos_embeddings
        layer.attn.pos_embeddings = RotaryPositionalEmbeddings(rope.dim, rope.max_seq_len, base=500_000)


def head_order(other: nn.Module) -> None:
    # The heads of q and k reversed after RoPE (torchtune shares one RoPE module between layers: hooked once).
    shared = {id(layer.attn.pos_embeddings): layer.attn.pos_embeddings for layer in other.layers}
    for rope in shared.values():
        rope.register_forward_hook(lambda _m, _a, out: out.flip(2))


def attention_scale(other: nn.Module) -> None:
    for layer in other.layers:
        attention = layer.attn
        call = attention._attention_call
        scale = math.sqrt(attention.head_dim)
        attention._attention_call = lambda q, k, v, _call=call, _scale=scale, **kw: _call(q * _scale, k, v, **kw)


def missing_residual(other: nn.Module) -> None:
    def forward(self: nn.Module, x: torch.Tensor, **_: Any) -> torch.Tensor:
        normed = self.sa_norm(x)
        h = self.sa_scale(self.attn(normed, normed)) + x
        return self.mlp_scale(self.mlp(self.mlp_norm(h)))  # the MLP's residual, h + ..., left out

    other.layers[1].forward = types.MethodType(forward, other.layers[1])


def low_precision_norms(other: nn.Module) -> None:
    """RMSNorm in the model's dtype, not upcast to fp32 as transformers' LlamaRMSNorm is."""

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.scale

    for module in other.modules():
        if type(module).__name__ == "RMSNorm":
            module.forward = types.MethodType(forward, module)


BUGS = {
    "norm_epsilon": (norm_epsilon, "layer 1's attention norm: eps 1e-5 instead of the reference's 1e-6"),
    "rotary_base": (rotary_base, "RoPE base 500000 instead of 10000"),
    "head_order": (head_order, "q and k heads reversed after RoPE"),
    "attention_scale": (attention_scale, "attention logits scaled by 1 instead of 1/sqrt(head_dim)"),
    "missing_residual": (missing_residual, "layer 1's MLP residual left out"),
}


# --- output ------------------------------------------------------------------------------------------------------


def section(title: str) -> None:
    print(f"\n{title}\n{'-' * len(title)}")


def percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.4f}%"


def units(value: float | None) -> str:
    return "-" if value is None else f"{value / FP32_ROUNDOFF:.3g} u"


def port_check(model: nn.Module) -> None:
    section("(a) The port check: torchtune_llama in fp32 against transformers' fp32")
    report = compare(model, batch(), [Variant("torchtune_fp32", implementation=PORT)], modules=MODULES)
    verdict = port_verdict(report, "torchtune_fp32")
    print(f"  {verdict}")
    rows = [r for kind in ("fw", "logprob", "loss", "bw", "grad") for r in report.records("torchtune_fp32", kind)]
    values = sorted(r.rms_rel for r in rows if r.rms_rel is not None)
    print(f"  {len(rows)} rows; rms_rel median {units(statistics.median(values))}, largest {units(values[-1])}")
    for kind in ("fw", "bw", "grad"):
        kind_values = [r.rms_rel for r in report.records("torchtune_fp32", kind) if r.rms_rel is not None]
        print(f"    {kind:<5} {len(kind_values):>3} rows: largest {units(max(kind_values))}")
    for name in ("model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj"):
        row = report.get("torchtune_fp32", name, "fw")
        print(f"  {name} (fw), through its adapter (interleaved RoPE pairs -> halves): {units(row.rms_rel)}")
    print(f"  limit: rms_rel {PORT_CHECK_LIMIT:.0e} = {PORT_CHECK_LIMIT / FP32_ROUNDOFF:.0f} u")


def planted_bugs(model: nn.Module) -> None:
    section("(b) Port bugs planted one at a time: the first row above the limit, in execution order")
    variants = [Variant(f"bug_{name}", implementation=planted(bug, name)) for name, (bug, _) in BUGS.items()]
    report = compare(model, batch(), variants=variants, modules=MODULES)
    print("  | bug | first row named | its rms_rel | in units u (2^-24) | times the limit |")
    print("  | --- | --- | --- | --- | --- |")
    details = []
    for name, (_, what) in BUGS.items():
        verdict = port_verdict(report, f"bug_{name}")
        first = verdict.first
        assert first is not None and first.rms_rel is not None, str(verdict)
        print(
            f"  | `{name}` | `{first.name}` ({first.kind}) | {first.rms_rel:.3g} | {first.rms_rel / FP32_ROUNDOFF:.3g} "
            f"| {first.rms_rel / PORT_CHECK_LIMIT:.3g} |"
        )
        fw = report.records(f"bug_{name}", "fw")
        before = fw[: fw.index(first)]
        largest_before = max((r.rms_rel or 0.0 for r in before), default=0.0)
        details.append(f"  {name}: {what}; {len(before)} fw rows before it, largest {units(largest_before)}")
    print()
    print("\n".join(details))


def block_rows(report: PrecisionReport, ours: str, theirs: str) -> list[Any]:
    blocks = {"model.embed_tokens", "model.norm", "lm_head", "logits"}
    grads = {
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.embed_tokens.weight",
    }
    rows = []
    for row in ratio_rows(report, ours, theirs, factor=WITH_LOSS):
        block = row.name in blocks or (row.name.startswith("model.layers.") and row.name.count(".") == 2)
        if (
            row.kind in ("logprob", "loss")
            or (row.kind in ("fw", "bw") and block)
            or (row.kind == "grad" and row.name in grads)
        ):
            rows.append(row)
    return rows


def precision_check(model: nn.Module) -> None:
    section("(c) The precision check: torchtune_llama in bf16 against transformers in bf16 (each against fp32)")
    variants = ["bf16", Variant("torchtune_bf16", dtype="bf16", implementation=PORT)]
    report = compare(model, batch(), variants=variants, modules=MODULES)
    print(f"  {'row':<52} {'torchtune bf16':>15} {'transformers bf16':>18} {'ratio':>7}")
    for row in block_rows(report, "torchtune_bf16", "bf16"):
        label = f"{row.name} ({row.kind})"
        print(f"  {label:<52} {percent(row.ours):>15} {percent(row.theirs):>18} {row.ratio:>7.3f}")
    every = ratio_rows(report, "torchtune_bf16", "bf16", factor=WITH_LOSS)
    others = [r for r in every if not (r.kind == "loss" or (r.name == "logits" and r.kind == "bw"))]
    print(
        f"  every row but the loss and the logits' gradient ({len(others)} rows): ratio "
        f"{min(r.ratio for r in others):.3f} to {max(r.ratio for r in others):.3f}, median "
        f"{statistics.median(r.ratio for r in others):.3f}"
    )
    worst = max(others, key=lambda r: r.ratio)
    print(f"    largest at {worst.name} ({worst.kind})")

    print("\n  the loss and the logits' gradient over eight batches (seeds 0-7 of the token generator):")
    print(f"  {'seed':<6} {'loss: tt':>10} {'hf':>10} {'ratio':>7}   {'logits bw: tt':>14} {'hf':>10} {'ratio':>7}")
    loss_ratios, logits_ratios = [], []
    for seed in range(8):
        seeded = compare(model, batch(seed), variants=variants, modules=MODULES)
        rows = {(r.name, r.kind): r for r in ratio_rows(seeded, "torchtune_bf16", "bf16", factor=WITH_LOSS)}
        loss = next(r for r in rows.values() if r.kind == "loss")
        logits_bw = rows[("logits", "bw")]
        loss_ratios.append(loss.ratio)
        logits_ratios.append(logits_bw.ratio)
        print(
            f"  {seed:<6} {percent(loss.ours):>10} {percent(loss.theirs):>10} {loss.ratio:>7.3f}   "
            f"{percent(logits_bw.ours):>14} {percent(logits_bw.theirs):>10} {logits_bw.ratio:>7.3f}"
        )
    print(
        f"  loss ratio: median {statistics.median(loss_ratios):.3f}, range {min(loss_ratios):.3f} to "
        f"{max(loss_ratios):.3f}; logits bw ratio: median {statistics.median(logits_ratios):.3f}, range "
        f"{min(logits_ratios):.3f} to {max(logits_ratios):.3f}"
    )
    print("  torchtune's TransformerDecoder returns output(h).float(): bf16 logits cast to fp32, so the gradient")
    print("  at the logits is computed in fp32; transformers' bf16 model returns bf16 logits and their gradient.")


def precision_bug(model: nn.Module) -> None:
    section("(d) A precision bug: RMSNorm in bf16 (transformers upcasts to fp32)")
    port = planted(low_precision_norms, "bf16_norms")
    variants = [
        "bf16",
        Variant("ours_fp32", implementation=port),
        Variant("ours_bf16", dtype="bf16", implementation=port),
    ]
    report = compare(model, batch(), variants=variants, modules=MODULES, backward=False)
    print(f"  {port_verdict(report, 'ours_fp32')}")
    rows = ratio_rows(report, "ours_bf16", "bf16")
    for row in rows:
        if row.name.endswith("layernorm") or row.name == "model.norm":
            label = f"{row.name} ({row.kind})"
            print(f"  {label:<52} {percent(row.ours):>10} {percent(row.theirs):>10} {row.ratio:>7.3f}")
    first = next(r for r in rows if r.ratio > 1.3)
    print(f"  first row above 1.3x in execution order: {first.name} ({first.kind}), ratio {first.ratio:.3f}")


def main() -> None:
    started = time.perf_counter()
    import torchtune

    pins = ", ".join(f"{name}={os.environ.get(name)}" for name in conftest.CPU_PINS)
    print(f"$ python docs/science/ports.py    # torch {torch.__version__}, torchtune {torchtune.__version__}")
    print(f"model: conftest.tiny_llama(layers=2); input_ids (2, 16), labels = input_ids; CPU pins: {pins}")
    print("error: rms_rel against the fp32 reference (transformers' LlamaForCausalLM in fp32); u = 2^-24")
    model = conftest.tiny_llama(layers=2)
    port_check(model)
    planted_bugs(model)
    precision_check(model)
    precision_bug(model)
    print(f"\nelapsed: {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
