"""What compiled variants cost (by hand, not in RESULTS.md's table): `python benchmarks/compile_cost.py [--quick]`.

Each variant of the 8-layer benchmark Llama (benchmarks/run.py's FULL sizes, 2 x 256 tokens) runs in a fresh
process twice: first against an empty Inductor cache (cold: every graph traced and generated, C++ compiled), then
against the cache the first left (warm: dynamo still traces every region, Inductor's FX-graph and AOTAutograd caches
serve the code). Printed per variant: the comparison's wall seconds, the seconds compiling took inside it
(report.compile_costs: dynamo's own total, tracing and backend), the variant run's seconds, and the same variant
eager for scale. The eager runs use the same cache directory (they compile nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FULL = {"layers": 8, "hidden": 256, "intermediate": 688, "heads": 8, "kv_heads": 4, "vocab": 4096, "batch": 2}
QUICK = {"layers": 2, "hidden": 64, "intermediate": 128, "heads": 4, "kv_heads": 2, "vocab": 256, "batch": 2}
VARIANTS = [
    ("fp32_compiled", "fp32"),
    ("bf16_compiled", "bf16"),
    ("bf16_compiled_emulated", "bf16"),
    ("bf16_compiled_aot_eager", "bf16"),
]

CHILD = """
import json, sys, time
sys.path.insert(0, {root!r}); sys.path.insert(0, {root!r} + "/benchmarks")
import conftest  # the CPU pins of the tests
import torch
from common import build_model
from pytest_precision import compare
spec = json.loads({spec!r})
model = build_model(spec)
ids = torch.randint(0, spec["vocab"], (spec["batch"], {tokens}), generator=torch.Generator().manual_seed(0))
start = time.perf_counter()
report = compare(model, {{"input_ids": ids, "labels": ids}}, variants=[{variant!r}])
wall = time.perf_counter() - start
print(json.dumps({{"wall": wall, "cost": report.compile_costs.get({variant!r})}}))
"""


def measure(variant: str, spec: dict[str, int], tokens: int, cache: str) -> dict[str, object]:
    code = CHILD.format(root=str(ROOT), spec=json.dumps(spec), tokens=tokens, variant=variant)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 2-layer model, 32 tokens: a smoke run")
    quick = parser.parse_args().quick
    spec, tokens = (QUICK, 32) if quick else (FULL, 256)
    import torch

    print(
        f"$ python benchmarks/compile_cost.py{' --quick' if quick else ''}    # torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d')}"
    )
    print(
        f"model: Llama {spec['layers']} layers, hidden {spec['hidden']}, vocabulary {spec['vocab']}; input "
        f"{spec['batch']} x {tokens} tokens; forward and backward; each figure a fresh process"
    )
    header = f"{'variant':<26}{'cache':<6}{'compare s':>10}{'compiling s':>13}{'variant run s':>15}{'graphs':>8}"
    print(header)
    with tempfile.TemporaryDirectory() as cache:
        for compiled, eager in VARIANTS:
            for label in ("cold", "warm"):
                result = measure(compiled, spec, tokens, cache)
                cost = result["cost"]
                assert isinstance(cost, dict)
                print(
                    f"{compiled:<26}{label:<6}{result['wall']:>10.2f}{cost['compile_seconds']:>13.2f}"
                    f"{cost['run_seconds']:>15.2f}{cost['compilations']:>8}"
                )
            result = measure(eager, spec, tokens, cache)
            print(f"{eager + ' (eager)':<26}{'':<6}{result['wall']:>10.2f}{'-':>13}{'-':>15}{'-':>8}")


if __name__ == "__main__":
    main()
