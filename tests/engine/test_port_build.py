"""Another implementation of the reference model compared against it (engine/port_build.py, the runner's port runs,
reports/ports.py and pytest_precision.ports): its weights loaded and checked through the parameter map, its tensors
renamed and adapted into the reference's rows, its gradients converted back, and the port check and ratio gate.

The models: `Ref`, blocks.{i}.a/.b/.norm in [batch, seq, hidden]; `Other`, the same function with the two linears of a
block fused into one weight (layers.{i}.ab), the input projection stored transposed and a seq-first layout inside its
layers. Most tests share one comparison (`report`)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import pytest_precision as pp
from pytest_precision.base.errors import ConfigurationError, ModelRunError
from pytest_precision.engine.port_build import build_port_model
from pytest_precision.engine.port_weights import ParameterMap, check_same_weights
from pytest_precision.ports import (
    Adapted,
    Converted,
    Fused,
    Port,
    Transposed,
    assert_port_agrees,
    assert_port_within,
    causal_lm_forward,
    causal_lm_loss,
    seq_first,
)
from pytest_precision.reports.ports import (
    PORT_CHECK_LIMIT,
    partner,
    port_lines,
    port_variants,
    port_verdict,
    ratio_rows,
    side_by_side,
)

D, LAYERS = 16, 3


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.tanh(self.a(self.norm(x))))


class Ref(nn.Module):
    def __init__(self, d: int = D, n: int = LAYERS) -> None:
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.out = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


class OBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ab = nn.Parameter(torch.zeros(2 * d, d))
        self.ab_bias = nn.Parameter(torch.zeros(2 * d))
        self.ln = nn.LayerNorm(d)
        self.d = d

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [seq, batch, d]
        w1, w2 = self.ab[: self.d], self.ab[self.d :]
        b1, b2 = self.ab_bias[: self.d], self.ab_bias[self.d :]
        return x + torch.tanh(self.ln(x) @ w1.T + b1) @ w2.T + b2


class Other(nn.Module):
    def __init__(self, d: int = D, n: int = LAYERS) -> None:
        super().__init__()
        self.proj_in = nn.Parameter(torch.zeros(8, d))
        self.proj_in_bias = nn.Parameter(torch.zeros(d))
        self.layers = nn.ModuleList(OBlock(d) for _ in range(n))
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = (x @ self.proj_in + self.proj_in_bias).transpose(0, 1)
        for layer in self.layers:
            h = layer(h)
        return self.head(h.transpose(0, 1))


PARAMETERS: dict[str, Any] = {
    "proj_in": Transposed("inp.weight"),
    "proj_in_bias": "inp.bias",
    "layers.{i}.ab": Fused(("blocks.{i}.a.weight", "blocks.{i}.b.weight")),
    "layers.{i}.ab_bias": Fused(("blocks.{i}.a.bias", "blocks.{i}.b.bias")),
    "layers.{i}.ln.weight": "blocks.{i}.norm.weight",
    "layers.{i}.ln.bias": "blocks.{i}.norm.bias",
    "head.weight": "out.weight",
    "head.bias": "out.bias",
}
MODULES: dict[str, Any] = {"layers.{i}": Adapted("blocks.{i}", output=seq_first, input=seq_first), "head": "out"}
SELECTED = ["inp", r"blocks.\d+", "out"]
ROW_KINDS = ("fw", "bw", "grad")


def loss_fn(output: torch.Tensor, inputs: Any) -> torch.Tensor:
    return output.pow(2).mean()


def make_port(model: Any = None, **changes: Any) -> Port:
    fields: dict[str, Any] = {
        "model": Other() if model is None else model,
        "modules": MODULES,
        "parameters": PARAMETERS,
    }
    fields.update(changes)
    return Port(**fields)


def seeded_ref() -> Ref:
    torch.manual_seed(0)
    return Ref()


def inputs(batch: int = 2, seq: int = 5) -> torch.Tensor:
    return torch.randn(batch, seq, 8, generator=torch.Generator().manual_seed(1))


def shapes_of(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def other_holding(reference: Ref) -> Other:
    """An Other holding `reference`'s weights, loaded by hand through the map."""
    other = Other()
    parameter_map = ParameterMap(make_port(other), shapes_of(reference))
    state = parameter_map.from_reference(
        {n: p.detach().clone() for n, p in reference.named_parameters()}, [n for n, _ in other.named_parameters()]
    )
    other.load_state_dict(state)
    return other


def run(model: nn.Module, variants: list[Any], **options: Any) -> pp.PrecisionReport:
    return pp.compare(model, inputs(), variants, loss_fn=loss_fn, modules=SELECTED, **options)


class Saved:
    """A model's parameters at one time, to check that nothing changed them."""

    def __init__(self, model: nn.Module) -> None:
        self.state = {n: p.detach().clone() for n, p in model.named_parameters()}

    def unchanged(self, model: nn.Module) -> None:
        assert [n for n, _ in model.named_parameters()] == list(self.state)
        for name, parameter in model.named_parameters():
            assert torch.equal(parameter.detach(), self.state[name]), name
            assert parameter.grad is None, name
            assert parameter.dtype == torch.float32, name
        for name, module in model.named_modules():
            for hooks in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
                assert not getattr(module, hooks), f"{name or 'root'}.{hooks}"


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models: with intra-op threads, pytest -n 2 on 2 cores oversubscribes them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def shared() -> dict[str, Any]:
    """One comparison: the reference's bf16, the faithful port in fp32 and bf16, a port with a planted bug (layer 1's
    norm epsilon), and a port mapping only its layers; weight_cast rows on. With the user's models saved beforehand."""
    ref = seeded_ref()
    other = Other()
    buggy = Other()
    buggy.layers[1].ln.eps = 1e-2
    faithful = make_port(other)
    saved = {"ref": Saved(ref), "other": Saved(other)}
    variants = [
        "bf16",
        "fp16",
        pp.Variant("ours_fp32", implementation=faithful),
        pp.Variant("ours_bf16", dtype="bf16", implementation=faithful),
        pp.Variant("ours_fp16", dtype="fp16", implementation=faithful),
        pp.Variant("bug", implementation=make_port(buggy)),
        pp.Variant(
            "partial",
            implementation=make_port(modules={"layers.{i}": Adapted("blocks.{i}", output=seq_first, input=seq_first)}),
        ),
    ]
    report = run(ref, variants, weight_cast=True)
    return {"report": report, "ref": ref, "other": other, "saved": saved}


