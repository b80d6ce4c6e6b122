"""Files read from disk: a saved Reference (safetensors) and the .npy log-probabilities of compare_logprobs.

A file may be truncated, tampered with or written by someone else: each case is one ConfigurationError
naming the file and saying what to do, never a raw safetensors, JSON or NumPy error. A Reference file records a
SHA-256 of each tensor and of its metadata: a changed value, byte, dtype, shape or setting is named at load.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from conftest import random_tokens, tiny_llama
from pytest_precision import ConfigurationError, Reference, compare, compare_logprobs, reference
from pytest_precision.engine.references import METADATA_KEY

VARIANTS = ["bf16", "fp16"]


@pytest.fixture(scope="module")
def llama() -> nn.Module:
    return tiny_llama(layers=2)


@pytest.fixture(scope="module")
def saved(llama: nn.Module, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small forward-only Reference file, as Reference.save writes it."""
    path = tmp_path_factory.mktemp("reference") / "ref.safetensors"
    ids = random_tokens(length=8)
    reference(llama, {"input_ids": ids, "labels": ids.clone()}, backward=False).save(path)
    return path


# ---------------------------------------------------------------- save -> load round trip


def test_the_readmes_batch_saves_once_and_loads_back(llama: nn.Module, tmp_path: Path) -> None:
    ids = random_tokens(length=16)
    batch = {"input_ids": ids, "labels": ids}  # the README's batch: one tensor, two inputs
    ref = reference(llama, batch)
    path = tmp_path / "ref.safetensors"
    ref.save(path)
    shared = ref.batch.kwargs["input_ids"] is ref.batch.kwargs["labels"]
    with safe_open(str(path), framework="pt") as handle:
        written = [key for key in handle.keys() if key.startswith("__inputs__/")]  # noqa: SIM118
    assert written == ["__inputs__/kwargs/input_ids"] if shared else len(written) == 2
    loaded = Reference.load(path, model=llama)
    inputs = loaded.batch.kwargs
    assert torch.equal(inputs["input_ids"], ids) and torch.equal(inputs["labels"], ids)
    assert (inputs["input_ids"] is inputs["labels"]) == shared  # as the saved batch held them
    assert list(loaded.stored) == list(ref.stored)
    assert all(torch.equal(loaded.stored[key], tensor.cpu()) for key, tensor in ref.stored.items())
    assert compare(loaded, variants=VARIANTS).to_dict() == compare(ref, variants=VARIANTS).to_dict()


def test_separate_equal_inputs_stay_separate(llama: nn.Module, tmp_path: Path) -> None:
    ids = random_tokens(length=8)
    ref = reference(llama, {"input_ids": ids, "labels": ids.clone()}, backward=False)
    path = tmp_path / "ref.safetensors"
    ref.save(path)
    inputs = Reference.load(path, model=llama).batch.kwargs
    assert inputs["input_ids"] is not inputs["labels"] and torch.equal(inputs["input_ids"], inputs["labels"])


