"""A port used as a hostile user would: NaN in the other implementation, frozen parameters, a factory handing back the
reference model or one object twice, NaN in the weights, a converter that does not return a state dict."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pytest_precision import ConfigurationError, ModelRunError, Variant, compare
from pytest_precision.ports import Port, assert_port_within


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 8)
        self.second = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))


class Renamed(nn.Module):
    def __init__(self, poison: str = "") -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 2)
        self.poison = poison
        if poison == "b":  # NaN born in the output of the other implementation's "b"
            self.b.register_forward_hook(lambda _module, _args, output: output / 0.0 * 0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.a(x))
        if self.poison == "top":  # NaN born in the top-level forward, between its modules
            hidden = hidden / 0.0 * 0.0
        return self.b(hidden)


PARAMETERS = {"a.weight": "first.weight", "a.bias": "first.bias", "b.weight": "second.weight", "b.bias": "second.bias"}


def port(model: object = None, **fields: object) -> Port:
    return Port(  # type: ignore[misc]
        model=model if model is not None else (lambda reference: Renamed()),
        modules={"a": "first", "b": "second"},
        **{"parameters": PARAMETERS, **fields},  # type: ignore[arg-type]
    )


def loss(output: torch.Tensor, _inputs: object) -> torch.Tensor:
    return output.pow(2).mean()


@pytest.fixture
def net() -> Net:
    torch.manual_seed(0)
    return Net()


def inputs() -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(1))


def test_nan_in_the_other_implementation_is_placed_by_the_reference_module_name(net: Net) -> None:
    in_module = port(lambda reference: Renamed(poison="b"), name="ours")
    top = port(lambda reference: Renamed(poison="top"), name="ours")
    variants = [Variant("nan", implementation=in_module), Variant("nan_top", implementation=top)]
    report = compare(net, inputs(), variants=variants, loss_fn=loss)
    assert report.nonfinite_origin["nan"] == "second (fw)"  # the port's "b", by the reference's name
    assert report.get("nan", "second").nonfinite > 0
    assert report.nonfinite_origin["nan_top"] == "the top-level forward of ours (fw)"


def test_frozen_reference_parameters_get_no_grad_rows_from_the_port(net: Net) -> None:
    net.first.weight.requires_grad_(False)
    report = compare(net, inputs(), variants=[Variant("ours", implementation=port())], loss_fn=loss)
    grads = {r.name for r in report.records("ours", "grad")}
    assert grads == {"first.bias", "second.weight", "second.bias"}
    assert report.missing["ours"] == []


def test_a_factory_returning_the_reference_model_is_refused_and_the_model_is_unchanged(net: Net) -> None:
    before = {name: tensor.clone() for name, tensor in net.state_dict().items()}
    itself = Port(model=lambda reference: reference, modules={"first": "first"}, parameters={"{x}": "{x}"})
    with pytest.raises(ConfigurationError, match=r"returned the reference model, or a model sharing its parameters"):
        compare(net, inputs(), variants=[Variant("itself", implementation=itself)], loss_fn=loss)
    assert all(torch.equal(before[n], t) for n, t in net.state_dict().items())
    assert all(p.dtype == torch.float32 for p in net.parameters())


def test_a_factory_returning_one_object_twice_is_refused(net: Net) -> None:
    shared = Renamed()
    once = port(lambda reference: shared)
    with pytest.raises(ConfigurationError, match=r"returned the same Renamed object for two runs"):
        compare(
            net,
            inputs(),
            variants=[Variant("one", implementation=once), Variant("two", implementation=once)],
            loss_fn=loss,
        )


def test_a_port_given_as_a_model_is_copied_never_changed(net: Net) -> None:
    given = Renamed()
    before = {name: tensor.clone() for name, tensor in given.state_dict().items()}
    compare(net, inputs(), variants=[Variant("ours_bf16", dtype="bf16", implementation=port(given))], loss_fn=loss)
    assert all(torch.equal(before[n], t) for n, t in given.state_dict().items())  # the reference's weights not loaded
    assert all(p.dtype == torch.float32 and p.grad is None for p in given.parameters())


def test_nan_in_the_port_weights_is_refused_by_the_weights_check(net: Net) -> None:
    given = Renamed()
    given.load_state_dict({k: net.state_dict()[v] for k, v in PARAMETERS.items()})
    with torch.no_grad():
        given.b.weight[0, 0] = math.nan
    with pytest.raises(ConfigurationError, match=r"parameter 'second\.weight' differs \(max \|difference\| inf\)"):
        compare(
            net,
            inputs(),
            variants=[Variant("nan_weights", implementation=port(given, load_weights=False))],
            loss_fn=loss,
        )


def test_a_converter_returning_no_state_dict_is_named(net: Net) -> None:
    broken = Port(
        model=lambda reference: Renamed(), modules={"a": "first"}, to_reference=lambda state: None, load_weights=False
    )
    with pytest.raises(ConfigurationError, match=r"to_reference returned NoneType, not a state dict"):
        compare(net, inputs(), variants=[Variant("broken", implementation=broken)], loss_fn=loss)
    raising = Port(
        model=lambda reference: Renamed(),
        modules={"a": "first"},
        to_reference=lambda state: state["nope"],
        load_weights=False,
    )
    with pytest.raises(ModelRunError, match=r"to_reference raised KeyError: 'nope'"):
        compare(net, inputs(), variants=[Variant("raising", implementation=raising)], loss_fn=loss)


def test_nan_everywhere_in_the_ratio_gate(net: Net) -> None:
    report = compare(
        net,
        inputs(),
        variants=["bf16", Variant("nan", dtype="bf16", implementation=port(lambda reference: Renamed(poison="b")))],
        loss_fn=loss,
    )
    with pytest.raises(AssertionError, match=r"port ratio nan vs bf16: second \(fw\) has rms_rel .* inf"):
        assert_port_within(report, "nan", "bf16", factor=1e9)


def test_a_port_combines_with_compilation_a_low_bit_format_and_weight_rows(net: Net) -> None:
    variants = [
        Variant("ours_compiled", implementation=port(), compile="eager"),
        Variant("ours_fp8", dtype="bf16", implementation=port(), weight_storage="float8_e4m3fn"),
    ]
    report = compare(net, inputs(), variants=variants, loss_fn=loss, weight_cast=True)
    compiled = report.runs["ours_compiled"].compiled
    assert compiled is not None and sorted(compiled["regions"]) == ["a", "b"]  # the other implementation's modules
    assert all(r.rms_rel is not None and r.rms_rel < 1e-6 for r in report.records("ours_compiled"))
    lowbit = report.runs["ours_fp8"].lowbit
    assert lowbit is not None and lowbit["modules"] == 2
    weights = {r.name: r.rms_rel for r in report.records("ours_fp8", "weight_cast")}
    assert set(weights) == set(PARAMETERS.values())
    assert weights["first.weight"] is not None and weights["first.weight"] > 1e-2  # fp8's rounding, not bf16's


def test_a_saved_reference_measures_a_port_as_the_live_one(net: Net, tmp_path: object) -> None:
    from pathlib import Path

    from pytest_precision import Reference, reference

    ref = reference(net, inputs(), loss_fn=loss)
    live = compare(ref, variants=[Variant("ours_bf16", dtype="bf16", implementation=port())])
    ref.save(Path(str(tmp_path)) / "ref")
    loaded = Reference.load(Path(str(tmp_path)) / "ref", model=net, loss_fn=loss)
    again = compare(loaded, variants=[Variant("ours_bf16", dtype="bf16", implementation=port())])
    assert [(r.name, r.kind, r.rms_rel) for r in again.records("ours_bf16")] == [
        (r.name, r.kind, r.rms_rel) for r in live.records("ours_bf16")
    ]


def test_a_port_called_with_inputs_it_does_not_take_says_how_to_call_it() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    tokens = Port(  # a model of bare token ids, given the reference's keyword arguments
        model=lambda reference: TokensOnly(reference),
        modules={"inner": "model"},
        to_reference=lambda state: {
            k.replace("inner.", "model.").replace("head.", "lm_head."): v for k, v in state.items()
        },
        from_reference=lambda state: {
            k.replace("lm_head.", "head.").replace("model.", "inner."): v for k, v in state.items()
        },
    )
    ids = torch.randint(0, 64, (1, 8))
    with pytest.raises(
        ModelRunError, match=r"rejected the inputs .* is called as the reference is unless its Port says forward=\.\.\."
    ):
        compare(model, {"input_ids": ids, "labels": ids}, variants=[Variant("tokens", implementation=tokens)])


class TokensOnly(nn.Module):
    def __init__(self, reference: nn.Module) -> None:
        super().__init__()
        import copy

        self.inner = copy.deepcopy(reference.model)
        self.head = copy.deepcopy(reference.lm_head)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(tokens).last_hidden_state)


def test_the_ratio_of_rows_whose_other_side_is_undefined_or_not_finite(net: Net) -> None:
    import dataclasses

    from pytest_precision.ports import ratio_rows, side_by_side

    report = compare(
        net, inputs(), variants=["bf16", Variant("ours", dtype="bf16", implementation=port())], loss_fn=loss
    )
    ours, theirs = report.get("ours", "second"), report.get("bf16", "second")
    assert ours.rms_rel is not None and ours.rms_rel > 0

    def ratio_with(theirs_row: object) -> float:
        rows = report._records["bf16"]
        index = rows.index(theirs)
        rows[index] = theirs_row  # type: ignore[call-overload]
        try:
            return next(r.ratio for r in ratio_rows(report, "ours", "bf16", floor=1e-3) if r.name == "second")
        finally:
            rows[index] = theirs

    assert ratio_with(theirs) == pytest.approx(ours.rms_rel / theirs.rms_rel)
    assert ratio_with(dataclasses.replace(theirs, rms_rel=None)) == pytest.approx(ours.rms_rel / 1e-3)  # the floor
    assert ratio_with(dataclasses.replace(theirs, rms_rel=math.inf)) == 0.0  # theirs infinitely wrong, ours finite
    assert ratio_with(dataclasses.replace(theirs, rms_rel=math.nan, nonfinite=3)) == 0.0
    table = side_by_side(report, "ours", "bf16")
    assert table[0].split() == ["ours", "vs", "bf16", "ours", "rms_rel", "bf16", "rms_rel", "ratio"]
    assert any(line.split()[:2] == ["second", "(fw)"] for line in table)


def test_the_port_check_line_is_only_for_plain_fp32_ports(net: Net) -> None:
    variants = [
        Variant("ours_fp32", implementation=port()),
        Variant("ours_fp8_storage", implementation=port(), weight_storage="float8_e4m3fn"),
    ]
    text = compare(net, inputs(), variants=variants, loss_fn=loss).format(full=False)
    assert "port check ours_fp32 (port against the reference implementation, fp32): agrees to rounding" in text
    assert "port check ours_fp8_storage" not in text


def test_a_state_dict_converter_leaving_a_weight_out_is_named(net: Net) -> None:
    dropping = Port(
        model=lambda reference: Renamed(),
        modules={"a": "first"},
        to_reference=lambda state: {k.replace("a.", "first.").replace("b.", "second."): v for k, v in state.items()},
        from_reference=lambda state: {
            k.replace("first.", "a.").replace("second.", "b."): v for k, v in state.items() if k != "second.bias"
        },
    )
    with pytest.raises(ConfigurationError, match=r"the parameter map gives no weight for b\.bias of the other"):
        compare(net, inputs(), variants=[Variant("dropping", implementation=dropping)], loss_fn=loss)
    renamed = dict(PARAMETERS, **{"b.bias": "second.offset"})
    with pytest.raises(
        ConfigurationError, match=r"parameters= maps 'b\.bias' to 'second\.offset', which the reference"
    ):
        compare(net, inputs(), variants=[Variant("wrong", implementation=port(parameters=renamed))], loss_fn=loss)


class SeqFirst(nn.Module):
    """Net in [seq, batch, hidden] between its layers: a port whose layer rows need a layout adapter."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.a(x.transpose(0, 1)))  # [seq, batch, 8]
        return self.b(hidden).transpose(0, 1)