@pytest.fixture(scope="module")
def report(shared: dict[str, Any]) -> pp.PrecisionReport:
    return shared["report"]


# --- (1) the faithful fp32 port agrees, rows under the reference's names -------------------------------------------


def test_the_faithful_fp32_port_agrees_to_rounding_in_every_row(report: pp.PrecisionReport) -> None:
    rows = [r for kind in ROW_KINDS for r in report.records("ours_fp32", kind)]
    assert len(rows) == 4 + 4 + 22  # fw and bw of blocks.0-2 and out, a gradient per reference parameter
    for record in rows:
        assert record.rms_rel is not None and record.rms_rel < 1e-5, (record.name, record.kind, record.rms_rel)
    loss = report.get("ours_fp32", "loss", "loss")
    assert loss.rms_rel is not None and loss.rms_rel < 1e-5
    # A bf16 run of either implementation is far from that: the rows measure something.
    assert report.get("ours_bf16", "blocks.2", "fw").rms_rel > 1e-3  # type: ignore[operator]


def test_gradient_rows_are_named_by_the_reference_parameters(report: pp.PrecisionReport) -> None:
    reference_names = [n for n, _ in seeded_ref().named_parameters()]
    assert len(reference_names) == 2 + LAYERS * 6 + 2
    for variant in ("ours_fp32", "ours_bf16", "ours_fp16", "bug", "partial"):
        grads = [r.name for r in report.records(variant, "grad")]
        assert sorted(grads) == sorted(reference_names), variant
        assert len(grads) == len(reference_names)
    assert {r.name for r in report.records("ours_fp32", "grad")} == {r.name for r in report.records("bf16", "grad")}
    # In the order backward fills them: the reference's parameters in reverse.
    assert [r.name for r in report.records("ours_fp32", "grad")] == reference_names[::-1]
    for name in ("inp.weight", "inp.bias", "blocks.0.a.weight", "blocks.2.b.bias", "out.weight"):
        assert report.get("ours_fp32", name, "grad").rms_rel < 1e-5  # type: ignore[operator]


def test_module_rows_are_named_by_the_reference_modules(report: pp.PrecisionReport) -> None:
    blocks = [f"blocks.{i}" for i in range(LAYERS)]
    assert [r.name for r in report.records("ours_fp32", "fw")] == [*blocks, "out"]
    assert sorted(r.name for r in report.records("ours_fp32", "bw")) == sorted([*blocks, "out"])
    # The other implementation's names never show.
    names = {r.name for r in report.records("ours_fp32")}
    assert not any(n.startswith(("layers", "head", "proj_in")) for n in names)
    # The reference's "inp" has no module in Other (a bare parameter): no row, and the report says so.
    assert ("inp", "fw") in report.missing["ours_fp32"]
    facts = report.runs["ours_fp32"].port
    assert facts is not None
    assert facts["name"] == "Other" and facts["class"] == "Other"
    assert facts["weights_checked"] == 2 + LAYERS * 6 + 2
    assert facts["unmapped_reference"] == ["inp"]
    assert facts["unmapped_implementation"] == []
    assert report.runs["bf16"].port is None
    assert port_variants(report) == ["ours_fp32", "ours_bf16", "ours_fp16", "bug", "partial"]


# --- (2) fused gradients split back by the reference's sizes -------------------------------------------------------


def test_fused_gradients_split_into_the_reference_gradients_float64() -> None:
    ref = seeded_ref().double()
    other = other_holding(seeded_ref()).double()
    x = inputs().double()
    loss_fn(ref(x), x).backward()
    loss_fn(other(x), x).backward()
    parameter_map = ParameterMap(make_port(other), shapes_of(ref))
    converted = parameter_map.to_reference({n: p.grad for n, p in other.named_parameters()})  # type: ignore[misc]
    expected = {n: p.grad for n, p in ref.named_parameters()}
    assert set(converted) == set(expected)
    for name, grad in expected.items():
        assert grad is not None and grad.abs().max() > 0, name
        torch.testing.assert_close(converted[name], grad, msg=name)
    # The fused weight's gradient is the a-part then the b-part, each the reference's own gradient.
    fused = other.layers[1].ab.grad
    assert fused is not None
    assert torch.equal(converted["blocks.1.a.weight"], fused[:D])
    assert torch.equal(converted["blocks.1.b.weight"], fused[D:])
    assert not torch.allclose(converted["blocks.1.a.weight"], converted["blocks.1.b.weight"])


def test_fused_splits_by_each_reference_size_along_its_dim() -> None:
    fused_port = Port(
        nn.Identity(), modules={"x": "y"}, parameters={"qkv.{i}": Fused(("q.{i}", "k.{i}", "v.{i}"), dim=1)}
    )
    shapes = {"q.0": (3, 4), "k.0": (3, 1), "v.0": (3, 2)}
    parameter_map = ParameterMap(fused_port, shapes)
    parts = {n: torch.randn(s, dtype=torch.float64) for n, s in shapes.items()}
    state = parameter_map.from_reference(parts, ["qkv.0"])
    assert list(state) == ["qkv.0"]
    assert torch.equal(state["qkv.0"], torch.cat([parts["q.0"], parts["k.0"], parts["v.0"]], dim=1))
    back = parameter_map.to_reference(state)
    assert list(back) == ["q.0", "k.0", "v.0"]
    for name, tensor in parts.items():
        assert torch.equal(back[name], tensor), name
    with pytest.raises(ConfigurationError, match=re.escape("Fused names k.1, v.1, not reference parameters")):
        ParameterMap(fused_port, {"q.1": (3, 4)}).to_reference({"qkv.1": torch.zeros(3, 7)})


# --- (3) Transposed and Converted both ways -------------------------------------------------------------------------


