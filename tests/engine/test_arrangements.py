"""Arrangement variants: the reference's tokens computed as a sampler computes them (one token at a time with a
KV cache, each sequence alone, left-padded among other requests), reassembled into the reference's layout and
measured against its full forward. Held against computations written here, independent of the package."""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from conftest import load_trained_lm, tiny_gpt2, tiny_llama, trained_lm_text_batch
from pytest_precision import Arrangement, Call, compare
from pytest_precision.base.errors import ConfigurationError
from pytest_precision.engine.arrangements import BUILTIN_ARRANGEMENTS, CallPlan, decode, left_padded
from pytest_precision.engine.variants import BUILTIN_VARIANTS, Variant
from pytest_precision.reports.report import PrecisionReport

VOCAB = 256
HIDDEN = 64
#: [start, end) of each row's tokens in the padded batch: row 0 full, row 1 right-padded, row 2 left-padded.
SPANS = ((0, 16), (0, 11), (9, 16))
RIGHT_PADDED = ((0, 16), (0, 11), (0, 7))
ARRANGED = ("fp32_decode", "fp32_batch_alone", "fp32_left_padded")


def padded_batch(
    spans: tuple[tuple[int, int], ...] = SPANS, seed: int = 0, garbage_seed: int = 1
) -> dict[str, torch.Tensor]:
    """3 x 16 random tokens in `spans`, random (garbage) ids where the attention mask is 0."""
    ids = torch.randint(0, VOCAB, (len(spans), 16), generator=torch.Generator().manual_seed(seed))
    mask = torch.zeros_like(ids)
    for row, (start, end) in enumerate(spans):
        mask[row, start:end] = 1
    garbage = torch.randint(0, VOCAB, ids.shape, generator=torch.Generator().manual_seed(garbage_seed))
    return {"input_ids": torch.where(mask.bool(), ids, garbage), "attention_mask": mask}


def counted(inputs: dict[str, torch.Tensor]) -> np.ndarray:
    """(batch, seq - 1) positions whose next token counts: both it and its predecessor are unmasked."""
    mask = inputs["attention_mask"].numpy().astype(bool)
    return mask[:, 1:] & mask[:, :-1]


