"""Inputs for language models (public: `pytest_precision.inputs.random_tokens(...)`): uniform random tokens, or
real text repeated to length. Defined in pytest_precision.engine.inputs, where the command line reads them too."""

from pytest_precision.engine.inputs import from_text, random_tokens

__all__ = ["from_text", "random_tokens"]
