"""The reference computed once: Reference, compare(ref, ...), the memoizing cache, save/load and offload."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch
from torch import nn

import pytest_precision
from conftest import random_tokens, tiny_llama
from pytest_precision import ConfigurationError, Reference, ReferenceCache, compare, reference
from pytest_precision.engine import runner
from pytest_precision.engine.fingerprint import state_checksum
from pytest_precision.reports.report import PrecisionReport

VARIANTS = ["bf16", "fp16"]


def batch(seed: int = 0) -> dict[str, torch.Tensor]:
    ids = random_tokens(seed=seed, length=16)
    return {"input_ids": ids, "labels": ids.clone()}


@pytest.fixture(scope="module")
def llama() -> nn.Module:
    return tiny_llama(layers=2)


@pytest.fixture(scope="module")
def uncached(llama: nn.Module) -> PrecisionReport:
    return compare(llama, batch(), VARIANTS)


def same(a: PrecisionReport, b: PrecisionReport) -> None:
    assert a.to_dict() == b.to_dict()


def test_public_names() -> None:
    assert isinstance(pytest_precision.Reference, type)
    ref_function: Any = pytest_precision.reference
    assert callable(ref_function)
    assert {"Reference", "ReferenceCache", "reference"} <= set(pytest_precision.__all__)


def test_compare_against_a_reference_equals_the_full_run(llama: nn.Module, uncached: PrecisionReport) -> None:
    ref = reference(llama, batch())
    assert isinstance(ref, Reference) and ref.model is llama and ref.info.variant["name"] == "fp32"
    assert ("logprob", "logprob") in ref.stored and ref.module_names
    same(compare(ref, variants=VARIANTS), uncached)
    same(compare(ref, variants=VARIANTS), uncached)  # reusable
    # One variant at a time gives the same records.
    assert compare(ref, variants=["fp16"]).records("fp16") == uncached.records("fp16")


def test_the_reference_runs_once(llama: nn.Module, uncached: PrecisionReport, monkeypatch: pytest.MonkeyPatch) -> None:

    runs: list[str] = []
    original = runner.Runner.run

    def counted(self: Any, variant: Any, *args: Any, **kwargs: Any) -> Any:
        runs.append(variant.name)
        return original(self, variant, *args, **kwargs)

    monkeypatch.setattr(runner.Runner, "run", counted)
    ref = reference(llama, batch())
    assert runs == ["fp32"]
    runs.clear()
    compare(ref, variants=["bf16"])
    assert runs == ["bf16"]


def test_repeats_with_a_reference_equal_the_full_run(llama: nn.Module) -> None:
    full = compare(llama, batch(), ["bf16"], repeats=2, backward=False)
    ref = reference(llama, batch(), backward=False)
    same(compare(ref, variants=["bf16"], repeats=2), full)
    assert compare(ref, variants=["bf16"]).reference.repeats == 1


def test_cache_hit_equals_uncached(llama: nn.Module, uncached: PrecisionReport) -> None:
    cache = ReferenceCache()
    first = compare(llama, batch(), VARIANTS, cache=cache)
    second = compare(llama, batch(), VARIANTS, cache=cache)
    assert (cache.hits, cache.misses, len(cache)) == (1, 1, 1)
    same(first, uncached)
    same(second, uncached)
    # Other inputs or options: a miss.
    compare(llama, batch(seed=1), ["bf16"], cache=cache)
    compare(llama, batch(), ["bf16"], cache=cache, temperature=0.7)
    assert cache.hits == 1 and cache.misses == 3


def test_an_in_place_edit_is_never_served_stale() -> None:
    model = tiny_llama(layers=2)
    cache = ReferenceCache()
    first = compare(model, batch(), ["bf16"], cache=cache)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[3, 5] += 0.25
    second = compare(model, batch(), ["bf16"], cache=cache)
    fresh = compare(model, batch(), ["bf16"])
    assert cache.hits == 0 and cache.misses == 2
    same(second, fresh)
    assert second.to_dict() != first.to_dict()


def test_an_explicit_reference_refuses_an_edited_model() -> None:
    model = tiny_llama(layers=2)
    ref = reference(model, batch(), backward=False)
    with torch.no_grad():
        model.model.norm.weight[0] += 1.0
    with pytest.raises(ConfigurationError, match="changed since its Reference was computed"):
        compare(ref, variants=["bf16"])


def test_lru_eviction_order_and_byte_budget() -> None:
    models = [tiny_llama(layers=1, seed=s) for s in range(3)]
    cache = ReferenceCache(max_entries=2)
    refs = [reference(m, batch(), backward=False, cache=cache) for m in models[:2]]
    keys = cache.keys()
    reference(models[0], batch(), backward=False, cache=cache)  # a hit: models[0] is now the most recent
    assert cache.hits == 1 and cache.keys() == [keys[1], keys[0]]
    reference(models[2], batch(), backward=False, cache=cache)  # evicts models[1], the least recent
    assert len(cache) == 2 and keys[1] not in (now := cache.keys()) and keys[0] in now
    reference(models[1], batch(), backward=False, cache=cache)
    assert cache.misses == 4 and keys[0] not in list(cache.keys())  # models[0] was then the least recent
    # A byte budget below one reference keeps nothing; one entry's worth keeps one.
    size = refs[0].nbytes
    small = ReferenceCache(max_entries=5, max_bytes=size - 1)
    reference(models[0], batch(), backward=False, cache=small)
    assert len(small) == 0
    budget = ReferenceCache(max_entries=5, max_bytes=size + size // 2)
    for m in models:
        reference(m, batch(), backward=False, cache=budget)
    assert len(budget) == 1 and budget.nbytes <= size + size // 2


def test_entries_go_with_their_model() -> None:
    import gc

    cache = ReferenceCache()
    model = tiny_llama(layers=1)
    reference(model, batch(), backward=False, cache=cache)
    assert len(cache) == 1
    del model
    gc.collect()
    assert len(cache) == 0


def test_save_load_round_trip(llama: nn.Module, uncached: PrecisionReport, tmp_path: Any) -> None:
    from safetensors import safe_open

    ref = reference(llama, batch())
    path = tmp_path / "ref.safetensors"
    ref.save(path)
    with safe_open(str(path), framework="pt") as handle:
        keys = set(handle.keys())
        assert "fw/model.layers.0" in keys and "grad/lm_head.weight" in keys and "loss/loss" in keys
        assert "pytest_precision.reference" in (handle.metadata() or {})
    loaded = Reference.load(path, model=llama)
    assert loaded.info == ref.info and loaded.module_names == ref.module_names
    assert list(loaded.stored) == list(ref.stored)
    same(compare(loaded, variants=VARIANTS), compare(ref, variants=VARIANTS))
    same(compare(loaded, variants=VARIANTS), uncached)
    # A factory building the same model works too.
    factory = lambda dtype, device: tiny_llama(layers=2).to(device)  # noqa: E731
    same(compare(Reference.load(path, model=factory), variants=["bf16"]), compare(ref, variants=["bf16"]))


def test_a_loaded_reference_needs_its_model_and_loss_fn(llama: nn.Module, tmp_path: Any) -> None:
    path = tmp_path / "ref.safetensors"
    reference(llama, batch(), backward=False).save(path)
    with pytest.raises(ConfigurationError, match=r"loaded from .*ref\.safetensors without its model"):
        compare(Reference.load(path), variants=["bf16"])
    same(
        compare(Reference.load(path).with_model(llama), variants=["bf16"]),
        compare(llama, batch(), ["bf16"], backward=False),
    )

    def loss_fn(output: Any, inputs: Any) -> torch.Tensor:
        return output.logits.float().square().mean()

    reference(llama, batch(), loss_fn=loss_fn).save(path)
    with pytest.raises(ConfigurationError, match=r"ran with loss_fn=.*loss_fn; pass it again"):
        compare(Reference.load(path, model=llama), variants=["bf16"])
    same(
        compare(Reference.load(path, model=llama, loss_fn=loss_fn), variants=["bf16"]),
        compare(llama, batch(), ["bf16"], loss_fn=loss_fn),
    )
    with pytest.raises(ConfigurationError, match=r"no pytest_precision\.reference metadata"):
        from safetensors.torch import save_file

        save_file({"x": torch.zeros(1)}, str(path))
        Reference.load(path)


def test_offload_gives_identical_results(llama: nn.Module, uncached: PrecisionReport) -> None:
    ref = reference(llama, batch(), offload=True)
    assert ref.offload and all(t.device.type == "cpu" for t in ref.stored.values())
    same(compare(ref, variants=VARIANTS), uncached)
    same(compare(llama, batch(), VARIANTS, offload=True), uncached)
    assert not reference(llama, batch(), backward=False).offload  # default on CPU
    # The head's output and the logits are one tensor: one host copy, not two.
    head, logits = ref.stored[("lm_head", "fw")], ref.stored[("logits", "logits")]
    assert head.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr()
    assert ref.nbytes == sum(t.numel() * t.element_size() for k, t in ref.stored.items() if k != ("logits", "logits"))


def test_clear_errors(llama: nn.Module) -> None:
    ref = reference(llama, batch(), backward=False)
    with pytest.raises(ConfigurationError, match="inputs cannot be given with a Reference"):
        compare(ref, batch(), ["bf16"])
    with pytest.raises(ConfigurationError, match="backward, modules cannot be given with a Reference"):
        compare(ref, variants=["bf16"], backward=True, modules=["lm_head"])
    with pytest.raises(ConfigurationError, match="device cannot be given"):
        compare(ref, variants=["bf16"], device="meta")
    compare(ref, variants=["bf16"], device="cpu")  # its own device is fine
    with pytest.raises(ConfigurationError, match="variants: give a non-empty list"):
        compare(ref)
    with pytest.raises(ConfigurationError, match="max_entries"):
        ReferenceCache(max_entries=0)
    with pytest.raises(ConfigurationError, match="model: expected"):
        reference(42, batch())  # type: ignore[arg-type]


@pytest.mark.parametrize("chunk", [None, 64])  # one chunk per tensor; several
def test_the_parameter_checksum_sees_any_edit_or_moved_value(monkeypatch, chunk):
    from pytest_precision.engine import fingerprint, references
    from pytest_precision.numbers import metrics

    if chunk is not None:
        monkeypatch.setattr(metrics, "CPU_CHUNK_ELEMENTS", chunk)
        monkeypatch.setattr(fingerprint, "_CHUNK_WEIGHTS", {})
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)  # 256 weights: 4 chunks of 64
    original = references.state_checksum(model)
    assert references.state_checksum(copy.deepcopy(model)) == original

    def edited(edit) -> tuple:
        changed = copy.deepcopy(model)
        with torch.no_grad():
            edit(changed.weight.view(-1))
        checksum = references.state_checksum(changed)
        # Seen by more than float64 rounding: a sum that differs in its last bit only is luck, not detection.
        sums, original_sums = checksum[1][1], original[1][1]
        if max(abs(a - b) / max(abs(b), 1e-300) for a, b in zip(sums, original_sums, strict=True)) < 1e-12:
            return original
        return checksum

    def swap(i: int, j: int):
        def apply(flat: torch.Tensor) -> None:
            flat[i], flat[j] = flat[j].clone(), flat[i].clone()

        return apply

    assert edited(lambda flat: flat[100].add_(1e-6)) != original  # a tiny in-place edit
    assert edited(swap(3, 40)) != original  # two values trading places within a chunk
    assert edited(swap(5, 5 + 64)) != original  # the same offset of two chunks
    assert edited(lambda flat: flat.copy_(flat.flip(0))) != original  # reversed


# ---------------------------------------------------------------- the weights a loaded Reference is compared with


class Factory:
    """tiny_llama(layers=2, seed=seed) in the dtype asked for; `calls` lists the dtypes asked for, `forwards`
    those of the models that ran a forward."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.calls: list[torch.dtype] = []
        self.forwards: list[torch.dtype] = []

    def __call__(self, dtype: torch.dtype, device: torch.device) -> nn.Module:
        self.calls.append(dtype)
        model: nn.Module = tiny_llama(layers=2, seed=self.seed).to(device=device, dtype=dtype)
        model.register_forward_pre_hook(lambda *_: self.forwards.append(dtype))
        return model