def chosen(logits: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """log_softmax(logits[:, t])[ids[:, t + 1]] computed in `dtype`, as float64 numpy (batch, seq - 1)."""
    logprobs = torch.log_softmax(logits[:, :-1].to(dtype), dim=-1)
    return logprobs.gather(-1, ids[:, 1:, None])[..., 0].to(torch.float64).numpy()


def decode_loop_logits(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The logits of a token-by-token loop with the model's KV cache: (batch, seq, vocab) in the model's dtype."""
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    steps = []
    model.eval()
    with torch.no_grad():
        output = model(input_ids=ids[:, :1], attention_mask=mask[:, :1], use_cache=True)
        steps.append(output.logits)
        for position in range(1, ids.shape[1]):
            # newer transformers return the KV cache as `output.cache` and take it back as `cache=`, older ones
            # as `past_key_values` (as pytest_precision.engine.arrangements.decode does)
            key = "cache" if getattr(output, "cache", None) is not None else "past_key_values"
            cache = getattr(output, key, None)
            assert cache is not None
            output = model(
                input_ids=ids[:, position : position + 1],
                attention_mask=mask[:, : position + 1],
                use_cache=True,
                **{key: cache},
            )
            steps.append(output.logits)
    logits = torch.cat(steps, dim=1)
    assert logits.shape == (*ids.shape, VOCAB)
    return logits


def full_logits(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Decoding runs many tiny forwards: with intra-op threads, pytest -n 2 on 2 cores oversubscribes them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_model() -> nn.Module:
    return tiny_llama()


@pytest.fixture(scope="module")
def tiny_report(tiny_model: nn.Module) -> PrecisionReport:
    return compare(tiny_model, padded_batch(), [*ARRANGED, "bf16", "bf16_decode"], backward=False)


@pytest.fixture(scope="module")
def trained_report() -> PrecisionReport:
    """The trained LM on held-out text (2 x 64, labels given: the reference and bf16 run backward)."""
    inputs = trained_lm_text_batch(batch=2, length=64)
    return compare(load_trained_lm, inputs, [*ARRANGED, "bf16", "bf16_decode"])


# 1. decode: the token-by-token loop, reassembled --------------------------------------------------------------


@pytest.mark.parametrize("spans", [RIGHT_PADDED, SPANS], ids=["right_padded", "right_and_left_padded"])
def test_decode_logprobs_equal_an_independent_token_by_token_loop(
    tiny_model: nn.Module, spans: tuple[tuple[int, int], ...]
) -> None:
    inputs = padded_batch(spans)
    ids = inputs["input_ids"]
    report = compare(tiny_model, inputs, ["fp32_decode"], backward=False)
    where = counted(inputs)
    assert where.sum() == sum(end - start - 1 for start, end in spans)
    np.testing.assert_array_equal(report.logprob_mask.numpy(), where)

    loop = decode_loop_logits(tiny_model, inputs)
    full = full_logits(tiny_model, inputs)
    # An fp32 reference computes chosen-token log-probs in float32 (then kept as float64).
    loop32, full32 = chosen(loop, ids, torch.float32), chosen(full, ids, torch.float32)
    loop64 = chosen(loop, ids, torch.float64)

    decoded = report.token_logprobs["fp32_decode"]
    assert decoded.dtype == torch.float64 and tuple(decoded.shape) == (3, 15)
    decoded = decoded.numpy()
    np.testing.assert_array_equal(decoded[where], loop32[where])
    np.testing.assert_allclose(decoded[where], loop64[where], rtol=0, atol=1e-6)
    np.testing.assert_array_equal(report.reference_logprobs.numpy()[where], full32[where])

    record = report.get("fp32_decode", "logprob", "logprob")
    delta = loop32[where] - full32[where]
    assert np.any(delta != 0)  # decoding is not bitwise the full forward: the check below measures something
    assert record.count == where.sum()
    assert record.delta_rms == pytest.approx(float(np.sqrt(np.mean(delta**2))), rel=1e-9, abs=0)
    assert record.delta_max_abs == pytest.approx(float(np.max(np.abs(delta))), rel=1e-9, abs=0)
    assert record.delta_mean == pytest.approx(float(np.mean(delta)), rel=1e-6, abs=1e-15)
    # The decode loop's logits at the counted positions are the fw row of lm_head.
    lm_head = report.get("fp32_decode", "lm_head")
    mask = inputs["attention_mask"].bool()
    difference = (loop[mask] - full[mask]).to(torch.float64).numpy()
    reference = full[mask].to(torch.float64).numpy()
    assert lm_head.count == mask.sum() * VOCAB
    assert lm_head.rms_abs == pytest.approx(float(np.sqrt(np.mean(difference**2))), rel=1e-6)
    assert lm_head.ref_rms == pytest.approx(float(np.sqrt(np.mean(reference**2))), rel=1e-6)


def test_decode_against_an_fp64_reference_keeps_float64_logprobs_of_the_loop(tiny_model: nn.Module) -> None:
    # Right padding only: transformers' eager Llama in float64 turns a left-padded row into NaN (its fully masked
    # first queries), which an fp64 reference rightly refuses.
    inputs = padded_batch(RIGHT_PADDED)
    report = compare(tiny_model, inputs, ["fp32_decode"], reference="fp64", backward=False)
    where = counted(inputs)
    loop64 = chosen(decode_loop_logits(tiny_model, inputs), inputs["input_ids"], torch.float64)
    np.testing.assert_array_equal(report.token_logprobs["fp32_decode"].numpy()[where], loop64[where])


# 2. size of the arrangement error ------------------------------------------------------------------------------


def test_fp32_arrangement_errors_are_measurable_but_tiny(
    tiny_report: PrecisionReport, trained_report: PrecisionReport
) -> None:
    # Found (CPU, torch 2.13, 1 thread): tiny_llama 3 x 16 (one row right-, one left-padded): fp32_decode
    # delta_rms 1.9e-7, fp32_batch_alone 8.6e-8, fp32_left_padded 0 (its lm_head fw row 8.9e-8); trained LM
    # 2 x 64: fp32_decode 9.6e-7, fp32_batch_alone 0 (bitwise), fp32_left_padded 1.1e-7.
    for report in (tiny_report, trained_report):
        decode_rms = report.get("fp32_decode", "logprob", "logprob").delta_rms
        assert decode_rms is not None and 0 < decode_rms < 1e-5
        for variant in ARRANGED:
            record = report.get(variant, "logprob", "logprob")
            assert record.delta_rms is not None and record.delta_rms < 1e-5, variant
            assert record.top1_agreement == 1.0 and record.clip_fraction == 0.0, variant
            assert record.kl_mean is not None and record.kl_mean < 1e-10, variant
            assert report.missing[variant] == []
            for fw in report.records(variant, "fw"):
                assert fw.rms_rel is not None and fw.rms_rel < 1e-5, (variant, fw.name)


def test_bf16_trainer_sampler_mismatch_dwarfs_the_fp32_arrangement_error(trained_report: PrecisionReport) -> None:
    # Found on the trained LM: bf16 vs bf16_decode rms_e_diff 1.3e-2 (bf16 delta_rms 1.5e-2, bf16_decode 1.7e-2,
    # rho 0.64) against fp32_decode's 9.6e-7. On the random tiny_llama (CPU) bf16_decode is bitwise bf16's full
    # forward: identical fw rows and logprob row (delta_rms 1.2e-3 both, mismatch 0).
    fp32_error = trained_report.get("fp32_decode", "logprob", "logprob").delta_rms
    mismatch = trained_report.logprob_mismatch([("bf16", "bf16_decode")])
    record = mismatch.get("bf16 vs bf16_decode", "logprob", "logprob")
    assert fp32_error is not None and record.rms_e_diff is not None
    bf16_error = trained_report.get("bf16", "logprob", "logprob").delta_rms
    assert bf16_error is not None
    if record.rms_e_diff < 1e-3 * bf16_error:
        # Found on torch 2.6 (CPU): the trained LM's token-by-token bf16 decode reproduces its full bf16 forward
        # up to fp32 rounding (torch 2.13's differ by about the bf16 error itself). Then every forward row of
        # the two runs agrees to that rounding.
        for full, decoded in zip(
            trained_report.records("bf16", "fw"), trained_report.records("bf16_decode", "fw"), strict=True
        ):
            assert decoded.rms_rel == pytest.approx(full.rms_rel, rel=1e-3, abs=1e-6), full.name
        return
    assert record.rms_e_diff > 1000 * fp32_error
    assert record.rms_e_diff > 1e-3


# 3. padding never counts -----------------------------------------------------------------------------------------


def test_padded_positions_never_count(tiny_model: nn.Module) -> None:
    first = padded_batch(garbage_seed=1)
    second = padded_batch(garbage_seed=2)
    assert torch.equal(first["attention_mask"], second["attention_mask"])
    padded = first["attention_mask"] == 0
    assert padded.sum() == 3 * 16 - sum(end - start for start, end in SPANS)
    assert torch.equal(first["input_ids"][~padded], second["input_ids"][~padded])
    assert (first["input_ids"][padded] != second["input_ids"][padded]).all()

    variants = ["fp32_decode", "fp32_batch_alone", "fp32_left_padded"]
    a = compare(tiny_model, first, variants, backward=False)
    b = compare(tiny_model, second, variants, backward=False)
    tokens = int(first["attention_mask"].sum())
    where = counted(first)
    for variant in variants:
        assert a.records(variant) == b.records(variant), variant
        fw = a.records(variant, "fw")
        assert [r.name for r in fw] == [
            "model.embed_tokens",
            *(f"model.layers.{i}" for i in range(4)),
            "model.norm",
            "lm_head",
        ]
        for record in fw:
            width = VOCAB if record.name == "lm_head" else HIDDEN
            assert record.count == tokens * width, (variant, record.name)
        assert a.get(variant, "logprob", "logprob").count == where.sum()
        np.testing.assert_array_equal(
            a.token_logprobs[variant].numpy()[where], b.token_logprobs[variant].numpy()[where]
        )


# 4. left_padded really runs a larger, left-padded batch ----------------------------------------------------------


def recording(builtin: Arrangement, calls: list[Call], outputs: list[Any]) -> Arrangement:
    """`builtin`, noting every Call it yields and every output it is sent back."""

    def plan(inputs: Any) -> CallPlan:
        inner = builtin.calls(inputs)
        output = None
        while True:
            try:
                call = inner.send(output)
            except StopIteration:
                return
            calls.append(call)
            output = yield call
            outputs.append(output)

    return Arrangement(f"recorded_{builtin.name}", plan)


def test_left_padded_runs_a_twice_larger_left_padded_batch(tiny_model: nn.Module) -> None:
    inputs = padded_batch()
    calls: list[Call] = []
    outputs: list[Any] = []
    arrangement = recording(BUILTIN_ARRANGEMENTS["left_padded"], calls, outputs)
    report = compare(
        tiny_model, inputs, [Variant("recorded", arrangement=arrangement), "fp32_left_padded"], backward=False
    )
    assert len(calls) == 1 and len(outputs) == 1
    [call] = calls
    assert isinstance(call.inputs, dict)
    given: dict[str, torch.Tensor] = call.inputs
    ids, mask, positions = given["input_ids"], given["attention_mask"], given["position_ids"]
    batch, width = 3, 16 + 3
    assert ids.shape == mask.shape == (2 * batch, width)
    assert call.rows is not None and list(call.rows) == [-1, 0, -1, 1, -1, 2]
    assert not isinstance(call.offsets, int)
    expected_positions = (mask.cumsum(-1) - 1).clamp(min=0)
    for row, (start, end) in enumerate(SPANS):
        real, length = 2 * row + 1, end - start
        assert mask[real, : width - length].eq(0).all() and mask[real, width - length :].eq(1).all()
        assert torch.equal(ids[real, width - length :], inputs["input_ids"][row, start:end])
        assert torch.equal(positions[2 * row], expected_positions[2 * row])
        if start == 0:  # positions 0..length-1, as in the reference (for a row left-padded in the batch itself,
            # see test_left_padded_keeps_the_reference_positions)
            assert torch.equal(positions[real], expected_positions[real])
            assert torch.equal(expected_positions[real, width - length :], torch.arange(length))
        # its call position width - length is the batch's position start
        assert call.offsets[real] == start - (width - length)
        filler = mask[2 * row]
        assert filler.sum() > 0 and (filler.diff() >= 0).all()  # fillers are left-padded too
    assert (mask == 0).any(dim=1)[1::2].all()  # every real row has padding on its left
    # The model ran on that batch, and its outputs went where the call says.
    logits = outputs[0].logits
    assert logits.shape == (2 * batch, width, VOCAB)
    with torch.no_grad():
        own = tiny_model(**given).logits
    assert torch.equal(own, logits)
    got = report.token_logprobs["recorded"].numpy()
    for row, (start, end) in enumerate(SPANS):
        real = own[2 * row + 1, width - (end - start) :]
        targets = inputs["input_ids"][row, start + 1 : end, None]
        expected = torch.log_softmax(real[:-1], dim=-1).gather(-1, targets)[:, 0]
        np.testing.assert_array_equal(got[row, start : end - 1], expected.to(torch.float64).numpy())
    assert report.records("recorded") == report.records("fp32_left_padded")


def test_left_padded_keeps_the_reference_positions() -> None:
    """A row left-padded in the batch itself is at positions start..end-1 in the reference's full forward
    (transformers numbers positions by index without position_ids); left_padded must compute its tokens at the
    same positions. GPT-2's learned absolute positions make a renumbering visible (RoPE models only see it as
    rounding)."""
    inputs = padded_batch(SPANS)
    report = compare(tiny_gpt2(), inputs, ["fp32_batch_alone", "fp32_left_padded"], backward=False)
    assert report.get("fp32_batch_alone", "logprob", "logprob").delta_rms < 1e-5
    delta = (report.token_logprobs["fp32_left_padded"] - report.reference_logprobs).abs() * report.logprob_mask
    per_row = delta.amax(dim=1).tolist()
    assert per_row[0] < 1e-5 and per_row[1] < 1e-5
    # Found: row 2 (left-padded in the batch) differs by up to 0.09 in log-prob, delta_rms 3.0e-2: the
    # arrangement gives it position_ids 0..6 where the reference ran it at 9..15.
    assert per_row[2] < 1e-5, (
        f"fp32_left_padded: the left-padded row's log-probs differ by {per_row[2]:.3g} from the reference's: "
        "its position_ids were renumbered from 0 (arrangements.left_padded), the reference's are its indices"
    )
    assert report.get("fp32_left_padded", "logprob", "logprob").delta_rms < 1e-5


@pytest.mark.parametrize("variant", [v for v in BUILTIN_VARIANTS if BUILTIN_VARIANTS[v].arrangement is not None])
def test_every_builtin_arrangement_variant_runs_forward_only(tiny_model: nn.Module, variant: str) -> None:
    report = compare(tiny_model, padded_batch(), [variant], backward=False)
    kinds = {r.kind for r in report.records(variant)}
    assert kinds == {"fw", "logprob"}
    assert report.missing[variant] == []
    record = report.get(variant, "logprob", "logprob")
    assert record.count == counted(padded_batch()).sum()
    assert record.delta_rms is not None and record.kl_mean is not None and record.top1_agreement is not None
    dtype = BUILTIN_VARIANTS[variant].dtype
    assert record.delta_rms < (1e-5 if dtype == "float32" else 1e-2)
    if dtype != "float32":
        assert record.delta_rms > 1e-5  # a real low-precision error, not the reference again
    assert report.runs[variant].variant["arrangement"] == BUILTIN_VARIANTS[variant].arrangement_name


def test_decode_with_the_whole_sequence_as_prefill_is_the_full_forward(tiny_model: nn.Module) -> None:
    one_call = Variant("fp32_prefill_all", arrangement=decode(prefill=16))
    four = Variant("fp32_prefill4", arrangement=decode(prefill=4))
    report = compare(tiny_model, padded_batch(), [one_call, four, "fp32_decode"], backward=False)
    for record in report.records("fp32_prefill_all"):
        assert record.rms_abs == 0 and record.max_abs == 0, record.name
    assert report.get("fp32_prefill_all", "logprob", "logprob").delta_rms == 0
    assert report.runs["fp32_prefill4"].variant["arrangement"] == "decode_prefill4"
    assert report.get("fp32_prefill4", "logprob", "logprob").delta_rms < 1e-5
    assert report.missing["fp32_prefill4"] == []


def test_left_padded_and_decode_builders() -> None:
    assert left_padded().name == "left_padded" and left_padded(5).name == "left_padded5"
    assert decode().name == "decode" and decode(4).name == "decode_prefill4"
    for bad in (-1, True, 1.5):
        with pytest.raises(ConfigurationError, match="extra_padding"):
            left_padded(bad)  # type: ignore[arg-type]
    for bad in (0, False, "1"):
        with pytest.raises(ConfigurationError, match="prefill"):
            decode(bad)  # type: ignore[arg-type]


# 5. custom arrangements on a plain nn.Module ---------------------------------------------------------------------


class PositionwiseBlocks(nn.Module):
    """Blocks of Linear layers applied to each position of x (batch, seq, hidden) alone."""

    def __init__(self, hidden: int = 16, depth: int = 3) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.blocks = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def positionwise_inputs() -> torch.Tensor:
    return torch.randn(3, 10, 16, generator=torch.Generator().manual_seed(0))


def chunked(k: int, *, forget_second: bool = False) -> Callable[[Any], CallPlan]:
    def calls(x: torch.Tensor) -> CallPlan:
        yield Call(x[:, :k], offsets=0)
        if not forget_second:
            yield Call(x[:, k:], offsets=k)

    return calls


def shuffled(x: torch.Tensor) -> CallPlan:
    """Rows reversed with a filler row, then the rest one row at a time shifted by per-row offsets."""
    batch = x.shape[0]
    filler = torch.full_like(x[:1, :4], 7.0)
    yield Call(torch.cat([x.flip(0)[:, :4], filler]), rows=[*range(batch - 1, -1, -1), -1], offsets=0)
    for row in range(batch):
        # positions 2.. of the row, as one call starting at its position 2 (overlap rewritten with equal values)
        yield Call((x[row : row + 1, 2:],), rows=[row], offsets=[2])


def test_custom_arrangement_on_a_positionwise_model_is_exact() -> None:
    """Every position lands where the reference has it: fp32 rows agree to rounding. Not bitwise: a matmul's
    blocking, and so its rounding, may depend on how many rows the call holds (MKL in its reproducible modes,
    conftest.CPU_PINS); a row or position put in the wrong place is an O(1) error."""
    model = PositionwiseBlocks()
    x = positionwise_inputs()
    variants = [
        Variant("fp32_chunked", arrangement=Arrangement("chunked", chunked(4))),
        Variant("fp32_shuffled", arrangement=Arrangement("shuffled", shuffled)),
    ]
    report = compare(model, x, variants, backward=False)
    for variant in ("fp32_chunked", "fp32_shuffled"):
        fw = report.records(variant, "fw")
        assert [r.name for r in fw] == ["blocks.0", "blocks.1", "blocks.2"]
        for record in fw:
            assert record.count == 3 * 10 * 16
            assert record.rms_rel is not None and record.rms_rel < 1e-6, (variant, record.name, record.rms_rel)
            assert record.max_rel is not None and record.max_rel < 1e-5, (variant, record.name, record.max_rel)
            assert record.ref_rms is not None and record.ref_rms > 0
        assert not report.records(variant, "logprob") and report.missing[variant] == []
    assert report.runs["fp32_chunked"].variant["arrangement"] == "chunked"


def test_custom_arrangement_that_misses_positions_or_yields_no_call_is_refused() -> None:
    model = PositionwiseBlocks()
    x = positionwise_inputs()
    forgetful = Variant("fp32_forgetful", arrangement=Arrangement("first_chunk_only", chunked(4, forget_second=True)))
    with pytest.raises(ConfigurationError, match=r"first_chunk_only.*no output for .*row 0, position 4"):
        compare(model, x, [forgetful], backward=False)

    def not_a_call(x: torch.Tensor) -> Generator[Any, Any, None]:
        yield x

    wrong = Variant("fp32_wrong", arrangement=Arrangement("tensor_yielder", not_a_call))  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"tensor_yielder.*yielded Tensor.*Call"):
        compare(model, x, [wrong], backward=False)

    def outside(x: torch.Tensor) -> CallPlan:
        yield Call(x, rows=[0, 1, 5])

    beyond = Variant("fp32_beyond", arrangement=Arrangement("outside_rows", outside))
    with pytest.raises(ConfigurationError, match=r"outside_rows.*outside the batch"):
        compare(model, x, [beyond], backward=False)


# 6. errors -------------------------------------------------------------------------------------------------------


def test_builtin_arrangement_needs_a_causal_lm() -> None:
    with pytest.raises(ConfigurationError, match=r"causal LM.*Arrangement"):
        compare(PositionwiseBlocks(), positionwise_inputs(), ["fp32_decode"], backward=False)


def test_arrangement_configuration_errors(tiny_model: nn.Module) -> None:
    with pytest.raises(ConfigurationError, match=r"'nope'.*decode, batch_alone, left_padded"):
        Variant("x", arrangement="nope")
    with pytest.raises(ConfigurationError, match="isolated"):
        Variant("x", arrangement="decode", isolate=True)
    with pytest.raises(ConfigurationError, match="sharded"):
        Variant("x", arrangement="decode", param_dtype="bfloat16")
    with pytest.raises(ConfigurationError, match="arrangement must be"):
        Variant("x", arrangement=3)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="name"):
        Arrangement("", chunked(2))
    with pytest.raises(ConfigurationError, match="generator function"):
        Arrangement("x", "not callable")  # type: ignore[arg-type]
    inputs = padded_batch()
    with pytest.raises(ConfigurationError, match="reference"):
        compare(tiny_model, inputs, ["bf16"], reference=Variant("r", arrangement="decode"), backward=False)
    gaps = {**inputs, "attention_mask": inputs["attention_mask"].clone()}
    gaps["attention_mask"][0, 5] = 0
    with pytest.raises(ConfigurationError, match=r"left_padded.*row 0.*gaps"):
        compare(tiny_model, gaps, ["fp32_left_padded"], backward=False)


def test_compare_isolate_leaves_arrangement_variants_unisolated(tiny_model: nn.Module) -> None:
    report = compare(tiny_model, padded_batch(), ["bf16", "fp32_decode"], isolate=True, backward=False)
    assert report.records("bf16", "fw_isolated")
    assert {r.kind for r in report.records("fp32_decode")} == {"fw", "logprob"}
    assert "isolate" not in report.runs["fp32_decode"].variant
    assert report.runs["fp32_decode"].variant["arrangement"] == "decode"
    assert report.missing["fp32_decode"] == []


# 7. a reference with backward, arrangement variants beside ordinary ones -----------------------------------------


def test_backward_reference_with_arrangement_variants(trained_report: PrecisionReport) -> None:
    assert trained_report.records("bf16", "bw") and trained_report.records("bf16", "grad")
    assert trained_report.records("bf16", "loss")
    assert trained_report.missing["bf16"] == []
    for variant in ("bf16_decode", *ARRANGED):
        assert not trained_report.records(variant, "bw"), variant
        assert not trained_report.records(variant, "grad"), variant
        assert not trained_report.records(variant, "loss"), variant
        assert trained_report.missing[variant] == [], variant
        fw = [r.name for r in trained_report.records(variant, "fw")]
        assert fw == [r.name for r in trained_report.records("bf16", "fw")], variant
        assert trained_report.get(variant, "logprob", "logprob").count == 2 * 63
    # bf16_decode's fw rows measure a real bf16 error, of bf16's size
    bf16_head = trained_report.get("bf16", "lm_head").rms_rel
    decode_head = trained_report.get("bf16_decode", "lm_head").rms_rel
    assert bf16_head is not None and decode_head is not None
    assert 0.3 * bf16_head < decode_head < 3 * bf16_head


# 8. logprob_mismatch ---------------------------------------------------------------------------------------------


def test_logprob_mismatch_matches_numpy(trained_report: PrecisionReport) -> None:
    mismatch = trained_report.logprob_mismatch([("bf16", "bf16_decode"), ("fp32_decode", "bf16_decode")])
    assert mismatch.variants == ["bf16 vs bf16_decode", "fp32_decode vs bf16_decode"]
    where = trained_report.logprob_mask.numpy().astype(bool)
    ref = trained_report.reference_logprobs.to(torch.float64).numpy()[where]
    trainer = trained_report.token_logprobs["bf16"].numpy()[where]
    sampler = trained_report.token_logprobs["bf16_decode"].numpy()[where]
    assert where.sum() == 2 * 63

    record = mismatch.get("bf16 vs bf16_decode", "logprob", "logprob")
    delta = trainer - sampler
    assert record.count == where.sum()
    assert record.delta_rms == pytest.approx(float(np.sqrt(np.mean(delta**2))), rel=1e-9)
    assert record.delta_mean == pytest.approx(float(np.mean(delta)), rel=1e-6)
    assert record.delta_max_abs == pytest.approx(float(np.max(np.abs(delta))), rel=1e-9)
    assert record.rms_e_diff == pytest.approx(float(np.sqrt(np.mean(delta**2))), rel=1e-9)
    assert record.rho == pytest.approx(float(np.corrcoef(trainer - ref, sampler - ref)[0, 1]), rel=1e-9)
    assert record.rms_e_a == pytest.approx(float(np.sqrt(np.mean((trainer - ref) ** 2))), rel=1e-9)
    assert record.rms_e_b == pytest.approx(float(np.sqrt(np.mean((sampler - ref) ** 2))), rel=1e-9)
    # each side's own error is that variant's delta_rms in the comparison report
    assert record.rms_e_a == pytest.approx(trained_report.get("bf16", "logprob", "logprob").delta_rms, rel=1e-9)
    assert record.rms_e_b == pytest.approx(trained_report.get("bf16_decode", "logprob", "logprob").delta_rms, rel=1e-9)
    assert record.rms_floor == 0

    with pytest.raises(ConfigurationError, match="'bf16_sampler'"):
        trained_report.logprob_mismatch([("bf16", "bf16_sampler")])
    with pytest.raises(ConfigurationError, match="pairs"):
        trained_report.logprob_mismatch([])


# 9. the user's model is left as found ----------------------------------------------------------------------------


def hooks_of(model: nn.Module) -> list[int]:
    return [
        len(getattr(module, attribute))
        for module in model.modules()
        for attribute in (
            "_forward_hooks",
            "_forward_pre_hooks",
            "_backward_hooks",
            "_backward_pre_hooks",
            "_state_dict_hooks",
            "_load_state_dict_pre_hooks",
        )
    ]


def test_arrangement_runs_leave_the_model_as_found() -> None:
    model = tiny_llama()
    model.train()
    model.model.layers[1].eval()
    model.model.embed_tokens.weight.requires_grad_(False)
    state = {name: value.clone() for name, value in model.state_dict().items()}
    training = [module.training for module in model.modules()]
    requires_grad = [p.requires_grad for p in model.parameters()]
    hooks = hooks_of(model)
    config = model.config.to_dict()
    inputs = padded_batch()
    inputs["labels"] = torch.where(inputs["attention_mask"].bool(), inputs["input_ids"], -100)
    given = {name: value.clone() for name, value in inputs.items()}

    report = compare(model, inputs, ["bf16", *ARRANGED, "bf16_decode"])
    assert report.records("bf16", "grad") and not report.records("bf16_decode", "grad")

    after = model.state_dict()
    assert after.keys() == state.keys()
    for name, value in state.items():
        assert torch.equal(after[name], value), name
    assert [module.training for module in model.modules()] == training
    assert [p.requires_grad for p in model.parameters()] == requires_grad
    assert all(p.grad is None for p in model.parameters())
    assert hooks_of(model) == hooks
    assert model.config.to_dict() == config
    for name, value in given.items():
        assert torch.equal(inputs[name], value), name