class SharedInputs(nn.Module):
    """Sums its inputs, all of shape (4,) or (3, 4), through a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.linear(sum(inputs)).square().mean()  # type: ignore[arg-type]


def test_inputs_sharing_storage_are_saved_apart_with_their_own_requires_grad(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = SharedInputs()
    x = torch.randn(3, 4, requires_grad=True)
    # x[0] shares x's storage in another view; x.detach() is the same view without requires_grad.
    ref = reference(model, (x, x[0].detach(), x, x.detach()), backward=False)
    path = tmp_path / "ref.safetensors"
    ref.save(path)
    args = Reference.load(path, model=model).batch.args
    for got, saved in zip(args, ref.batch.args, strict=True):
        assert torch.equal(got, saved) and got.requires_grad == saved.requires_grad
    assert compare(Reference.load(path, model=model), variants=VARIANTS).to_dict() == (
        compare(ref, variants=VARIANTS).to_dict()
    )


# ---------------------------------------------------------------- truncated and tampered files


def incomplete(path: Path) -> str:
    return (
        rf"^Reference\.load\('{path}'\): not a complete Reference file written by Reference\.save \(.*\); "
        r"re-create it with Reference\.save$"
    )


def load_error(path: Path) -> str:
    with pytest.raises(ConfigurationError) as error:
        Reference.load(path)
    return str(error.value)


@pytest.mark.parametrize("kept", [0, 5, 8, 40, 0.5, -1])
def test_a_truncated_file_is_refused_by_name(saved: Path, tmp_path: Path, kept: float) -> None:
    data = saved.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[: int(len(data) * kept) if isinstance(kept, float) else kept])
    assert len(cut.read_bytes()) < len(data)
    with pytest.raises(ConfigurationError, match=incomplete(cut)):
        Reference.load(cut)


def test_a_corrupted_header_is_refused_by_name(saved: Path, tmp_path: Path) -> None:
    data = bytearray(saved.read_bytes())
    header_length = int.from_bytes(data[:8], "little")
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(bytes(data[:8]) + b"#" + bytes(data[9:]))  # the header's JSON loses its "{"
    with pytest.raises(ConfigurationError, match=incomplete(broken)):
        Reference.load(broken)
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes((header_length * 1000).to_bytes(8, "little") + bytes(data[8:]))
    with pytest.raises(ConfigurationError, match=incomplete(huge)):
        Reference.load(huge)


def test_files_that_are_not_safetensors_are_refused_by_name(tmp_path: Path) -> None:
    for name, content in (("empty", b""), ("json", b'{"schema_version": 1}'), ("zeros", bytes(64))):
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(content)
        with pytest.raises(ConfigurationError, match=incomplete(path)):
            Reference.load(path)
    message = load_error(tmp_path / "absent.safetensors")
    assert message.startswith(f"Reference.load('{tmp_path / 'absent.safetensors'}'): cannot read it: ")


def rewritten(
    saved: Path, tmp_path: Path, edit: Any, drop: str | None = None, change: tuple[str, Any] | None = None
) -> Path:
    """A copy of `saved` whose metadata went through `edit` (a function of the metadata dict, or of its text),
    without the tensor `drop`, and with the tensor change[0] through the function change[1]."""
    with safe_open(str(saved), framework="pt") as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
        raw = (handle.metadata() or {})[METADATA_KEY]
    if drop is not None:
        del tensors[drop]
    if change is not None:
        tensors[change[0]] = change[1](tensors[change[0]])
    if isinstance(edit, str):
        text = edit.replace("RAW", raw[: len(raw) // 2])
    else:
        meta = json.loads(raw)
        edit(meta)
        text = json.dumps(meta)
    path = tmp_path / "tampered.safetensors"
    save_file(tensors, str(path), metadata={METADATA_KEY: text})
    return path


def _first_stored(meta: dict[str, Any]) -> str:
    name, kind = meta["order"][0]
    return f"{kind}/{name}"


METADATA_EDITS: dict[str, Any] = {
    "cut-in-half": "RAW",
    "not-json": "{'format': 1}",
    "a-list": "[1]",
    "nested-too-deep": "[" * 100_000,
    "no-order": lambda m: m.pop("order"),
    "order-a-dict": lambda m: m.update(order={"a": 1}),
    "order-of-triples": lambda m: m.update(order=[["a", "fw", "x"]]),
    "no-inputs": lambda m: m.pop("inputs"),
    "input-a-string": lambda m: m["inputs"]["kwargs"].update(input_ids="ids"),
    "input-value-a-list": lambda m: m["inputs"]["kwargs"].update(extra={"value": [1, 2]}),
    "input-not-in-file": lambda m: m["inputs"]["kwargs"].update(labels={"tensor": "nope", "requires_grad": False}),
    "requires-grad-a-word": lambda m: m["inputs"]["kwargs"]["labels"].update(requires_grad="no"),
    "backward-a-word": lambda m: m.update(backward="yes"),
    "temperature-a-word": lambda m: m.update(temperature="hot"),
    "device-unknown": lambda m: m.update(device="warp9"),
    "variant-unknown-field": lambda m: m["reference"].update(flavour="vanilla"),
    "variant-bad-precision": lambda m: m["reference"].update(matmul_precision="extreme"),
    "run-a-list": lambda m: m.update(run=[1]),
    "modules-a-number": lambda m: m.update(modules=3),
    "module-names-a-string": lambda m: m.update(module_names="model"),
    "no-tensor-digests": lambda m: m.pop("tensor_sha256"),
    "no-metadata-digest": lambda m: m.pop("metadata_sha256"),
    "tensor-digests-a-list": lambda m: m.update(tensor_sha256=[]),
    "a-tensor-without-digest": lambda m: m["tensor_sha256"].pop(_first_stored(m)),
    "a-digest-without-tensor": lambda m: m["tensor_sha256"].update({"fw/nowhere": "0" * 64}),
    "metadata-digest-a-number": lambda m: m.update(metadata_sha256=0),
    "no-model": lambda m: m.pop("model"),
    "model-a-list": lambda m: m.update(model=[]),
    "model-without-config": lambda m: m["model"].pop("config"),
    "model-config-a-list": lambda m: m["model"].update(config=[1]),
    "model-modules-not-pairs": lambda m: m["model"].update(modules=[["", "A", "B"]]),
    "model-settings-a-list": lambda m: m["model"].update(settings=[]),
    "model-tensor-shape-of-floats": lambda m: m["model"].update(tensors=[["w", [1.5], "float32"]]),
}


@pytest.mark.parametrize("case", list(METADATA_EDITS))
def test_tampered_metadata_is_refused_by_name(saved: Path, tmp_path: Path, case: str) -> None:
    path = rewritten(saved, tmp_path, METADATA_EDITS[case])
    with pytest.raises(ConfigurationError, match=incomplete(path)):
        Reference.load(path)


def test_a_tensor_the_metadata_lists_missing_from_the_file_is_refused_by_name(saved: Path, tmp_path: Path) -> None:
    with safe_open(str(saved), framework="pt") as handle:
        first = _first_stored(json.loads((handle.metadata() or {})[METADATA_KEY]))
    path = rewritten(saved, tmp_path, lambda m: None, drop=first)
    message = load_error(path)
    assert f"1 tensor(s) its metadata lists are not in the file, e.g. {first!r}" in message
    path = rewritten(saved, tmp_path, lambda m: None, drop="__inputs__/kwargs/labels")
    assert "the input tensor '__inputs__/kwargs/labels' its metadata lists is not in the file" in load_error(path)


def test_another_format_is_refused_with_the_fix(saved: Path, tmp_path: Path) -> None:
    path = rewritten(saved, tmp_path, lambda m: m.update(format=4))
    assert load_error(path) == (
        f"Reference.load('{path}'): unknown format 4 (this pytest-precision reads format 3); "
        "re-create it with Reference.save"
    )


def test_a_format_1_file_which_records_no_digests_is_refused_with_the_fix(saved: Path, tmp_path: Path) -> None:
    def as_written_by_0_1(meta: dict[str, Any]) -> None:
        meta.update(format=1)
        del meta["tensor_sha256"], meta["metadata_sha256"]

    path = rewritten(saved, tmp_path, as_written_by_0_1)
    assert load_error(path) == (
        f"Reference.load('{path}'): format 1, written by pytest-precision 0.1, records no digest of its tensors, "
        "so a change to them cannot be seen; re-create it with Reference.save"
    )


def test_a_format_2_file_which_records_no_model_is_refused_with_the_fix(saved: Path, tmp_path: Path) -> None:
    def as_written_by_format_2(meta: dict[str, Any]) -> None:
        meta.update(format=2)
        del meta["model"]

    path = rewritten(saved, tmp_path, as_written_by_format_2)
    assert load_error(path) == (
        f"Reference.load('{path}'): format 2 records the model's weights but not the model (its modules, settings "
        "and config), so another model holding the same weights cannot be told apart; re-create it with "
        "Reference.save"
    )


def test_an_untampered_rewrite_still_loads(saved: Path, tmp_path: Path, llama: nn.Module) -> None:
    # The rewriting helper itself changes nothing: the refusals above come from the edits.
    path = rewritten(saved, tmp_path, lambda m: None)
    assert compare(Reference.load(path, model=llama), variants=["bf16"]).to_dict() == (
        compare(Reference.load(saved, model=llama), variants=["bf16"]).to_dict()
    )


def data_offset(path: Path, key: str) -> int:
    """Where in the safetensors file `path` the bytes of tensor `key` begin."""
    raw = path.read_bytes()
    header_length = int.from_bytes(raw[:8], "little")
    return 8 + header_length + int(json.loads(raw[8 : 8 + header_length])[key]["data_offsets"][0])


def edited_bytes(saved: Path, tmp_path: Path, offset: int, new: bytes) -> Path:
    """A copy of `saved` with `new` written at byte `offset` (the header and everything else unchanged)."""
    data = bytearray(saved.read_bytes())
    assert data[offset : offset + len(new)] != new
    data[offset : offset + len(new)] = new
    path = tmp_path / "edited.safetensors"
    path.write_bytes(bytes(data))
    return path


def tensor_count(path: Path) -> int:
    with safe_open(str(path), framework="pt") as handle:
        return len(list(handle.keys()))


def test_a_changed_value_is_refused_naming_the_tensor(saved: Path, tmp_path: Path, llama: nn.Module) -> None:
    """The issue's case: one log-prob set to -50 would measure fp16 at 32 % instead of 0.05 %."""
    path = edited_bytes(saved, tmp_path, data_offset(saved, "logprob/logprob"), struct.pack("<f", -50.0))
    with pytest.raises(ConfigurationError) as error:
        Reference.load(path, model=llama)
    assert str(error.value) == (
        f"Reference.load('{path}'): 1 of its {tensor_count(saved)} tensors differs from the SHA-256 digests it "
        "records: 'logprob/logprob', so the file was changed after Reference.save wrote it; re-create it with "
        "Reference.save"
    )