DIGEST = r"[0-9a-f]{16}"


@pytest.fixture(scope="module")
def factory_saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Reference, Any]:
    """A forward-only Reference of Factory(seed=0) and the file it was saved to."""
    ref = reference(Factory(seed=0), batch(), backward=False)
    path = tmp_path_factory.mktemp("factory") / "ref.safetensors"
    ref.save(path)
    return ref, path


@pytest.mark.parametrize("first", ["fp32", "bf16"])  # the checked model is the run's; one built for the check
def test_a_factory_building_other_weights_is_refused_before_anything_runs(
    factory_saved: tuple[Reference, Any], first: str
) -> None:
    _, path = factory_saved
    other = Factory(seed=1)
    loaded = Reference.load(path, model=other)
    assert loaded.model is other and other.calls == []  # a factory is checked when first called
    with pytest.raises(ConfigurationError) as error:
        compare(loaded, variants=[first, "fp16"])
    message = str(error.value)
    digests = re.fullmatch(
        rf"Reference\.load\('{re.escape(str(path))}', model=factory\): the factory builds other weights than "
        rf"those the reference was computed with: weights checksum ({DIGEST}) of the float32 model it builds, "
        rf"({DIGEST}) in the file \(the values of \d+ of \d+ parameters and buffers differ, e\.g\. "
        r"'model\.embed_tokens\.weight'\); pass the factory \(or model\) the reference was computed with, or "
        r"compute a new reference with reference\(factory, inputs, \.\.\.\)",
        message,
    )
    assert digests is not None, message
    assert digests[1] != digests[2]
    assert other.calls == [torch.float32] and other.forwards == []  # refused on the checked model, before any run


