"""What a port variant costs: torchtune's Llama (pytest_precision.ports.torchtune_llama) against the same variant on the
reference implementation, transformers' LlamaForCausalLM, on benchmark 1's 8-layer Llama (hidden 512, 8 heads, 4 KV
heads, intermediate 1408, vocabulary 4096; random weights, seed 0) on 2 x 256 tokens. By hand, not in RESULTS.md:

    python benchmarks/port_cost.py [--quick] [--rounds N]

GPU-shaped (benchmarks/README.md): the variant computes at fp32 speed with TF32 asked for (`matmul_precision="high"`,
IEEE on a CPU), where bf16's slow CPU kernels would hide the plugin's own cost. One compare() per round measures the
same variant twice, once per implementation, against one shared reference; the progress events split each run into
build (for the port: building torchtune's model from the config, loading the reference's weights through
hf_to_tune, reading them back through tune_to_hf and checking them equal), forward, backward and measure. The figure
is the median over rounds of each phase and of the port's total against the reference implementation's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import conftest  # noqa: F401  (the CPU pins, before torch)
from pytest_precision import Variant, compare
from pytest_precision.engine.progress import ProgressEvent
from pytest_precision.ports import torchtune_llama


def model(quick: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=128 if quick else 512,
        intermediate_size=352 if quick else 1408,
        num_hidden_layers=2 if quick else 8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 2-layer, hidden-128 model on 2 x 64 tokens")
    parser.add_argument("--rounds", type=int, default=5)
    arguments = parser.parse_args()
    llama = model(arguments.quick)
    length = 64 if arguments.quick else 256
    ids = torch.randint(0, 4096, (2, length), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    port = torchtune_llama()
    phases: dict[tuple[str, str], list[float]] = defaultdict(list)
    totals: dict[str, list[float]] = defaultdict(list)

    for round_index in range(arguments.rounds):
        order = ["theirs", "ours"] if round_index % 2 == 0 else ["ours", "theirs"]
        variants = [
            Variant(name, matmul_precision="high", implementation=port if name == "ours" else None) for name in order
        ]
        started: dict[tuple[str, str], float] = {}
        current: dict[str, float] = defaultdict(float)

        def progress(event: ProgressEvent, started=started, current=current) -> None:
            key = (event.run, event.phase)
            now = time.perf_counter()
            for (run, phase), began in list(started.items()):
                if run == event.run and phase != event.phase:
                    current[f"{run}/{phase}"] += now - began
                    del started[(run, phase)]
            if event.phase != "done":
                started[key] = now

        compare(llama, batch, variants, progress=progress)
        for key, seconds in current.items():
            run, phase = key.split("/")
            phases[(run, phase)].append(seconds)
        for name in ("ours", "theirs"):
            totals[name].append(sum(s for k, s in current.items() if k.startswith(f"{name}/")))

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {'quick' if arguments.quick else 'full'} size"
    )
    print(f"{'phase':10} {'torchtune (s)':>14} {'transformers (s)':>17} {'ratio':>7}")
    for phase in ("build", "forward", "backward", "measure"):
        ours = statistics.median(phases[("ours", phase)] or [0.0])
        theirs = statistics.median(phases[("theirs", phase)] or [0.0])
        ratio = ours / theirs if theirs else float("nan")
        print(f"{phase:10} {ours:14.3f} {theirs:17.3f} {ratio:7.2f}")
    ratios = [o / t for o, t in zip(totals["ours"], totals["theirs"], strict=True)]
    print(
        f"{'total':10} {statistics.median(totals['ours']):14.3f} {statistics.median(totals['theirs']):17.3f} "
        f"{statistics.median(ratios):7.2f}  (median over {arguments.rounds} rounds of the ratio within a round)"
    )


if __name__ == "__main__":
    main()
