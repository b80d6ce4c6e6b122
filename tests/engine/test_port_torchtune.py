"""A real second implementation: torchtune's Llama (code nobody here wrote, with torchtune's own weight conversion)
against transformers' LlamaForCausalLM. The port check, the precision check, the weights check, and port bugs planted
one at a time in a copy of torchtune's model, each named at the right module first.

Needs torchtune (`pip install torchtune`, in .ci/run's main environment); skipped where it is not installed."""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from conftest import tiny_llama
from pytest_precision import ConfigurationError, NotSupportedHere, PrecisionReport, Variant, compare
from pytest_precision.ports import Port, assert_port_agrees, assert_port_within, torchtune_llama
from pytest_precision.reports.ports import PORT_CHECK_LIMIT, port_verdict, ratio_rows

pytestmark = pytest.mark.needs_torchtune

#: Every block, its norms, attention, MLP and their projections: the port check can name the module a bug lives in.
MODULES = [
    r"model\.embed_tokens",
    r"model\.layers\.\d+",
    r"model\.layers\.\d+\.(input_layernorm|post_attention_layernorm|self_attn|mlp)",
    r"model\.layers\.\d+\.self_attn\.[qkvo]_proj",
    r"model\.layers\.\d+\.mlp\.(gate|up|down)_proj",
    r"model\.norm",
    "lm_head",
]


def batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


_PORT: list[Port] = []


def the_port() -> Port:
    """torchtune's port, imported when a test first needs it (not at collection: torchtune imports datasets, pandas
    and torchao), or the test skipped saying what to install."""
    if not _PORT:
        try:
            _PORT.append(torchtune_llama())
        except NotSupportedHere as missing:  # pragma: no cover - CI's main environment installs torchtune
            pytest.skip(str(missing))
    return _PORT[0]


@pytest.fixture(scope="module")
def model() -> nn.Module:
    return tiny_llama(layers=2)


@pytest.fixture(scope="module")
def report(model: nn.Module) -> PrecisionReport:
    port = the_port()
    variants = [
        "bf16",
        Variant("torchtune_fp32", implementation=port),
        Variant("torchtune_bf16", dtype="bf16", implementation=port),
    ]
    return compare(model, batch(), variants=variants, modules=MODULES)


def test_the_faithful_port_agrees_to_rounding_in_every_row(report: PrecisionReport) -> None:
    verdict = port_verdict(report, "torchtune_fp32")
    assert verdict.agrees, str(verdict)
    assert verdict.largest is not None and verdict.largest.rms_rel is not None
    assert verdict.largest.rms_rel < 1e-5  # a few tens of units of fp32 rounding, far below the limit
    checked = [r for kind in ("fw", "logprob", "loss", "bw", "grad") for r in report.records("torchtune_fp32", kind)]
    assert any(r.rms_rel == 0 for r in checked)  # the embedding: a lookup, exact
    assert verdict.largest.rms_rel == max(r.rms_rel for r in checked if r.rms_rel is not None)
    assert "agrees to rounding" in str(verdict)
    assert_port_agrees(report, "torchtune_fp32")


def test_rows_are_named_by_the_reference_and_cover_forward_backward_and_every_parameter(
    report: PrecisionReport, model: nn.Module
) -> None:
    ours = {(r.name, r.kind) for r in report.records("torchtune_bf16")}
    theirs = {(r.name, r.kind) for r in report.records("bf16")}
    assert ours == theirs  # every row of the reference implementation's bf16 run, by the same names
    grads = {r.name for r in report.records("torchtune_bf16", "grad")}
    assert grads == {name for name, _ in model.named_parameters()}
    facts = report.runs["torchtune_bf16"].port
    assert facts is not None and facts["weights_checked"] == len(list(model.parameters()))
    assert facts["unmapped_reference"] == [] and facts["unmapped_implementation"] == []


def test_the_q_and_k_projections_agree_through_their_adapter(report: PrecisionReport) -> None:
    """torchtune rotates interleaved pairs, transformers the two halves of each head: the rows of q_proj and k_proj only
    agree when the adapter reorders the output columns as hf_to_tune reorders the weights."""
    for name in ("model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj"):
        row = report.get("torchtune_fp32", name, "fw")
        assert row.rms_rel is not None and row.rms_rel < 1e-6


def test_our_bf16_is_within_a_factor_of_theirs_row_by_row(report: PrecisionReport) -> None:
    rows = ratio_rows(report, "torchtune_bf16", "bf16")
    assert len(rows) == len(report.records("bf16")) - 1  # every row but the loss, which counts only when named
    assert max(r.ratio for r in rows) < 1.3
    assert_port_within(report, "torchtune_bf16", "bf16", factor=1.3)
    # torchtune's output projection returns fp32 logits: the gradient at the logits is ten times closer to the
    # reference's than transformers' bf16 (docs/science/ports.py: 0.09 to 0.11 over eight batches). The loss is one
    # scalar: its ratio is noise (0.18 to 24 over the same batches), counted only when the factor names it.
    named = ratio_rows(report, "torchtune_bf16", "bf16", factor={"*": 1.3, "loss": 1.0})
    assert [r.kind for r in named].count("loss") == 1
    assert report.get("torchtune_bf16", "logits", "bw").rms_rel < 0.2 * report.get("bf16", "logits", "bw").rms_rel


def test_the_report_says_the_verdict_and_the_ratio(report: PrecisionReport) -> None:
    text = report.format(full=False)
    assert "torchtune_fp32: implementation torchtune_llama (TransformerDecoder), 21 parameters equal" in text
    assert "port check torchtune_fp32" in text and "agrees to rounding" in text
    assert "torchtune_bf16" in text and "against bf16: rms_rel ratio median" in text


