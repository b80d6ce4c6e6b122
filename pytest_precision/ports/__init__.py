"""Comparing another implementation of a model against the reference implementation (docs/concepts/ports.md).

    from pytest_precision.ports import Port, Fused, Transposed, Adapted, causal_lm_forward

A `Port` says how to build the other implementation and how its modules and parameters map onto the reference's;
`Variant(name="ours_bf16", dtype="bf16", implementation=port)` runs it. `torchtune_llama()` is a ready port of
torchtune's Llama against transformers' LlamaForCausalLM. `assert_port_agrees` (fp32: the port check) and
`assert_port_within` (our low-precision error against the reference implementation's) are its gates.
"""

from __future__ import annotations

from pytest_precision.engine.port_spec import Adapted, Converted, Fused, Layout, Port, Transposed, seq_first
from pytest_precision.ports.assertions import assert_port_agrees, assert_port_within
from pytest_precision.ports.causal_lm import causal_lm_forward, causal_lm_loss
from pytest_precision.ports.torchtune_llama import torchtune_llama
from pytest_precision.reports.ports import (
    PORT_CHECK_LIMIT,
    PortVerdict,
    RatioRow,
    port_verdict,
    ratio_rows,
    side_by_side,
)

__all__ = [
    "PORT_CHECK_LIMIT",
    "Adapted",
    "Converted",
    "Fused",
    "Layout",
    "Port",
    "PortVerdict",
    "RatioRow",
    "Transposed",
    "assert_port_agrees",
    "assert_port_within",
    "causal_lm_forward",
    "causal_lm_loss",
    "port_verdict",
    "ratio_rows",
    "seq_first",
    "side_by_side",
    "torchtune_llama",
]
