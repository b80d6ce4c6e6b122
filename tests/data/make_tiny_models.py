"""Write the tiny Llama checkpoint committed under tests/data/tiny-llama (run from the repository root).

python tests/data/make_tiny_models.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from conftest import TINY_LLAMA_DIR, tiny_llama

if __name__ == "__main__":
    model = tiny_llama(seed=1234)
    model.save_pretrained(TINY_LLAMA_DIR, safe_serialization=True)
    print(f"wrote {TINY_LLAMA_DIR}")
