"""How much of a one-variant compare()'s overhead on CPU is the C allocator: `python benchmarks/allocator.py`.

Runs benchmark 7's / 8's pair (a one-variant `compare(model, inputs, ["tf32"])` against the hand-written fp32
copy + fp32 copy, forward+backward) in two fresh subprocesses: one with glibc's default malloc settings, one
with glibc told to keep the memory it frees (no trimming of the heap, blocks up to 32 MiB from the heap, 1 GiB
kept at its top), which is what a GPU's caching allocator does for device memory. Each prints the paired ratio,
the overhead and the minor page faults and system CPU time of each side per call.

Run by hand; figures in benchmarks/README.md. `--model 8l` (benchmark 7's Llama), `--model smol` (benchmark
8's SmolLM2-135M configuration, ~10 s a call), `--rounds N`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

#: glibc malloc told to keep what is freed (see mallopt(3)): the largest mmap threshold glibc accepts on 64-bit,
#: a trim threshold no heap reaches, and 1 GiB of padding added to every heap growth.
CACHING_MALLOC = {
    "MALLOC_MMAP_THRESHOLD_": str(32 * 1024 * 1024),
    "MALLOC_TRIM_THRESHOLD_": str(64 * 1024**3),
    "MALLOC_TOP_PAD_": str(1024**3),
}


def measure(model_name: str, rounds: int) -> dict[str, Any]:
    """Paired, order-alternating rounds of compare vs hand-written in this process (after one warm-up round)."""
    sys.path.insert(0, str(HERE))
    import run as bench  # benchmarks/run.py: the models and the hand-written side

    from pytest_precision import compare

    if model_name == "smol":
        spec, tokens = bench.SMOL, bench.SMOL_TOKENS
        model = bench.build_smol(spec)
    else:
        spec, tokens = bench.sizes(False)
        model = bench.build_model(spec)
    inputs = bench.build_inputs(spec, tokens)

    def hand() -> None:
        bench.bare_run(model, inputs, "float32")
        bench.bare_run(model, inputs, "float32")

    def call() -> None:
        compare(model, inputs, ["tf32"])

    sides = {"hand-written": hand, "compare": call}
    samples: dict[str, list[tuple[float, int, float]]] = {name: [] for name in sides}
    for round_index in range(rounds + 1):
        order = list(sides.items())
        for name, side in order if round_index % 2 == 0 else reversed(order):
            before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            side()
            elapsed, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
            if round_index:
                samples[name].append((elapsed, after.ru_minflt - before.ru_minflt, after.ru_stime - before.ru_stime))
    ratios = [c[0] / h[0] for c, h in zip(samples["compare"], samples["hand-written"], strict=True)]
    overheads = [c[0] - h[0] for c, h in zip(samples["compare"], samples["hand-written"], strict=True)]
    result: dict[str, Any] = {"ratio": statistics.median(ratios), "overhead_s": statistics.median(overheads)}
    for name, values in samples.items():
        result[name] = {
            "seconds": statistics.median(v[0] for v in values),
            "minor_faults": statistics.median(v[1] for v in values),
            "system_cpu_s": statistics.median(v[2] for v in values),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("8l", "smol"), default="smol")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.model, args.rounds)))
        return
    for label, extra in (("glibc defaults", {}), ("glibc keeping freed memory", CACHING_MALLOC)):
        environment = {**os.environ, **extra, "PYTHONPATH": str(HERE.parent)}
        command = [sys.executable, __file__, "--child", "--model", args.model, "--rounds", str(args.rounds)]
        output = subprocess.run(command, env=environment, check=True, capture_output=True, text=True).stdout
        result = json.loads(output.strip().splitlines()[-1])
        hand, call = result["hand-written"], result["compare"]
        print(
            f"{args.model}, {label}: compare {call['seconds']:.3f} s vs hand-written {hand['seconds']:.3f} s -> "
            f"{result['ratio']:.2f}x ({1000 * result['overhead_s']:+.0f} ms); minor page faults per call "
            f"{call['minor_faults']:.0f} vs {hand['minor_faults']:.0f}, system CPU {call['system_cpu_s']:.2f} s vs "
            f"{hand['system_cpu_s']:.2f} s"
        )


if __name__ == "__main__":
    main()
