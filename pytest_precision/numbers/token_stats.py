"""Per-token statistics of a variant's next-token distributions against the reference's: everything
llama.cpp's `llama-perplexity --kl-divergence` prints, which is what quantized models are compared by.

Over the N counted positions, from four per-token vectors (float64, on the host):

- PPL(variant) and PPL(reference) = exp(mean nll), each ± its standard error; their ratio
  exp(mean(nll_variant) - mean(nll_reference)) ± its standard error, and the correlation of the two runs'
  per-token negative log-likelihoods (llama.cpp's Cor(ln(PPL(Q)), ln(PPL(base))));
- KL(p_ref || p_variant) per token: mean ± standard error (the mean and the maximum are `kl_mean` /
  `kl_max`, computed with the other distribution statistics), the 99.9 / 99 / 95 / 90 / 10 / 5 / 1 / 0.1
  percentiles, median and minimum;
- Δp = p_variant(chosen) - p_ref(chosen), the change of the chosen token's probability: mean ± standard
  error, RMS ± standard error, the 99.9 / 99 / 95 / 90 / 75 / 25 / 10 / 5 / 1 / 0.1 percentiles, median,
  minimum and maximum;
- "same top p": the share of positions whose argmax agrees (`top1_agreement`), ± its standard error.

A standard error here is that of a mean over N tokens treated as independent draws, sqrt(var / (N - 1)); a
ratio's and an RMS's follow from it to first order. It measures how much the figure would move on other
text of the same kind, not the run-to-run noise of a gate on fixed inputs (there: none, the inputs are the
same every run). Percentiles and medians are llama.cpp's (see `percentile`), so that the same per-token
values give the same figures. Where llama.cpp's own definitions differ (it scores the second half of each
context window only, keeps the base log-probabilities in 16 bits, leaves base log p <= -16 out of the KL
sum, reports no uncertainty at 10 tokens or fewer): docs/reference/metrics.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

#: The percentiles llama.cpp prints besides the median, as fractions, each with the TokenStats field holding it.
KL_PERCENTILES: tuple[tuple[float, str], ...] = (
    (0.999, "kl_p999"),
    (0.99, "kl_p99"),
    (0.95, "kl_p95"),
    (0.9, "kl_p90"),
    (0.1, "kl_p10"),
    (0.05, "kl_p5"),
    (0.01, "kl_p1"),
    (0.001, "kl_p01"),
)
DP_PERCENTILES: tuple[tuple[float, str], ...] = (
    (0.999, "dp_p999"),
    (0.99, "dp_p99"),
    (0.95, "dp_p95"),
    (0.9, "dp_p90"),
    (0.75, "dp_p75"),
    (0.25, "dp_p25"),
    (0.1, "dp_p10"),
    (0.05, "dp_p5"),
    (0.01, "dp_p1"),
    (0.001, "dp_p01"),
)


@dataclass(frozen=True)
class TokenStats:
    """llama.cpp's KL-divergence statistics of one variant against the reference (None: too few tokens).

    kl_pX / dp_pX: the X% percentile, the dot left out (kl_p999: 99.9%, kl_p01: 0.1%)."""

    kl_mean_se: float | None
    kl_median: float | None
    kl_p90: float | None
    kl_p99: float | None
    kl_p999: float | None
    dp_mean: float | None
    dp_mean_se: float | None
    dp_rms: float | None
    dp_rms_se: float | None
    dp_p1: float | None
    dp_p5: float | None
    dp_p95: float | None
    dp_p99: float | None
    dp_min: float | None
    dp_max: float | None
    top1_agreement_se: float | None
    ppl_ratio: float | None
    ppl_ratio_se: float | None
    ln_ppl_corr: float | None
    kl_p95: float | None
    kl_p10: float | None
    kl_p5: float | None
    kl_p1: float | None
    kl_p01: float | None
    kl_min: float | None
    dp_p999: float | None
    dp_p90: float | None
    dp_p75: float | None
    dp_median: float | None
    dp_p25: float | None
    dp_p10: float | None
    dp_p01: float | None
    ppl_variant: float | None
    ppl_variant_se: float | None
    ppl_reference: float | None
    ppl_reference_se: float | None


#: Fewer tokens than this give no standard errors or correlation (a variance over 1 token is meaningless).
MIN_TOKENS_FOR_ERRORS = 2


def mean_and_standard_error(values: NDArray[np.float64]) -> tuple[float, float | None]:
    """(mean, sqrt(population variance / (n - 1))); the error is None for fewer than 2 values."""
    n = values.size
    mean = float(values.mean())
    if n < MIN_TOKENS_FOR_ERRORS:
        return mean, None
    variance = max(0.0, float(values.var()))
    return mean, math.sqrt(variance / (n - 1))


def percentile(ordered: NDArray[np.float64], fraction: float) -> float:
    """llama.cpp's `percentile` of ascending values: linear interpolation at position fraction * (n - 1),
    that position and its weight computed in float32 as llama.cpp computes them (so that a position a float32
    rounding puts on an order statistic picks the same one). The values themselves stay float64."""
    import numpy as np

    n = ordered.size
    if fraction <= 0:
        return float(ordered[0])
    if fraction >= 1:
        return float(ordered[-1])
    position = np.float32(fraction) * np.float32(n - 1)
    low = int(position)
    weight = float(position - np.float32(low))
    high = min(low + 1, n - 1)
    return (1 - weight) * float(ordered[low]) + weight * float(ordered[high])


def median(ordered: NDArray[np.float64]) -> float:
    """llama.cpp's median of ascending values: the middle one, or the mean of the two middle ones."""
    n = ordered.size
    middle = n // 2
    return float(ordered[middle]) if n % 2 else 0.5 * (float(ordered[middle]) + float(ordered[middle - 1]))