def test_a_factory_building_the_same_weights_measures_as_the_reference_computed_here(
    factory_saved: tuple[Reference, Any],
) -> None:
    ref, path = factory_saved
    same_weights = Factory(seed=0)
    loaded = Reference.load(path, model=same_weights)
    same(compare(loaded, variants=["bf16"]), compare(ref, variants=["bf16"]))
    # One model built in the reference's dtype for the check, then the run's; checked once per Reference.
    assert same_weights.calls == [torch.float32, torch.bfloat16]
    compare(loaded, variants=["fp16"])
    assert same_weights.calls == [torch.float32, torch.bfloat16, torch.float16]
    # A first run in the reference's dtype is itself the checked model: no extra build.
    again = Factory(seed=0)
    same(compare(Reference.load(path, model=again), variants=["fp32"]), compare(ref, variants=["fp32"]))
    assert again.calls == [torch.float32]


def test_a_factory_reference_computed_here_builds_no_extra_model() -> None:
    built = Factory(seed=0)
    ref = reference(built, batch(), backward=False)
    assert ref.model is built and built.calls == [torch.float32]
    compare(ref, variants=["bf16"])
    assert built.calls == [torch.float32, torch.bfloat16]
    # What save records is the reference run's model's checksum, taken without a host sync until then.
    assert ref.weights_checksum() == state_checksum(tiny_llama(layers=2, seed=0))


