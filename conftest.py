"""Shared by the repository's own tests and examples: tiny transformers models with fixed seeds.

The models are small enough that a comparison with several variants takes well under a second on CPU.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import pytest

#: The CPU code paths of our own runs, set before torch is imported (here, and inherited by every xdist worker,
#: pytester subprocess and torchrun rank). Torch, oneDNN and MKL choose their kernels by the CPU they find
#: (AVX2, AVX-512, AVX-512 FP16, AMX), and with the kernel the order in which sums are rounded: the committed
#: example baselines, recorded on AVX2 machines, moved by up to 1.25x on an AVX-512 one (fp16 gradients of norm
#: weights). Pinned to the paths every x86-64 CI machine has, a baseline means the same on each of them. A
#: value already in the environment wins.
CPU_PINS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_CBWR": "COMPATIBLE"}
if platform.machine().lower() in ("x86_64", "amd64"):
    for _name, _value in CPU_PINS.items():
        os.environ.setdefault(_name, _value)

ROOT = Path(__file__).parent
#: A tiny Llama committed as safetensors (see tests/data/make_tiny_models.py): the bundled example model.
TINY_LLAMA_DIR = ROOT / "tests" / "data" / "tiny-llama"

#: A tiny byte-level Llama trained on public-domain text (see tests/data/tiny-trained-lm/TRAINING.md):
#: its next-token distributions are peaked like a real model's, unlike random weights'.
TRAINED_LM_DIR = ROOT / "tests" / "data" / "tiny-trained-lm"

#: A tiny byte-level Qwen3-MoE (8 experts, top-2) trained with that recipe (tests/data/tiny-trained-moe/TRAINING.md):
#: its routers prefer experts with a margin, unlike random routers, whose top-k choices are near-ties.
TRAINED_MOE_DIR = ROOT / "tests" / "data" / "tiny-trained-moe"

VOCAB_SIZE = 256


def _seeded(config: Any, model_class: Any, seed: int) -> Any:
    import torch

    torch.manual_seed(seed)
    model = model_class(config)
    model.eval()
    return model


def tiny_llama(*, seed: int = 0, tied: bool = False, layers: int = 4, dropout: float = 0.0) -> Any:
    """A 4-layer Llama (hidden 64, 4 heads, 2 KV heads, vocabulary 256) with random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        attention_dropout=dropout,
        attn_implementation="eager",
    )
    return _seeded(config, LlamaForCausalLM, seed)


def tiny_gpt2(*, seed: int = 0, layers: int = 3, dropout: float = 0.0) -> Any:
    """A 3-layer GPT-2 (hidden 64, 4 heads, tied head, with biases and dropout) with random weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB_SIZE,
        n_embd=64,
        n_layer=layers,
        n_head=4,
        n_positions=256,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
    )
    return _seeded(config, GPT2LMHeadModel, seed)


def tiny_qwen2(*, seed: int = 0, tied: bool = True, layers: int = 3) -> Any:
    """A 3-layer Qwen2 (hidden 64, biased QKV, tied head by default) with random weights."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        attn_implementation="eager",
    )
    return _seeded(config, Qwen2ForCausalLM, seed)


#: The mixture-of-experts families tiny_moe builds (routers: tests/engine/test_routing*.py).
MOE_FAMILIES = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "deepseek_v3")


def tiny_moe(family: str = "qwen3_moe", *, seed: int = 0, layers: int = 2, experts: int = 8, top_k: int = 2) -> Any:
    """A 2-layer mixture-of-experts causal LM of `family` (hidden 64, vocabulary 256) with random weights; a
    DeepSeek-V3 one routes with 4 expert groups, 2 of them per token, and a bias correction."""
    import transformers

    common: dict[str, Any] = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
        "attn_implementation": "eager",
    }
    if family == "qwen3_moe":
        config: Any = transformers.Qwen3MoeConfig(
            **common,
            head_dim=16,
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=64,
            norm_topk_prob=True,
        )
        model_class: Any = transformers.Qwen3MoeForCausalLM
    elif family == "mixtral":
        config = transformers.MixtralConfig(**common, num_local_experts=experts, num_experts_per_tok=top_k)
        model_class = transformers.MixtralForCausalLM
    elif family == "olmoe":
        config = transformers.OlmoeConfig(**common, num_experts=experts, num_experts_per_tok=top_k)
        model_class = transformers.OlmoeForCausalLM
    elif family == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(
            **common,
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            norm_topk_prob=False,
        )
        model_class = transformers.Qwen2MoeForCausalLM
    elif family == "deepseek_v3":
        config = transformers.DeepseekV3Config(
            **{**common, "num_key_value_heads": 4},
            n_routed_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=64,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=0,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            routed_scaling_factor=2.5,
        )
        model_class = transformers.DeepseekV3ForCausalLM
    else:
        raise ValueError(f"tiny_moe: unknown family {family!r}; one of {', '.join(MOE_FAMILIES)}")
    model = _seeded(config, model_class, seed)
    if family == "deepseek_v3":  # a bias correction as training leaves it: not zero
        import torch

        generator = torch.Generator().manual_seed(seed + 1)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.05 * torch.randn(buffer.shape, generator=generator))
    return model


