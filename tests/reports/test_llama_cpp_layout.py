# ruff: noqa: UP031  (llama.cpp's printf formats, copied as they are)
"""format_kl_divergence against llama.cpp's own printing block (tools/perplexity/perplexity.cpp, kl_divergence):
its printf formats copied as they are, fed by its sum-based formulas computed here in NumPy float64."""

from __future__ import annotations

import dataclasses
import math
import struct

import numpy as np
import pytest

from pytest_precision.base.records import Record, RunInfo
from pytest_precision.numbers.token_stats import token_stats
from pytest_precision.reports.report import PrecisionReport


def run_info(name: str) -> RunInfo:
    return RunInfo({"name": name}, {}, {}, {}, None, {"settings": {}, "no_effect": []})


def logprob_record(kl: np.ndarray, agree: np.ndarray, ref: np.ndarray, var: np.ndarray) -> Record:
    """A logprob row as compare makes it: kl_mean / kl_max / top1_agreement beside token_stats."""
    error_fields = ("ref_rms", "rms_abs", "rms_rel", "max_abs", "max_rel", "bias_abs", "bias_rel", "correlation")
    return Record(
        count=kl.size,
        nonfinite=0,
        slope=None,
        residual_rms_rel=None,
        cosine=None,
        sqnr_db=None,
        **dict.fromkeys(error_fields),
        name="logprob",
        kind="logprob",
        shape=(kl.size,),
        kl_mean=float(kl.mean()),
        kl_max=float(kl.max()),
        top1_agreement=float(agree.mean()),
        **dataclasses.asdict(token_stats(kl, agree, ref, var)),
    )


def llama_cpp_percentile(ordered: np.ndarray, fraction: float) -> float:
    """perplexity.cpp's `percentile`, its position in float32 (struct-encoded here, not NumPy's float32)."""

    def f32(x: float) -> float:
        return float(struct.unpack("f", struct.pack("f", x))[0])

    p = f32(f32(fraction) * f32(len(ordered) - 1))
    ip = int(p)
    p -= ip
    return (1 - p) * ordered[ip] + p * ordered[min(ip + 1, len(ordered) - 1)]


