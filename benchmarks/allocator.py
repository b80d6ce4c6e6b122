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
from collections.abc import Callable
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
    """Paired, order-alternating rounds of compare vs hand-written in this process (run.py's `interleave`, one
    warm-up round)."""
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
    # Page faults and system CPU per call, counted around each side while run.py's interleave times it.
    counts: dict[str, list[tuple[int, float]]] = {name: [] for name in sides}

    def counted(name: str, side: Callable[[], None]) -> Callable[[], None]:
        def run_side() -> None:
            before = resource.getrusage(resource.RUSAGE_SELF)
            side()
            after = resource.getrusage(resource.RUSAGE_SELF)
            counts[name].append((after.ru_minflt - before.ru_minflt, after.ru_stime - before.ru_stime))

        return run_side

    times = bench.interleave({name: counted(name, side) for name, side in sides.items()}, rounds, warmup=1)
    result: dict[str, Any] = {
        "ratio": bench.paired_ratio(times, "compare", "hand-written"),
        "overhead_s": bench.paired_difference(times, "compare", "hand-written"),
    }
    for name in sides:
        timed = counts[name][1:]  # the warm-up round's call left out, as interleave leaves out its time
        result[name] = {
            "seconds": statistics.median(times[name]),
            "minor_faults": statistics.median(faults for faults, _ in timed),
            "system_cpu_s": statistics.median(system for _, system in timed),
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
