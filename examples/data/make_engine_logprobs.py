"""Write the log-prob vectors of examples/test_cross_engine_logprobs.py (run from the repository root):

    python examples/data/make_engine_logprobs.py

They stand in for what two engines return for the same held-out text with the bundled trained LM: a
"trainer" computing in bf16 with an fp32 LM head, an "engine" in plain bf16, and each side's fp32 reference
(the same model here, so the floor is zero). Stored as .npy (float32, shape (2, 127)).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from conftest import load_trained_lm, trained_lm_text_batch  # noqa: E402
from pytest_precision.engine.model_build import build_run_model  # noqa: E402
from pytest_precision.engine.variants import BUILTIN_VARIANTS  # noqa: E402
from pytest_precision.numbers.logprobs import chosen_logprobs  # noqa: E402


def logprobs(variant: str, ids: torch.Tensor) -> np.ndarray:
    model = build_run_model(load_trained_lm, BUILTIN_VARIANTS[variant], torch.device("cpu"))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return chosen_logprobs(logits, ids[:, 1:]).numpy()


if __name__ == "__main__":
    ids = trained_lm_text_batch(batch=2, length=128)["input_ids"]
    out = Path(__file__).parent
    np.save(out / "reference_logprobs.npy", logprobs("fp32", ids))
    np.save(out / "trainer_logprobs.npy", logprobs("bf16_fp32_head", ids))
    np.save(out / "engine_logprobs.npy", logprobs("bf16", ids))
    print(f"wrote {out}/*_logprobs.npy")