def test_transposed_and_converted_round_trip() -> None:
    permutation = torch.tensor([2, 0, 3, 1])  # not its own inverse
    inverse = torch.argsort(permutation)
    mapped = Port(
        nn.Identity(),
        modules={"x": "y"},
        parameters={
            "layers.{i}.wt": Transposed("blocks.{i}.w"),
            "layers.{i}.rows": Converted(
                "blocks.{i}.r", to_reference=lambda t: t[permutation], from_reference=lambda t: t[inverse]
            ),
            "layers.{i}.same": "blocks.{i}.s",
        },
    )
    reference = {
        "blocks.0.w": torch.randn(3, 5),
        "blocks.0.r": torch.randn(4, 2),
        "blocks.0.s": torch.randn(6),
        "blocks.1.w": torch.randn(3, 5),
        "blocks.1.r": torch.randn(4, 2),
        "blocks.1.s": torch.randn(6),
    }
    parameter_map = ParameterMap(mapped, {n: tuple(t.shape) for n, t in reference.items()})
    names = [f"layers.{i}.{p}" for i in range(2) for p in ("wt", "rows", "same")]
    state = parameter_map.from_reference(reference, names)
    assert set(state) == set(names)
    assert torch.equal(state["layers.1.wt"], reference["blocks.1.w"].T)
    assert torch.equal(state["layers.0.rows"], reference["blocks.0.r"][inverse])
    assert torch.equal(state["layers.1.same"], reference["blocks.1.s"])
    back = parameter_map.to_reference(state)
    assert set(back) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(back[name], tensor), name
    with pytest.raises(
        ConfigurationError, match=re.escape("maps 'layers.2.wt' to 'blocks.2.w', which the reference model does not")
    ):
        parameter_map.from_reference(reference, ["layers.2.wt"])


def test_the_toy_port_round_trips_every_weight() -> None:
    ref = seeded_ref()
    other = other_holding(ref)
    assert torch.equal(other.proj_in, ref.inp.weight.T)
    assert torch.equal(other.layers[2].ab[D:], ref.blocks[2].b.weight)
    back = ParameterMap(make_port(other), shapes_of(ref)).to_reference(dict(other.named_parameters()))
    reference = dict(ref.named_parameters())
    assert set(back) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(back[name], tensor), name
    assert check_same_weights(reference, back, make_port(other)) == len(reference)
    with torch.no_grad():
        x = inputs()
        torch.testing.assert_close(other(x), ref(x))


# --- (4) the weights check -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("row", "column", "named"), [(0, 3, "blocks.1.a.weight"), (D + 2, 0, "blocks.1.b.weight")])
def test_the_weights_check_names_the_reference_parameter_that_differs(row: int, column: int, named: str) -> None:
    ref = seeded_ref()
    other = other_holding(ref)
    with torch.no_grad():
        other.layers[1].ab[row, column] += 0.25
    with pytest.raises(ConfigurationError) as info:
        run(ref, [pp.Variant("ours", implementation=make_port(other, load_weights=False))])
    message = str(info.value)
    assert f"parameter {named!r} differs" in message
    assert "max |difference| 0.25" in message
    assert "implementation 'Other'" in message
    # Loading the reference's weights (the default) replaces the perturbed ones: accepted, and it agrees.
    loaded = run(ref, [pp.Variant("ours", implementation=make_port(other, load_weights=True))])
    assert_port_agrees(loaded, "ours")
    # And the model given holds its perturbed weight still.
    original = (ref.blocks[1].a.weight if row < D else ref.blocks[1].b.weight).detach()[row % D, column]
    assert float(other.layers[1].ab.detach()[row, column] - original) == pytest.approx(0.25)


def test_a_port_holding_the_weights_already_runs_with_load_weights_false() -> None:
    ref = seeded_ref()
    report = run(ref, [pp.Variant("ours", implementation=make_port(other_holding(ref), load_weights=False))])
    assert_port_agrees(report, "ours")
    assert report.runs["ours"].port["weights_checked"] == 22  # type: ignore[index]


def test_check_same_weights_refuses_a_missing_counterpart_and_extra_names() -> None:
    reference = {"a": torch.ones(2), "b": torch.zeros(3)}
    mapped = make_port()
    with pytest.raises(ConfigurationError, match="the reference's parameter 'b' has no counterpart"):
        check_same_weights(reference, {"a": torch.ones(2)}, mapped)
    with pytest.raises(ConfigurationError, match=r"parameter 'b' has shape \(1, 3\) in the other implementation"):
        check_same_weights(reference, {"a": torch.ones(2), "b": torch.zeros(1, 3)}, mapped)
    with pytest.raises(ConfigurationError, match="the parameter map gives c, which the reference model does not have"):
        check_same_weights(reference, {"a": torch.ones(2), "b": torch.zeros(3), "c": torch.ones(1)}, mapped)
    # A tied parameter's other name is not extra.
    both = {"a": torch.ones(2), "b": torch.zeros(3), "c": torch.ones(2)}
    assert check_same_weights(reference, both, mapped, aliases={"a", "b", "c"}) == 2
    nan = {"a": torch.tensor([1.0, math.nan]), "b": torch.zeros(3)}
    with pytest.raises(ConfigurationError, match="parameter 'a' differs"):
        check_same_weights({"a": torch.ones(2), "b": torch.zeros(3)}, nan, mapped)


# --- (5) parameters without a counterpart --------------------------------------------------------------------------


@pytest.mark.parametrize("load_weights", [True, False])
def test_a_parameter_left_out_of_the_map_is_named(load_weights: bool) -> None:
    ref = seeded_ref()
    parameters = {k: v for k, v in PARAMETERS.items() if k != "layers.{i}.ln.bias"}
    model = other_holding(ref)
    with pytest.raises(
        ConfigurationError, match=r"parameter 'layers.0.ln.bias' of the other implementation matches no pattern"
    ):
        run(
            ref, [pp.Variant("ours", implementation=make_port(model, parameters=parameters, load_weights=load_weights))]
        )


