"""What routing rows and routing replay cost (by hand, not in RESULTS.md).

PYTHONPATH=. .venv/bin/python benchmarks/routing_overhead.py [--quick]

On a Qwen3-MoE with random weights (8 layers, hidden 256, 16 experts, top-4; --quick: 2 layers, hidden 64), one
bf16 variant forward and backward, `compare()` with the routers found (the default) against `routers=False`, and
`bf16_replay` against `bf16`: the median over interleaved rounds (A, B, then B, A, ...) of the ratio within a
round, with the median paired difference in ms. Routing rows add per router a handful of small tensor ops on
(tokens, k) and (tokens, experts) and no host synchronisation (their statistics travel in the run's one transfer);
replay adds a softmax and a gather per router.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from pytest_precision import compare


def moe(quick: bool) -> Any:
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=1024,
        hidden_size=64 if quick else 256,
        intermediate_size=128 if quick else 512,
        moe_intermediate_size=64 if quick else 256,
        num_hidden_layers=2 if quick else 8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16 if quick else 64,
        num_experts=8 if quick else 16,
        num_experts_per_tok=2 if quick else 4,
        norm_topk_prob=True,
        attn_implementation="eager",
    )
    return Qwen3MoeForCausalLM(config).eval()


def timed(call: Callable[[], Any]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def paired(a: Callable[[], Any], b: Callable[[], Any], rounds: int) -> tuple[float, float, float]:
    """Median ratio b / a, median difference b - a (ms) and median time of a (s) over interleaved rounds."""
    ratios, differences, firsts = [], [], []
    for round_index in range(rounds):
        if round_index % 2:
            tb, ta = timed(b), timed(a)
        else:
            ta, tb = timed(a), timed(b)
        ratios.append(tb / ta)
        differences.append(1000 * (tb - ta))
        firsts.append(ta)
    return statistics.median(ratios), statistics.median(differences), statistics.median(firsts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    model = moe(args.quick)
    length = 64 if args.quick else 256
    ids = torch.randint(0, 1024, (2 if args.quick else 4, length), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    rounds = 3 if args.quick else 7
    compare(model, batch, ["bf16"])  # warm up
    without = lambda: compare(model, batch, ["bf16"], routers=False)  # noqa: E731
    with_rows = lambda: compare(model, batch, ["bf16"])  # noqa: E731
    replay = lambda: compare(model, batch, ["bf16_replay"])  # noqa: E731
    ratio, ms, base = paired(without, with_rows, rounds)
    print(
        f"model: Qwen3-MoE {model.config.num_hidden_layers} layers x {model.config.num_experts} experts, "
        f"top-{model.config.num_experts_per_tok}; input_ids {tuple(ids.shape)}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; {rounds} rounds"
    )
    print(
        f"routing rows (default) against routers=False: {ratio:.3f}x, {ms:+.1f} ms per compare() "
        f"(routers=False: {base:.2f} s)"
    )
    ratio, ms, base = paired(with_rows, replay, rounds)
    print(f"bf16_replay against bf16 (both with routing rows): {ratio:.3f}x, {ms:+.1f} ms (bf16: {base:.2f} s)")


if __name__ == "__main__":
    main()
