"""Causal-LM features: chosen-token log-probabilities and their log-ratio statistics, whole-distribution
agreement, the gradient at the logits, fp16 loss scaling, the fp32 head, attention variants, backend flags,
gradient categories, inputs, and forward-only runs."""

from __future__ import annotations

import copy
import math
import statistics

import numpy as np
import pytest
import torch

from conftest import cpu_matmul_precision, tiny_gpt2, tiny_llama, tiny_qwen2
from pytest_precision import Reference, compare, reference
from pytest_precision.base.errors import ConfigurationError
from pytest_precision.engine.backend_flags import snapshot_backend_state
from pytest_precision.engine.losses import fp16_loss_scale
from pytest_precision.engine.model_build import build_run_model
from pytest_precision.engine.variants import BUILTIN_VARIANTS, Variant
from pytest_precision.inputs import from_text, random_tokens

VOCAB = 256


def batch(length: int = 48, seed: int = 0) -> dict[str, torch.Tensor]:
    ids = random_tokens(VOCAB, 2, length, seed)
    return {"input_ids": ids, "labels": ids.clone()}


def bf16_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A bf16 model built independently of the library: parameters cast, buffers kept."""
    copied = copy.deepcopy(model)
    for parameter in copied.parameters():
        parameter.data = parameter.data.to(torch.bfloat16)
    return copied


def numpy_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> np.ndarray:
    """log_softmax(logits[t] / T)[ids[t+1]] in float64 numpy from float32 logits, as the spec defines it."""
    x = logits[:, :-1].detach().to(torch.float32).numpy().astype(np.float64) / temperature
    x = x - x.max(axis=-1, keepdims=True)
    log_z = np.log(np.exp(x).sum(axis=-1))
    chosen = np.take_along_axis(x, targets[:, 1:].numpy()[..., None], axis=-1)[..., 0]
    return chosen - log_z


def test_logprob_row_matches_an_independent_computation():
    model = tiny_llama()
    inputs = batch()
    report = compare(model, inputs, ["bf16"], backward=False)
    record = report.get("bf16", "logprob", "logprob")

    with torch.no_grad():
        reference_logits = model(input_ids=inputs["input_ids"]).logits
        variant_logits = bf16_copy(model)(input_ids=inputs["input_ids"]).logits
    reference = numpy_logprobs(reference_logits, inputs["input_ids"])
    variant = numpy_logprobs(variant_logits, inputs["input_ids"])
    delta = variant - reference

    assert record.shape == (2, 47)
    assert record.count == delta.size
    # The library computes logpi in float32 (the spec); numpy here in float64 from the same logits.
    assert record.delta_mean == pytest.approx(delta.mean(), rel=1e-3, abs=1e-7)
    assert record.delta_rms == pytest.approx(np.sqrt((delta**2).mean()), rel=1e-3)
    assert record.delta_max_abs == pytest.approx(np.abs(delta).max(), rel=1e-3)
    per_sequence = delta.mean(axis=1)
    assert record.seq_delta_mean == pytest.approx(per_sequence.mean(), rel=1e-3, abs=1e-7)
    assert record.seq_delta_std == pytest.approx(per_sequence.std(), rel=1e-2, abs=1e-7)
    assert record.seq_delta_rms == pytest.approx(np.sqrt((per_sequence**2).mean()), rel=1e-3)
    assert record.seq_delta_max == pytest.approx(np.abs(per_sequence).max(), rel=1e-3)
    assert record.rms_abs == pytest.approx(np.sqrt((delta**2).mean()), rel=1e-3)
    assert record.ref_rms == pytest.approx(np.sqrt((reference**2).mean()), rel=1e-6)

    # Whole distribution: KL(p_ref || p_var) per position and the argmax agreement.
    p = torch.log_softmax(reference_logits[:, :-1].double(), -1)
    q = torch.log_softmax(variant_logits[:, :-1].double(), -1)
    kl = (p.exp() * (p - q)).sum(-1)
    assert record.kl_mean == pytest.approx(kl.mean().item(), rel=1e-6)
    assert record.kl_max == pytest.approx(kl.max().item(), rel=1e-6)
    assert record.top1_agreement == pytest.approx((p.argmax(-1) == q.argmax(-1)).double().mean().item())

    # llama.cpp's statistics, from the same per-token values in NumPy float64.
    kl_tokens = kl.reshape(-1).numpy()
    agree = (p.argmax(-1) == q.argmax(-1)).double().reshape(-1).numpy()
    n = kl_tokens.size
    assert record.kl_median == pytest.approx(np.median(kl_tokens), rel=1e-6)
    assert record.kl_p99 == pytest.approx(np.percentile(kl_tokens, 99), rel=1e-6)
    assert record.kl_mean_se == pytest.approx(kl_tokens.std() / np.sqrt(n - 1), rel=1e-6)
    dp = np.exp(variant) - np.exp(reference)  # float64 here, float32 log-probs in the library
    assert record.dp_mean == pytest.approx(dp.mean(), rel=1e-3, abs=1e-8)
    assert record.dp_rms == pytest.approx(np.sqrt((dp**2).mean()), rel=1e-3)
    assert record.dp_min == pytest.approx(dp.min(), rel=1e-3) and record.dp_max == pytest.approx(dp.max(), rel=1e-3)
    assert record.dp_p5 == pytest.approx(np.percentile(dp, 5), rel=1e-2, abs=1e-7)
    assert record.top1_agreement_se == pytest.approx(np.sqrt(agree.mean() * (1 - agree.mean()) / (n - 1)))
    assert record.ppl_ratio == pytest.approx(np.exp((reference - variant).mean()), rel=1e-6)
    assert record.ln_ppl_corr == pytest.approx(np.corrcoef(reference.reshape(-1), variant.reshape(-1))[0, 1], rel=1e-6)


def test_clip_fraction_counts_ratios_outside_the_ppo_band():
    # A temperature far below 1 sharpens the distributions, so bf16 noise moves some log-probs past the band.
    model = tiny_llama()
    inputs = batch()
    for eps in (0.2, 0.05):
        report = compare(model, inputs, ["bf16"], backward=False, temperature=0.01, clip_eps=eps)
        record = report.get("bf16", "logprob", "logprob")
        with torch.no_grad():
            reference = numpy_logprobs(model(input_ids=inputs["input_ids"]).logits, inputs["input_ids"], 0.01)
            variant = numpy_logprobs(bf16_copy(model)(input_ids=inputs["input_ids"]).logits, inputs["input_ids"], 0.01)
        delta = variant - reference
        expected = np.mean((delta < math.log(1 - eps)) | (delta > math.log(1 + eps)))
        assert 0 < expected < 1
        assert record.clip_fraction == pytest.approx(expected, abs=1.5 / delta.size)


def test_masked_and_ignored_positions_are_left_out_of_logprobs():
    inputs = batch(length=32)
    inputs["labels"][0, 10:] = -100
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    inputs["attention_mask"][1, 24:] = 0
    report = compare(tiny_llama(), inputs, ["bf16"], backward=False)
    record = report.get("bf16", "logprob", "logprob")
    # Sequence 0: targets 1..9 count (label -100 from 10 on); sequence 1: positions whose target and input
    # are both unpadded (targets 1..23).
    assert record.count == 9 + 23


def test_labels_shift_like_transformers():
    inputs = batch(length=16)
    inputs["labels"] = torch.roll(inputs["input_ids"], 1, dims=1)  # targets differ from the inputs
    model = tiny_llama()
    report = compare(model, inputs, ["fp32"], backward=False, reference="fp64")
    record = report.get("fp32", "logprob", "logprob")
    with torch.no_grad():
        expected = numpy_logprobs(model(input_ids=inputs["input_ids"]).logits, inputs["labels"])
    # ref_rms of the fp64 reference's logpi is the RMS of the labels' log-probabilities.
    assert record.ref_rms == pytest.approx(np.sqrt((expected**2).mean()), rel=1e-5)
    assert record.rms_rel > 0  # fp32 against an fp64 reference is not exact


def test_gradient_at_the_logits_is_the_first_backward_row():
    report = compare(tiny_llama(), batch(), ["bf16"])
    bw = report.records("bf16", "bw")
    assert bw[0].name == "logits"
    assert bw[0].shape == (2, 48, VOCAB)
    assert bw[0].rms_rel > 0


def test_bf16_error_is_about_eight_times_fp16s_everywhere():
    """bf16 keeps 7 mantissa bits, fp16 10: 2^3 = 8x the rounding error, in every kind of tensor."""
    report = compare(tiny_llama(), batch(length=64), ["bf16", "fp16"])
    for kind in ("fw", "bw", "grad", "logprob"):
        ratios = [
            bf16.rms_rel / fp16.rms_rel
            for bf16, fp16 in zip(report.records("bf16", kind), report.records("fp16", kind), strict=True)
            if fp16.rms_rel
        ]
        assert ratios, kind
        assert 5 < statistics.median(ratios) < 12, (kind, statistics.median(ratios))


def small_loss(output, inputs):
    """A loss 1e-4 times smaller: its gradients fall below fp16's subnormal range without scaling."""
    return output.loss * 1e-4


