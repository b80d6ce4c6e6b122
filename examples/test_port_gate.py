"""Two implementations of one model: torchtune's Llama, a port of transformers' LlamaForCausalLM with torchtune's own
weight conversion, on the bundled tiny Llama. The port's fp32 must agree with the reference implementation to fp32
rounding in every row (the port check), and its bf16 must stay within 1.3 times transformers' bf16 error in every row
(the precision check); both bf16 runs are held against the baseline committed under baselines/examples/. Needs
torchtune (pip install torchtune); skipped without it.

    pytest examples/test_port_gate.py --precision-tables
"""

from __future__ import annotations

import pytest

from conftest import load_tiny_llama, random_tokens
from pytest_precision import NotSupportedHere, Variant
from pytest_precision.ports import torchtune_llama


@pytest.fixture
def batch() -> dict[str, object]:
    ids = random_tokens(batch=2, length=64, seed=0)
    return {"input_ids": ids, "labels": ids}


@pytest.fixture
def port():  # type: ignore[no-untyped-def]
    try:
        return torchtune_llama()
    except NotSupportedHere as missing:
        pytest.skip(str(missing))


# torchtune's RMSNorm normalises in fp32 and scales by its bf16 weight: torch says it cannot fuse the two dtypes
# (a warning of the other implementation's own code, not of the comparison).
@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight:UserWarning")
def test_torchtune_llama_port(precision, assert_precision_within, assert_port_agrees, assert_port_within, batch, port):
    variants = [
        "bf16",
        Variant("torchtune_fp32", implementation=port),
        Variant("torchtune_bf16", dtype="bf16", implementation=port),
    ]
    report = precision.run(load_tiny_llama, batch, variants=variants)
    # The port check: where a port bug would first show, named (docs/concepts/ports.md).
    assert_port_agrees(report, "torchtune_fp32")
    # The precision check: our bf16 against theirs, row by row, as a ratio of errors against the same fp32 reference.
    assert_port_within(report, "torchtune_bf16", "bf16", factor=1.3)
    # And each run against its baseline, as any variant.
    assert_precision_within(report)