def planted(bug: Callable[[nn.Module], None], name: str) -> Port:
    """The torchtune port whose model, built as torchtune builds it, then gets `bug`."""
    build = the_port().model

    def buggy(reference: nn.Module) -> nn.Module:
        other = build(reference)
        bug(other)
        return other

    return dataclasses.replace(the_port(), model=buggy, name=name)


def norm_epsilon(other: nn.Module) -> None:
    other.layers[1].sa_norm.eps = 1e-5  # the reference's rms_norm_eps is 1e-6


def rotary_base(other: nn.Module) -> None:
    from torchtune.modules import RotaryPositionalEmbeddings

    for layer in other.layers:
        rope = layer.attn.pos_embeddings
        layer.attn.pos_embeddings = RotaryPositionalEmbeddings(rope.dim, rope.max_seq_len, base=500_000)


def head_order(other: nn.Module) -> None:
    # The heads of q and k reversed after RoPE (torchtune shares one RoPE module between layers: hooked once): each
    # query still meets its key, but the values and the output projection see the heads in the wrong order.
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


BUGS = {
    "norm_epsilon": (norm_epsilon, "model.layers.1.input_layernorm"),
    "rotary_base": (rotary_base, "model.layers.0.self_attn.o_proj"),
    "head_order": (head_order, "model.layers.0.self_attn.o_proj"),
    "attention_scale": (attention_scale, "model.layers.0.self_attn.o_proj"),
    "missing_residual": (missing_residual, "model.layers.1"),
}


@pytest.fixture(scope="module")
def bugs_report(model: nn.Module) -> PrecisionReport:
    variants = [Variant(f"bug_{name}", implementation=planted(bug, name)) for name, (bug, _) in BUGS.items()]
    return compare(model, batch(), variants=variants, modules=MODULES)


@pytest.mark.parametrize("bug", list(BUGS))
def test_a_planted_port_bug_is_named_at_its_module_first(bugs_report: PrecisionReport, bug: str) -> None:
    verdict = port_verdict(bugs_report, f"bug_{bug}")
    assert verdict.first is not None, str(verdict)
    assert (verdict.first.name, verdict.first.kind) == (BUGS[bug][1], "fw"), str(verdict)
    assert verdict.first.rms_rel is not None and verdict.first.rms_rel > 10 * PORT_CHECK_LIMIT  # far above rounding
    with pytest.raises(AssertionError, match=rf"first divergence at {BUGS[bug][1]} \(fw\)"):
        assert_port_agrees(bugs_report, f"bug_{bug}")
    # Every row before it agrees to fp32 rounding: the divergence starts there.
    rows = [r for r in bugs_report.records(f"bug_{bug}", "fw")]
    before = rows[: rows.index(verdict.first)]
    assert before and all(r.rms_rel is not None and r.rms_rel < 1e-5 for r in before)


def test_a_bf16_port_computing_its_norms_in_bf16_fails_the_ratio_gate(model: nn.Module) -> None:
    """A precision bug, not a port bug: RMSNorm in the low dtype instead of fp32 (transformers upcasts) agrees in fp32
    and loses precision in bf16 (1.4 times transformers' error at the first norm): the ratio gate names that row, where
    the faithful port stays below 1.3 in every row (test above)."""

    def low_precision_norms(other: nn.Module) -> None:
        def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.scale

        for module in other.modules():
            if type(module).__name__ == "RMSNorm":
                module.forward = types.MethodType(forward, module)

    port = planted(low_precision_norms, "bf16_norms")
    variants = [
        "bf16",
        Variant("ours_fp32", implementation=port),
        Variant("ours_bf16", dtype="bf16", implementation=port),
    ]
    report = compare(model, batch(), variants=variants, modules=MODULES, backward=False)
    assert_port_agrees(report, "ours_fp32")
    with pytest.raises(AssertionError, match=r"port ratio ours_bf16 vs bf16: model\.layers\.0\.input_layernorm \(fw\)"):
        assert_port_within(report, "ours_bf16", "bf16", factor=1.3)


def test_two_implementations_holding_different_weights_are_refused_naming_the_parameter(model: nn.Module) -> None:
    torch.manual_seed(1)
    own = the_port().model(model)  # torchtune's own initialisation, not the reference's weights
    port = dataclasses.replace(the_port(), model=own, load_weights=False)
    with pytest.raises(ConfigurationError, match=r"parameter 'model\.embed_tokens\.weight' differs"):
        compare(model, batch(), variants=[Variant("theirs_weights", implementation=port)])


def test_a_config_the_port_cannot_build_is_refused_by_name() -> None:
    tied = tiny_llama(layers=1, tied=True)
    with pytest.raises(ConfigurationError, match=r"tie_word_embeddings=True"):
        compare(tied, batch(), variants=[Variant("tt", implementation=the_port())])


def test_isolated_rows_place_a_port_bug_in_its_block_alone(model: nn.Module) -> None:
    """Propagated rows carry a bug downstream; isolated rows (each block on the reference's input) put it in the
    block it is in: layer 1's norm epsilon shows in layer 1's isolated row, layer 0's stays at rounding."""
    port = planted(norm_epsilon, "norm_epsilon")
    report = compare(model, batch(), variants=[Variant("bug", implementation=port, isolate=True)])
    layer0, layer1 = (report.get("bug", f"model.layers.{i}", "fw_isolated").rms_rel for i in (0, 1))
    assert layer0 is not None and layer0 < 1e-6
    assert layer1 is not None and layer1 > 10 * PORT_CHECK_LIMIT
    assert report.get("bug", "model.norm", "fw_isolated").rms_rel < 1e-6  # downstream, on the reference's input
    assert report.get("bug", "model.norm", "fw").rms_rel > 10 * PORT_CHECK_LIMIT  # propagated, it inherits the bug