@pytest.mark.parametrize("where", ["first", "middle", "last", "end-of-largest"])
def test_one_flipped_byte_anywhere_in_the_data_is_refused(saved: Path, tmp_path: Path, where: str) -> None:
    raw = saved.read_bytes()
    start = 8 + int.from_bytes(raw[:8], "little")
    spans = [entry["data_offsets"] for key, entry in json.loads(raw[8:start]).items() if key != "__metadata__"]
    largest = max(spans, key=lambda span: span[1] - span[0])
    assert largest[1] - largest[0] >= 1 << 14  # the logits: every byte of a big tensor counts, not its first ones
    offset = {
        "first": start,
        "middle": (start + len(raw)) // 2,
        "last": len(raw) - 1,
        "end-of-largest": start + largest[1] - 1,
    }[where]
    path = edited_bytes(saved, tmp_path, offset, bytes([raw[offset] ^ 0x01]))
    message = load_error(path)
    assert message.startswith(f"Reference.load('{path}'): 1 of its {tensor_count(saved)} tensors differs from the ")
    assert message.endswith("so the file was changed after Reference.save wrote it; re-create it with Reference.save")


def test_a_tensor_given_another_dtype_or_shape_in_the_header_is_refused(saved: Path, tmp_path: Path) -> None:
    """The same bytes read as other values: the digest covers the dtype and shape too."""
    for edit in (lambda t: t.view(torch.int32), lambda t: t.reshape(t.shape[::-1])):
        path = rewritten(saved, tmp_path, lambda m: None, change=("logprob/logprob", edit))
        assert ": 'logprob/logprob', so the file was changed after Reference.save" in load_error(path)


