"""Where error is born: the bundled tiny Llama in bf16, each block measured on the fp32 reference's input for
that block (isolated) beside the usual propagated error, both held against the baseline.

    pytest examples/test_where_error_is_born.py --precision-tables
"""

from __future__ import annotations

import pytest

from conftest import load_tiny_llama, random_tokens


@pytest.mark.precision(isolate=True)
def test_tiny_llama_isolated(precision, assert_precision_within):
    ids = random_tokens(batch=2, length=64, seed=0)
    report = precision.run(load_tiny_llama, {"input_ids": ids, "labels": ids}, variants=["bf16"])
    assert_precision_within(report)
    # The first block's input is the embedding's output, whose error isolation removes: each block adds less
    # than what reaches the last one.
    last = report.records("bf16", "fw")[-1]
    assert report.get("bf16", last.name, "fw_isolated").rms_rel < last.rms_rel
