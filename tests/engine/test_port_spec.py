"""Ports as data (engine/port_spec.py): name patterns over layer indices, the module and parameter maps' refusals, and
the variants that run another implementation (Variant(implementation=...))."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import nn

import pytest_precision as pp
from pytest_precision.base.errors import ConfigurationError
from pytest_precision.engine.port_registry import port_names
from pytest_precision.engine.port_spec import filled, matched, pattern
from pytest_precision.engine.variants import Variant, resolve_reference, resolve_variant
from pytest_precision.ports import Adapted, Converted, Fused, Port, Transposed, seq_first


def identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def port(**changes: Any) -> Port:
    """A small valid port of nn.Linear onto itself, with `changes` to its fields."""
    fields: dict[str, Any] = {
        "model": nn.Linear(2, 2),
        "modules": {"layers.{i}": "blocks.{i}"},
        "parameters": {"layers.{i}.weight": "blocks.{i}.weight"},
    }
    fields.update(changes)
    return Port(**fields)


# --- name patterns -------------------------------------------------------------------------------------------------


def test_pattern_matches_whole_names_only() -> None:
    regex = pattern("layers.{i}.mlp", "here")
    assert regex.fullmatch("layers.12.mlp") is not None
    assert regex.fullmatch("layers.0.mlp.up") is None  # a prefix is not a match
    assert regex.fullmatch("model.layers.0.mlp") is None
    assert regex.fullmatch("layers.x.mlp") is None  # a placeholder stands for an index
    assert regex.fullmatch("layers..mlp") is None
    assert matched("layers.{i}.mlp", "layers.0.mlp.up") is None
    assert matched("layers.{i}.mlp", "model.layers.0.mlp") is None


def test_a_repeated_placeholder_is_a_back_reference() -> None:
    assert matched("layers.{i}.x.{i}", "layers.3.x.3") == {"i": "3"}
    assert matched("layers.{i}.x.{i}", "layers.3.x.4") is None
    assert matched("layers.{i}.x.{i}", "layers.3.x.31") is None
    assert matched("layers.{i}.x.{i}", "layers.13.x.3") is None
    assert matched("layers.{i}.x.{j}", "layers.3.x.4") == {"i": "3", "j": "4"}


def test_dots_and_other_regex_characters_are_literal() -> None:
    assert matched("a.b", "a.b") == {}
    assert matched("a.b", "aXb") is None
    assert matched("layers.{i}.w", "layersX0Xw") is None
    assert matched("layers.{i}.w", "layersX0.w") is None  # the text before a placeholder too
    assert matched("layers.{i}.w", "layers.0Xw") is None
    assert matched("a+b", "a+b") == {}
    assert matched("a+b", "aab") is None
    assert matched("w[0]", "w[0]") == {}
    assert matched("w[0]", "w0") is None


def test_matched_and_filled_round_trip() -> None:
    values = matched("layers.{i}.ab", "layers.7.ab")
    assert values == {"i": "7"}
    assert filled("blocks.{i}.a.weight", values) == "blocks.7.a.weight"
    for text, name in (
        ("layers.{i}.ab", "layers.7.ab"),
        ("experts.{e}.layer.{i}.w", "experts.2.layer.10.w"),
        ("plain.name", "plain.name"),
    ):
        found = matched(text, name)
        assert found is not None
        assert filled(text, found) == name
    # Placeholders may be reordered between the two sides.
    swapped = matched("experts.{e}.layer.{i}", "experts.2.layer.10")
    assert swapped is not None
    assert filled("blocks.{i}.moe.{e}", swapped) == "blocks.10.moe.2"


@pytest.mark.parametrize("text", ["", None, 3])
def test_pattern_refuses_what_is_not_a_name(text: Any) -> None:
    with pytest.raises(ConfigurationError, match="here: a name pattern must be a non-empty string"):
        pattern(text, "here")


# --- the Port's refusals -------------------------------------------------------------------------------------------


def test_a_valid_port_normalizes_its_maps() -> None:
    made = port(
        modules={"layers.{i}": "blocks.{i}", "head": ["out", Adapted("out2", output=seq_first)]},
        parameters={
            "layers.{i}.weight": "blocks.{i}.weight",
            "layers.{i}.wt": Transposed("blocks.{i}.wt"),
            "layers.{i}.ab": Fused(["blocks.{i}.a", "blocks.{i}.b"]),  # type: ignore[arg-type]
            "layers.{i}.c": Converted("blocks.{i}.c", identity, identity),
        },
    )
    assert made.modules["layers.{i}"] == (Adapted("blocks.{i}"),)
    assert [t.name for t in made.modules["head"]] == ["out", "out2"]  # type: ignore[union-attr]
    assert made.modules["head"][1].output is seq_first  # type: ignore[index,union-attr]
    assert made.parameters is not None
    assert made.parameters["layers.{i}.ab"].names == ("blocks.{i}.a", "blocks.{i}.b")  # type: ignore[union-attr]
    assert made.label == "Linear"
    assert port(name="mine").label == "mine"
    assert made.to_dict() == {
        "name": "Linear",
        "modules": {"layers.{i}": ["blocks.{i}"], "head": ["out", "out2"]},
        "parameters": 4,
    }
    converters = port(parameters=None, to_reference=dict, from_reference=dict)
    assert converters.to_dict()["parameters"] == "state-dict converter"


@pytest.mark.parametrize("modules", [{}, None, ["layers.{i}"]])
def test_port_refuses_empty_or_non_dict_modules(modules: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"Port\(Linear\): modules must map"):
        port(modules=modules)


@pytest.mark.parametrize("target", [3, None, nn.Linear(1, 1), Transposed("blocks.{i}"), Adapted(3)])  # type: ignore[arg-type]
def test_port_refuses_a_module_target_that_is_not_a_name(target: Any) -> None:
    with pytest.raises(ConfigurationError, match=re.escape("modules['layers.{i}'] must be a reference module name")):
        port(modules={"head": "out", "layers.{i}": target})


def test_port_refuses_an_empty_list_of_module_targets() -> None:
    with pytest.raises(ConfigurationError, match=re.escape("modules['layers.{i}'] is empty")):
        port(modules={"layers.{i}": []})


def test_port_refuses_an_empty_module_pattern() -> None:
    with pytest.raises(ConfigurationError, match="a name pattern must be a non-empty string"):
        port(modules={"": "out"})


@pytest.mark.parametrize("which", ["output", "input"])
def test_port_refuses_a_non_callable_adapter(which: str) -> None:
    target = Adapted("blocks.{i}", **{which: "seq_first"})  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=re.escape("modules['layers.{i}']: an adapter must be a callable")):
        port(modules={"layers.{i}": target})


@pytest.mark.parametrize(
    ("modules", "parameters", "entry"),
    [
        ({"layers.{i}": "blocks.0"}, None, "modules['layers.{i}'] -> 'blocks.0'"),
        ({"layers.0": "blocks.{i}"}, None, "modules['layers.0'] -> 'blocks.{i}'"),
        ({"layers.{i}": "blocks.{j}"}, None, "modules['layers.{i}'] -> 'blocks.{j}'"),
        ({"layers.{i}": ["blocks.{i}", "extra.{j}"]}, None, "modules['layers.{i}'] -> 'extra.{j}'"),
        (None, {"layers.{i}.w": "blocks.w"}, "parameters['layers.{i}.w'] -> 'blocks.w'"),
        (None, {"layers.{i}.w": Transposed("blocks.{j}.w")}, "parameters['layers.{i}.w'] -> 'blocks.{j}.w'"),
        (None, {"layers.{i}.w": Fused(("blocks.{i}.a", "b.w"))}, "parameters['layers.{i}.w'] -> 'b.w'"),
        (
            None,
            {"w": Converted("blocks.{i}.w", identity, identity)},
            "parameters['w'] -> 'blocks.{i}.w'",
        ),
    ],
)
def test_port_refuses_placeholders_that_differ_between_the_sides(modules: Any, parameters: Any, entry: str) -> None:
    changes: dict[str, Any] = {}
    if modules is not None:
        changes["modules"] = modules
    if parameters is not None:
        changes["parameters"] = parameters
    with pytest.raises(ConfigurationError, match=re.escape(entry) + ".*same placeholders"):
        port(**changes)


@pytest.mark.parametrize("target", [3, None, ("blocks.{i}.weight",), Adapted("blocks.{i}.weight")])
def test_port_refuses_a_parameter_target_of_another_type(target: Any) -> None:
    with pytest.raises(
        ConfigurationError,
        match=re.escape(
            "parameters['layers.{i}.weight'] must be a reference parameter name, Transposed, Fused or Converted"
        ),
    ):
        port(parameters={"layers.{i}.weight": target})


def test_port_refuses_parameters_that_are_not_a_dict() -> None:
    with pytest.raises(ConfigurationError, match="parameters must be a dict, got list"):
        port(parameters=[("layers.{i}.weight", "blocks.{i}.weight")])


def test_port_wants_exactly_one_parameter_correspondence() -> None:
    with pytest.raises(ConfigurationError, match="give the parameter correspondence once"):
        port(parameters=None)  # neither
    with pytest.raises(ConfigurationError, match="give the parameter correspondence once"):
        port(to_reference=dict, from_reference=dict)  # both
    # Either one alone is accepted.
    port(parameters=None, to_reference=dict, from_reference=dict)
    port(parameters=None, to_reference=dict, load_weights=False)


def test_port_refuses_loading_weights_without_from_reference() -> None:
    with pytest.raises(ConfigurationError, match="load_weights=True with to_reference needs from_reference"):
        port(parameters=None, to_reference=dict)
    with pytest.raises(ConfigurationError, match="load_weights=True with to_reference needs from_reference"):
        port(parameters=None, to_reference=dict, load_weights=True)


@pytest.mark.parametrize("function", ["to_reference", "from_reference", "forward"])
def test_port_refuses_non_callable_functions(function: str) -> None:
    changes: dict[str, Any] = {"parameters": None, "to_reference": dict, "from_reference": dict}
    changes[function] = "not a function"
    with pytest.raises(ConfigurationError, match=f"{function} must be a callable, got str"):
        port(**changes)


@pytest.mark.parametrize(("to_reference", "from_reference"), [(3, identity), (identity, "inverse"), (None, None)])
def test_port_refuses_a_converted_without_two_callables(to_reference: Any, from_reference: Any) -> None:
    with pytest.raises(
        ConfigurationError, match=re.escape("parameters['layers.{i}.weight']: Converted needs two callables")
    ):
        port(parameters={"layers.{i}.weight": Converted("blocks.{i}.weight", to_reference, from_reference)})


@pytest.mark.parametrize("names", [(), [], ("blocks.{i}.a", 3)])
def test_port_refuses_a_fused_without_names(names: Any) -> None:
    with pytest.raises(
        ConfigurationError,
        match=re.escape("parameters['layers.{i}.weight']: Fused needs the reference's parameter names"),
    ):
        port(parameters={"layers.{i}.weight": Fused(names)})


@pytest.mark.parametrize("value", [1, 0, "yes", None])
def test_port_refuses_load_weights_that_is_not_a_bool(value: Any) -> None:
    with pytest.raises(ConfigurationError, match=re.escape(f"load_weights must be True or False, got {value!r}")):
        port(load_weights=value)


def test_port_label_names_the_model_class_or_the_factory() -> None:
    def build_other(reference: nn.Module) -> nn.Module:
        return nn.Linear(2, 2)

    assert port(model=build_other).label == "build_other"
    assert port(model=lambda reference: nn.Linear(2, 2)).label == "port"  # a lambda has no name to show
    assert port(model=nn.GELU()).label == "GELU"
    assert port(model=nn.GELU(), name="mine").label == "mine"
    assert port(model=build_other).to_dict()["name"] == "build_other"


# --- variants running a port ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "what"),
    [
        ({"arrangement": "decode"}, "an arrangement"),
        ({"replay_routing": True}, "routing replay"),
        ({"param_dtype": "bf16"}, "FSDP2 mixed precision"),
        ({"reduce_dtype": "fp32"}, "FSDP2 mixed precision"),
    ],
)
def test_a_port_variant_refuses_what_is_not_measured_for_ports(changes: dict[str, Any], what: str) -> None:
    with pytest.raises(ConfigurationError, match=rf"variant 'ours': .*{what} is not measured for a port"):
        Variant("ours", dtype="bf16", implementation=port(), **changes)
    Variant("ours", dtype="bf16", **changes)  # the same without the port is a valid variant


def test_a_port_variant_may_be_isolated() -> None:
    assert Variant("ours", dtype="bf16", implementation=port(), isolate=True).isolate


def test_the_reference_is_never_a_port() -> None:
    with pytest.raises(ConfigurationError, match="reference: 'ours' runs another implementation"):
        resolve_reference(Variant("ours", implementation=port()))
    with pytest.raises(ConfigurationError, match="reference: 'ours' runs another implementation"):
        resolve_reference({"name": "ours", "implementation": port()})
    assert resolve_reference("fp32").port is None


def test_an_unknown_port_name_lists_the_known_ones() -> None:
    assert "torchtune_llama" in port_names()
    with pytest.raises(
        ConfigurationError, match=r"variant 'ours': implementation 'no_such_port' is not a port"
    ) as info:
        Variant("ours", implementation="no_such_port")
    assert "torchtune_llama" in str(info.value)


@pytest.mark.parametrize("implementation", [3, nn.Linear(2, 2), {"model": None}])
def test_a_variant_refuses_an_implementation_that_is_not_a_port(implementation: Any) -> None:
    with pytest.raises(ConfigurationError, match=re.escape("implementation must be a pytest_precision.Port")):
        Variant("ours", implementation=implementation)


def test_a_port_variant_describes_itself_by_the_port_label() -> None:
    made = port()
    ours = Variant("ours", dtype="bf16", implementation=made)
    assert ours.port is made
    assert ours.to_dict()["implementation"] == "Linear"
    assert Variant("ours", implementation=port(name="fast")).to_dict()["implementation"] == "fast"
    plain = resolve_variant("bf16")
    assert plain.port is None
    assert "implementation" not in plain.to_dict()
    # But for the name and the implementation, the description is the plain variant's.
    described = {k: v for k, v in ours.to_dict().items() if k not in ("name", "implementation")}
    assert described == {k: v for k, v in plain.to_dict().items() if k != "name"}


def test_port_is_public() -> None:
    assert pp.Port is Port
