"""What the benchmarks share: the seeded Llama they measure and the reader of a process's peak memory."""

from __future__ import annotations

import contextlib
import resource
from pathlib import Path
from typing import Any

SEED = 0


def build_model(spec: dict[str, int], positions: int = 1024, **config: Any) -> Any:
    """A Llama of `spec`'s sizes with random weights (seed SEED), in eval mode; `config` overrides LlamaConfig
    fields (untied head by default)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    settings: dict[str, Any] = {"max_position_embeddings": max(positions, 1024), "tie_word_embeddings": False}
    llama_config = LlamaConfig(
        vocab_size=spec["vocab"],
        hidden_size=spec["hidden"],
        intermediate_size=spec["intermediate"],
        num_hidden_layers=spec["layers"],
        num_attention_heads=spec["heads"],
        num_key_value_heads=spec["kv_heads"],
        **{**settings, **config},
    )
    torch.manual_seed(SEED)
    model: Any = LlamaForCausalLM(llama_config)
    model.eval()
    return model


def peak_rss_kib() -> int:
    """This process's peak resident set: VmHWM, not ru_maxrss, which a child inherits from its parent across
    fork + exec (the parent here holds GiBs after benchmarks 1-3, hiding every child's own peak)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
