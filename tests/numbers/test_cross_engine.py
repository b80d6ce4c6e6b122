"""compare_logprobs on synthetic log-probability vectors, against independent float64 NumPy computations."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from pytest_precision.base.errors import ConfigurationError
from pytest_precision.base.records import Record
from pytest_precision.gate import baseline
from pytest_precision.numbers.cross_engine import decomposition, error_terms
from pytest_precision.reports import environment
from pytest_precision.reports.report import PrecisionReport, compare_logprobs

RTOL = 1e-10
CLIP_LOW, CLIP_HIGH = math.log(0.8), math.log(1.2)


def logprobs(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Plausible chosen-token log-probabilities: mostly near 0, a tail down to about -10."""
    return -np.random.default_rng(seed).exponential(1.5, size=shape)


def noise(shape: tuple[int, ...], scale: float, seed: int) -> np.ndarray:
    return scale * np.random.default_rng(seed).standard_normal(shape)


def record_of(report: PrecisionReport, variant: str = "a") -> Record:
    (record,) = report.records(variant)
    return record


def numpy_delta_stats(a: np.ndarray, b: np.ndarray, valid: np.ndarray) -> dict[str, float]:
    """Token and per-sequence statistics of a - b where valid, from the definitions (no package code)."""
    a2, b2, v2 = (np.atleast_2d(x) for x in (a, b, valid))
    d = a2 - b2
    tokens = d[v2]
    sequence_means = np.array([d[i][v2[i]].mean() for i in range(d.shape[0]) if v2[i].any()])
    return {
        "delta_mean": float(tokens.mean()),
        "delta_rms": float(np.sqrt(np.mean(tokens**2))),
        "delta_max_abs": float(np.max(np.abs(tokens))),
        "clip_fraction": float(np.mean((tokens < CLIP_LOW) | (tokens > CLIP_HIGH))),
        "seq_delta_mean": float(sequence_means.mean()),
        "seq_delta_std": float(sequence_means.std()),
        "seq_delta_rms": float(np.sqrt(np.mean(sequence_means**2))),
        "seq_delta_max": float(np.max(np.abs(sequence_means))),
    }