def test_a_loaded_reference_checks_a_model_a_factory_and_with_model_alike(
    factory_saved: tuple[Reference, Any], llama: nn.Module
) -> None:
    _, path = factory_saved
    with pytest.raises(ConfigurationError) as error:
        Reference.load(path, model=tiny_llama(layers=2, seed=1))
    assert re.fullmatch(
        rf"Reference\.load\('{re.escape(str(path))}'\): the model's weights differ from those the reference was "
        rf"computed with: weights checksum {DIGEST} here, {DIGEST} in the file \(the values of \d+ of \d+ "
        r"parameters and buffers differ, e\.g\. 'model\.embed_tokens\.weight'\); pass the same model, or "
        r"compute a new reference with reference\(model, inputs, \.\.\.\)",
        str(error.value),
    ), str(error.value)
    with pytest.raises(ConfigurationError) as error:
        Reference.load(path, model=tiny_llama(layers=1, seed=0))  # another architecture: named before the weights
    assert str(error.value) == (
        f"Reference.load('{path}'): the model differs from the one the reference was computed with, whatever its "
        "weights (config.num_hidden_layers: 2 in the reference, 1 now; module model.layers.1: LlamaDecoderLayer in "
        "the reference, absent now); pass the same model, or compute a new reference with reference(model, inputs, "
        "...)"
    )
    with pytest.raises(ConfigurationError, match="the model's weights differ"):
        Reference.load(path).with_model(tiny_llama(layers=2, seed=1))
    with pytest.raises(ConfigurationError, match="the factory builds other weights"):
        compare(Reference.load(path).with_model(Factory(seed=1)), variants=["bf16"])
    Reference.load(path, model=tiny_llama(layers=2, seed=0))  # a model of the same weights (the factory's)
    # A caller that checked the weights otherwise (pytest-precision run: the checkpoint's SHA-256) skips it.
    unchecked = Factory(seed=1)
    compare(Reference.load(path, model=unchecked, check_weights=False), variants=["bf16"])
    assert unchecked.calls == [torch.bfloat16]


def test_weight_sums_read_later_equal_the_state_checksum() -> None:
    from pytest_precision.engine.reference_integrity import WeightSums

    model = nn.BatchNorm1d(5)  # parameters and buffers, an integer one among them
    with torch.no_grad():
        model.weight.uniform_(-1, 1)
        model.running_mean.uniform_(-1, 1)
    model.num_batches_tracked += 7
    assert WeightSums(model).checksum() == state_checksum(model)
    assert WeightSums(tiny_llama(layers=1)).checksum() == state_checksum(tiny_llama(layers=1))