def _transformers_major() -> int:
    from importlib.metadata import version

    return int(version("transformers").split(".")[0])


#: transformers >= 5 made MoE routers modules of their own, returning their choice; 4.x computes top-k inside the
#: MoE block (tests/engine/test_routing_transformers4.py) and names experts other than the committed trained MoE.
requires_transformers_routers = pytest.mark.skipif(
    _transformers_major() < 5, reason="routing rows of transformers' MoE models need transformers >= 5"
)


def load_trained_moe(dtype: Any = None, device: Any = "cpu") -> Any:
    """The committed trained tiny MoE (Qwen3-MoE), loaded like a checkpoint; usable as a model factory."""
    return _load_checkpoint(TRAINED_MOE_DIR, dtype, device)


def _load_checkpoint(path: Path, dtype: Any, device: Any) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32)
    return model.to(device).eval()


def load_tiny_llama(dtype: Any = None, device: Any = "cpu") -> Any:
    """The committed tiny Llama, loaded from disk as transformers would load a checkpoint.

    Usable as a model factory: `compare(load_tiny_llama, ...)` builds each run's model in its own dtype.
    """
    return _load_checkpoint(TINY_LLAMA_DIR, dtype, device)


def load_trained_lm(dtype: Any = None, device: Any = "cpu") -> Any:
    """The committed trained tiny LM, loaded like a checkpoint; usable as a model factory."""
    return _load_checkpoint(TRAINED_LM_DIR, dtype, device)


def trained_lm_text_batch(*, batch: int = 2, length: int = 128) -> dict[str, Any]:
    """input_ids and labels from the held-out end of the trained model's corpus (text it never saw)."""
    from transformers import AutoTokenizer

    from pytest_precision.inputs import from_text

    text = (TRAINED_LM_DIR / "corpus.txt").read_text(encoding="utf-8")
    held_out = text[int(len(text) * 0.9) :]
    ids = from_text(AutoTokenizer.from_pretrained(TRAINED_LM_DIR), held_out, batch, length)
    return {"input_ids": ids, "labels": ids.clone()}


def random_tokens(*, batch: int = 2, length: int = 32, seed: int = 0) -> Any:
    """Uniform random token ids, shape (batch, length)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB_SIZE, (batch, length), generator=generator)


@pytest.fixture
def llama_batch() -> dict[str, Any]:
    """input_ids and labels for the tiny models: 2 sequences of 32 random tokens."""
    ids = random_tokens()
    return {"input_ids": ids, "labels": ids.clone()}


# --- The code blocks of README.md and of the docs pages (docs/**/*.md) run as tests, one per page -------------
# (docs/doc_blocks.py says how each block runs). Here and not in a docs/conftest.py: a second module named
# `conftest` would shadow this one for the tests that import its models.
# The CPU (oneDNN) fp32 matmul precision in one vocabulary on every torch: "ieee", "tf32" or "bf16". torch >= 2.9
# has `torch.backends.mkldnn.matmul.fp32_precision`; older torch has the process-wide float32 matmul precision.
_LEGACY_TO_CPU_PRECISION = {"highest": "ieee", "high": "tf32", "medium": "bf16"}


def cpu_matmul_precision() -> str:
    """The fp32 matmul precision oneDNN uses now, read through torch's public API of this version."""
    import torch

    if hasattr(torch.backends.mkldnn, "matmul"):
        return str(torch.backends.mkldnn.matmul.fp32_precision)
    return _LEGACY_TO_CPU_PRECISION[torch.get_float32_matmul_precision()]


def set_cpu_matmul_precision(value: str) -> None:
    """Set what cpu_matmul_precision() reads ("ieee", "tf32" or "bf16"; "none" too on torch >= 2.9)."""
    import torch

    if hasattr(torch.backends.mkldnn, "matmul"):
        torch.backends.mkldnn.matmul.fp32_precision = value
    else:
        legacy = {v: k for k, v in _LEGACY_TO_CPU_PRECISION.items()}
        torch.set_float32_matmul_precision(legacy[value])


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    if file_path != ROOT / "README.md" and not (file_path.suffix == ".md" and (ROOT / "docs") in file_path.parents):
        return None
    import importlib.util
    import sys

    if "doc_blocks" not in sys.modules:
        spec = importlib.util.spec_from_file_location("doc_blocks", ROOT / "docs" / "doc_blocks.py")
        assert spec is not None and spec.loader is not None
        sys.modules["doc_blocks"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["doc_blocks"])
    return sys.modules["doc_blocks"].collect_page(file_path, parent)  # type: ignore[no-any-return]
