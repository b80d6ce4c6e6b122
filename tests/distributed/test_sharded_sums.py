"""How per-rank parts combine into whole-tensor numbers (sharding.py), checked without processes: the parts'
sums combined equal one process's sums of the whole tensor, and which parts count."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pytest_precision import ConfigurationError, Variant, compare, sharded
from pytest_precision.distributed.sharding import (
    Part,
    add_vectors,
    combine_exact_sums,
    combined_shape,
    counted,
    largest,
)
from pytest_precision.numbers.logprobs import LOG_RATIO_MAXIMA, log_ratio_from_sums, log_ratio_sums
from pytest_precision.numbers.metrics import exact_error, exact_sums


def cases() -> dict[str, tuple[torch.Tensor, torch.Tensor, list[slice]]]:
    """name -> (reference, variant, the rows each rank holds)."""
    generator = torch.Generator().manual_seed(11)
    reference = torch.randn(4, 16, 32, generator=generator) + 0.5
    bf16_like = reference.to(torch.bfloat16).to(torch.float32)
    poisoned = bf16_like.clone()
    poisoned[3, 2, 5] = float("nan")
    poisoned[3, 7, 1] = float("inf")
    poisoned_both = poisoned.clone()
    poisoned_both[0, 0, 0] = float("-inf")
    constant = torch.full((4, 8), 0.1)
    return {
        "data-parallel halves": (reference, bf16_like, [slice(0, 2), slice(2, 4)]),
        "NaN and Inf on rank 1 only": (reference, poisoned, [slice(0, 2), slice(2, 4)]),
        "non-finite values on both ranks": (reference, poisoned_both, [slice(0, 2), slice(2, 4)]),
        "uneven, rank 1 empty": (reference, bf16_like, [slice(0, 4), slice(4, 4)]),
        "uneven, 1 and 3 rows": (reference, bf16_like, [slice(0, 1), slice(1, 4)]),
        "four ranks": (reference, bf16_like, [slice(0, 1), slice(1, 2), slice(2, 3), slice(3, 4)]),
        "constant reference": (constant, constant + 1e-3 * torch.arange(8.0), [slice(0, 3), slice(3, 4)]),
    }


@pytest.mark.parametrize("name", list(cases()))
def test_combined_parts_give_the_whole_tensors_sums_and_metrics(name: str) -> None:
    reference, variant, rows = cases()[name]
    whole = exact_sums(reference, variant).tolist()
    parts = [exact_sums(reference[r], variant[r]).tolist() for r in rows]
    combined = combine_exact_sums(parts)
    assert combined[0] == whole[0] and combined[7] == whole[7]  # counts, exactly
    assert combined[6:] == whole[6:]  # extremes, exactly
    assert combined[1:6] == pytest.approx(whole[1:6], rel=1e-12, abs=1e-12)
    want, got = exact_error(whole), exact_error(combined)
    for field, value in vars(want).items():
        if value is None or isinstance(value, int):
            assert getattr(got, field) == value, field
        else:
            assert getattr(got, field) == pytest.approx(value, rel=1e-9, abs=1e-15), field


def test_a_vector_of_the_wrong_length_is_refused() -> None:
    with pytest.raises(ValueError, match="7 values, expected 12"):
        combine_exact_sums([[0.0] * 7])


def test_which_parts_count() -> None:
    a, b = [1.0, 2.0], [1.0, 3.0]
    # Plain tensors: a rank repeating a lower rank's sums bit for bit holds the same data (a replica).
    assert counted([(a, Part(None, (2,))), (a, Part(None, (2,))), (b, Part(None, (2,)))]) == [0, 2]
    # DTensor shards: ownership decides, never the values (two shards may hold equal numbers).
    assert counted([(a, Part(True, (4,))), (a, Part(True, (4,))), (b, Part(False, (4,)))]) == [0, 1]
    nan = [math.nan, 1.0]
    assert counted([(nan, Part(None, (2,))), (list(nan), Part(None, (2,)))]) == [0]  # NaN sums repeat too


def test_the_whole_shape() -> None:
    rows = [Part(None, (1, 12, 16)), Part(None, (3, 12, 16))]
    assert combined_shape(rows, rows_split=True) == (4, 12, 16)  # data parallel: the rows add up
    assert combined_shape(rows, rows_split=False) == (1, 12, 16)  # the same inputs: a shard's shape
    assert combined_shape([Part(True, (64, 32)), Part(True, (64, 32))], rows_split=True) == (64, 32)
    assert combined_shape([Part(None, (2, 3)), Part(None, (2, 4))], rows_split=True) == (2, 3)


def test_maxima_keep_nan_whatever_the_rank_order() -> None:
    assert math.isnan(largest(0.5, math.nan)) and math.isnan(largest(math.nan, 0.5))
    assert largest(0.5, 2.0) == 2.0
    combined = add_vectors([[1.0, 0.5], [2.0, math.nan]], maximum=(1,))
    assert combined[0] == 3.0 and math.isnan(combined[1])
    assert math.isnan(add_vectors([[1.0, math.nan], [2.0, 0.5]], maximum=(1,))[1])


def test_log_ratio_sums_of_sequence_groups_add_up_to_the_whole_batch() -> None:
    generator = torch.Generator().manual_seed(5)
    delta = torch.randn(5, 9, generator=generator, dtype=torch.float64) * 0.05 + 0.01
    valid = torch.rand(5, 9, generator=generator) > 0.3
    valid[2] = False  # a sequence without counted tokens
    whole = log_ratio_from_sums(log_ratio_sums(delta, valid).tolist())
    groups = [slice(0, 2), slice(2, 3), slice(3, 5)]
    parts = [log_ratio_sums(delta[g], valid[g]).tolist() for g in groups]
    split = log_ratio_from_sums(add_vectors(parts, maximum=LOG_RATIO_MAXIMA))
    for field, value in vars(whole).items():
        assert getattr(split, field) == pytest.approx(value, rel=1e-12, abs=1e-15), field
    # The statistics themselves, against NumPy-free float64 arithmetic on the counted tokens.
    counted_delta = delta[valid]
    assert whole.delta_mean == pytest.approx(float(counted_delta.mean()), rel=1e-12)
    means = [float(delta[i][valid[i]].mean()) for i in range(5) if valid[i].any()]
    mean = sum(means) / len(means)
    assert whole.seq_delta_std == pytest.approx(math.sqrt(sum((m - mean) ** 2 for m in means) / len(means)), rel=1e-9)
    assert whole.seq_delta_max == pytest.approx(max(abs(m) for m in means), rel=1e-12)


def test_sharded_refuses_what_it_cannot_shard() -> None:
    with pytest.raises(ConfigurationError, match=r"model must be a torch\.nn\.Module or a factory"):
        sharded("llama", lambda model, variant: model)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="shard must be a callable"):
        sharded(nn.Linear(2, 2), "fully_shard")  # type: ignore[arg-type]


def test_a_shard_function_that_skips_the_variants_policy_is_refused() -> None:
    """Without a process group: fully_shard needs one, so the check is exercised on what the function returns."""
    model = nn.Sequential(nn.Linear(4, 4))

    def returns_something_else(model: nn.Module, variant: Variant) -> object:
        return "sharded"

    with pytest.raises(ConfigurationError, match="the shard function returned str"):
        compare(sharded(model, returns_something_else), torch.randn(2, 4), ["bf16"], loss_fn=lambda o, i: o.sum())
    with pytest.raises(ConfigurationError, match=r"sets FSDP2 mixed precision .* applied no fully_shard"):
        compare(sharded(model, lambda m, v: None), torch.randn(2, 4), ["fsdp_bf16"], loss_fn=lambda o, i: o.sum())