def test_a_consistent_change_of_a_setting_is_refused(saved: Path, tmp_path: Path) -> None:
    path = rewritten(saved, tmp_path, lambda m: m.update(temperature=2.0))
    assert load_error(path) == (
        f"Reference.load('{path}'): its metadata differs from the SHA-256 it records, so the file was changed "
        "after Reference.save wrote it; re-create it with Reference.save"
    )


@pytest.mark.parametrize("umask", [0o022, 0o027], ids=["022", "027"])
def test_a_saved_reference_gets_the_umasks_ordinary_mode(saved: Path, tmp_path: Path, umask: int) -> None:
    """Not the 0600 of a temporary file: a reference is shared like any other output."""
    ref = Reference.load(saved)
    previous = os.umask(umask)
    try:
        ref.save(tmp_path / "ref.safetensors")
        ref.save(tmp_path / "ref.safetensors")  # replacing one too
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "ref.safetensors").stat().st_mode) == 0o666 & ~umask
    assert [p.name for p in tmp_path.iterdir()] == ["ref.safetensors"]  # no temporary file left
    assert Reference.load(tmp_path / "ref.safetensors").stored.keys() == ref.stored.keys()


# ---------------------------------------------------------------- compare_logprobs' .npy files


def logprobs(shape: tuple[int, ...] = (2, 16), seed: int = 0) -> np.ndarray[Any, Any]:
    values: np.ndarray[Any, Any] = -np.abs(np.random.default_rng(seed).normal(2.0, 1.0, shape))
    return values