def test_isolated_rows_of_a_port_feed_each_module_the_reference_input_in_its_own_layout() -> None:
    from pytest_precision.ports import Adapted, Layout, seq_first

    torch.manual_seed(0)
    net = Net()
    x = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(1))  # [batch, seq, in]
    both_ways = Port(
        model=lambda reference: SeqFirst(),
        modules={
            "a": Adapted("first", output=seq_first, input=seq_first),
            "b": Adapted("second", output=seq_first, input=seq_first),
        },
        parameters=PARAMETERS,
    )
    report = compare(
        net,
        x,
        [
            "bf16",
            Variant("ours_fp32", implementation=both_ways),
            Variant("ours_bf16", dtype="bf16", implementation=both_ways),
        ],
        loss_fn=loss,
        isolate=True,
    )
    for kind in ("fw_isolated", "bw_isolated", "grad_isolated"):
        rows = report.records("ours_fp32", kind)
        assert {r.name for r in rows} == {r.name for r in report.records("bf16", kind)} and rows
        assert all(r.rms_rel is not None and r.rms_rel < 1e-6 for r in rows)
    # The same module fed the same input in bf16: the error it adds itself, near the reference implementation's (its
    # input is [seq, batch, ...]: another matmul kernel, another rounding).
    ours, theirs = report.get("ours_bf16", "second", "fw_isolated"), report.get("bf16", "second", "fw_isolated")
    assert ours.rms_rel is not None and theirs.rms_rel is not None
    assert 0.5 < ours.rms_rel / theirs.rms_rel < 2
    # One-way adapters cannot feed a module the reference's input.
    one_way = Port(
        model=lambda reference: SeqFirst(),
        modules={
            "a": Adapted("first", output=lambda t: t.transpose(0, 1), input=seq_first),
            "b": Adapted("second", output=seq_first, input=seq_first),
        },
        parameters=PARAMETERS,
    )
    with pytest.raises(ConfigurationError, match=r"the adapter of 'a' -> 'first' goes one way; give a .*Layout"):
        compare(net, x, [Variant("one_way", implementation=one_way, isolate=True)], loss_fn=loss)
    assert isinstance(seq_first, Layout)