def llama_cpp_block(kl: np.ndarray, agree: np.ndarray, ref: np.ndarray, var: np.ndarray) -> list[str]:
    """What kl_divergence() prints after its chunks, from its accumulated sums (kl_divergence_result)."""
    n = kl.size
    nll, nll_base = -var, -ref

    def mean_and_uncertainty(s: float, s2: float) -> tuple[float, float]:
        f = s / n
        df = s2 / n - f * f
        return f, (math.sqrt(df / (n - 1)) if df > 0 and n > 10 else 0.0)

    cov = (np.sum(nll * nll_base) / n - (np.sum(nll) / n) * (np.sum(nll_base) / n)) / (n - 1)
    log_ppl = mean_and_uncertainty(np.sum(nll), np.sum(nll**2))
    ppl, ppl_unc = math.exp(log_ppl[0]), math.exp(log_ppl[0]) * log_ppl[1]
    log_base = mean_and_uncertainty(np.sum(nll_base), np.sum(nll_base**2))
    base, base_unc = math.exp(log_base[0]), math.exp(log_base[0]) * log_base[1]
    cor = cov / (log_ppl[1] * log_base[1])
    ratio_val = log_ppl[0] - log_base[0]
    ratio_unc = math.sqrt(log_ppl[1] ** 2 + log_base[1] ** 2 - 2.0 * cov)
    diff_unc = math.sqrt(ppl_unc**2 + base_unc**2 - 2.0 * ppl * base * cov)
    kld = mean_and_uncertainty(np.sum(kl), np.sum(kl**2))
    p_diff = np.exp(-nll) - np.exp(-nll_base)
    pdm = mean_and_uncertainty(np.sum(p_diff), np.sum(p_diff**2))
    mse = mean_and_uncertainty(np.sum(p_diff**2), np.sum(p_diff**4))
    rms, rms_unc = math.sqrt(mse[0]), 0.5 / math.sqrt(mse[0]) * mse[1]
    same = float(np.sum(agree)) / n
    kv, pv = np.sort(kl), np.sort(p_diff)

    def middle(v: np.ndarray) -> float:
        return float(0.5 * (v[n // 2] + v[n // 2 - 1]) if n % 2 == 0 else v[n // 2])

    lines = [
        "====== Perplexity statistics ======",
        "Mean PPL(Q)                   : %10.6f ± %10.6f" % (ppl, ppl_unc),
        "Mean PPL(base)                : %10.6f ± %10.6f" % (base, base_unc),
        "Cor(ln(PPL(Q)), ln(PPL(base))): %6.2f%%" % (100.0 * cor),
        "Mean ln(PPL(Q)/PPL(base))     : %10.6f ± %10.6f" % (ratio_val, ratio_unc),
        "Mean PPL(Q)/PPL(base)         : %10.6f ± %10.6f" % (math.exp(ratio_val), math.exp(ratio_val) * ratio_unc),
        "Mean PPL(Q)-PPL(base)         : %10.6f ± %10.6f" % (ppl - base, diff_unc),
        "",
        "====== KL divergence statistics ======",
        "Mean    KLD: %10.6f ± %10.6f" % kld,
        "Maximum KLD: %10.6f" % kv[-1],
    ]
    for label, fraction in (("99.9%", 0.999), ("99.0%", 0.99), ("95.0%", 0.95), ("90.0%", 0.9)):
        lines.append("%s   KLD: %10.6f" % (label, llama_cpp_percentile(kv, fraction)))
    lines.append("Median  KLD: %10.6f" % middle(kv))
    for label, fraction in (("10.0%", 0.1), (" 5.0%", 0.05), (" 1.0%", 0.01), (" 0.1%", 0.001)):
        lines.append("%s   KLD: %10.6f" % (label, llama_cpp_percentile(kv, fraction)))
    lines += ["Minimum KLD: %10.6f" % kv[0], "", "====== Token probability statistics ======"]
    lines.append("Mean    Δp: %6.3f ± %5.3f %%" % (100.0 * pdm[0], 100.0 * pdm[1]))
    lines.append("Maximum Δp: %6.3f%%" % (100.0 * pv[-1]))
    for label, fraction in (("99.9%", 0.999), ("99.0%", 0.99), ("95.0%", 0.95), ("90.0%", 0.9), ("75.0%", 0.75)):
        lines.append("%s   Δp: %6.3f%%" % (label, 100.0 * llama_cpp_percentile(pv, fraction)))
    lines.append("Median  Δp: %6.3f%%" % (100.0 * middle(pv)))
    for label, fraction in (("25.0%", 0.25), ("10.0%", 0.1), (" 5.0%", 0.05), (" 1.0%", 0.01), (" 0.1%", 0.001)):
        lines.append("%s   Δp: %6.3f%%" % (label, 100.0 * llama_cpp_percentile(pv, fraction)))
    lines.append("Minimum Δp: %6.3f%%" % (100.0 * pv[0]))
    lines.append("RMS Δp    : %6.3f ± %5.3f %%" % (100.0 * rms, 100.0 * rms_unc))
    lines.append("Same top p: %6.3f ± %5.3f %%" % (100.0 * same, 100.0 * math.sqrt(same * (1.0 - same) / (n - 1))))
    return lines


def vectors(n: int, seed: int, spread: float) -> tuple[np.ndarray, ...]:
    """Per-token KL, agreement and chosen-token log-probabilities of a plausible quantized run."""
    generator = np.random.default_rng(seed)
    ref = np.log(generator.uniform(0.02, 0.98, size=n))
    var = np.minimum(ref + generator.normal(0.0, spread, size=n), -1e-6)
    kl = generator.exponential(spread**2, size=n)
    agree = (generator.random(n) < 0.95).astype(np.float64)
    return kl, agree, ref, var


@pytest.mark.parametrize(("n", "spread"), [(400, 0.05), (1001, 0.3), (128, 0.01)])
def test_every_line_is_llama_cpps(n: int, spread: float) -> None:
    """Each printed line equals llama.cpp's printf of its own formulas on the same per-token values."""
    kl, agree, ref, var = vectors(n, n, spread)
    report = PrecisionReport(reference=run_info("fp32"), device="cpu")
    report.add("q4", run_info("q4"), [logprob_record(kl, agree, ref, var)], [])
    printed = report.format_kl_divergence().splitlines()
    assert printed[0] == "--- q4 (Q) against fp32 (base) ---"
    expected = llama_cpp_block(kl, agree, ref, var)
    assert len(printed) - 1 == len(expected)
    for got, want in zip(printed[1:], expected, strict=True):
        assert got == want


def test_one_block_per_variant_and_nothing_without_logprob_rows() -> None:
    """Two variants give two blocks separated by a blank line; a report without logprob rows prints nothing."""
    report = PrecisionReport(reference=run_info("fp32"), device="cpu")
    assert report.format_kl_divergence() == ""
    for name, seed in (("bf16", 1), ("fp16", 2)):
        report.add(name, run_info(name), [logprob_record(*vectors(50, seed, 0.05))], [])
    lines = report.format_kl_divergence().splitlines()
    headers = [i for i, line in enumerate(lines) if line.startswith("--- ")]
    assert [lines[i] for i in headers] == [
        "--- bf16 (Q) against fp32 (base) ---",
        "--- fp16 (Q) against fp32 (base) ---",
    ]
    assert lines[headers[1] - 1] == "" and lines.count("====== KL divergence statistics ======") == 2


def test_one_token_prints_values_without_uncertainty() -> None:
    """A single token has no standard error: its lines keep the value and leave the "±" part out; an undefined
    correlation prints nan, as printf prints one."""
    report = PrecisionReport(reference=run_info("fp32"), device="cpu")
    one = [np.array([v]) for v in (0.25, 1.0, -1.0, -2.0)]
    report.add("q", run_info("q"), [logprob_record(*one)], [])
    lines = report.format_kl_divergence().splitlines()
    assert "Mean    KLD:   0.250000" in lines
    assert "Cor(ln(PPL(Q)), ln(PPL(base))):    nan%" in lines
    assert f"Mean PPL(Q)/PPL(base)         : {math.e:10.6f}" in lines
    assert not any("±" in line for line in lines)
