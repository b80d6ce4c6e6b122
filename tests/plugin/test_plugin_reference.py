"""precision.reference / precision.run(ref, ...): a Reference shared by a module-scoped fixture runs once."""

from __future__ import annotations

from plugin_testing import output, project, run

SHARED_REFERENCE_TEST = """
import json

import pytest
import torch

import pytest_precision
from tinymodel import tiny_batch, tiny_model

FP32_BUILDS = []


def factory(dtype, device):
    if dtype == torch.float32:
        FP32_BUILDS.append(1)  # only the reference runs in fp32 here
    return tiny_model().to(device=device, dtype=dtype)


@pytest.fixture(scope="module")
def ref():
    return pytest_precision.reference(factory, tiny_batch())


@pytest.mark.parametrize("variant", ["bf16", "fp16", "fp64"])
def test_shared(precision, ref, variant):
    shared = precision.run(ref, variants=[variant])
    full = precision.run(tiny_model(), tiny_batch(), variants=[variant])
    assert json.dumps(shared.to_dict(), sort_keys=True) == json.dumps(full.to_dict(), sort_keys=True)
    assert len(FP32_BUILDS) == 1


def test_precision_reference_and_memoized_runs(precision):
    model = tiny_model()
    ref = precision.reference(model, tiny_batch())
    assert ref.device == torch.device(precision.device) and ref.model is model
    assert precision.reference(model, tiny_batch()).stored is ref.stored  # memoized in the session
    first = precision.run(model, tiny_batch(), variants=["bf16"])
    assert precision.cache.hits == 2
    with torch.no_grad():
        model.blocks[1].lin.weight[0, 0] += 0.5
    second = precision.run(model, tiny_batch(), variants=["bf16"])
    fresh = pytest_precision.compare(model, tiny_batch(), ["bf16"])
    assert second.to_dict() == fresh.to_dict() != first.to_dict()


def test_errors_fail_cleanly(precision):
    ref = precision.reference(tiny_model(), tiny_batch())
    precision.run(ref, tiny_batch(), variants=["bf16"])
"""


def test_a_shared_reference_runs_once_and_matches_full_runs(pytester, monkeypatch):
    project(pytester, monkeypatch, test_shared=SHARED_REFERENCE_TEST)
    result = run(pytester, "-p", "no:randomly")
    result.assert_outcomes(passed=4, failed=1)
    assert "ConfigurationError: compare(reference, ...): inputs cannot be given with a Reference" in output(result)
    assert "Traceback" not in output(result)