def test_fp16_gradients_underflow_without_loss_scaling_and_match_with_it():
    model = tiny_llama()
    unscaled = compare(model, batch(), ["fp16"], loss_fn=small_loss, loss_scale=1.0)
    scaled = compare(model, batch(), ["fp16"], loss_fn=small_loss)
    worst_unscaled = max(r.rms_rel for r in unscaled.records("fp16", "grad"))
    worst_scaled = max(r.rms_rel for r in scaled.records("fp16", "grad"))
    assert worst_unscaled > 0.5  # most of some gradient flushed to zero
    assert worst_scaled < 0.01
    scale = scaled.runs["fp16"].loss_scale
    assert scale is not None and scale > 1 and math.log2(scale).is_integer()
    assert unscaled.runs["fp16"].loss_scale == 1.0
    # Passing the scale back reproduces the run exactly: what a compare run does with the baseline's scale.
    again = compare(model, batch(), ["fp16"], loss_fn=small_loss, loss_scale={"fp16": scale})
    assert again.records("fp16") == scaled.records("fp16")
    # Only fp16 variants are scaled.
    assert compare(model, batch(), ["bf16"]).runs["bf16"].loss_scale is None


def largest_reference_gradient(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> float:
    """max |gradient| over every parameter's .grad and the captured modules' backward tensors, from an fp32
    run done by hand (numpy float64 reductions): what the default fp16 loss scale is sized from."""
    run_model = copy.deepcopy(model)
    grads: list[np.ndarray] = []
    names = ["model.embed_tokens", *[f"model.layers.{i}" for i in range(len(run_model.model.layers))]]
    names += ["model.norm", "lm_head"]
    handles = [
        run_model.get_submodule(name).register_full_backward_hook(
            lambda module, grad_in, grad_out: grads.append(grad_out[0].detach().double().numpy())
        )
        for name in names
    ]
    output = run_model(**inputs)
    output.logits.retain_grad()
    output.loss.backward()
    for handle in handles:
        handle.remove()
    grads += [p.grad.double().numpy() for p in run_model.parameters()]
    grads.append(output.logits.grad.double().numpy())
    return max(float(np.abs(g).max()) for g in grads)


def counting_factory(model: torch.nn.Module, calls: list[str]):
    def factory(dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
        calls.append(str(dtype))
        return copy.deepcopy(model).to(dtype=dtype, device=device)

    return factory


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_the_default_fp16_loss_scale_comes_from_the_reference_gradients_without_an_extra_pass():
    model, inputs = tiny_llama(layers=2), batch(length=24)
    largest = largest_reference_gradient(model, inputs)
    assert reference(model, inputs).max_gradient == pytest.approx(largest, rel=1e-6)
    expected = fp16_loss_scale(largest)
    assert expected > 1
    assert compare(model, inputs, ["fp16"]).runs["fp16"].loss_scale == expected
    # Runs per compare: the reference and the variant only; "calibrate" adds an unscaled fp16 pass.
    calls: list[str] = []
    compare(counting_factory(model, calls), inputs, ["fp16"])
    assert calls == ["torch.float32", "torch.float16"]
    calls.clear()
    calibrated = compare(counting_factory(model, calls), inputs, ["fp16"], loss_scale="calibrate")
    assert calls == ["torch.float32", "torch.float16", "torch.float16"]
    scale = calibrated.runs["fp16"].loss_scale
    assert scale is not None and math.log2(scale).is_integer() and scale > 1


def test_a_loaded_reference_sizes_the_same_loss_scale(tmp_path):
    model, inputs = tiny_llama(layers=2), batch(length=24)
    ref = reference(model, inputs)
    ref.save(tmp_path / "ref.safetensors")
    loaded = Reference.load(tmp_path / "ref.safetensors", model=model)
    assert loaded.max_gradient is None  # computed on first need, from the loaded tensors
    built = compare(ref, variants=["fp16"]).runs["fp16"].loss_scale
    assert compare(loaded, variants=["fp16"]).runs["fp16"].loss_scale == built
    assert loaded.max_gradient == ref.max_gradient


@pytest.mark.parametrize("bad", ["auto", -2.0, 0, math.inf, [1.0]])
def test_a_bad_loss_scale_names_the_variant(bad):
    model, inputs = tiny_llama(layers=1), batch(length=8)
    with pytest.raises(ConfigurationError, match=r"loss_scale for 'fp16' must be a positive number or 'calibrate'"):
        compare(model, inputs, ["fp16"], loss_scale={"fp16": bad})


def test_an_overflowing_loss_scale_is_halved_until_gradients_are_finite():
    model, inputs = tiny_llama(layers=2), batch(length=24)
    calibrated = compare(model, inputs, ["fp16"]).runs["fp16"].loss_scale
    assert calibrated is not None
    too_large = calibrated * 2.0**6  # past fp16's range: the scaled gradients overflow
    report = compare(model, inputs, ["fp16"], loss_scale=too_large)
    scale = report.runs["fp16"].loss_scale
    assert scale is not None and calibrated <= scale < too_large and math.log2(scale).is_integer()
    assert all(r.nonfinite == 0 for r in report.records("fp16"))


def test_loss_scale_formula():
    assert fp16_loss_scale(0.0) == 1.0
    assert fp16_loss_scale(1.0) == 2.0**13  # 65504 / 1 / 4 = 16376 -> 2^13
    assert fp16_loss_scale(1e-3) == 2.0**23
    assert fp16_loss_scale(1e5) == 1.0  # never below 1
    assert fp16_loss_scale(math.inf) == 1.0


@pytest.mark.parametrize("builder", [tiny_llama, tiny_qwen2], ids=["untied", "tied"])
def test_fp32_head_computes_logits_in_fp32_and_keeps_the_weights_low(builder):
    model = builder()
    variant = BUILTIN_VARIANTS["bf16_fp32_head"]
    run_model = build_run_model(model, variant, torch.device("cpu"))
    embedding = run_model.get_input_embeddings()
    head = run_model.get_output_embeddings()
    with torch.no_grad():
        logits = run_model(input_ids=batch()["input_ids"]).logits
    assert logits.dtype == torch.float32
    assert embedding.weight.dtype == torch.bfloat16
    assert head.weight.dtype == torch.bfloat16
    assert (embedding.weight is head.weight) == (builder is tiny_qwen2)
    # The upcast matmul, checked against one done by hand on the same bf16 weights.
    hidden = {}
    handle = head.register_forward_pre_hook(lambda module, args: hidden.setdefault("x", args[0]))
    with torch.no_grad():
        logits = run_model(input_ids=batch()["input_ids"]).logits
    handle.remove()
    expected = hidden["x"].float() @ head.weight.float().T
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)


def test_fp32_head_lowers_the_logprob_error():
    report = compare(tiny_llama(), batch(length=64), ["bf16", "bf16_fp32_head"], backward=False)
    head = report.get("bf16_fp32_head", "logprob", "logprob").rms_rel
    plain = report.get("bf16", "logprob", "logprob").rms_rel
    assert head < plain


def test_fp32_head_keeps_the_gradient_flowing_to_a_tied_bf16_weight():
    report = compare(tiny_qwen2(), batch(), ["bf16_fp32_head"])
    assert report.runs["bf16_fp32_head"].parameter_dtypes == {"bfloat16": sum(1 for _ in tiny_qwen2().parameters())}
    embedding_grad = report.get("bf16_fp32_head", "model.embed_tokens.weight", "grad")
    assert 0 < embedding_grad.rms_rel < 0.05


def test_attention_variants_switch_the_implementation():
    model = tiny_llama()  # eager attention
    report = compare(model, batch(), ["fp32_eager", "fp32_sdpa", "bf16_eager", "bf16_sdpa"])
    assert all(r.rms_abs == 0 for r in report.records("fp32_eager"))
    sdpa = [r.rms_rel for r in report.records("fp32_sdpa", "fw")]
    assert max(sdpa) < 1e-5  # another kernel, fp32: rounding-level differences
    assert report.runs["fp32_sdpa"].variant["attn_implementation"] == "sdpa"
    run_model = build_run_model(model, BUILTIN_VARIANTS["bf16_sdpa"], torch.device("cpu"))
    assert run_model.config._attn_implementation == "sdpa"
    assert model.config._attn_implementation == "eager"  # the user's model is untouched


def test_backend_flags_apply_only_inside_the_variant_run():
    seen: dict[str, object] = {}

    def record_flags(model):
        seen["mkldnn"] = cpu_matmul_precision()
        seen["bf16_reduction"] = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        return model

    before = snapshot_backend_state()
    variant = Variant(
        "probe",
        dtype="bfloat16",
        matmul_precision="high",
        backend={"cuda.matmul.allow_bf16_reduced_precision_reduction": True},
        prepare=record_flags,
    )
    compare(tiny_llama(), batch(), [variant], backward=False)
    assert seen == {"mkldnn": "tf32", "bf16_reduction": True}
    assert snapshot_backend_state() == before


def test_gradient_categories():
    llama = compare(tiny_llama(), batch(), ["bf16"])
    categories = llama.reference.parameter_categories
    assert categories["lm_head.weight"] == "lm_head"
    assert categories["model.embed_tokens.weight"] == "embedding"
    assert categories["model.layers.0.self_attn.q_proj.weight"] == "linear"
    assert categories["model.layers.0.input_layernorm.weight"] == "norm"
    assert categories["model.norm.weight"] == "norm"
    assert "bias" not in categories.values()
    assert llama.reference.tied_head is False
    table = llama.format(full=False)
    assert "lm_head  linear med  linear max  norm med  norm max  embedding  loss scale" in table

    gpt2 = compare(tiny_gpt2(), batch(), ["bf16"])
    assert gpt2.reference.tied_head is True
    assert "bias" in gpt2.reference.parameter_categories.values()
    table = gpt2.format(full=False)
    assert "bias med  bias max" in table
    assert "n/a (tied)" in table


def test_logprob_table():
    report = compare(tiny_llama(), batch(), ["bf16", "fp16"], backward=False)
    lines = report.format(full=False).splitlines()
    header = next(line for line in lines if line.strip().startswith("logprob"))
    for column in ("rms_rel", "bias_rel", "resid_rel", "corr", "slope", "max_abs", "scale", "delta_rms", "clip"):
        assert column in header
    rows = [line.split() for line in lines[lines.index(header) + 1 : lines.index(header) + 3]]
    assert [row[0] for row in rows] == ["bf16", "fp16"]


# Replay needs an MoE: tests/engine/test_routing.py; compiled variants: tests/engine/test_compiled_variants.py.
@pytest.mark.parametrize(
    "name",
    sorted(n for n, v in BUILTIN_VARIANTS.items() if not v.fsdp_knobs and not v.replay_routing and not v.compiled),
)
def test_forward_only_gives_the_same_forward_and_logprob_numbers(name):
    model = tiny_llama(layers=2)
    inputs = batch(length=24)
    full = compare(model, inputs, [name])
    forward = compare(model, inputs, [name], backward=False)
    kept = ("fw", "logprob", "loss")
    assert forward.records(name) == [r for r in full.records(name) if r.kind in kept]
    assert not forward.records(name, "bw") and not forward.records(name, "grad")


def test_random_tokens():
    ids = random_tokens(100, 3, 7, seed=5)
    assert ids.shape == (3, 7) and ids.dtype == torch.long
    assert int(ids.min()) >= 0 and int(ids.max()) < 100
    assert torch.equal(ids, random_tokens(100, 3, 7, seed=5))
    assert not torch.equal(ids, random_tokens(100, 3, 7, seed=6))
    state = torch.get_rng_state()
    random_tokens(100, 3, 7)
    assert torch.equal(state, torch.get_rng_state())  # a private generator


def test_from_text_repeats_the_text_to_length():
    class ByteTokenizer:
        def encode(self, text, add_special_tokens=False):
            return list(text.encode())

    ids = from_text(ByteTokenizer(), "abc", batch=2, length=4)
    assert ids.tolist() == [[97, 98, 99, 97], [98, 99, 97, 98]]


def test_models_that_are_not_causal_lms_get_no_logprob_row():
    from transformers import BertConfig, BertForMaskedLM, LlamaConfig, LlamaForTokenClassification

    torch.manual_seed(0)
    tagger = LlamaForTokenClassification(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            num_labels=4,
        )
    )
    report = compare(tagger, {"input_ids": batch()["input_ids"]}, ["bf16"], backward=False)
    assert not report.records("bf16", "logprob")
    masked_lm = BertForMaskedLM(
        BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    )
    report = compare(masked_lm, {"input_ids": batch()["input_ids"]}, ["bf16"], backward=False)
    assert not report.records("bf16", "logprob")
    assert report.records("bf16", "fw")