def ordered(values: NDArray[np.float64]) -> NDArray[np.float64]:
    """`values` ascending; all NaN when one is NaN, so that no percentile, median or extreme skips it (a NaN
    sorts last, and a percentile below it would look healthy), as NumPy's quantile gives NaN."""
    import numpy as np

    ascending = np.sort(values)
    return np.full_like(ascending, np.nan) if ascending.size and np.isnan(ascending[-1]) else ascending


def second_half(positions: NDArray[np.int64], row_length: int) -> NDArray[np.bool_]:
    """Which tokens llama.cpp's `--kl-divergence` scores: those predicted from logits positions row_length // 2
    and later of their row (its `first = n_ctx/2`; each of its context windows is one row of `row_length`
    tokens). `positions`: each token's logits position in its row, 0-based (the last position predicts no
    token, so at most row_length - 2)."""
    return positions >= row_length // 2


def token_stats(
    kl: NDArray[np.float64],
    agree: NDArray[np.float64],
    logp_reference: NDArray[np.float64],
    logp_variant: NDArray[np.float64],
    *,
    scored: NDArray[np.bool_] | None = None,
) -> TokenStats:
    """TokenStats from per-token vectors of one length: KL(p_ref || p_var), 1.0 where the argmaxes agree
    (else 0.0), and the chosen token's log-probability under the reference and the variant. `scored` (a bool
    vector of that length, e.g. `second_half(...)`): only the tokens where it is True count."""
    import numpy as np

    n = kl.size
    if not (agree.size == logp_reference.size == logp_variant.size == n):
        raise ValueError(
            f"per-token vectors of different lengths: kl {kl.size}, agree {agree.size}, "
            f"reference {logp_reference.size}, variant {logp_variant.size}"
        )
    if scored is not None:
        if scored.shape != (n,):
            raise ValueError(f"scored: a bool vector of the {n} tokens, got shape {scored.shape}")
        kl, agree, logp_reference, logp_variant = (v[scored] for v in (kl, agree, logp_reference, logp_variant))
        n = kl.size
    if n == 0:
        return TokenStats(**dict.fromkeys(f.name for f in fields(TokenStats)))
    kl_mean_se = mean_and_standard_error(kl)[1]
    kl_sorted = ordered(kl)
    percentiles = {field: percentile(kl_sorted, fraction) for fraction, field in KL_PERCENTILES}

    dp = np.exp(logp_variant) - np.exp(logp_reference)
    dp_sorted = ordered(dp)
    percentiles |= {field: percentile(dp_sorted, fraction) for fraction, field in DP_PERCENTILES}
    dp_mean, dp_mean_se = mean_and_standard_error(dp)
    dp_squared_mean, dp_squared_se = mean_and_standard_error(dp * dp)
    dp_rms = math.sqrt(dp_squared_mean)
    # d sqrt(x) = dx / (2 sqrt(x)); undefined at an RMS of exactly 0 (then every Δp is 0: no spread either).
    dp_rms_se = None if dp_squared_se is None else (0.0 if dp_rms == 0 else dp_squared_se / (2 * dp_rms))

    top1 = float(agree.mean())
    top1_se = math.sqrt(top1 * (1 - top1) / (n - 1)) if n >= MIN_TOKENS_FOR_ERRORS else None

    # PPL = exp(mean nll); d exp(x) = exp(x) dx carries the standard error of the mean nll to it.
    nll_variant, nll_variant_se = mean_and_standard_error(-logp_variant)
    nll_reference, nll_reference_se = mean_and_standard_error(-logp_reference)
    ppl_variant, ppl_reference = math.exp(nll_variant), math.exp(nll_reference)
    # ln(PPL_var / PPL_ref) = mean(nll_var - nll_ref) = -mean(logp_var - logp_ref): the standard error of a mean
    # of differences is llama.cpp's sqrt(se_a^2 + se_b^2 - 2 cov(a, b)) written directly.
    log_ratio, log_ratio_se = mean_and_standard_error(logp_reference - logp_variant)
    ppl_ratio = math.exp(log_ratio)
    ppl_ratio_se = None if log_ratio_se is None else ppl_ratio * log_ratio_se
    ln_ppl_corr = None
    if n >= MIN_TOKENS_FOR_ERRORS:
        spread = float(np.std(logp_reference)) * float(np.std(logp_variant))
        if spread > 0:
            covariance = float(np.mean((logp_reference - logp_reference.mean()) * (logp_variant - logp_variant.mean())))
            ln_ppl_corr = covariance / spread
    return TokenStats(
        kl_mean_se=kl_mean_se,
        kl_median=median(kl_sorted),
        dp_mean=dp_mean,
        dp_mean_se=dp_mean_se,
        dp_rms=dp_rms,
        dp_rms_se=dp_rms_se,
        dp_min=float(dp_sorted[0]),
        dp_max=float(dp_sorted[-1]),
        top1_agreement_se=top1_se,
        ppl_ratio=ppl_ratio,
        ppl_ratio_se=ppl_ratio_se,
        ln_ppl_corr=ln_ppl_corr,
        kl_min=float(kl_sorted[0]),
        dp_median=median(dp_sorted),
        ppl_variant=ppl_variant,
        ppl_variant_se=None if nll_variant_se is None else ppl_variant * nll_variant_se,
        ppl_reference=ppl_reference,
        ppl_reference_se=None if nll_reference_se is None else ppl_reference * nll_reference_se,
        **percentiles,
    )