def test_the_verdict_and_the_report_lines_read_the_rows_right(net: Net) -> None:
    import dataclasses
    import statistics

    from pytest_precision.ports import port_verdict, ratio_rows

    report = compare(
        net,
        inputs(),
        variants=[
            "bf16",
            Variant("ours", implementation=port()),
            Variant("ours_bf16", dtype="bf16", implementation=port()),
        ],
        loss_fn=loss,
    )
    rows = [r for r in report.records("ours") if r.kind in ("fw", "bw", "grad", "loss")]
    verdict = port_verdict(report, "ours")
    assert verdict.largest is not None
    assert verdict.largest.rms_rel == max(r.rms_rel for r in rows if r.rms_rel is not None)
    # A row whose reference is all zeros (rms_rel undefined) agrees when the port's is zeros too, not otherwise.
    records = report._records["ours"]
    index = records.index(report.get("ours", "second"))
    original = records[index]
    records[index] = dataclasses.replace(original, rms_rel=None, rms_abs=0.0)
    assert port_verdict(report, "ours").agrees
    records[index] = dataclasses.replace(original, rms_rel=None, rms_abs=1e-9)
    assert port_verdict(report, "ours").first is records[index]
    records[index] = original
    # The header's median is the median row's ratio.
    ratios = sorted(r.ratio for r in ratio_rows(report, "ours_bf16", "bf16"))
    line = next(x for x in report.format(full=False).splitlines() if "against bf16: rms_rel ratio median" in x)
    assert f"median {ratios[len(ratios) // 2]:.2f}," in line
    assert abs(ratios[len(ratios) // 2] - statistics.median(ratios)) <= max(ratios) - min(ratios)


def test_a_converter_giving_a_buffer_before_the_weights_still_loads_every_weight(net: Net) -> None:
    class WithBuffer(Renamed):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("scale", torch.ones(1))

    def from_reference(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        converted = {"scale": torch.ones(1)}  # a buffer first, as some converters give them
        converted.update({k.replace("first.", "a.").replace("second.", "b."): v for k, v in state.items()})
        return converted

    with_buffer = Port(
        model=lambda reference: WithBuffer(),
        modules={"a": "first", "b": "second"},
        to_reference=lambda state: {k.replace("a.", "first.").replace("b.", "second."): v for k, v in state.items()},
        from_reference=from_reference,
    )
    report = compare(net, inputs(), variants=[Variant("buffered", implementation=with_buffer)], loss_fn=loss)
    assert report.runs["buffered"].port["weights_checked"] == 4


def test_the_port_check_of_a_low_precision_port_points_to_the_ratio_gate(net: Net) -> None:
    from pytest_precision.ports import assert_port_agrees

    report = compare(net, inputs(), variants=[Variant("ours_bf16", dtype="bf16", implementation=port())], loss_fn=loss)
    with pytest.raises(ConfigurationError, match=r"'ours_bf16' runs in bfloat16; .*assert_port_within"):
        assert_port_agrees(report, "ours_bf16")


@pytest.mark.parametrize("name", [3, "", "  ", b"ours"])
def test_a_port_name_that_is_not_a_name_is_refused(name: object) -> None:
    with pytest.raises(ConfigurationError, match=r"Port: name must be a non-empty string"):
        port(name=name)