def test_gradient_at_the_logits_counts_the_positions_whose_target_counts():
    inputs = batch(length=32)
    inputs["labels"][0, :4] = -100  # targets 1..3 of sequence 0 ignored
    report = compare(tiny_llama(), inputs, ["bf16"])
    logits = report.get("bf16", "logits", "bw")
    logprob = report.get("bf16", "logprob", "logprob")
    # Position t of the logits predicts token t + 1: as many positions count as log-probabilities, each with
    # the whole vocabulary.
    assert logprob.count == 2 * 31 - 3
    assert logits.count == logprob.count * VOCAB


def test_a_nan_logit_makes_the_kl_statistics_nan_not_a_smaller_number():
    """One NaN logit of the variant: the logprob row counts it, and the KL maximum and percentiles are NaN (a
    maximum that skipped it would report a healthy-looking number)."""

    def nan_logit(model):
        def hook(_module, _args, out):
            out = out.clone()
            out[0, 3, 5] = float("nan")
            return out

        model.lm_head.register_forward_hook(hook)
        return model

    report = compare(tiny_llama(), batch(), [Variant("nan_head", dtype="bfloat16", prepare=nan_logit)], backward=False)
    record = report.get("nan_head", "logprob", "logprob")
    assert record.nonfinite >= 1
    assert math.isnan(record.kl_max) and math.isnan(record.kl_p99) and math.isnan(record.kl_mean)
