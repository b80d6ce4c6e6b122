"""What engine/reference_integrity.py tells a user when a saved Reference does not match (issue 34's mutants): a
config field one side lacks, many changed tensors, a malformed description, other parameter names, weights
recorded across two devices; and the tensor digests of a big reference hashed on worker threads."""

from __future__ import annotations

import hashlib
import json
import threading
from typing import Any

import pytest
import torch
from torch import nn

from pytest_precision.base.errors import ConfigurationError
from pytest_precision.engine import reference_integrity
from pytest_precision.engine.fingerprint import state_checksum
from pytest_precision.engine.model_facts import model_description
from pytest_precision.engine.reference_integrity import (
    changed_parts,
    check_description,
    check_module,
    checksum_difference,
    recorded_digests,
    sealed,
    tensor_digests,
)

CALL = "Reference.load('ref.safetensors')"
ADVICE = "pass the same model"


class Configured(nn.Module):
    """A model whose `config` is a plain dict (model_facts.config_description describes it field by field)."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.config = config
        self.linear = nn.Linear(2, 2)


def description_of(model: nn.Module) -> Any:
    """The model's description as a saved file holds it (JSON)."""
    return json.loads(json.dumps(model_description(model)))


def refusal(recorded: Any, model: nn.Module) -> str:
    with pytest.raises(ConfigurationError) as error:
        check_description(CALL, recorded, model, ADVICE)
    return str(error.value)


def test_a_config_field_only_one_side_has_is_named_absent_on_the_other() -> None:
    recorded = description_of(Configured({"eps": 1e-6, "use_cache": True}))
    message = refusal(recorded, Configured({"eps": 1e-6, "rope_theta": 10000.0}))
    assert message.startswith(f"{CALL}: the model differs from the one the reference was computed with")
    assert (
        "config.use_cache: True in the reference, absent now; config.rope_theta: absent in the reference, " in message
    )
    assert "10000.0 now" in message and "malformed" not in message


def test_a_malformed_description_names_the_error_type() -> None:
    recorded = description_of(Configured({}))
    del recorded["config"]
    message = refusal(recorded, Configured({}))
    assert message == (
        f"{CALL}: the model description it records is malformed (KeyError: 'config'); re-create it with Reference.save"
    )


def sealed_file(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, str]]:
    """The metadata a saved file holds for `tensors`, and the tensor digests it records."""
    meta = json.loads(sealed({"format": 3}, tensors))
    return meta, recorded_digests(meta, list(tensors))


def test_more_than_five_changed_tensors_are_counted_after_the_first_five() -> None:
    tensors = {f"t{i}": torch.full((3,), float(i)) for i in range(7)}
    meta, digests = sealed_file(tensors)
    edited = {key: value + 1 for key, value in tensors.items()}
    assert changed_parts(meta, edited, digests) == (
        "7 of its 7 tensors differ from the SHA-256 digests it records: 't0', 't1', 't2', 't3', 't4' and 2 more"
    )
    edited = {**tensors, "t3": tensors["t3"] + 1}
    assert (
        changed_parts(meta, edited, digests) == "1 of its 7 tensors differs from the SHA-256 digests it records: 't3'"
    )


def checksum_refusal(model: nn.Module, recorded: Any) -> str:
    with pytest.raises(ConfigurationError) as error:
        check_module("ref.safetensors", model, recorded)
    return str(error.value)


def test_other_parameter_names_are_named_missing_or_extra() -> None:
    torch.manual_seed(0)
    one, two = nn.Sequential(nn.Linear(2, 2)), nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    extra = checksum_refusal(two, state_checksum(one))
    assert "(parameters or buffers: 2 here not in the file's model, e.g. '1.weight');" in extra
    missing = checksum_refusal(one, state_checksum(two))
    assert "(parameters or buffers: 2 of the file's model's missing here, e.g. '1.weight');" in missing
    renamed = nn.Sequential()
    renamed.add_module("first", one[0])
    both = checksum_refusal(renamed, state_checksum(one))
    assert (
        "(parameters or buffers: 2 of the file's model's missing here, e.g. '0.weight'; 2 here not in the file's "
        "model, e.g. 'first.weight');"
    ) in both


def test_weights_recorded_on_two_devices_name_no_tensor_by_position() -> None:
    """A model split over two devices sums per device (fingerprint._checksum): its sums are in device order, not in
    the order of the names, so no tensor can be named from them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    training, (layout, sums) = state_checksum(model)
    # Recorded with 0.* on cuda:0 and 1.* on the CPU, 1.bias since edited: cuda:0's sums, then the CPU's.
    split = tuple(
        (name, shape, dtype, "cuda:0" if name.startswith("0.") else "cpu") for name, shape, dtype, _ in layout
    )
    recorded = (training, (split, (*sums[:6], sums[6] + 1.0, sums[7])))
    assert checksum_difference(recorded, state_checksum(model)) == "the same names, shapes and dtypes; other values"
    assert checksum_difference((training, (layout, recorded[1][1])), state_checksum(model)) == (
        "the values of 1 of 4 parameters and buffers differ, e.g. '1.bias'"
    )


def independent_digest(tensor: torch.Tensor) -> str:
    header = f"{str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}\n".encode()
    return hashlib.sha256(header + tensor.numpy().tobytes()).hexdigest()


@pytest.fixture
def hashing_threads(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Every reference counts as big; records, per tensor hashed, whether it was hashed on the main thread."""
    on_main: list[bool] = []
    digest = reference_integrity.tensor_digest

    def recorded(tensor: torch.Tensor) -> str:
        on_main.append(threading.current_thread() is threading.main_thread())
        return digest(tensor)

    monkeypatch.setattr(reference_integrity, "PARALLEL_HASH_BYTES", 0)
    monkeypatch.setattr(reference_integrity, "tensor_digest", recorded)
    return on_main


def test_a_big_reference_of_two_tensors_is_hashed_on_worker_threads(hashing_threads: list[bool]) -> None:
    tensors = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.int64)}
    assert tensor_digests(tensors) == {key: independent_digest(t) for key, t in tensors.items()}
    assert hashing_threads and not any(hashing_threads)


def test_a_big_reference_of_one_tensor_is_hashed_on_the_calling_thread(hashing_threads: list[bool]) -> None:
    tensor = torch.arange(5, dtype=torch.float64)
    assert tensor_digests({"only": tensor}) == {"only": independent_digest(tensor)}
    assert hashing_threads == [True]
