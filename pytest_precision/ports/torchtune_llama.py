"""A ready port: torchtune's Llama (`torchtune.models.llama3._component_builders.llama3`, plain RoPE) against
transformers' LlamaForCausalLM, with torchtune's own weight conversion (`convert_weights.hf_to_tune` / `tune_to_hf`).

    from pytest_precision.ports import torchtune_llama
    Variant("torchtune_bf16", dtype="bf16", implementation=torchtune_llama())

or `implementation = "torchtune_llama"` in a variants file. Needs `pip install torchtune` (0.6.1 was tested).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
from typing import TYPE_CHECKING, Any

from pytest_precision.base.errors import ConfigurationError, NotSupportedHere
from pytest_precision.engine.port_spec import Adapted, Port
from pytest_precision.ports.causal_lm import causal_lm_forward

if TYPE_CHECKING:
    import torch
    from torch import nn

#: torchao moved the NF4 tensor that torchtune 0.6.1 imports at its top level; the new place, aliased under the old
#: name (only when the old name is missing) so that torchtune imports beside torchao >= 0.15.
_NF4_OLD = "torchao.dtypes.nf4tensor"
_NF4_NEW = "torchao.quantization.quantize_.workflows.nf4.nf4_tensor"


def import_torchtune() -> tuple[Any, Any, Any]:
    """torchtune's llama3 builder and its two converters, or NotSupportedHere saying what to install."""
    from pytest_precision.base.torchao_notices import quiet_torchao_notices

    quiet_torchao_notices()
    try:
        importlib.import_module(_NF4_OLD)
    except ImportError:
        with contextlib.suppress(ImportError):
            sys.modules[_NF4_OLD] = importlib.import_module(_NF4_NEW)
    try:
        from torchtune.models.convert_weights import hf_to_tune, tune_to_hf
        from torchtune.models.llama3._component_builders import llama3
    except ImportError as error:
        installed = importlib.util.find_spec("torchtune") is not None
        what = "torchtune is installed but does not import" if installed else "torchtune is not installed"
        reason = " ".join(f"{type(error).__name__}: {error}".split())
        raise NotSupportedHere(
            f"the torchtune_llama port needs torchtune: {what} ({reason}); pip install 'pytest-precision[ports]' "
            "installs torchtune and the torchao it imports (torchtune 0.6.1 was tested)"
        ) from error
    return llama3, hf_to_tune, tune_to_hf


class _Shapes:
    """The head counts of the reference model, set when the port builds the other implementation (the converters
    and the q/k adapters need them)."""

    heads = 0
    kv_heads = 0
    dim = 0
    head_dim = 0

    def read(self, config: Any) -> None:
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.dim = int(config.hidden_size)
        self.head_dim = self.dim // self.heads

    def keywords(self) -> dict[str, int]:
        return {"num_heads": self.heads, "num_kv_heads": self.kv_heads, "dim": self.dim}

    def halves(self, tensor: torch.Tensor) -> torch.Tensor:
        """A q or k projection's output in torchtune's layout (each head's RoPE pairs interleaved) as transformers
        lays it out (each head's two halves)."""
        size = self.head_dim
        pairs = tensor.reshape(*tensor.shape[:-1], -1, size // 2, 2)
        return pairs.transpose(-1, -2).flatten(-3)


def _checked_config(reference: nn.Module) -> Any:
    config = getattr(reference, "config", None)
    if config is None or getattr(config, "model_type", None) != "llama":
        raise ConfigurationError(
            f"the torchtune_llama port compares against a transformers LlamaForCausalLM; the reference is "
            f"{type(reference).__name__}"
        )
    refused = []
    if getattr(config, "rope_scaling", None) not in (None, {}) and (config.rope_scaling or {}).get("rope_type") not in (
        None,
        "default",
    ):
        refused.append(f"rope_scaling={config.rope_scaling}")
    for flag in ("attention_bias", "mlp_bias", "tie_word_embeddings"):
        if getattr(config, flag, False):
            refused.append(f"{flag}=True")
    head_dim = getattr(config, "head_dim", None)
    if head_dim is not None and head_dim * config.num_attention_heads != config.hidden_size:
        refused.append(f"head_dim={head_dim}")
    if getattr(config, "hidden_act", "silu") != "silu":
        refused.append(f"hidden_act={config.hidden_act!r}")
    if refused:
        raise ConfigurationError(
            f"the torchtune_llama port builds torchtune's plain Llama (untied head, no biases, plain RoPE, SiLU); the "
            f"reference's config has {', '.join(refused)}: write a Port for that model"
        )
    return config


def _rope_theta(config: Any) -> float:
    theta = getattr(config, "rope_theta", None)
    if theta is None:  # transformers 5 keeps it in rope_parameters
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return float(theta)


def torchtune_llama() -> Port:
    """The port of torchtune's Llama against transformers' LlamaForCausalLM: every decoder layer, its norms, attention
    and MLP and their projections mapped by name; weights loaded and gradients converted by torchtune's own
    converters."""
    llama3, hf_to_tune, tune_to_hf = import_torchtune()
    shapes = _Shapes()

    def build(reference: nn.Module) -> nn.Module:
        config = _checked_config(reference)
        shapes.read(config)
        return llama3(  # type: ignore[no-any-return]
            vocab_size=config.vocab_size,
            num_layers=config.num_hidden_layers,
            num_heads=shapes.heads,
            num_kv_heads=shapes.kv_heads,
            embed_dim=shapes.dim,
            max_seq_len=config.max_position_embeddings,
            intermediate_dim=config.intermediate_size,
            norm_eps=config.rms_norm_eps,
            rope_base=_rope_theta(config),
        )

    layer = "model.layers.{i}"
    return Port(
        model=build,
        modules={
            "tok_embeddings": "model.embed_tokens",
            "layers.{i}": layer,
            "layers.{i}.sa_norm": f"{layer}.input_layernorm",
            "layers.{i}.attn": f"{layer}.self_attn",
            "layers.{i}.attn.q_proj": Adapted(f"{layer}.self_attn.q_proj", output=shapes.halves),
            "layers.{i}.attn.k_proj": Adapted(f"{layer}.self_attn.k_proj", output=shapes.halves),
            "layers.{i}.attn.v_proj": f"{layer}.self_attn.v_proj",
            "layers.{i}.attn.output_proj": f"{layer}.self_attn.o_proj",
            "layers.{i}.mlp_norm": f"{layer}.post_attention_layernorm",
            "layers.{i}.mlp": f"{layer}.mlp",
            "layers.{i}.mlp.w1": f"{layer}.mlp.gate_proj",
            "layers.{i}.mlp.w2": f"{layer}.mlp.down_proj",
            "layers.{i}.mlp.w3": f"{layer}.mlp.up_proj",
            "norm": "model.norm",
            "output": "lm_head",
        },
        to_reference=lambda state: tune_to_hf(state, **shapes.keywords()),
        from_reference=lambda state: hf_to_tune(state, **shapes.keywords()),
        forward=causal_lm_forward,
        name="torchtune_llama",
    )
