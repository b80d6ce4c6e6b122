"""What `pytest-precision run --reference` saves: `python benchmarks/reference_reuse.py [--quick] [--rounds N]`.

A randomly initialised Llama of SmolLM2-135M's configuration (benchmarks/run.py's `build_smol`: 30 layers,
hidden 576, vocabulary 49152, tied embeddings; --quick: 4 layers) is saved to a temporary folder as a
checkpoint. One `run --save-reference` writes the reference; then, in alternating order per round, the same
one-variant run (bf16, 1 x 512 tokens, forward and backward) is timed fresh (the fp32 reference runs again)
and with `--reference` (it is loaded and checked). Each is a whole command in its own process, as a user runs
it: startup, imports, weights hashing and loading included. Printed: the median wall time of each, their
ratio, and the reference file's size.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def make_checkpoint(folder: Path, *, layers: int) -> Path:
    """benchmarks/run.py's SmolLM2-135M-shaped Llama (random weights, seed 0) with `layers` layers, saved."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import run as bench  # benchmarks/run.py: SMOL and build_smol

    path = folder / "smol-shaped"
    bench.build_smol({**bench.SMOL, "layers": layers}).save_pretrained(path)
    return path


def timed(arguments: list[str]) -> float:
    """Wall seconds of `pytest-precision ARGUMENTS` in a fresh interpreter."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pytest_precision.cli.main", *arguments], check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 layers instead of 30")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=512)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        checkpoint = make_checkpoint(folder, layers=4 if options.quick else 30)
        reference = folder / "reference.safetensors"
        common = ["run", str(checkpoint), "--variants", "bf16", "--quiet"]
        inputs = ["--tokens", str(options.tokens), "--batch", "1"]
        saving = timed([*common, *inputs, "--save-reference", str(reference)])
        fresh: list[float] = []
        reused: list[float] = []
        for round_number in range(options.rounds):
            order = [(fresh, [*common, *inputs]), (reused, [*common, "--reference", str(reference)])]
            for times, arguments in order if round_number % 2 == 0 else reversed(order):
                times.append(timed(arguments))
        fresh_median, reused_median = statistics.median(fresh), statistics.median(reused)
        print(f"checkpoint: {checkpoint.name}, {'4' if options.quick else '30'} layers, 1 x {options.tokens} tokens")
        print(f"run with --save-reference: {saving:.1f} s; reference file {reference.stat().st_size / 2**20:.0f} MiB")
        print(f"fresh (reference + bf16):  median {fresh_median:.1f} s  {[round(t, 1) for t in fresh]}")
        print(f"--reference (bf16 only):   median {reused_median:.1f} s  {[round(t, 1) for t in reused]}")
        print(f"reused / fresh: {reused_median / fresh_median:.2f}")


if __name__ == "__main__":
    main()
