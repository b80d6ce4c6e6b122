"""llama.cpp's KL-divergence statistics (token_stats) against an independent computation: plain Python
float64 arithmetic on known inputs, with llama.cpp's percentile and median (tools/perplexity/perplexity.cpp)
written out by hand."""

from __future__ import annotations

import dataclasses
import math
import random
import struct

import numpy as np
import pytest
import torch

from pytest_precision.numbers.logprobs import distribution_rows, distribution_sums
from pytest_precision.numbers.token_stats import TokenStats, second_half, token_stats


def float32(value: float) -> float:
    """`value` rounded to the nearest float32, through its 4-byte encoding."""
    return float(struct.unpack("f", struct.pack("f", value))[0])


def percentile(values: list[float], fraction: float) -> float:
    """llama.cpp's `percentile(values, fraction)`: `float p = fraction*(values.size() - 1); size_t ip = size_t(p);
    p -= ip; return (1 - p)*values[ip] + p*values[min(ip+1, size-1)]`, its float fraction and position in float32."""
    ordered = sorted(values)
    position = float32(float32(fraction) * float32(len(ordered) - 1))
    low = int(position)
    weight = position - low
    return (1 - weight) * ordered[low] + weight * ordered[min(low + 1, len(ordered) - 1)]


def median(values: list[float]) -> float:
    """llama.cpp's median: the middle value, or the mean of the two middle values."""
    ordered, n = sorted(values), len(values)
    return ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2] + ordered[n // 2 - 1])


def mean_se(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = math.fsum(values) / n
    second = math.fsum(v * v for v in values) / n
    return mean, math.sqrt(max(0.0, second - mean * mean) / (n - 1))


def expected_stats(kl: list[float], agree: list[float], ref: list[float], var: list[float]) -> dict[str, float]:
    n = len(kl)
    dp = [math.exp(b) - math.exp(a) for a, b in zip(ref, var, strict=True)]
    dp_mean, dp_mean_se = mean_se(dp)
    squares_mean, squares_se = mean_se([d * d for d in dp])
    top1 = math.fsum(agree) / n
    nll_ref, nll_var = [-a for a in ref], [-b for b in var]
    mean_ref, se_ref = mean_se(nll_ref)
    mean_var, se_var = mean_se(nll_var)
    covariance = (math.fsum(a * b for a, b in zip(nll_var, nll_ref, strict=True)) / n - mean_var * mean_ref) / (n - 1)
    log_ratio = mean_var - mean_ref
    log_ratio_se = math.sqrt(se_var**2 + se_ref**2 - 2 * covariance)  # llama.cpp's form
    ppl_var, ppl_ref = math.exp(mean_var), math.exp(mean_ref)
    kl_percentiles = {
        "p999": 0.999,
        "p99": 0.99,
        "p95": 0.95,
        "p90": 0.9,
        "p10": 0.1,
        "p5": 0.05,
        "p1": 0.01,
        "p01": 0.001,
    }
    dp_percentiles = {"p999": 0.999, "p90": 0.9, "p75": 0.75, "p25": 0.25, "p10": 0.1, "p01": 0.001}
    return {
        **{f"kl_{name}": percentile(kl, fraction) for name, fraction in kl_percentiles.items()},
        **{f"dp_{name}": percentile(dp, fraction) for name, fraction in dp_percentiles.items()},
        "kl_min": min(kl),
        "dp_median": median(dp),
        "ppl_variant": ppl_var,
        "ppl_variant_se": ppl_var * se_var,
        "ppl_reference": ppl_ref,
        "ppl_reference_se": ppl_ref * se_ref,
        "kl_mean_se": mean_se(kl)[1],
        "kl_median": median(kl),
        "dp_mean": dp_mean,
        "dp_mean_se": dp_mean_se,
        "dp_rms": math.sqrt(squares_mean),
        "dp_rms_se": squares_se / (2 * math.sqrt(squares_mean)),
        "dp_p1": percentile(dp, 0.01),
        "dp_p5": percentile(dp, 0.05),
        "dp_p95": percentile(dp, 0.95),
        "dp_p99": percentile(dp, 0.99),
        "dp_min": min(dp),
        "dp_max": max(dp),
        "top1_agreement_se": math.sqrt(top1 * (1 - top1) / (n - 1)),
        "ppl_ratio": math.exp(log_ratio),
        "ppl_ratio_se": math.exp(log_ratio) * log_ratio_se,
        "ln_ppl_corr": covariance / (se_var * se_ref),  # llama.cpp's Cor(ln(PPL(Q)), ln(PPL(base)))
    }


@pytest.mark.parametrize("n", [7, 100, 1001, 17002])
def test_every_statistic_matches_an_independent_computation(n: int) -> None:
    """Every TokenStats field, against llama.cpp's formulas in plain Python float64 (n = 17002: see below)."""
    generator = random.Random(n)
    kl = [generator.expovariate(50.0) for _ in range(n)]
    agree = [float(generator.random() < 0.9) for _ in range(n)]
    ref = [math.log(generator.uniform(0.01, 0.99)) for _ in range(n)]
    var = [a + generator.gauss(0.0, 0.05) for a in ref]
    var = [min(v, -1e-6) for v in var]  # a probability stays below 1
    stats = token_stats(*(np.array(v, dtype=np.float64) for v in (kl, agree, ref, var)))
    expected = expected_stats(kl, agree, ref, var)
    assert set(expected) == {f.name for f in dataclasses.fields(TokenStats)}
    for name, value in expected.items():
        assert getattr(stats, name) == pytest.approx(value, rel=1e-9, abs=1e-15), name


def test_known_small_input() -> None:
    """Five tokens, by hand: KL 0, 1, 2, 3, 4 -> median 2, 90% 3.6; the variant halves no probability."""
    kl = np.array([0.0, 1.0, 2.0, 3.0, 4.0])
    agree = np.array([1.0, 1.0, 0.0, 1.0, 1.0])
    ref = np.log(np.array([0.5, 0.5, 0.25, 0.25, 0.1]))
    var = np.log(np.array([0.5, 0.4, 0.25, 0.5, 0.1]))
    stats = token_stats(kl, agree, ref, var)
    assert (stats.kl_median, stats.kl_p90) == (2.0, pytest.approx(3.6))
    assert stats.dp_min == pytest.approx(-0.1) and stats.dp_max == pytest.approx(0.25)
    assert stats.dp_mean == pytest.approx(0.03)
    assert stats.top1_agreement_se == pytest.approx(math.sqrt(0.8 * 0.2 / 4))
    # PPL ratio: exp(mean(nll_var) - mean(nll_ref)) = exp(-(ln 0.8 + ln 2) / 5)
    assert stats.ppl_ratio == pytest.approx(math.exp(-(math.log(0.8) + math.log(2.0)) / 5))


def test_identical_runs_give_zero_error_and_full_correlation() -> None:
    ref = np.log(np.array([0.5, 0.2, 0.9, 0.3]))
    stats = token_stats(np.zeros(4), np.ones(4), ref, ref.copy())
    assert stats.ppl_ratio == 1.0 and stats.ppl_ratio_se == 0.0
    assert stats.dp_rms == 0.0 and stats.dp_rms_se == 0.0 and stats.dp_max == 0.0
    assert stats.top1_agreement_se == 0.0 and stats.kl_p999 == 0.0
    assert stats.ln_ppl_corr == pytest.approx(1.0)


def test_no_tokens_and_one_token() -> None:
    empty = np.zeros(0)
    assert token_stats(empty, empty, empty, empty) == TokenStats(
        **dict.fromkeys(f.name for f in dataclasses.fields(TokenStats))
    )
    one = token_stats(np.array([0.5]), np.array([1.0]), np.array([-1.0]), np.array([-2.0]))
    assert one.kl_median == 0.5 and one.ppl_ratio == pytest.approx(math.e)
    assert one.kl_mean_se is None and one.ppl_ratio_se is None and one.ln_ppl_corr is None
    with pytest.raises(ValueError, match="different lengths"):
        token_stats(np.zeros(2), np.zeros(3), np.zeros(2), np.zeros(2))


def test_distribution_rows_are_per_token_kl_and_agreement_in_float64() -> None:
    """Per row: KL(p || q) and argmax agreement against NumPy float64 by hand; the sums are their sums."""
    generator = torch.Generator().manual_seed(0)
    reference = torch.randn(2, 5, 11, generator=generator)
    variant = reference + 0.3 * torch.randn(2, 5, 11, generator=generator)
    rows = torch.tensor([0, 2, 3, 7, 9])
    per_row = distribution_rows(reference, variant, rows).numpy()
    p_logits = reference.reshape(-1, 11).double().numpy()[rows.numpy()]
    q_logits = variant.reshape(-1, 11).double().numpy()[rows.numpy()]
    for i in range(rows.numel()):
        log_p = p_logits[i] - np.log(np.exp(p_logits[i] - p_logits[i].max()).sum()) - p_logits[i].max()
        log_q = q_logits[i] - np.log(np.exp(q_logits[i] - q_logits[i].max()).sum()) - q_logits[i].max()
        assert per_row[0, i] == pytest.approx(float(np.sum(np.exp(log_p) * (log_p - log_q))), rel=1e-12)
        assert per_row[1, i] == float(p_logits[i].argmax() == q_logits[i].argmax())
    sums = distribution_sums(reference, variant, rows).tolist()
    assert sums == pytest.approx([per_row[0].sum(), per_row[0].max(), per_row[1].sum()], rel=1e-12)


def test_every_token_statistic_is_a_record_metric_with_a_direction() -> None:
    """TokenStats' fields are the logprob rows' optional metrics of records.py, each gateable in a direction."""
    from pytest_precision.base.records import METRIC_DIRECTIONS, OPTIONAL_METRICS, TOKEN_STAT_METRICS, Record

    names = [f.name for f in dataclasses.fields(TokenStats)]
    assert names == list(TOKEN_STAT_METRICS)
    record_fields = {f.name for f in dataclasses.fields(Record)}
    assert set(names) <= record_fields & set(OPTIONAL_METRICS) & set(METRIC_DIRECTIONS)


def test_percentile_position_is_llama_cpps_float32_one() -> None:
    """99.9% of 17002 values: position 0.999 * 17001 = 16983.999, which llama.cpp's float32 arithmetic rounds to
    16984, so it prints the 16985th smallest value where NumPy's float64 interpolation gives another figure."""
    values = np.sort(np.random.default_rng(0).exponential(size=17002))
    stats = token_stats(values, np.ones_like(values), np.full_like(values, -1.0), np.full_like(values, -1.0))
    assert stats.kl_p999 == values[16984]
    assert stats.kl_p999 != pytest.approx(float(np.quantile(values, 0.999)), rel=1e-9, abs=0)


def test_scored_keeps_only_the_second_half_of_each_row() -> None:
    """second_half: llama.cpp's `first = n_ctx/2`; rows of 6 tokens predict from positions 0..4, of which 3 and 4
    count; token_stats(scored=...) equals token_stats of the kept tokens alone."""
    positions = np.array([0, 1, 2, 3, 4, 0, 1, 2, 3, 4])
    keep = second_half(positions, 6)
    assert keep.tolist() == [p >= 3 for p in positions]
    assert second_half(np.arange(6), 7).tolist() == [False, False, False, True, True, True]  # first = 7 // 2
    generator = np.random.default_rng(1)
    kl, agree = generator.exponential(size=10), (generator.random(10) < 0.8).astype(np.float64)
    ref = np.log(generator.uniform(0.05, 0.95, size=10))
    var = np.minimum(ref + generator.normal(0, 0.1, size=10), -1e-6)
    assert token_stats(kl, agree, ref, var, scored=keep) == token_stats(kl[keep], agree[keep], ref[keep], var[keep])
    assert token_stats(kl, agree, ref, var, scored=keep) != token_stats(kl, agree, ref, var)
    with pytest.raises(ValueError, match="scored: a bool vector of the 10 tokens"):
        token_stats(kl, agree, ref, var, scored=keep[:5])


def test_a_nan_token_makes_every_order_statistic_nan() -> None:
    """A NaN sorts last: without care the 1% percentile, median and minimum below it would look healthy."""
    kl = np.array([0.1, 0.2, np.nan, 0.3])
    ref = np.log(np.array([0.5, 0.4, 0.3, 0.2]))
    var = np.array([ref[0], ref[1], np.nan, ref[3]])
    stats = token_stats(kl, np.ones(4), ref, var)
    order_statistics = [f.name for f in dataclasses.fields(TokenStats) if f.name.startswith(("kl_p", "dp_p"))]
    order_statistics += ["kl_median", "kl_min", "dp_median", "dp_min", "dp_max"]
    assert all(math.isnan(getattr(stats, name)) for name in order_statistics), order_statistics
