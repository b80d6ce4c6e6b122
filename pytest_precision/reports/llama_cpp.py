"""A report's token statistics printed as llama.cpp's `llama-perplexity --kl-divergence` prints its final
statistics: the same three sections, labels, order, units and printf formats line for line, so that a user
can hold one against the other (Q: the variant, base: the reference). See numbers/token_stats.py for the
statistics and docs/reference/metrics.md for where llama.cpp's definitions differ.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pytest_precision.base.records import Record
    from pytest_precision.reports.report import PrecisionReport

#: (label, value metric, error metric or None): each line in llama.cpp's order, under its section header.
#: The value formats are llama.cpp's: "%10.6lf ± %10.6lf" for perplexities and KLD, "%6.2lf%%" for the
#: correlation, "%6.3lf%%" and "%6.3lf ± %5.3lf %%" for probabilities (x 100).
KLD_LINES: tuple[tuple[str, str], ...] = (
    ("Maximum KLD", "kl_max"),
    ("99.9%   KLD", "kl_p999"),
    ("99.0%   KLD", "kl_p99"),
    ("95.0%   KLD", "kl_p95"),
    ("90.0%   KLD", "kl_p90"),
    ("Median  KLD", "kl_median"),
    ("10.0%   KLD", "kl_p10"),
    (" 5.0%   KLD", "kl_p5"),
    (" 1.0%   KLD", "kl_p1"),
    (" 0.1%   KLD", "kl_p01"),
    ("Minimum KLD", "kl_min"),
)
DP_LINES: tuple[tuple[str, str], ...] = (
    ("Maximum Δp", "dp_max"),
    ("99.9%   Δp", "dp_p999"),
    ("99.0%   Δp", "dp_p99"),
    ("95.0%   Δp", "dp_p95"),
    ("90.0%   Δp", "dp_p90"),
    ("75.0%   Δp", "dp_p75"),
    ("Median  Δp", "dp_median"),
    ("25.0%   Δp", "dp_p25"),
    ("10.0%   Δp", "dp_p10"),
    (" 5.0%   Δp", "dp_p5"),
    (" 1.0%   Δp", "dp_p1"),
    (" 0.1%   Δp", "dp_p01"),
    ("Minimum Δp", "dp_min"),
)


def _number(value: float | None, spec: str, scale: float = 1.0) -> str:
    """`value * scale` in printf's `spec`; an undefined value prints as nan, as printf prints one."""
    return f"{math.nan if value is None else scale * value:{spec}}"


def _plus_minus(value: float | None, error: float | None, spec: str, error_spec: str, scale: float = 1.0) -> str:
    """ "value ± error"; the value alone where the error is undefined (fewer than 2 tokens)."""
    text = _number(value, spec, scale)
    return text if error is None else f"{text} ± {_number(error, error_spec, scale)}"


def derived_perplexity(record: Record) -> dict[str, float | None]:
    """llama.cpp's ln(PPL(Q)/PPL(base)) and PPL(Q)-PPL(base), each with its uncertainty, from the record's
    perplexities, their standard errors and the correlation of the per-token nll (what llama.cpp derives
    them from): ln ratio ± ratio_se / ratio; difference ± sqrt(se_q^2 + se_base^2 - 2 PPL(Q) PPL(base) cov),
    cov = corr * (se_q / PPL(Q)) * (se_base / PPL(base)) the covariance of the two mean nll."""
    ratio, ratio_se = record.ppl_ratio, record.ppl_ratio_se
    ppl_q, se_q, ppl_base, se_base = (
        record.ppl_variant,
        record.ppl_variant_se,
        record.ppl_reference,
        record.ppl_reference_se,
    )
    out: dict[str, float | None] = {"ln_ratio": None, "ln_ratio_se": None, "diff": None, "diff_se": None}
    if ratio is not None and ratio > 0:
        out["ln_ratio"] = math.log(ratio)
        out["ln_ratio_se"] = None if ratio_se is None else ratio_se / ratio
    if ppl_q is not None and ppl_base is not None:
        out["diff"] = ppl_q - ppl_base
        if se_q is not None and se_base is not None and ppl_q > 0 and ppl_base > 0:
            # A correlation is undefined where either run's nll is constant: then that se is 0 and so is cov.
            covariance = (record.ln_ppl_corr or 0.0) * (se_q / ppl_q) * (se_base / ppl_base)
            out["diff_se"] = math.sqrt(max(0.0, se_q**2 + se_base**2 - 2 * ppl_q * ppl_base * covariance))
    return out


def llama_cpp_lines(record: Record) -> list[str]:
    """The three statistics sections llama.cpp prints at the end of a `--kl-divergence` run, of one logprob
    record."""
    derived = derived_perplexity(record)
    lines = [
        "====== Perplexity statistics ======",
        "Mean PPL(Q)                   : " + _plus_minus(record.ppl_variant, record.ppl_variant_se, "10.6f", "10.6f"),
        "Mean PPL(base)                : "
        + _plus_minus(record.ppl_reference, record.ppl_reference_se, "10.6f", "10.6f"),
        f"Cor(ln(PPL(Q)), ln(PPL(base))): {_number(record.ln_ppl_corr, '6.2f', 100.0)}%",
        "Mean ln(PPL(Q)/PPL(base))     : " + _plus_minus(derived["ln_ratio"], derived["ln_ratio_se"], "10.6f", "10.6f"),
        "Mean PPL(Q)/PPL(base)         : " + _plus_minus(record.ppl_ratio, record.ppl_ratio_se, "10.6f", "10.6f"),
        "Mean PPL(Q)-PPL(base)         : " + _plus_minus(derived["diff"], derived["diff_se"], "10.6f", "10.6f"),
        "",
        "====== KL divergence statistics ======",
        "Mean    KLD: " + _plus_minus(record.kl_mean, record.kl_mean_se, "10.6f", "10.6f"),
        *(f"{label}: {_number(record.metric(metric), '10.6f')}" for label, metric in KLD_LINES),
        "",
        "====== Token probability statistics ======",
        f"Mean    Δp: {_plus_minus(record.dp_mean, record.dp_mean_se, '6.3f', '5.3f', 100.0)} %",
        *(f"{label}: {_number(record.metric(metric), '6.3f', 100.0)}%" for label, metric in DP_LINES),
        f"RMS Δp    : {_plus_minus(record.dp_rms, record.dp_rms_se, '6.3f', '5.3f', 100.0)} %",
        f"Same top p: {_plus_minus(record.top1_agreement, record.top1_agreement_se, '6.3f', '5.3f', 100.0)} %",
    ]
    return lines


def kl_divergence_lines(report: PrecisionReport) -> list[str]:
    """llama.cpp's final `--kl-divergence` statistics of every variant with a logprob row, one block each under
    a line naming the variant (Q) and the reference (base); [] without logprob rows."""
    reference = report.reference.variant.get("name", "fp32")
    lines: list[str] = []
    for variant in report.variants:
        rows = report.records(variant, "logprob")
        if not rows:
            continue
        if lines:
            lines.append("")
        lines.append(f"--- {variant} (Q) against {reference} (base) ---")
        lines.extend(llama_cpp_lines(rows[0]))
    return lines