def numpy_tensor_metrics(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    """The main TensorError metrics of a (variant) against b (reference), both 1-D and finite."""
    d = a - b
    ref_rms = math.sqrt(np.mean(b * b))
    return {
        "count": a.size,
        "ref_rms": ref_rms,
        "rms_abs": math.sqrt(np.mean(d * d)),
        "rms_rel": math.sqrt(np.mean(d * d)) / ref_rms,
        "max_abs": float(np.max(np.abs(d))),
        "max_rel": float(np.max(np.abs(d))) / ref_rms,
        "bias_abs": float(np.mean(d)),
        "bias_rel": float(np.mean(d)) / ref_rms,
        "correlation": float(np.corrcoef(b, a)[0, 1]),
        "slope": float(np.polyfit(b, a, 1)[0]),
        "cosine": float(np.dot(a, b) / math.sqrt(np.dot(a, a) * np.dot(b, b))),
        "sqnr_db": 10 * math.log10(np.sum(b * b) / np.sum(d * d)),
    }


def numpy_decomposition(a, b, ref_a, ref_b) -> dict[str, float]:
    e_a, e_b, floor = a - ref_a, b - ref_b, ref_a - ref_b

    def rms(x: np.ndarray) -> float:
        return float(np.sqrt(np.mean(x * x)))

    return {
        "rho": float(np.corrcoef(e_a, e_b)[0, 1]),
        "rms_e_a": rms(e_a),
        "rms_e_b": rms(e_b),
        "rms_e_diff": rms(e_a - e_b),
        "rms_floor": rms(floor),
    }


def assert_fields(record: Record, expected: dict[str, float], rel: float = RTOL) -> None:
    for name, value in expected.items():
        assert getattr(record, name) == pytest.approx(value, rel=rel, abs=1e-15), name


# ---------------------------------------------------------------------------------------------- statistics


def test_delta_statistics_match_numpy_on_a_batch():
    b = logprobs((4, 300))
    a = b + noise(b.shape, 0.15, seed=1)  # wide enough that some tokens leave the clip band
    record = record_of(compare_logprobs(a, b))
    expected = numpy_delta_stats(a, b, np.ones(b.shape, dtype=bool))
    assert 0.05 < expected["clip_fraction"] < 0.5
    assert_fields(record, expected)
    assert record.kind == "logprob" and record.name == "logprob" and record.shape == (4, 300)


def test_delta_statistics_known_exactly():
    # Two sequences; deltas chosen by hand: 0.3 and -0.3 leave [log 0.8, log 1.2] = [-0.223, 0.182].
    b = np.array([[-1.0, -2.0, -0.5, -3.0], [-0.25, -4.0, -1.5, -0.125]])
    delta = np.array([[0.0, 0.1, -0.3, 0.2], [0.3, -0.1, 0.0, 0.0]])
    record = record_of(compare_logprobs(b + delta, b))
    d = (b + delta) - b  # what float64 actually holds
    assert record.delta_mean == pytest.approx(d.mean(), rel=RTOL)
    assert record.delta_max_abs == pytest.approx(0.3, rel=1e-12)
    assert record.clip_fraction == 3 / 8  # -0.3, 0.2 (> log 1.2 = 0.1823) and 0.3
    assert record.seq_delta_mean == pytest.approx(np.mean([0.0, 0.05]), rel=1e-12)
    assert record.seq_delta_std == pytest.approx(0.025, rel=1e-12)
    assert record.seq_delta_max == pytest.approx(0.05, rel=1e-12)


def test_constant_offset_gives_exact_statistics():
    b = logprobs((3, 40))
    a = b + 0.25
    record = record_of(compare_logprobs(a, b))
    assert record.delta_mean == pytest.approx(0.25, rel=1e-12)
    assert record.delta_rms == pytest.approx(0.25, rel=1e-12)
    assert record.clip_fraction == 1.0  # 0.25 > log(1.2)
    assert record.seq_delta_std == pytest.approx(0.0, abs=1e-15)
    assert record.slope == pytest.approx(1.0, rel=1e-12)
    assert record_of(compare_logprobs(b + 0.1, b)).clip_fraction == 0.0


def test_clip_eps_moves_the_band():
    b = logprobs((200,))
    a = b + noise(b.shape, 0.1, seed=3)
    for eps in (0.05, 0.2, 0.5):
        d = a - b
        outside = np.mean((d < math.log(1 - eps)) | (d > math.log(1 + eps)))
        assert record_of(compare_logprobs(a, b, clip_eps=eps)).clip_fraction == pytest.approx(outside, rel=1e-12)


def test_one_dimensional_input_is_one_sequence():
    b = logprobs((500,))
    a = b + noise(b.shape, 0.05, seed=2)
    record = record_of(compare_logprobs(a, b))
    expected = numpy_delta_stats(a, b, np.ones(b.shape, dtype=bool))
    assert_fields(record, expected)
    assert record.seq_delta_mean == pytest.approx(np.mean(a - b), rel=RTOL)
    assert record.seq_delta_std == 0.0
    assert record.seq_delta_max == pytest.approx(abs(np.mean(a - b)), rel=RTOL)
    assert record.shape == (500,)
    # The same vector as a (1, tokens) batch gives the same numbers.
    as_batch = record_of(compare_logprobs(a[None], b[None]))
    assert dataclasses.replace(as_batch, shape=(500,)) == record


def test_tensor_metrics_match_numpy():
    b = logprobs((3, 200), seed=5)
    a = b * 1.01 + noise(b.shape, 0.02, seed=6)
    record = record_of(compare_logprobs(a, b))
    assert_fields(record, numpy_tensor_metrics(a.ravel(), b.ravel()), rel=1e-9)
    assert record.nonfinite == 0
    # delta_* and the tensor metrics describe the same differences.
    assert record.delta_rms == pytest.approx(record.rms_abs, rel=RTOL)
    assert record.delta_mean == pytest.approx(record.bias_abs, rel=RTOL)
    assert record.delta_max_abs == pytest.approx(record.max_abs, rel=RTOL)


def test_identical_vectors_have_zero_error():
    b = logprobs((2, 30))
    record = record_of(compare_logprobs(b.copy(), b))
    assert record.rms_rel == 0.0 and record.delta_rms == 0.0 and record.clip_fraction == 0.0
    assert record.sqnr_db == math.inf


def test_low_precision_inputs_are_compared_in_float64():
    b32 = torch.from_numpy(logprobs((2, 64))).to(torch.float32)
    a16 = (b32 + 0.01).to(torch.bfloat16)
    record = record_of(compare_logprobs(a16, b32))
    a64, b64 = a16.double().numpy(), b32.double().numpy()
    assert_fields(record, numpy_delta_stats(a64, b64, np.ones(b64.shape, dtype=bool)))


# ---------------------------------------------------------------------------------------------- decomposition


def decomposition_case(n: int = 4000, seed: int = 10):
    ref_b = logprobs((n,), seed=seed)
    ref_a = ref_b + noise((n,), 1e-3, seed + 1)  # the floor: the stacks differ even at high precision
    a = ref_a + noise((n,), 2e-2, seed + 2)
    b = ref_b + noise((n,), 1e-2, seed + 3)
    return a, b, ref_a, ref_b


def test_decomposition_adds_up():
    a, b, ref_a, ref_b = (torch.from_numpy(x) for x in decomposition_case())
    floor, e_a, e_b = error_terms(a, b, ref_a, ref_b)
    assert torch.allclose(floor + e_a - e_b, a - b, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(e_a.numpy(), (a - ref_a).numpy())
    np.testing.assert_array_equal(e_b.numpy(), (b - ref_b).numpy())
    np.testing.assert_array_equal(floor.numpy(), (ref_a - ref_b).numpy())


def test_decomposition_matches_numpy():
    a, b, ref_a, ref_b = decomposition_case()
    record = record_of(compare_logprobs(a, b, ref_a=ref_a, ref_b=ref_b))
    expected = numpy_decomposition(a, b, ref_a, ref_b)
    assert_fields(record, expected)
    # Independent errors: rho ~ 0 (its standard error is 1/sqrt(n) ~ 0.016), and rms_e_diff^2 ~ sum of squares.
    assert abs(record.rho) < 0.06
    assert record.rms_e_diff == pytest.approx(math.hypot(record.rms_e_a, record.rms_e_b), rel=0.05)
    assert record.rms_floor == pytest.approx(1e-3, rel=0.1)


def test_independent_errors_have_rho_near_zero():
    a, b, ref_a, ref_b = decomposition_case(n=200_000, seed=20)
    record = record_of(compare_logprobs(a, b, ref_a=ref_a, ref_b=ref_b))
    assert abs(record.rho) < 0.01  # 1/sqrt(n) = 0.0022


def test_identical_errors_have_rho_one_and_no_difference():
    ref = logprobs((1000,), seed=30)
    error = noise((1000,), 0.01, seed=31)
    record = record_of(compare_logprobs(ref + error, ref + error, ref_a=ref, ref_b=ref))
    assert record.rho == pytest.approx(1.0, rel=1e-12)
    assert record.rms_e_diff == 0.0
    assert record.rms_floor == 0.0
    assert record.rms_e_a == record.rms_e_b == pytest.approx(np.sqrt(np.mean(error**2)), rel=1e-6)


def test_known_correlation():
    # e_a = s + u, e_b = s + w with s, u, w independent and of equal variance: rho = 1/2.
    n = 200_000
    ref = logprobs((n,), seed=40)
    shared, own_a, own_b = (noise((n,), 0.01, seed) for seed in (41, 42, 43))
    a, b = ref + shared + own_a, ref + shared + own_b
    record = record_of(compare_logprobs(a, b, ref_a=ref, ref_b=ref))
    assert record.rho == pytest.approx(0.5, abs=0.01)
    assert record.rho == pytest.approx(np.corrcoef(a - ref, b - ref)[0, 1], rel=1e-9)
    # Opposite errors: rho = -1 and e_a - e_b doubles.
    opposite = record_of(compare_logprobs(ref + own_a, ref - own_a, ref_a=ref, ref_b=ref))
    assert opposite.rho == pytest.approx(-1.0, rel=1e-12)
    assert opposite.rms_e_diff == pytest.approx(2 * opposite.rms_e_a, rel=1e-12)


def test_rho_undefined_when_an_error_is_constant():
    ref = np.round(logprobs((100,), seed=50) * 64) / 64  # multiples of 1/64: ref + 0.125 - ref is exact
    a = ref + noise((100,), 0.01, seed=51)
    record = record_of(compare_logprobs(a, ref + 0.125, ref_a=ref, ref_b=ref))
    assert record.rho is None
    assert record.rms_e_b == 0.125
    exact = record_of(compare_logprobs(a, ref.copy(), ref_a=ref, ref_b=ref))
    assert exact.rho is None and exact.rms_e_b == 0.0


def test_without_references_the_decomposition_is_absent():
    a, b, _, _ = decomposition_case(n=100)
    record = record_of(compare_logprobs(a, b))
    assert (record.rho, record.rms_e_a, record.rms_e_b, record.rms_e_diff, record.rms_floor) == (None,) * 5
    assert not {"rho", "rms_e_a", "rms_floor"} & set(record.to_dict())


def test_decomposition_function_leaves_out_invalid_and_nonfinite_positions():
    a, b, ref_a, ref_b = (torch.from_numpy(x) for x in decomposition_case(n=50))
    valid = torch.ones(50, dtype=torch.bool)
    valid[:5] = False
    ref_a = ref_a.clone()
    ref_a[10] = math.nan
    keep = valid.clone()
    keep[10] = False
    result = decomposition(a, b, ref_a, ref_b, valid)
    expected = numpy_decomposition(*(x[keep].numpy() for x in (a, b, ref_a, ref_b)))
    for name, value in expected.items():
        assert getattr(result, name) == pytest.approx(value, rel=RTOL)


# ---------------------------------------------------------------------------------------------- masking


def test_mask_leaves_positions_out_everywhere():
    b = logprobs((3, 50), seed=60)
    a = b + noise(b.shape, 0.1, seed=61)
    ref_a, ref_b = b + noise(b.shape, 1e-3, 62), b + noise(b.shape, 1e-3, 64)
    mask = np.random.default_rng(63).random(b.shape) < 0.7
    mask[2] = False  # a whole sequence left out: it has no per-sequence mean
    # Garbage where masked out: it must not show anywhere.
    a_garbage, b_garbage, ref_a_garbage = a.copy(), b.copy(), ref_a.copy()
    a_garbage[~mask] = math.nan
    b_garbage[~mask] = 1e6
    ref_a_garbage[~mask] = -math.inf
    report = compare_logprobs(a_garbage, b_garbage, ref_a=ref_a_garbage, ref_b=ref_b, mask=mask)
    record = record_of(report)
    assert record.count == mask.sum() and record.nonfinite == 0
    assert report.reference.token_count == report.runs["a"].token_count == int(mask.sum())
    assert_fields(record, numpy_delta_stats(a, b, mask))
    assert_fields(record, numpy_tensor_metrics(a[mask], b[mask]), rel=1e-9)
    assert_fields(record, numpy_decomposition(a[mask], b[mask], ref_a[mask], ref_b[mask]))


def test_mask_of_ones_and_zeros_equals_bool_mask():
    b = logprobs((2, 40), seed=70)
    a = b + noise(b.shape, 0.05, seed=71)
    mask = np.random.default_rng(72).random(b.shape) < 0.5
    expected = compare_logprobs(a, b, mask=mask).to_dict()
    assert compare_logprobs(a, b, mask=mask.astype(np.int64)).to_dict() == expected
    assert compare_logprobs(a, b, mask=torch.from_numpy(mask).float()).to_dict() == expected
    assert compare_logprobs(a, b, mask=torch.from_numpy(mask)).to_dict() == expected


def test_masked_vector_equals_the_vector_of_kept_positions():
    b = logprobs((300,), seed=80)
    a = b + noise(b.shape, 0.05, seed=81)
    mask = np.arange(300) % 3 != 0
    masked = record_of(compare_logprobs(a, b, mask=mask))
    kept = record_of(compare_logprobs(a[mask], b[mask]))
    assert masked.shape == (300,) and kept.shape == (200,)
    # Equal up to summation order (the masked sums also add the zeros left where positions are out).
    for field in dataclasses.fields(Record):
        want = getattr(kept, field.name)
        if isinstance(want, float):
            assert getattr(masked, field.name) == pytest.approx(want, rel=1e-12), field.name
        elif field.name != "shape":
            assert getattr(masked, field.name) == want, field.name


def test_nonfinite_reference_positions_are_excluded_and_variant_ones_counted():
    b = logprobs((2, 30), seed=90)
    a = b + noise(b.shape, 0.05, seed=91)
    b_bad, a_bad = b.copy(), a.copy()
    b_bad[0, 3] = math.nan
    b_bad[1, 7] = -math.inf  # an engine's -inf log-probability: the reference is unusable there
    a_bad[0, 5] = -math.inf
    a_bad[1, 9] = math.nan
    a_bad[0, 3] = math.nan  # excluded already by b: not counted as nonfinite
    report = compare_logprobs(a_bad, b_bad)
    record = record_of(report)
    assert record.nonfinite == 2
    assert report.reference.token_count == 60 - 2
    compared = np.isfinite(b_bad) & np.isfinite(a_bad)
    assert record.count == compared.sum() == 60 - 4
    assert_fields(record, numpy_delta_stats(a, b, compared))
    assert_fields(record, numpy_tensor_metrics(a[compared], b[compared]), rel=1e-9)


# ---------------------------------------------------------------------------------------------- the report


def test_report_structure():
    b = logprobs((2, 25), seed=100)
    a = b + noise(b.shape, 0.05, seed=101)
    mask = np.ones(b.shape, dtype=bool)
    mask[1, 20:] = False
    report = compare_logprobs(a, b, mask=mask, names=("trainer", "vllm"))
    assert report.variants == ["trainer"]
    assert report.device == "cpu"
    for run, name in ((report.reference, "vllm"), (report.runs["trainer"], "trainer")):
        assert run.variant == {"name": name, "source": "external"}
        assert run.parameter_dtypes == {} and run.buffer_dtypes == {}
        assert run.input_shapes == {"logprobs": [2, 25]}
        assert run.token_count == 45
        assert run.backend == {"settings": {}, "no_effect": []}
    assert report.get("trainer", "logprob", "logprob").count == 45
    assert report.missing == {"trainer": []}
    text = report.format()
    assert "against the vllm reference" in text
    assert re.search(r"^\s+logprob\s+logprob\s", text, flags=re.M)
    report.format(full=False)
    assert PrecisionReport.from_dict(report.to_dict()).to_dict() == report.to_dict()


def test_report_renders_as_a_baseline():
    a, b, ref_a, ref_b = decomposition_case(n=64)
    report = compare_logprobs(a, b, ref_a=ref_a, ref_b=ref_b)
    document = baseline.document(report, "test_x", environment.environment(report.device, {}))
    (row,) = json.loads(baseline.render(document))["variants"]["a"]["records"]
    assert row["name"] == "logprob" and row["kind"] == "logprob"
    assert {"delta_rms", "clip_fraction", "seq_delta_std", "rho", "rms_e_diff", "rms_floor"} <= set(row)
    assert not {"kl_mean", "top1_agreement"} & set(row)


def test_tensors_on_autograd_are_accepted():
    b = torch.from_numpy(logprobs((20,), seed=110))
    a = (b + 0.01).requires_grad_()
    assert record_of(compare_logprobs(a, b)).delta_mean == pytest.approx(0.01, rel=1e-9)


# ---------------------------------------------------------------------------------------------- files


@pytest.fixture
def vectors():
    b = torch.from_numpy(logprobs((3, 20), seed=120)).float()
    a = (b + torch.from_numpy(noise((3, 20), 0.05, 121)).float()).contiguous()
    ref_a = (a.double() + 1e-3).float()
    ref_b = b.clone()
    return {"a": a, "b": b, "ref_a": ref_a, "ref_b": ref_b}


def write(directory: Path, name: str, tensor: torch.Tensor, fmt: str) -> Path:
    if fmt == "pt":
        path = directory / f"{name}.pt"
        torch.save(tensor, path)
    elif fmt == "pt-dict":
        path = directory / f"{name}.pt"
        torch.save({"whatever": tensor}, path)
    elif fmt == "pt-key":
        path = directory / f"{name}.pt"
        torch.save({"logprobs": tensor, "token_ids": torch.arange(tensor.numel())}, path)
    elif fmt == "safetensors":
        path = directory / f"{name}.safetensors"
        save_file({"some_name": tensor}, path)
    elif fmt == "safetensors-key":
        path = directory / f"{name}.safetensors"
        save_file({"logprobs": tensor, "mask": torch.ones(tensor.shape, dtype=torch.bool)}, path)
    else:
        path = directory / f"{name}.npy"
        np.save(path, tensor.numpy())
    return path


@pytest.mark.parametrize("fmt", ["pt", "pt-dict", "pt-key", "safetensors", "safetensors-key", "npy"])
def test_every_file_format_gives_the_same_report(tmp_path, vectors, fmt):
    expected = compare_logprobs(**{k: v.numpy() for k, v in vectors.items()}).to_dict()
    assert compare_logprobs(**vectors).to_dict() == expected
    paths = {name: write(tmp_path, name, tensor, fmt) for name, tensor in vectors.items()}
    assert compare_logprobs(**paths).to_dict() == expected
    assert compare_logprobs(**{k: str(v) for k, v in paths.items()}).to_dict() == expected


def test_mixed_sources_and_a_mask_file(tmp_path, vectors):
    mask = torch.rand(3, 20, generator=torch.Generator().manual_seed(0)) < 0.6
    expected = compare_logprobs(vectors["a"], vectors["b"], mask=mask).to_dict()
    np.save(tmp_path / "mask.npy", mask.numpy())
    got = compare_logprobs(
        write(tmp_path, "a", vectors["a"], "safetensors"),
        vectors["b"].numpy(),
        mask=tmp_path / "mask.npy",
    )
    assert got.to_dict() == expected


# ---------------------------------------------------------------------------------------------- errors


def error_message(**kwargs) -> str:
    with pytest.raises(ConfigurationError) as info:
        compare_logprobs(**kwargs)
    return str(info.value)


def test_shape_mismatch_names_the_argument_and_the_file(tmp_path):
    b = logprobs((2, 10))
    np.save(tmp_path / "engine.npy", b)
    message = error_message(a=logprobs((2, 11)), b=tmp_path / "engine.npy")
    assert message.startswith("a (a NumPy array) has shape (2, 11) but b (file ")
    assert "engine.npy) has (2, 10)" in message and "same tokens" in message
    torch.save(torch.zeros(2, 9), tmp_path / "ref.pt")
    message = error_message(a=b, b=b, ref_a=tmp_path / "ref.pt", ref_b=b)
    assert message.startswith(f"ref_a (file {tmp_path / 'ref.pt'}) has shape (2, 9)")


def test_unknown_suffix(tmp_path):
    path = tmp_path / "logprobs.json"
    path.write_text("[]")
    message = error_message(a=path, b=logprobs((3,)))
    assert message.startswith(f"a: file {path} has the unknown suffix '.json'")
    assert ".pt, .pth, .safetensors, .npy" in message and "numpy.save" in message


def test_missing_file(tmp_path):
    message = error_message(a=logprobs((3,)), b=tmp_path / "nowhere.safetensors")
    assert message.startswith(f"b: file {tmp_path / 'nowhere.safetensors'} does not exist")
    assert "check the path" in message


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_file_of_several_tensors_without_a_logprobs_key(tmp_path, fmt):
    tensors = {"chosen": torch.zeros(4), "other": torch.ones(4)}
    if fmt == "pt":
        path = tmp_path / "two.pt"
        torch.save(tensors, path)
    else:
        path = tmp_path / "two.safetensors"
        save_file(tensors, path)
    message = error_message(a=logprobs((4,)), b=logprobs((4,)), ref_a=path, ref_b=logprobs((4,)))
    assert message.startswith(f"ref_a: file {path} holds 2 entries ('chosen', 'other') and none is named 'logprobs'")
    assert "store the log-probabilities under the key 'logprobs'" in message


def test_unreadable_and_non_tensor_files(tmp_path):
    broken = tmp_path / "broken.pt"
    broken.write_bytes(b"not a pickle")
    message = error_message(a=broken, b=logprobs((3,)))
    assert message.startswith(f"a: cannot read file {broken} as .pt: ")
    listed = tmp_path / "list.pt"
    torch.save([1.0, 2.0], listed)
    message = error_message(a=logprobs((2,)), b=listed)
    assert message.startswith(f"b (file {listed}) holds a list, not a tensor")
    objects = tmp_path / "objects.npy"
    np.save(objects, np.array([None, 1.0], dtype=object), allow_pickle=True)
    assert error_message(a=objects, b=logprobs((2,))).startswith(f"a: cannot read file {objects} as .npy: ")


def test_bad_shapes_and_types():
    message = error_message(a=np.zeros((2, 3, 4)), b=np.zeros((2, 3, 4)))
    assert message.startswith("a (a NumPy array) has shape (2, 3, 4); pass per-token log-probabilities")
    assert error_message(a=torch.tensor(1.0), b=np.zeros(1)).startswith("a (a tensor) has shape ()")
    assert error_message(a=[1.0, 2.0], b=np.zeros(2)).startswith("a (a list) holds a list, not a tensor")
    assert "complex" in error_message(a=torch.zeros(2, dtype=torch.complex64), b=np.zeros(2))


def test_one_reference_without_the_other():
    b = logprobs((5,))
    message = error_message(a=b, b=b, ref_a=b)
    assert message.startswith("ref_a is given without ref_b")
    assert "pass both, or neither" in message
    assert error_message(a=b, b=b, ref_b=b).startswith("ref_b is given without ref_a")


def test_bad_masks():
    b = logprobs((2, 5))
    message = error_message(a=b, b=b, mask=np.ones((2, 4), dtype=bool))
    assert message == "mask (a NumPy array) has shape (2, 4), the log-probabilities (2, 5); pass one entry per token"
    message = error_message(a=b, b=b, mask=np.full((2, 5), 2))
    assert message == "mask (a NumPy array) holds values other than 0 and 1; pass a bool or 0/1 array"
    message = error_message(a=b, b=b, mask=np.zeros((2, 5), dtype=bool))
    assert message.startswith("no token to compare: the mask and the non-finite values of b (a NumPy array)")
    assert "leave out all 10 positions" in message
    assert error_message(a=b, b=np.full((2, 5), math.nan)).startswith("no token to compare")


def test_bad_clip_eps_and_names():
    b = logprobs((5,))
    for eps in (0, 1, -0.1, 1.5, math.nan):
        assert error_message(a=b, b=b, clip_eps=eps).startswith(f"clip_eps={eps!r}: pass a number in (0, 1)")
    for names in (("x", "x"), ("x",), ("", "y"), "ab"):
        assert error_message(a=b, b=b, names=names).startswith(f"names={names!r}: pass two different, non-empty")


def test_all_nonfinite_variant_still_reports():
    b = logprobs((2, 5))
    record = record_of(compare_logprobs(np.full(b.shape, math.nan), b))
    assert record.nonfinite == 10 and record.count == 0
    assert record.rms_rel is None and record.delta_rms is None


def test_format_shows_the_decomposition_and_no_undefined_percentages():
    rng = np.random.default_rng(1)
    ref = -np.abs(rng.normal(2.0, 1.0, 200))
    a = ref + rng.normal(0, 0.01, 200)
    b = ref + rng.normal(0, 0.02, 200)
    text = compare_logprobs(a, b, ref_a=ref, ref_b=ref).format()
    assert next(line.split() for line in text.splitlines() if line.strip().startswith("decomposition")) == [
        "decomposition",
        "rho",
        "rms_e_a",
        "rms_e_b",
        "rms_e_diff",
        "rms_floor",
    ]
    assert "n/a%" not in text


# ---------------------------------------------------------------------------------------------- logprob_mismatch


def kept_logprobs() -> PrecisionReport:
    """A report holding the log-probs of bf16, fp16 and bf16_decode as compare() keeps them for a causal LM."""
    ref = torch.from_numpy(logprobs((2, 10), seed=200))
    report = compare_logprobs(ref + 0.01, ref)
    report.token_logprobs = {
        name: ref + torch.from_numpy(noise(tuple(ref.shape), 0.01, seed))
        for seed, name in enumerate(["bf16", "fp16", "bf16_decode"], start=201)
    }
    report.reference_logprobs = ref
    report.logprob_mask = torch.ones(ref.shape, dtype=torch.bool)
    return report


def test_logprob_mismatch_takes_lists_tuples_and_iterators_of_pairs() -> None:
    report = kept_logprobs()
    expected = ["bf16 vs bf16_decode", "fp16 vs bf16_decode"]
    for pairs in (
        [("bf16", "bf16_decode"), ("fp16", "bf16_decode")],
        (["bf16", "bf16_decode"], ["fp16", "bf16_decode"]),
        iter([("bf16", "bf16_decode"), ("fp16", "bf16_decode")]),
    ):
        assert report.logprob_mismatch(pairs).variants == expected
    # a pair and its reverse are two pairs (delta of opposite sign)
    assert report.logprob_mismatch([("bf16", "fp16"), ("fp16", "bf16")]).variants == ["bf16 vs fp16", "fp16 vs bf16"]


USAGE = "pass a list of (trainer, sampler) pairs of variant names, e.g. [('bf16', 'bf16_decode')]"


@pytest.mark.parametrize(
    ("pairs", "message"),
    [
        ([(["bf16"], "fp16")], f"pairs[0] = (['bf16'], 'fp16'): ['bf16'] is not a variant name (a str); {USAGE}"),
        ([("bf16", 16)], f"pairs[0] = ('bf16', 16): 16 is not a variant name (a str); {USAGE}"),
        (
            [("bf16", "fp16"), ("fp16", None)],
            f"pairs[1] = ('fp16', None): None is not a variant name (a str); {USAGE}",
        ),
        (
            [("bf16", "bf16")],
            "pairs[0] = ('bf16', 'bf16') pairs 'bf16' with itself: its mismatch is zero by construction; pair a "
            "trainer variant with a different sampler variant",
        ),
        ([], f"no pair given; {USAGE}"),
        ("bf16", f"got 'bf16'; {USAGE}"),
        (None, f"got None; {USAGE}"),
        ({"bf16": "fp16"}, f"got {{'bf16': 'fp16'}}; {USAGE}"),
        ({("bf16", "fp16")}, f"got {{('bf16', 'fp16')}}; {USAGE}"),
        (("bf16", "fp16"), "got one pair ('bf16', 'fp16'), not a list of pairs; pass [('bf16', 'fp16')]"),
        (
            [("bf16", "fp16"), ["bf16", "fp16"]],
            "pairs[1] = ['bf16', 'fp16'] repeats pairs[0] = ('bf16', 'fp16') (each pair is one variant 'bf16 vs "
            "fp16' of the result); give each pair once",
        ),
        (
            [("bf16", "fp16", "x")],
            f"pairs[0] = ('bf16', 'fp16', 'x') is not a (trainer, sampler) pair of two variant names; {USAGE}",
        ),
        (["bf16"], f"pairs[0] = 'bf16' is not a (trainer, sampler) pair of two variant names; {USAGE}"),
        (
            [("bf16", "bf16_sampler")],
            "pairs[0] = ('bf16', 'bf16_sampler'): no log-probabilities of variant 'bf16_sampler' in this report; "
            "variants with them: bf16, fp16, bf16_decode (compare() keeps them in memory for causal LMs, not in files)",
        ),
    ],
)
def test_every_bad_pair_is_a_configuration_error_naming_it(pairs: object, message: str) -> None:
    with pytest.raises(ConfigurationError) as raised:
        kept_logprobs().logprob_mismatch(pairs)  # type: ignore[arg-type]
    assert str(raised.value).startswith(f"logprob_mismatch: {message}"), str(raised.value)


def test_names_that_collide_as_one_result_variant_are_refused() -> None:
    """("a vs", "b") and ("a", "vs b") would both be the variant "a vs b": the second would replace the first."""
    report = kept_logprobs()
    report.token_logprobs = {
        "a vs": report.token_logprobs["bf16"],
        "b": report.token_logprobs["fp16"],
        "a": report.token_logprobs["bf16"],
        "vs b": report.token_logprobs["fp16"],
    }
    with pytest.raises(ConfigurationError, match=r"^logprob_mismatch: pairs\[1\] = \('a', 'vs b'\) repeats pairs\[0\]"):
        report.logprob_mismatch([("a vs", "b"), ("a", "vs b")])
