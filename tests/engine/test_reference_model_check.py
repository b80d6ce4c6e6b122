"""A saved Reference records the model, not only its weights: the same weights in a model of another
`rms_norm_eps`, another module class or another torch.nn setting measure something else, and are refused at
load naming the field (issue 34, item 6)."""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import random_tokens, tiny_llama
from pytest_precision import ConfigurationError, Reference, compare, reference
from pytest_precision.engine.fingerprint import state_checksum
from pytest_precision.engine.model_facts import model_description

ADVICE = "pass the same model, or compute a new reference with reference(model, inputs, ...)"


@pytest.fixture(scope="module")
def llama() -> nn.Module:
    return tiny_llama(layers=2)


@pytest.fixture(scope="module")
def saved(llama: nn.Module, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("reference") / "ref.safetensors"
    ids = random_tokens(length=16)
    reference(llama, {"input_ids": ids, "labels": ids.clone()}, backward=False).save(path)
    return path


def with_config(model: nn.Module, **changes: Any) -> nn.Module:
    """A Llama of `model`'s config with `changes`, holding `model`'s weights."""
    attention = model.config._attn_implementation  # which to_dict() leaves out
    config = LlamaConfig(**{**model.config.to_dict(), "attn_implementation": attention, **changes})
    other = LlamaForCausalLM(config).eval()
    other.load_state_dict(model.state_dict())
    return other


def refusal(path: Path, model: Any) -> str:
    with pytest.raises(ConfigurationError) as error:
        Reference.load(path, model=model)
    return str(error.value)


def test_the_same_weights_with_another_rms_norm_eps_are_refused_naming_the_field(saved: Path, llama: nn.Module) -> None:
    other = with_config(llama, rms_norm_eps=1e-5)
    assert state_checksum(other) == state_checksum(llama)  # the weights alone cannot tell them apart
    assert refusal(saved, other) == (
        f"Reference.load('{saved}'): the model differs from the one the reference was computed with, whatever its "
        f"weights (config.rms_norm_eps: 1e-06 in the reference, 1e-05 now); {ADVICE}"
    )
    with pytest.raises(ConfigurationError, match=r"\(config\.rms_norm_eps: 1e-06 in the reference, 1e-05 now\)"):
        Reference.load(saved).with_model(other)


def test_what_the_check_prevents(saved: Path, llama: nn.Module) -> None:
    """The issue's measurement: against the other rms_norm_eps, bf16's log-prob error is that of the norms."""
    right = compare(Reference.load(saved, model=llama), variants=["bf16"])
    wrong = compare(
        Reference.load(saved, model=with_config(llama, rms_norm_eps=1e-2), check_weights=False), variants=["bf16"]
    )
    right_error = right.get("bf16", "logprob", "logprob").rms_rel
    wrong_error = wrong.get("bf16", "logprob", "logprob").rms_rel
    assert right_error is not None and wrong_error is not None
    assert wrong_error > 10 * right_error  # measured: 0.022 against 0.00015


def test_a_factory_building_another_rms_norm_eps_is_refused_before_anything_runs(saved: Path, llama: nn.Module) -> None:
    built: list[torch.dtype] = []
    ran: list[bool] = []

    def factory(dtype: torch.dtype, device: torch.device) -> nn.Module:
        built.append(dtype)
        model = with_config(llama, rms_norm_eps=1e-5).to(dtype)
        model.register_forward_pre_hook(lambda *_: ran.append(True))
        return model

    loaded = Reference.load(saved, model=factory)
    with pytest.raises(ConfigurationError) as error:
        compare(loaded, variants=["bf16"])
    assert str(error.value) == (
        f"Reference.load('{saved}', model=factory): the float32 model it builds differs from the one the reference "
        "was computed with, whatever its weights (config.rms_norm_eps: 1e-06 in the reference, 1e-05 now); pass "
        "the factory (or model) the reference was computed with, or compute a new reference with "
        "reference(factory, inputs, ...)"
    )
    assert built == [torch.float32] and ran == []


def test_a_module_of_another_class_is_refused_naming_it(saved: Path, llama: nn.Module) -> None:
    """The same config and weights, one activation swapped: only the module tree tells."""
    other = copy.deepcopy(llama)
    activation = type(llama.model.layers[1].mlp.act_fn).__name__  # transformers 5: SiLUActivation; 4.x: SiLU
    other.model.layers[1].mlp.act_fn = nn.GELU()
    assert state_checksum(other) == state_checksum(llama)
    assert other.config.to_dict() == llama.config.to_dict()
    assert refusal(saved, other) == (
        f"Reference.load('{saved}'): the model differs from the one the reference was computed with, whatever its "
        f"weights (module model.layers.1.mlp.act_fn: {activation} in the reference, GELU now); {ADVICE}"
    )


def test_a_module_more_is_named_once_not_with_everything_inside_it(saved: Path, llama: nn.Module) -> None:
    other = copy.deepcopy(llama)
    other.model.layers[0].mlp.extra = nn.Sequential(nn.Identity(), nn.Identity())
    assert refusal(saved, other) == (
        f"Reference.load('{saved}'): the model differs from the one the reference was computed with, whatever its "
        f"weights (module model.layers.0.mlp.extra: absent in the reference, Sequential now); {ADVICE}"
    )


def test_bookkeeping_config_fields_change_nothing(saved: Path, llama: nn.Module) -> None:
    other = copy.deepcopy(llama)
    other.config._name_or_path = "/somewhere/else"
    other.config.architectures = ["LlamaForCausalLM"]
    Reference.load(saved, model=other)


class Normed(nn.Module):
    """A plain torch model: its settings are its torch.nn modules' (a LayerNorm's eps), there is no config."""

    def __init__(self, eps: float = 1e-5, p: float = 0.0) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8, eps=eps)
        self.dropout = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.norm(self.linear(x))).square().mean()


