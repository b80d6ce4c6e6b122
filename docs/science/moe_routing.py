"""Routing in a trained mixture-of-experts LM: where precision flips experts, and what replay removes.
`python docs/science/moe_routing.py`

On the bundled trained tiny MoE (tests/data/tiny-trained-moe: a byte-level Qwen3-MoE, 4 layers of 8 experts, top-2)
and its held-out text, it prints:

1. per-layer routing agreement with the fp32 reference of fp32_decode, bf16, bf16_decode, fp8_rowwise (torchao's fp8
   training, emulated here; it converts the attention projections, the only nn.Linear layers besides the head) and
   bf16_replay, with the per-layer forward error;
2. the trainer-vs-sampler gap (bf16 full forward against bf16 decode): the share of tokens the two route
   differently, and the log-prob mismatch without and with replay of the sampler's routing into the trainer
   (R3); and the same split of bf16's own error against the reference (bf16 against bf16_replay);
3. the reference's router margin (k-th chosen logit minus the best unchosen one) of the tokens bf16 flipped, against
   that of all tokens: flips are near-ties;
4. the same on a random (untrained) Qwen3-MoE of the same shape, whose routers are near-uniform.

The CPU pins of the repository's conftest are set by importing it before torch, as for the tests. Saved output:
docs/science/moe_routing_results.txt.
"""

from __future__ import annotations

import importlib
import math
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

#: The repository's conftest, imported before torch: it sets the CPU pins torch reads when imported.
conftest = importlib.import_module("conftest")

import torch  # noqa: E402

from pytest_precision import PrecisionReport, Variant, compare  # noqa: E402

VARIANTS: list[str | Variant] = [
    "fp32_decode",
    "bf16",
    "bf16_decode",
    "bf16_replay",
    # The trainer replaying the sampler's routing (R3): bf16 full forward, experts as bf16_decode chose them.
    Variant("bf16_replaying_decode", dtype="bfloat16", replay_routing="bf16_decode"),
]
LOW_BIT = "fp8_rowwise"


def held_out_batch(rows: int, length: int) -> dict[str, Any]:
    return conftest.trained_lm_text_batch(batch=rows, length=length)


def percentiles(values: Sequence[float], points: Sequence[float] = (10, 50, 90)) -> list[float]:
    ordered = sorted(values)
    if not ordered:
        return [math.nan for _ in points]
    out = []
    for point in points:
        position = (len(ordered) - 1) * point / 100
        low = math.floor(position)
        high = min(low + 1, len(ordered) - 1)
        out.append(ordered[low] + (ordered[high] - ordered[low]) * (position - low))
    return out


def block_median(report: PrecisionReport, variant: str) -> float:
    """The median forward rms_rel of the decoder blocks."""
    return statistics.median(r.rms_rel or 0.0 for r in report.records(variant, "fw") if ".layers." in r.name)


def agreement_section(report: PrecisionReport, variants: Sequence[str]) -> list[str]:
    lines = [
        "1. Routing agreement per layer (share of tokens whose top-2 experts are the reference's; flips)",
        "-" * 96,
    ]
    routers = [r.name for r in report.records("bf16", "routing")]
    lines.append("  " + "router".ljust(26) + "".join(v.rjust(22) for v in variants))
    for router in routers:
        cells = []
        for variant in variants:
            record = report.get(variant, router, "routing")
            flips = round((1 - record.expert_agreement) * record.shape[0])
            cells.append(f"{100 * record.expert_agreement:6.2f}% ({flips:3d})".rjust(22))
        lines.append("  " + router.ljust(26) + "".join(cells))
    lines.append(
        "  "
        + "block fw rms_rel (median)".ljust(26)
        + "".join(f"{100 * block_median(report, v):.3f}%".rjust(22) for v in variants)
    )
    lines.append(
        "  "
        + "logprob rms_rel".ljust(26)
        + "".join(f"{100 * (report.get(v, 'logprob', 'logprob').rms_rel or 0.0):.3f}%".rjust(22) for v in variants)
    )
    return lines


