"""Per-token statistics of a variant's next-token distributions against the reference's, in the layout of
llama.cpp's `llama-perplexity --kl-divergence`, which is what quantized models are compared by.

Over the N counted positions, from four per-token vectors (float64, on the host):

- KL(p_ref || p_variant) per token: mean ± standard error, median, 90 / 99 / 99.9 percentiles (the maximum
  and the mean are `kl_max` / `kl_mean`, computed with the other distribution statistics);
- Δp = p_variant(chosen) - p_ref(chosen), the change of the chosen token's probability: mean ± standard
  error, RMS ± standard error, the 1 / 5 / 95 / 99 percentiles, minimum and maximum;
- "same top p": the share of positions whose argmax agrees (`top1_agreement`), ± its standard error;
- PPL(variant) / PPL(reference) = exp(mean(nll_variant) - mean(nll_reference)) ± standard error, and the
  correlation of the two runs' per-token negative log-likelihoods (llama.cpp's Cor(ln PPL(Q), ln PPL(base))).

A standard error here is that of a mean over N tokens treated as independent draws, sqrt(var / (N - 1)); a
ratio's and an RMS's follow from it to first order. It measures how much the figure would move on other
text of the same kind, not the run-to-run noise of a gate on fixed inputs (there: none, the inputs are the
same every run). Percentiles interpolate linearly between order statistics (NumPy's default), as llama.cpp
does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

#: The KL and Δp percentiles reported, as fractions.
KL_PERCENTILES = (0.5, 0.9, 0.99, 0.999)
DP_PERCENTILES = (0.01, 0.05, 0.95, 0.99)


@dataclass(frozen=True)
class TokenStats:
    """llama.cpp's KL-divergence statistics of one variant against the reference (None: too few tokens)."""

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


def token_stats(
    kl: NDArray[np.float64],
    agree: NDArray[np.float64],
    logp_reference: NDArray[np.float64],
    logp_variant: NDArray[np.float64],
) -> TokenStats:
    """TokenStats from per-token vectors of one length: KL(p_ref || p_var), 1.0 where the argmaxes agree
    (else 0.0), and the chosen token's log-probability under the reference and the variant."""
    import numpy as np

    n = kl.size
    if not (agree.size == logp_reference.size == logp_variant.size == n):
        raise ValueError(
            f"per-token vectors of different lengths: kl {kl.size}, agree {agree.size}, "
            f"reference {logp_reference.size}, variant {logp_variant.size}"
        )
    if n == 0:
        return TokenStats(*([None] * 19))
    kl_mean_se = mean_and_standard_error(kl)[1]
    kl_median, kl_p90, kl_p99, kl_p999 = (float(v) for v in np.quantile(kl, KL_PERCENTILES))

    dp = np.exp(logp_variant) - np.exp(logp_reference)
    dp_mean, dp_mean_se = mean_and_standard_error(dp)
    dp_squared_mean, dp_squared_se = mean_and_standard_error(dp * dp)
    dp_rms = math.sqrt(dp_squared_mean)
    # d sqrt(x) = dx / (2 sqrt(x)); undefined at an RMS of exactly 0 (then every Δp is 0: no spread either).
    dp_rms_se = None if dp_squared_se is None else (0.0 if dp_rms == 0 else dp_squared_se / (2 * dp_rms))
    dp_p1, dp_p5, dp_p95, dp_p99 = (float(v) for v in np.quantile(dp, DP_PERCENTILES))

    top1 = float(agree.mean())
    top1_se = math.sqrt(top1 * (1 - top1) / (n - 1)) if n >= MIN_TOKENS_FOR_ERRORS else None

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
        kl_mean_se,
        kl_median,
        kl_p90,
        kl_p99,
        kl_p999,
        dp_mean,
        dp_mean_se,
        dp_rms,
        dp_rms_se,
        dp_p1,
        dp_p5,
        dp_p95,
        dp_p99,
        float(dp.min()),
        float(dp.max()),
        top1_se,
        ppl_ratio,
        ppl_ratio_se,
        ln_ppl_corr,
    )