def error_of(**kwargs: Any) -> str:
    with pytest.raises(ConfigurationError) as error:
        compare_logprobs(**kwargs)
    return str(error.value)


@pytest.mark.parametrize("dtype", [">f4", ">f8", ">f2"])
def test_a_big_endian_npy_loads_as_its_values(tmp_path: Path, dtype: str) -> None:
    a, b = logprobs(seed=1), logprobs(seed=2)
    np.save(tmp_path / "a.npy", a.astype(dtype))
    np.save(tmp_path / "b.npy", b.astype(dtype))
    np.save(tmp_path / "mask.npy", (np.arange(32).reshape(2, 16) % 3 != 0).astype(">i4"))
    native = dtype.replace(">", "<")
    expected = compare_logprobs(a.astype(native), b.astype(native), mask=np.load(tmp_path / "mask.npy") != 0)
    got = compare_logprobs(tmp_path / "a.npy", tmp_path / "b.npy", mask=tmp_path / "mask.npy")
    assert got.to_dict() == expected.to_dict()
    assert compare_logprobs(a.astype(dtype), b).to_dict() == compare_logprobs(a.astype(native), b).to_dict()


class Unpickled:
    """Leaves a marker file when unpickled: an object .npy must never be unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.marker.write_text, ("unpickled",))


def test_an_object_npy_is_refused_unread(tmp_path: Path) -> None:
    marker = tmp_path / "UNPICKLED"
    path = tmp_path / "objects.npy"
    np.save(path, np.array([Unpickled(marker), 1.0], dtype=object), allow_pickle=True)
    assert error_of(a=path, b=logprobs((2,))).startswith(f"a: cannot read file {path} as .npy: ")
    assert not marker.exists()


def test_npy_files_of_other_dtypes_are_refused_by_name(tmp_path: Path) -> None:
    for name, array in (("ints", np.arange(32).reshape(2, 16)), ("bools", np.ones((2, 16), dtype=bool))):
        path = tmp_path / f"{name}.npy"
        np.save(path, array)
        assert error_of(a=logprobs(), b=path) == (
            f"b (file {path}) holds {torch.from_numpy(array).dtype} values, not log-probabilities; pass "
            "floating-point log-probabilities (float32 or float64)".replace("torch.", "")
        )
    for name, array in (("text", np.array(["a", "b"])), ("records", np.zeros(2, dtype=[("x", "<f4")]))):
        path = tmp_path / f"{name}.npy"
        np.save(path, array)
        assert error_of(a=path, b=logprobs((2,))).startswith(f"a (file {path}) is a NumPy array of dtype ")


@pytest.mark.parametrize("kept", [0, 30, 100, -8])
def test_a_truncated_npy_is_refused_by_name(tmp_path: Path, kept: int) -> None:
    whole = tmp_path / "whole.npy"
    np.save(whole, logprobs())
    path = tmp_path / "cut.npy"
    path.write_bytes(whole.read_bytes()[:kept])
    assert error_of(a=logprobs(), b=path).startswith(f"b: cannot read file {path} as .npy: ")


def test_wrong_shapes_and_nan_files_are_refused_by_name(tmp_path: Path) -> None:
    cube, short, nan = tmp_path / "cube.npy", tmp_path / "short.npy", tmp_path / "nan.npy"
    np.save(cube, np.zeros((2, 2, 2)))
    np.save(short, logprobs((2, 15)))
    np.save(nan, np.full((2, 16), math.nan))
    assert error_of(a=cube, b=logprobs()).startswith(f"a (file {cube}) has shape (2, 2, 2)")
    assert error_of(a=short, b=logprobs()).startswith(f"a (file {short}) has shape (2, 15) but b (a NumPy array)")
    message = error_of(a=logprobs(), b=nan)
    assert message.startswith(f"no token to compare: the mask and the non-finite values of b (file {nan})")