def mismatch_section(report: PrecisionReport) -> list[str]:
    lines = [
        "",
        "2. Trainer (bf16 full forward) against sampler (bf16_decode), and what routing replay removes",
        "-" * 96,
    ]
    differ = report.routing_mismatch("bf16", "bf16_decode")
    replayed = report.routing_mismatch("bf16_replaying_decode", "bf16_decode")
    for router, share in differ.items():
        lines.append(
            f"  {router:26s} routed differently: {100 * share:6.2f}% of tokens; "
            f"after replay: {100 * replayed[router]:.2f}%"
        )
    gap = report.logprob_mismatch([("bf16", "bf16_decode"), ("bf16_replaying_decode", "bf16_decode")])
    without = gap.get("bf16 vs bf16_decode", "logprob", "logprob")
    with_replay = gap.get("bf16_replaying_decode vs bf16_decode", "logprob", "logprob")
    removed = 1 - (with_replay.delta_rms or 0.0) / (without.delta_rms or math.nan)
    lines += [
        f"  log-prob mismatch (RMS of log pi_trainer - log pi_sampler): {without.delta_rms:.5f} without replay, "
        f"{with_replay.delta_rms:.5f} with the sampler's routing replayed into the trainer: "
        f"{100 * removed:.1f}% removed",
        f"  largest |mismatch|: {without.delta_max_abs:.4f} without, {with_replay.delta_max_abs:.4f} with replay",
    ]
    own = report.get("bf16", "logprob", "logprob")
    replay = report.get("bf16_replay", "logprob", "logprob")
    split = 1 - (replay.delta_rms or 0.0) / (own.delta_rms or math.nan)
    lines.append(
        f"  bf16 against the fp32 reference: log-prob delta RMS {own.delta_rms:.5f}; "
        "with the reference's routing replayed "
        f"(bf16_replay) {replay.delta_rms:.5f}: flips cause {100 * split:.1f}%, arithmetic the rest"
    )
    return lines


def margin_section(report: PrecisionReport, title: str) -> list[str]:
    flipped = [m for margins in report.flip_margins.get("bf16", {}).values() for m in margins]
    everyone = [
        float(value)
        for pack in report.reference_routing.values()
        for value in pack.reshape(-1, pack.shape[-1])[:, -1].tolist()
    ]
    low, mid, high = percentiles(flipped)
    all_low, all_mid, all_high = percentiles(everyone)
    share_below = sum(m < mid for m in everyone) / len(everyone) if flipped else math.nan
    return [
        "",
        title,
        "-" * 96,
        f"  flipped by bf16: {len(flipped)} of {len(everyone)} token-routings; "
        "their reference margin p10 / median / p90: "
        f"{low:.4f} / {mid:.4f} / {high:.4f}",
        f"  all tokens' reference margin p10 / median / p90: {all_low:.4f} / {all_mid:.4f} / {all_high:.4f}; "
        f"{100 * share_below:.1f}% of all tokens have a margin below the flips' median",
    ]


def main() -> None:
    start = time.perf_counter()
    torch.set_num_threads(1)
    batch = held_out_batch(4, 128)
    import torchao  # noqa: F401  (the fp8 variant; pip install "pytest-precision[lowbit]")

    trained = conftest.load_trained_moe()
    report = compare(trained, batch, [*VARIANTS, LOW_BIT])
    shown = ["fp32_decode", "bf16", "bf16_decode", LOW_BIT, "bf16_replay"]
    lines = [
        f"$ python docs/science/moe_routing.py    # torch {torch.__version__}",
        "model: trained tiny MoE (tests/data/tiny-trained-moe, Qwen3-MoE, 4 layers x 8 experts, top-2); held-out "
        f"text, input_ids {tuple(batch['input_ids'].shape)}",
        "",
        *agreement_section(report, shown),
        *mismatch_section(report),
        *margin_section(report, "3. The reference's router margin of the tokens bf16 flipped (trained MoE)"),
    ]
    random_model = conftest.tiny_moe("qwen3_moe", layers=4)
    random_report = compare(random_model, batch, ["bf16"])
    agreement = [r.expert_agreement for r in random_report.records("bf16", "routing")]
    lines += margin_section(random_report, "4. The same on a random Qwen3-MoE of the same shape (near-uniform routers)")
    lines.append("  its bf16 routing agreement per layer: " + ", ".join(f"{100 * (a or 0):.2f}%" for a in agreement))
    lines += ["", f"elapsed: {time.perf_counter() - start:.1f} s"]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
