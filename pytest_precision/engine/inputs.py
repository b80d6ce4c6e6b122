"""Inputs for language models: uniform random tokens, or real text repeated to length.

The two give very different pictures. Random tokens make a trained model uncertain: |logpi| is large
(~ln(vocab) for an untrained model) and the relative log-prob error small. Real text makes the next-token
distribution peaked: |logpi| is small, so the same absolute logit error is a far larger relative one, and
the log-ratio statistics that matter for RL (delta, clip fraction) are the ones on real text.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pytest_precision.base.errors import ConfigurationError

if TYPE_CHECKING:
    import torch


def random_tokens(vocab_size: int, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    """(batch, length) int64 token ids drawn uniformly from [0, vocab_size) with a private generator."""
    import torch

    if vocab_size < 1 or batch < 1 or length < 1:
        raise ConfigurationError(
            f"random_tokens: vocab_size, batch and length must be positive, got {vocab_size}, {batch}, {length}"
        )
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, length), generator=generator)


def from_text(tokenizer: Any, text: str, batch: int, length: int) -> torch.Tensor:
    """(batch, length) token ids of `text`, repeated until long enough; row i starts i * length tokens in.

    `tokenizer` is any callable/`encode`-able tokenizer, e.g. `AutoTokenizer.from_pretrained(local_dir)`.
    """
    import torch

    if not text:
        raise ConfigurationError("from_text: the text is empty")
    encode = getattr(tokenizer, "encode", None)
    if not callable(encode):
        raise ConfigurationError(f"from_text: {type(tokenizer).__name__} has no encode(); pass a tokenizer")
    try:
        ids = list(encode(text, add_special_tokens=False))
    except TypeError:
        ids = list(encode(text))
    if not ids:
        raise ConfigurationError("from_text: the tokenizer produced no tokens for this text")
    needed = batch * length
    repeated = (ids * (needed // len(ids) + 1))[:needed]
    return torch.tensor(repeated, dtype=torch.long).reshape(batch, length)