def test_a_state_dict_converter_dropping_a_parameter_is_refused() -> None:
    ref = seeded_ref()
    model = other_holding(ref)
    full = ParameterMap(make_port(model), shapes_of(ref))

    def to_reference(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        converted = full.to_reference(state)
        del converted["blocks.2.norm.bias"]
        return converted

    converter = Port(model, modules=MODULES, to_reference=to_reference, load_weights=False)
    with pytest.raises(
        ConfigurationError, match=re.escape("the reference's parameter 'blocks.2.norm.bias' has no counterpart")
    ):
        run(ref, [pp.Variant("ours", implementation=converter)])


def test_state_dict_converters_run_a_port() -> None:
    ref = seeded_ref()
    full = ParameterMap(make_port(), shapes_of(ref))
    names = [n for n, _ in Other().named_parameters()]
    converter = Port(
        Other(),
        modules=MODULES,
        to_reference=full.to_reference,
        from_reference=lambda state: full.from_reference(state, names),
        name="converted",
    )
    report = run(ref, [pp.Variant("ours", implementation=converter)])
    assert_port_agrees(report, "ours")
    assert report.runs["ours"].port["parameters"] == "state-dict converter"  # type: ignore[index]
    assert report.runs["ours"].port["name"] == "converted"  # type: ignore[index]

    def broken(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise KeyError("no such key")

    with pytest.raises(ModelRunError, match="implementation 'Other': from_reference raised KeyError"):
        run(
            ref,
            [
                pp.Variant(
                    "ours", implementation=Port(Other(), modules=MODULES, to_reference=dict, from_reference=broken)
                )
            ],
        )


def test_a_factory_builds_the_other_implementation_from_the_reference() -> None:
    ref = seeded_ref()
    seen: list[nn.Module] = []

    def build(reference: nn.Module) -> nn.Module:
        seen.append(reference)
        return Other(d=reference.out.in_features, n=len(reference.blocks))  # type: ignore[arg-type]

    report = run(ref, [pp.Variant("ours", implementation=make_port(build))])
    assert_port_agrees(report, "ours")
    assert len(seen) == 1 and isinstance(seen[0], Ref)
    assert torch.equal(seen[0].inp.weight, ref.inp.weight)  # type: ignore[union-attr, arg-type]

    def failing(reference: nn.Module) -> nn.Module:
        raise RuntimeError("cannot build")

    with pytest.raises(ModelRunError, match="its factory raised RuntimeError: cannot build"):
        run(ref, [pp.Variant("ours", implementation=make_port(failing))])
    with pytest.raises(ConfigurationError, match=re.escape("the factory returned dict, not an nn.Module")):
        run(ref, [pp.Variant("ours", implementation=make_port(lambda reference: {}))])


# --- (6) unmapped modules ------------------------------------------------------------------------------------------


def test_unmapped_modules_of_either_side_are_listed_and_missing(report: pp.PrecisionReport) -> None:
    facts = report.runs["partial"].port
    assert facts is not None
    assert facts["unmapped_reference"] == ["inp", "out"]
    assert facts["unmapped_implementation"] == ["head"]
    assert facts["modules"] == {"layers.{i}": ["blocks.{i}"]}
    missing = report.missing["partial"]
    assert ("out", "fw") in missing and ("inp", "fw") in missing and ("out", "bw") in missing
    assert ("blocks.0", "fw") not in missing
    assert [r.name for r in report.records("partial", "fw")] == ["blocks.0", "blocks.1", "blocks.2"]
    # The parameter map still covers head: its gradients are rows.
    assert report.get("partial", "out.weight", "grad").rms_rel < 1e-5  # type: ignore[operator]
    lines = "\n".join(port_lines(report))
    assert "unmapped reference modules (no rows): inp, out" in lines
    assert "unmapped implementation modules (no rows): head" in lines


# --- (7) the adapters ----------------------------------------------------------------------------------------------


def test_without_the_output_adapter_the_forward_rows_are_refused_by_shape() -> None:
    ref = seeded_ref()
    modules = {"layers.{i}": Adapted("blocks.{i}", input=seq_first), "head": "out"}
    with pytest.raises(
        ModelRunError, match=r"fw tensor 'blocks.0' has shape \(5, 2, 16\), the reference's is \(2, 5, 16\)"
    ):
        run(ref, [pp.Variant("ours", implementation=make_port(modules=modules))])


def test_without_the_adapters_a_square_layout_gives_large_errors() -> None:
    """batch == seq: the seq-first tensors have the reference's shape, and only the adapters make them agree."""
    ref = seeded_ref()
    x = inputs(batch=4, seq=4)
    plain = make_port(modules={"layers.{i}": "blocks.{i}", "head": "out"})
    report = pp.compare(
        ref,
        x,
        [pp.Variant("plain", implementation=plain), pp.Variant("adapted", implementation=make_port())],
        loss_fn=loss_fn,
        modules=SELECTED,
    )
    for i in range(LAYERS):
        assert report.get("plain", f"blocks.{i}", "fw").rms_rel > 0.1  # type: ignore[operator]
        assert report.get("plain", f"blocks.{i}", "bw").rms_rel > 0.1  # type: ignore[operator]
        assert report.get("adapted", f"blocks.{i}", "fw").rms_rel < 1e-5  # type: ignore[operator]
        assert report.get("adapted", f"blocks.{i}", "bw").rms_rel < 1e-5  # type: ignore[operator]
    # The unadapted rows do not change the model: its output, loss and gradients agree.
    assert report.get("plain", "out", "fw").rms_rel < 1e-5  # type: ignore[operator]
    assert report.get("plain", "blocks.1.a.weight", "grad").rms_rel < 1e-5  # type: ignore[operator]
    verdict = port_verdict(report, "plain")
    assert not verdict.agrees
    assert (verdict.first.name, verdict.first.kind) == ("blocks.0", "fw")  # type: ignore[union-attr]


@pytest.mark.parametrize("which", ["output", "input"])
def test_an_adapter_raising_names_the_module_pair(which: str) -> None:
    def broken(tensor: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("bad layout")

    adapters = {"output": seq_first, "input": seq_first, which: broken}
    modules = {"layers.{i}": Adapted("blocks.{i}", **adapters), "head": "out"}
    kind = "fw" if which == "output" else "bw"
    block = 0 if which == "output" else LAYERS - 1  # backward reaches the last block first
    with pytest.raises(
        ModelRunError,
        match=re.escape(
            f"the adapter of 'layers.{block}' -> 'blocks.{block}' raised RuntimeError: bad layout on its {kind}"
        ),
    ):
        run(seeded_ref(), [pp.Variant("ours", implementation=make_port(modules=modules))])


# --- (8) module map errors -----------------------------------------------------------------------------------------


def test_a_module_pattern_matching_nothing_is_named() -> None:
    modules = {**MODULES, "decoder.{i}.mlp": "blocks.{i}.a"}
    with pytest.raises(ConfigurationError, match=r"module pattern\(s\) 'decoder.{i}.mlp' match no module of Other"):
        run(seeded_ref(), [pp.Variant("ours", implementation=make_port(modules=modules))])


def test_two_modules_mapped_to_one_reference_module_are_refused() -> None:
    modules = {**MODULES, "layers.{i}.ln": "blocks.{i}"}
    with pytest.raises(
        ConfigurationError,
        match=re.escape("modules 'layers.0' and 'layers.0.ln' both map to the reference's 'blocks.0'"),
    ):
        run(seeded_ref(), [pp.Variant("ours", implementation=make_port(modules=modules))])
    with pytest.raises(
        ConfigurationError, match=re.escape("modules 'layers.2' and 'head' both map to the reference's 'blocks.2'")
    ):
        run(seeded_ref(), [pp.Variant("ours", implementation=make_port(modules={**MODULES, "head": "blocks.2"}))])


def test_build_port_model_maps_selected_modules_only() -> None:
    ref = seeded_ref()
    other, built = build_port_model(ref, make_port(), torch.device("cpu"), ["blocks.1", "out"])
    assert built.captured == ["layers.1", "head"]
    assert built.unmapped_reference == []
    assert built.unmapped_other == []
    assert built.weights_checked == 22
    assert other is built.model and isinstance(other, Other)
    assert torch.equal(other.layers[1].ab[:D], ref.blocks[1].a.weight)
    rows: list[tuple[str, str, tuple[int, ...]]] = []
    sink = built.sink(lambda name, kind, tensor: rows.append((name, kind, tuple(tensor.shape))))
    sink("layers.1#2", "fw", torch.zeros(5, 2, D))
    sink("layers.1", "bw", torch.zeros(5, 2, D))
    sink("head", "fw", torch.zeros(2, 5, 4))
    sink("logits", "bw", torch.zeros(3))
    sink("layers.1.ab", "grad", torch.zeros(1))
    assert rows == [
        ("blocks.1#2", "fw", (2, 5, D)),
        ("blocks.1", "bw", (2, 5, D)),
        ("out", "fw", (2, 5, 4)),
        ("logits", "bw", (3,)),
        ("layers.1.ab", "grad", (1,)),
    ]


def test_a_module_standing_for_several_makes_no_input_gradient_row() -> None:
    ref = seeded_ref()
    modules = {"layers.{i}": [Adapted("blocks.{i}", output=seq_first), Adapted("blocks.{i}.norm", output=seq_first)]}
    _, built = build_port_model(ref, make_port(modules=modules), torch.device("cpu"), ["blocks.0", "blocks.0.norm"])
    rows: list[tuple[str, str]] = []
    sink = built.sink(lambda name, kind, tensor: rows.append((name, kind)))
    sink("layers.0", "fw", torch.zeros(5, 2, D))
    sink("layers.0", "bw", torch.zeros(5, 2, D))
    assert rows == [("blocks.0", "fw"), ("blocks.0.norm", "fw")]


# --- (9) the port check --------------------------------------------------------------------------------------------


def test_the_port_check_finds_the_planted_bug_where_it_is(report: pp.PrecisionReport) -> None:
    verdict = port_verdict(report, "bug")
    assert not verdict.agrees
    assert verdict.first is not None
    assert (verdict.first.name, verdict.first.kind) == ("blocks.1", "fw")
    assert verdict.first.rms_rel > PORT_CHECK_LIMIT  # type: ignore[operator]
    assert report.get("bug", "blocks.0", "fw").rms_rel < 1e-5  # type: ignore[operator]
    assert verdict.implementation == "Other"
    assert "first divergence at blocks.1 (fw)" in str(verdict)
    with pytest.raises(AssertionError, match=r"first divergence at blocks.1 \(fw\)"):
        assert_port_agrees(report, "bug")
    # A limit above the bug's error lets it through.
    assert_port_agrees(report, "bug", limit=10.0)


def test_the_port_check_passes_the_faithful_port(report: pp.PrecisionReport) -> None:
    verdict = port_verdict(report, "ours_fp32")
    assert verdict.agrees
    assert verdict.first is None
    rows = sum(len(report.records("ours_fp32", k)) for k in ("fw", "logprob", "loss", "bw", "grad"))
    assert verdict.rows == rows
    assert verdict.largest is not None and verdict.largest.rms_rel < 1e-5  # type: ignore[operator]
    assert "agrees to rounding in all" in str(verdict)
    assert_port_agrees(report, "ours_fp32")
    with pytest.raises(AssertionError, match="first divergence"):
        assert_port_agrees(report, "ours_fp32", limit=1e-12)


def test_the_port_check_refuses_other_variants_and_bad_limits(report: pp.PrecisionReport) -> None:
    with pytest.raises(
        ConfigurationError, match="'bf16' is not a variant of this report running another implementation"
    ):
        port_verdict(report, "bf16")
    with pytest.raises(ConfigurationError, match="'nope' is not a variant"):
        port_verdict(report, "nope")
    for limit in (0, -1.0, math.nan, math.inf, "1e-4", True):
        with pytest.raises(ConfigurationError, match="limit must be a finite number above 0"):
            port_verdict(report, "ours_fp32", limit=limit)  # type: ignore[arg-type]


# --- (10) the ratio gate -------------------------------------------------------------------------------------------


def test_the_ratio_gate_passes_within_the_factor(report: pp.PrecisionReport) -> None:
    assert_port_within(report, "ours_bf16", "bf16", factor=3)
    assert_port_within(report, "ours_bf16", "bf16", factor={"*": 3})


def test_the_ratio_gate_names_the_first_row_above_its_limit(report: pp.PrecisionReport) -> None:
    with pytest.raises(AssertionError) as info:
        assert_port_within(report, "ours_bf16", "bf16", factor={"*": 3, "grad": 1e-3})
    message = str(info.value)
    rows = ratio_rows(report, "ours_bf16", "bf16")
    first_grad = next(r for r in rows if r.kind == "grad")
    grads = sum(r.kind == "grad" for r in rows)
    assert f"{first_grad.name} (grad)" in message.splitlines()[0]
    assert f"({grads} of {len(rows)} rows above their limit)" in message
    assert "ours_bf16 vs bf16" in message  # the side-by-side table
    # A name regex wins over its row's kind.
    with pytest.raises(AssertionError, match=r"blocks.1 \(bw\)"):
        assert_port_within(report, "ours_bf16", "bf16", factor={"*": 3, r"blocks\.1": 1e-3, "fw": 3})
    with pytest.raises(AssertionError, match=r"port ratio ours_bf16 vs bf16: blocks.0 \(fw\)"):
        assert_port_within(report, "ours_bf16", "bf16", factor=1e-3)
    # The loss row is gated only when the factor names it.
    assert_port_within(report, "ours_bf16", "bf16", factor={"*": 3, "loss": 3})
    with pytest.raises(AssertionError, match=r"port ratio ours_bf16 vs bf16: loss \(loss\)"):
        assert_port_within(report, "ours_bf16", "bf16", factor={"*": 3, "loss": 1e-6})


@pytest.mark.parametrize(
    "factor", [0, math.nan, -1, "x", True, math.inf, {"*": 3, "grad": 0}, {"*": -2.0}, {"*": 3, "fw": "3"}, {3: 2.0}]
)
def test_the_ratio_gate_refuses_an_invalid_factor(report: pp.PrecisionReport, factor: Any) -> None:
    with pytest.raises(ConfigurationError, match="port ratio: factor"):
        assert_port_within(report, "ours_bf16", "bf16", factor=factor)


def test_the_ratio_gate_needs_a_limit_for_the_rows_no_key_names(report: pp.PrecisionReport) -> None:
    with pytest.raises(ConfigurationError, match="names no limit for the rows none of its keys name; add '\\*'"):
        assert_port_within(report, "ours_bf16", "bf16", factor={"fw": 3, "grad": 3})
    # math.inf in a dict leaves rows ungated.
    assert_port_within(report, "ours_bf16", "bf16", factor={"*": math.inf, "fw": 3})
    with pytest.raises(AssertionError, match=r"\(grad\)"):
        assert_port_within(report, "ours_bf16", "bf16", factor={"*": math.inf, "grad": 1e-3})


def test_the_ratio_gate_refuses_an_invalid_name_regex(report: pp.PrecisionReport) -> None:
    """A factor key that is no regex is a configuration error like any other invalid factor (not re.error)."""
    with pytest.raises(ConfigurationError, match="port ratio: factor"):
        assert_port_within(report, "ours_bf16", "bf16", factor={"*": 3, "blocks.(": 2})


@pytest.mark.parametrize("floor", [0, math.nan, -1e-6, "x", True])
def test_the_ratio_gate_refuses_an_invalid_floor(report: pp.PrecisionReport, floor: Any) -> None:
    with pytest.raises(ConfigurationError, match="port ratio: floor must be a finite number above 0"):
        assert_port_within(report, "ours_bf16", "bf16", floor=floor)


def test_the_ratio_gate_refuses_unknown_variants(report: pp.PrecisionReport) -> None:
    with pytest.raises(ConfigurationError, match="port ratio: no variant 'nope' in this report"):
        ratio_rows(report, "ours_bf16", "nope")


@pytest.mark.parametrize(("floor", "loss"), [(1e-6, None), (3e-3, None), (1e-6, 5.0)])
def test_ratio_rows_are_our_error_over_theirs(report: pp.PrecisionReport, floor: float, loss: float | None) -> None:
    """Per row both variants have, in execution order: ours / max(theirs, floor), recomputed from the records; the
    loss row only when the factor names "loss"."""
    factor = {"*": 2.5, "grad": 4.0, "out": 7.0, **({} if loss is None else {"loss": loss})}
    rows = ratio_rows(report, "ours_bf16", "bf16", factor=factor, floor=floor)
    kinds = ("fw", "loss", "bw", "grad") if loss is not None else ("fw", "bw", "grad")
    ours = {(r.name, r.kind): r.rms_rel for kind in kinds for r in report.records("ours_bf16", kind)}
    theirs = {(r.name, r.kind): r.rms_rel for kind in kinds for r in report.records("bf16", kind)}
    shared_rows = [key for key in ours if key in theirs]
    assert [(r.name, r.kind) for r in rows] == shared_rows
    assert (("loss", "loss") in shared_rows) == (loss is not None)
    assert len(rows) == 4 + 4 + 22 + (loss is not None)
    assert ("inp", "fw") in theirs and ("inp", "fw") not in {(r.name, r.kind) for r in rows}
    floored = 0
    for row in rows:
        mine, other = ours[(row.name, row.kind)], theirs[(row.name, row.kind)]
        assert (row.ours, row.theirs) == (mine, other)
        assert row.ratio == pytest.approx(mine / max(other, floor), rel=1e-12)  # type: ignore[operator]
        floored += other < floor  # type: ignore[operator]
        expected = 7.0 if row.name == "out" else 4.0 if row.kind == "grad" else loss if row.kind == "loss" else 2.5
        assert row.limit == expected, (row.name, row.kind)
    assert (floored > 0) == (floor > 1e-6)  # the floor was used where it is above some of theirs
    lines = side_by_side(report, "ours_bf16", "bf16", rows)
    assert "ours_bf16 vs bf16" in lines[0]
    assert any("blocks.1 (fw)" in line and f"{rows[1].ratio:.2f}" in line for line in lines)


def test_partner_and_port_lines(report: pp.PrecisionReport) -> None:
    assert partner(report, "ours_bf16") == "bf16"
    assert partner(report, "ours_fp32") is None  # no fp32 variant of the reference implementation
    lines = port_lines(report)
    text = "\n".join(lines)
    assert "ours_fp32: implementation Other (Other), 22 parameters equal to the reference's through the map" in text
    assert re.search(r"port check ours_fp32 .*agrees to rounding", text)
    assert re.search(r"port check bug .*first divergence at blocks.1 \(fw\)", text)
    assert "port check ours_bf16" not in text  # bf16 is not the port check's
    assert re.search(r"against bf16: rms_rel ratio median [0-9.]+, largest [0-9.]+ at ", text)


# --- (11) the user's models are left as they were ------------------------------------------------------------------


def test_compare_leaves_the_user_models_unchanged(shared: dict[str, Any]) -> None:
    shared["saved"]["ref"].unchanged(shared["ref"])
    shared["saved"]["other"].unchanged(shared["other"])
    # The port's model was given holding zeros: the reference's weights went into a copy.
    other = shared["other"]
    assert not other.layers[0].ab.detach().any() and not other.proj_in.detach().any()


def test_a_port_holding_the_weights_is_left_unchanged() -> None:
    ref = seeded_ref()
    other = other_holding(ref)
    saved_ref, saved_other = Saved(ref), Saved(other)
    run(ref, [pp.Variant("ours", dtype="bf16", implementation=make_port(other, load_weights=False))])
    saved_ref.unchanged(ref)
    saved_other.unchanged(other)


# --- (12) weight_cast rows -----------------------------------------------------------------------------------------


def test_weight_cast_rows_are_named_by_the_reference_parameters(report: pp.PrecisionReport) -> None:
    reference_names = [n for n, _ in seeded_ref().named_parameters()]
    for variant in ("ours_fp32", "ours_bf16"):
        assert [r.name for r in report.records(variant, "weight_cast")] == reference_names, variant
    for record in report.records("ours_fp32", "weight_cast"):
        assert record.rms_abs == 0, record.name
    # The same weights rounded to bf16: the same error as the reference implementation's bf16 run, row by row.
    theirs = {r.name: r for r in report.records("bf16", "weight_cast")}
    nonzero = 0
    for record in report.records("ours_bf16", "weight_cast"):
        assert record.rms_abs == pytest.approx(theirs[record.name].rms_abs, rel=1e-9, abs=0), record.name
        assert record.ref_rms == pytest.approx(theirs[record.name].ref_rms, rel=1e-12), record.name
        nonzero += bool(record.rms_abs)
    assert nonzero >= 2 + LAYERS * 4 + 1  # every weight matrix and random bias is rounded


# --- more: fp16 loss scaling, the report's files, forward=, tied weights ---------------------------------------------


def test_an_fp16_port_gets_its_gradients_unscaled(report: pp.PrecisionReport) -> None:
    """fp16 runs scale the loss: the port's gradient rows, streamed after backward, are unscaled like the reference
    implementation's (a scaled gradient would be off by the scale, rms_rel far above 1)."""
    assert report.runs["ours_fp16"].loss_scale is not None and report.runs["ours_fp16"].loss_scale > 1
    for kind in ("bw", "grad"):
        for record in report.records("ours_fp16", kind):
            assert record.rms_rel is not None and record.rms_rel < 0.05, (record.name, kind)
    assert partner(report, "ours_fp16") == "fp16"
    assert_port_within(report, "ours_fp16", "fp16", factor=10)


def test_the_port_facts_survive_the_report_file(report: pp.PrecisionReport) -> None:
    loaded = pp.PrecisionReport.from_dict(json.loads(json.dumps(report.to_dict())))
    assert loaded.runs["partial"].port == report.runs["partial"].port
    assert loaded.runs["ours_bf16"].variant["implementation"] == "Other"
    assert loaded.runs["bf16"].port is None
    assert port_variants(loaded) == port_variants(report)
    assert port_verdict(loaded, "bug").first.name == "blocks.1"  # type: ignore[union-attr]
    assert ratio_rows(loaded, "ours_bf16", "bf16") == ratio_rows(report, "ours_bf16", "bf16")
    assert port_lines(loaded) == port_lines(report)


def test_a_port_forward_calls_the_other_implementation() -> None:
    calls: list[tuple[type, tuple[int, ...]]] = []

    def forward(model: nn.Module, inputs: Any) -> torch.Tensor:
        calls.append((type(model), tuple(inputs.shape)))
        return model(inputs) * 2

    report = run(seeded_ref(), [pp.Variant("ours", implementation=make_port(forward=forward))])
    assert calls == [(Other, (2, 5, 8))]
    # The loss reads the forward's result: twice the output, four times the loss.
    assert report.get("ours", "loss", "loss").bias_rel == pytest.approx(3.0, rel=1e-5)
    assert report.get("ours", "blocks.1", "fw").rms_rel < 1e-5  # type: ignore[operator]


class TiedRef(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, D)
        self.lin = nn.Linear(D, D)
        self.out = nn.Linear(D, 10, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.lin(self.emb(ids))))


class TiedOther(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(10, D)
        self.mid = nn.Linear(D, D)
        self.head = nn.Linear(D, 10, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.tok(ids))))


TIED_PARAMETERS = {
    "tok.weight": "emb.weight",
    "mid.weight": "lin.weight",
    "mid.bias": "lin.bias",
    "head.weight": "out.weight",
}


@pytest.mark.parametrize("load_weights", [False, True])
def test_a_port_with_tied_weights(load_weights: bool) -> None:
    """Both implementations tie the head to the embedding; the map names both of the other's names. Holding the
    weights (load_weights=False) or loading them (True), the port runs and agrees, with one gradient row for the
    tied weight."""
    torch.manual_seed(0)
    ref = TiedRef()
    other = TiedOther()
    if not load_weights:
        with torch.no_grad():
            other.tok.weight.copy_(ref.emb.weight)
            other.mid.weight.copy_(ref.lin.weight)
            other.mid.bias.copy_(ref.lin.bias)
    tied = Port(other, modules={"mid": "lin", "head": "out"}, parameters=TIED_PARAMETERS, load_weights=load_weights)
    ids = torch.randint(0, 10, (2, 5), generator=torch.Generator().manual_seed(2))
    report = pp.compare(ref, ids, [pp.Variant("ours", implementation=tied)], loss_fn=loss_fn, modules=["lin", "out"])
    assert_port_agrees(report, "ours")
    assert sorted(r.name for r in report.records("ours", "grad")) == ["emb.weight", "lin.bias", "lin.weight"]


def test_a_factory_must_build_a_model_of_its_own() -> None:
    ref = seeded_ref()

    def the_reference(reference: nn.Module) -> nn.Module:
        return reference

    with pytest.raises(ConfigurationError, match="the factory returned the reference model, or a model sharing its"):
        run(ref, [pp.Variant("ours", implementation=make_port(the_reference))])

    def sharing(reference: nn.Module) -> nn.Module:
        other = Other()
        other.head.weight = reference.out.weight  # type: ignore[union-attr]
        return other

    with pytest.raises(ConfigurationError, match="a model sharing its parameters"):
        run(ref, [pp.Variant("ours", implementation=make_port(sharing))])
    saved = Saved(ref)
    one = Other()
    same = make_port(lambda reference: one)
    with pytest.raises(ConfigurationError, match="the factory returned the same Other object for two runs"):
        run(ref, [pp.Variant("a", implementation=same), pp.Variant("b", dtype="bf16", implementation=same)])
    saved.unchanged(ref)


def test_a_frozen_reference_parameter_has_no_gradient_row() -> None:
    ref = seeded_ref()
    ref.blocks[0].norm.weight.requires_grad_(False)
    report = run(ref, ["bf16", pp.Variant("ours", implementation=make_port())])
    ours = {r.name for r in report.records("ours", "grad")}
    assert "blocks.0.norm.weight" not in ours
    assert ours == {r.name for r in report.records("bf16", "grad")}
    assert len(ours) == 21
    assert not any(key[1] == "grad" for key in report.missing["ours"])
    assert_port_agrees(report, "ours")


@pytest.mark.parametrize(
    ("modules", "origin"),
    [
        (MODULES, "layers.1.ln (fw) (a module of Other, mapped to none of the reference's)"),
        ({**MODULES, "layers.{i}.ln": Adapted("blocks.{i}.norm", output=seq_first)}, "blocks.1.norm (fw)"),
    ],
)
def test_where_nan_starts_is_named_by_the_reference_module(modules: dict[str, Any], origin: str) -> None:
    ref = seeded_ref()
    broken = Other()
    broken.layers[1].ln.eps = -1e6  # the square root of a negative variance
    report = run(ref, [pp.Variant("nan", implementation=make_port(broken, modules=modules))])
    assert report.nonfinite_origin["nan"] == origin
    verdict = port_verdict(report, "nan")
    assert verdict.first is not None and (verdict.first.name, verdict.first.kind) == ("blocks.1", "fw")
    assert verdict.first.nonfinite > 0


class HeadRef(Ref):
    def get_output_embeddings(self) -> nn.Module:
        return self.out


def test_the_output_head_is_found_through_the_module_map() -> None:
    """fp32_modules=["<output head>"] names the reference's get_output_embeddings(); Other has none, and its head
    is found through the map (head -> out), on the run's copy only."""
    torch.manual_seed(0)
    ref = HeadRef()
    other = Other()
    faithful = make_port(other)
    variants = [
        "bf16_fp32_head",
        pp.Variant("ours", dtype="bf16", implementation=faithful),
        pp.Variant("ours_head", dtype="bf16", fp32_modules=["<output head>"], implementation=faithful),
    ]
    report = run(ref, variants)
    assert partner(report, "ours_head") == "bf16_fp32_head"
    # The head in fp32 leaves out the rounding of its bf16 output.
    assert report.get("ours_head", "out", "fw").rms_rel < report.get("ours", "out", "fw").rms_rel  # type: ignore[operator]
    assert_port_within(report, "ours_head", "bf16_fp32_head", factor=3)
    assert not hasattr(other, "get_output_embeddings")
    with pytest.raises(ConfigurationError, match="'<output head>' needs a model with get_output_embeddings"):
        run(
            seeded_ref(),
            [pp.Variant("ours_head", dtype="bf16", fp32_modules=["<output head>"], implementation=faithful)],
        )


# --- (13) the causal-LM helpers ------------------------------------------------------------------------------------


def test_causal_lm_loss_is_shifted_cross_entropy_ignoring_minus_100() -> None:
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 6, 11, generator=generator).to(torch.bfloat16)
    labels = torch.randint(0, 11, (2, 6), generator=generator)
    labels[0, 2] = labels[1, 4] = labels[1, 5] = labels[0, 0] = -100
    value = causal_lm_loss(logits, labels)
    assert value.dtype == torch.float32

    numbers = logits.float().double().numpy()
    targets = labels.numpy()
    losses = []
    for b in range(2):
        for t in range(5):
            target = targets[b, t + 1]
            if target == -100:
                continue
            row = numbers[b, t]
            top = row.max()
            losses.append(top + np.log(np.exp(row - top).sum()) - row[target])
    assert len(losses) == 2 * 5 - 3  # labels[0, 0] is never a target
    assert float(value) == pytest.approx(float(np.mean(losses)), rel=1e-6)


def test_causal_lm_forward_returns_logits_and_the_loss() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 4), nn.Linear(4, 11))
    ids = torch.randint(0, 11, (2, 6), generator=torch.Generator().manual_seed(4))
    result = causal_lm_forward(model, {"input_ids": ids, "labels": ids})
    assert set(result) == {"logits", "loss"}
    torch.testing.assert_close(result["loss"], causal_lm_loss(model(ids), ids))
    assert set(causal_lm_forward(model, {"input_ids": ids})) == {"logits"}
    with pytest.raises(ConfigurationError, match="causal_lm_forward: the inputs must be a dict with 'input_ids'"):
        causal_lm_forward(model, ids)
