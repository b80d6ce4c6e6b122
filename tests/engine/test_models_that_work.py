"""Models and inputs that must just work (BatchNorm, length-1 sequences, one-string module selections), and
tests pinning the details of model building and log-probabilities that a one-line bug would break."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from conftest import random_tokens, tiny_llama
from pytest_precision.base.errors import ConfigurationError
from pytest_precision.engine.compare import compare
from pytest_precision.engine.model_build import _matching_modules, build_run_model, compute_in_fp32, parameter_dtypes
from pytest_precision.engine.reference_run import reference
from pytest_precision.engine.variants import Variant
from pytest_precision.numbers.logprobs import chosen_logprobs, next_token_targets

# BatchNorm in low precision.


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.norm2d = nn.BatchNorm2d(4)
        self.flat = nn.Flatten()
        self.linear = nn.Linear(4 * 6 * 6, 8)
        self.norm1d = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.norm2d(self.conv(x)))
        return self.head(torch.relu(self.norm1d(self.linear(self.flat(x)))))


def images() -> torch.Tensor:
    return torch.randn(5, 3, 6, 6, generator=torch.Generator().manual_seed(1))


def trained_stats_convnet(train: bool) -> ConvNet:
    """A ConvNet whose running statistics are not the initial 0 and 1 (a few training-mode passes)."""
    model = ConvNet()
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(images() * 2 + 1)
    return model.train(train)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_batchnorm_runs_in_bf16_and_fp16(train: bool) -> None:
    model = trained_stats_convnet(train)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    report = compare(model, images(), ["fp32", "bf16", "fp16"], loss_fn=lambda out, _inputs: out.square().mean())
    for name in ("norm2d", "norm1d"):
        assert report.get("fp32", name).rms_rel == 0
        for variant in ("bf16", "fp16"):
            error = report.get(variant, name).rms_rel
            assert error is not None and math.isfinite(error) and error > 0, (variant, name, error)
    assert report.records("bf16", "grad")
    # The user's model is unchanged: running statistics, batch counter, mode.
    for key, value in model.state_dict().items():
        assert torch.equal(value, saved[key]), key
    assert model.training is train and model.norm2d.training is train


def test_batchnorm_statistics_take_the_weight_dtype_other_buffers_keep_theirs() -> None:
    model = trained_stats_convnet(False)
    model.register_buffer("table", torch.ones(3))  # a plain buffer: keeps fp32, like rotary inv_freq
    built = build_run_model(model, Variant("bf16", dtype="bfloat16"), torch.device("cpu"))
    assert built.norm2d.running_mean.dtype == torch.bfloat16 and built.norm1d.running_var.dtype == torch.bfloat16
    assert built.norm2d.num_batches_tracked.dtype == torch.long
    assert built.table.dtype == torch.float32
    assert model.norm2d.running_mean.dtype == torch.float32
    # The statistics of the bf16 run are the fp32 ones, rounded once (an fp64 computation of the layer).
    x = torch.randn(5, 4, 6, 6, generator=torch.Generator().manual_seed(2))
    norm = model.norm2d.double()
    expected = torch.nn.functional.batch_norm(
        x.double(), norm.running_mean, norm.running_var, norm.weight, norm.bias, False, 0.0, norm.eps
    )
    model.norm2d.float()
    obtained = built.norm2d(x.bfloat16()).double()
    assert torch.allclose(obtained, expected, rtol=0.05, atol=0.05)


def test_instance_norm_with_running_stats_runs_in_bf16() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(2, 3, 3), nn.InstanceNorm1d(3, affine=True, track_running_stats=True), nn.Tanh())
    report = compare(model, torch.randn(4, 2, 9), ["bf16"], loss_fn=lambda out, _inputs: out.sum())
    assert report.get("bf16", "1").rms_rel


# Causal LMs on sequences of length 1.


def test_next_token_targets_and_chosen_logprobs_of_length_one() -> None:
    ids = torch.tensor([[5], [7]])
    targets, valid = next_token_targets(ids, ids, torch.ones(2, 1, dtype=torch.long))
    assert targets.shape == (2, 0) and valid.shape == (2, 0)
    chosen = chosen_logprobs(torch.randn(2, 1, 11), targets)
    assert chosen.shape == (2, 0)


def test_a_causal_lm_on_sequences_of_length_one() -> None:
    model = tiny_llama(layers=1)
    ids = random_tokens(batch=3, length=1)
    report = compare(model, {"input_ids": ids}, ["bf16"], backward=False)
    assert not report.records("bf16", "logprob")
    assert report.get("bf16", "lm_head").rms_rel


# modules= given as one string, or as nothing.


def test_modules_as_one_string_is_one_regex() -> None:
    model = tiny_llama(layers=2)
    ids = random_tokens(length=8)
    report = compare(model, {"input_ids": ids}, ["bf16"], modules=r"model\.layers\.1", backward=False)
    assert [r.name for r in report.records("bf16", "fw")] == ["model.layers.1"]
    ref = reference(model, {"input_ids": ids}, modules="lm_head", backward=False)
    assert ref.modules == ("lm_head",) and ref.module_names == ["lm_head"]


@pytest.mark.parametrize("modules", [[], ()])
def test_an_empty_module_selection_is_refused(modules: Any) -> None:
    with pytest.raises(ConfigurationError, match="modules: give at least one regex, or None for the default selection"):
        compare(tiny_llama(layers=1), {"input_ids": random_tokens(length=4)}, ["bf16"], modules=modules)


def test_a_module_selection_of_non_strings_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="modules: each item must be a regex string"):
        compare(tiny_llama(layers=1), {"input_ids": random_tokens(length=4)}, ["bf16"], modules=[3])


# Log-probabilities: masks and dtypes.


def test_left_padding_counts_a_position_only_when_both_it_and_its_target_are_attended() -> None:
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    attention = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    _targets, valid = next_token_targets(ids, None, attention)
    # Position t predicts t + 1: it counts only when t and t + 1 are attended. Row 0: t = 1 predicts the first
    # real token from a padding position, so it does not count.
    assert valid.tolist() == [[False, False, True, True], [True, True, True, True]]
    right = torch.tensor([[1, 1, 1, 0, 0]])
    _targets, valid = next_token_targets(ids[:1], None, right)
    assert valid.tolist() == [[True, True, False, False]]


def test_an_fp64_reference_computes_its_log_probs_in_float64() -> None:
    model = tiny_llama(layers=1).double()
    ids = random_tokens(length=6)
    ref = reference(model, {"input_ids": ids}, reference="fp64", backward=False)
    chosen = ref.stored[("logprob", "logprob")]
    assert chosen.dtype == torch.float64
    logits = ref.stored[("logits", "logits")].numpy()
    rows = logits[:, :-1]
    shifted = rows - rows.max(axis=-1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    expected = np.take_along_axis(log_softmax, ids[:, 1:].numpy()[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(chosen.numpy(), expected, rtol=1e-13, atol=1e-13)


# Model building: fp32-pinned modules.


class Pinned(nn.Module):
    _keep_in_fp32_modules = ("mlp",)
    _keep_in_fp32_modules_strict = ("gate",)

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Linear(4, 4)
        self.gate = nn.Linear(4, 4)
        self.proj = nn.Linear(4, 4)


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        ("bfloat16", {"mlp": torch.bfloat16, "gate": torch.float32, "proj": torch.bfloat16}),
        ("float16", {"mlp": torch.float32, "gate": torch.float32, "proj": torch.float16}),
    ],
)
def test_keep_in_fp32_modules_in_fp16_only_and_strict_in_both(dtype: str, expected: dict[str, torch.dtype]) -> None:
    dtypes = parameter_dtypes(Pinned(), dtype)
    for module, wanted in expected.items():
        assert dtypes[f"{module}.weight"] == wanted and dtypes[f"{module}.bias"] == wanted, module


class Deep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(11)])


def test_fp32_module_prefixes_match_whole_names_only() -> None:
    # layers.1 must not cover layers.10: covered means inside it ("layers.1."), not sharing a prefix.
    outer, _head = _matching_modules(Deep(), (r"layers\.1", r"layers\.10"))
    assert outer == ["layers.1", "layers.10"]
    nested, _head = _matching_modules(Deep(), (r"layers", r"layers\.1"))
    assert nested == ["layers"]


def test_an_fp32_module_casts_its_output_back_to_the_input_dtype() -> None:
    torch.manual_seed(0)
    inner = nn.Linear(4, 4).bfloat16()
    compute_in_fp32(inner, "cpu", keep_output_fp32=False)
    x = torch.randn(2, 4).bfloat16()
    out = inner(x)
    assert out.dtype == torch.bfloat16
    expected = (x.double() @ inner.weight.double().T + inner.bias.double()).bfloat16()
    assert torch.equal(out, expected)
    head = nn.Linear(4, 4).bfloat16()
    compute_in_fp32(head, "cpu", keep_output_fp32=True)
    assert head(x).dtype == torch.float32


def test_a_pinned_block_hands_the_next_block_its_own_dtype() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    variant = Variant("bf16_first_fp32", dtype="bfloat16", fp32_modules=("0",))
    report = compare(model, torch.randn(3, 4), [variant], loss_fn=lambda out, _inputs: out.sum())
    assert report.get("bf16_first_fp32", "2").rms_rel


# Which tensor a module's row is, and which modules are captured by default.


class TokenLossLM(nn.Module):
    """Returns an unreduced (per-token) loss before its logits, as some training code does."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(self.embed(ids))
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten(), reduction="none").view(ids.shape)
        return {"loss": loss, "logits": logits}


class Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = TokenLossLM()

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.inner(ids)
        return {"loss": out["loss"].mean(), "logits": out["logits"]}


def test_a_modules_row_is_its_output_not_a_loss_it_returns_first() -> None:
    ids = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(0))
    report = compare(Wrapper(), {"ids": ids}, ["bf16"], modules=["inner"])
    assert report.get("bf16", "inner").shape == (2, 5, 16)  # the logits, not the (2, 5) per-token loss


class TwoLists(nn.Module):
    """A small adapter list beside the main block list: the default selection takes the blocks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 8)
        self.adapters = nn.ModuleList(nn.Linear(8, 8, bias=False) for _ in range(2))
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.embed(ids)
        for adapter in self.adapters:
            x = x + 0.1 * adapter(x)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        logits = self.head(x)
        return {"loss": nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()), "logits": logits}


def test_the_default_selection_takes_the_block_list_with_most_parameters() -> None:
    from pytest_precision.engine.capture import default_module_names

    names = default_module_names(TwoLists())
    assert names == ["embed", "blocks.0", "blocks.1", "blocks.2"]


def test_padding_and_ignored_labels_both_leave_positions_out() -> None:
    from pytest_precision.engine.batch import Batch

    attention = np.array([[0, 1, 1, 1], [1, 1, 1, 0]])
    labels = np.array([[5, 6, -100, 7], [1, 2, 3, 4]])
    batch = Batch((), {"attention_mask": torch.tensor(attention), "labels": torch.tensor(labels)})
    expected = (attention != 0) & (labels != -100)
    mask = batch.mask(torch.device("cpu"))
    assert mask is not None
    assert np.array_equal(mask.numpy(), expected)
    assert batch.token_count() == int(expected.sum())


def test_the_clip_fraction_counts_ratios_outside_the_ppo_band() -> None:
    """clip: exp(delta) outside [1 - eps, 1 + eps], i.e. delta outside [log(0.8), log(1.2)] = [-0.223, 0.182]."""
    from pytest_precision.numbers.logprobs import log_ratio_stats

    delta = np.array([[0.19, -0.21, 0.0, 0.17], [-0.23, 0.3, 0.185, -0.1]])
    valid = np.ones_like(delta, dtype=bool)
    ratio = np.exp(delta)
    expected = float(((ratio < 0.8) | (ratio > 1.2)).mean())
    stats = log_ratio_stats(torch.tensor(delta), torch.tensor(valid), clip_eps=0.2)
    assert stats.clip_fraction == pytest.approx(expected, abs=0)
    assert expected == 4 / 8  # 0.19, 0.185 and 0.3 above 1.2, -0.23 below 0.8; -0.21 is inside the band