def test_a_torch_nn_setting_is_refused_naming_the_module(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Normed()
    path = tmp_path / "ref.safetensors"
    reference(model, (torch.randn(3, 8),), backward=False).save(path)
    other = Normed(eps=1e-6)
    other.load_state_dict(model.state_dict())
    assert refusal(path, other) == (
        f"Reference.load('{path}'): the model differs from the one the reference was computed with, whatever its "
        f"weights (norm.eps: 1e-05 in the reference, 1e-06 now); {ADVICE}"
    )
    Reference.load(path, model=model)


def test_the_description_is_plain_json(llama: nn.Module) -> None:
    description = model_description(llama)
    assert description["config"]["rms_norm_eps"] == 1e-6
    assert not {"_name_or_path", "transformers_version", "architectures", "dtype"} & set(description["config"])
    assert description["modules"][0] == ["", "LlamaForCausalLM"]
    assert ["model.norm", "LlamaRMSNorm"] in description["modules"]
    assert ["lm_head.weight", [256, 64], "float32"] in description["tensors"]
    assert description["settings"]["lm_head"] == {"in_features": 64, "out_features": 256}
    assert math.isclose(description["settings"]["model.embed_tokens"]["norm_type"], 2.0)


def test_another_attention_implementation_is_refused(saved: Path, llama: nn.Module) -> None:
    """transformers' to_dict() leaves the attention implementation out; eager and sdpa round differently."""
    other = copy.deepcopy(llama)
    other.set_attn_implementation("sdpa")
    assert "config._attn_implementation: 'eager' in the reference, 'sdpa' now" in refusal(saved, other)


@dataclasses.dataclass
class Settings:
    eps: float = 1e-5


def test_a_dataclass_config_is_recorded_too(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Normed()
    model.config = Settings()  # type: ignore[assignment]
    path = tmp_path / "ref.safetensors"
    reference(model, (torch.randn(3, 8),), backward=False).save(path)
    model.config = Settings(eps=1e-6)  # type: ignore[assignment]
    assert "(config.eps: 1e-05 in the reference, 1e-06 now)" in refusal(path, model)
