"""compare() end to end on the tiny models: rows, numbers, isolation of the user's model and process state."""

from __future__ import annotations

import copy
import json
import math
import random
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import pytest_precision
from conftest import (
    cpu_matmul_precision,
    load_tiny_llama,
    random_tokens,
    set_cpu_matmul_precision,
    tiny_gpt2,
    tiny_llama,
    tiny_qwen2,
)
from pytest_precision.base.errors import ConfigurationError, ModelRunError
from pytest_precision.base.records import Record
from pytest_precision.engine.backend_flags import snapshot_backend_state
from pytest_precision.engine.compare import compare
from pytest_precision.engine.variants import BUILTIN_VARIANTS, Variant
from pytest_precision.reports.report import PrecisionReport

LLAMA_FW = [
    "model.embed_tokens",
    "model.layers.0",
    "model.layers.1",
    "model.layers.2",
    "model.layers.3",
    "model.norm",
    "lm_head",
]
#: Gradients at the captured modules' inputs, in backward order (no embedding row: its input is integer ids).
LLAMA_MODULE_BW = ["lm_head", "model.norm", "model.layers.3", "model.layers.2", "model.layers.1", "model.layers.0"]
#: Every bw row of a causal LM: the gradient at the logits fires first, then the modules' input gradients.
LLAMA_BW = ["logits", *LLAMA_MODULE_BW]


def make_batch(**overrides: Any) -> dict[str, torch.Tensor]:
    ids = random_tokens()
    return {"input_ids": ids, "labels": ids.clone(), **overrides}


@pytest.fixture(scope="module")
def llama() -> nn.Module:
    return tiny_llama()


@pytest.fixture(scope="module")
def llama_report(llama: nn.Module) -> PrecisionReport:
    return compare(llama, make_batch(), ["fp32", "bf16", "fp16"])


def names(records: list[Record]) -> list[str]:
    return [r.name for r in records]


def rms(tensor: torch.Tensor) -> float:
    return math.sqrt(float((tensor.detach().double() ** 2).mean()))


def fp32_oracle(
    model: nn.Module, inputs: dict[str, torch.Tensor], modules: list[str]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """fw outputs, bw input gradients and parameter gradients of an fp32 eval-mode copy, by hand.

    Also, under the names the report uses: fw["logprob"], the chosen-token log-probabilities
    log_softmax(logits[:, :-1])[labels[:, 1:]], and bw["logits"], the gradient at the logits.
    """
    model = copy.deepcopy(model).eval()
    fw: dict[str, torch.Tensor] = {}
    bw: dict[str, torch.Tensor] = {}
    handles = []
    by_name = dict(model.named_modules())

    def pre(name: str) -> Any:
        def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            for value in (*args, *kwargs.values()):
                if isinstance(value, torch.Tensor) and value.is_floating_point() and value.requires_grad:
                    handles.append(value.register_hook(lambda g: bw.__setitem__(name, g.detach().clone())))
                    return

        return hook

    def post(name: str) -> Any:
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            tensor = output if isinstance(output, torch.Tensor) else output[0]
            fw[name] = tensor.detach().clone()

        return hook

    for name in modules:
        handles.append(by_name[name].register_forward_pre_hook(pre(name), with_kwargs=True))
        handles.append(by_name[name].register_forward_hook(post(name)))
    output = model(**inputs)
    output.logits.register_hook(lambda g: bw.__setitem__("logits", g.detach().clone()))
    targets = inputs["labels"][:, 1:].clamp_min(0)
    log_softmax = torch.log_softmax(output.logits.detach()[:, :-1].float(), dim=-1)
    fw["logprob"] = log_softmax.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    output.loss.backward()
    for handle in handles:
        handle.remove()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return fw, bw, grads


# --- every built-in variant ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fsdp_bf16", "fsdp_bf16_reduce_bf16"])
def test_an_fsdp_variant_of_an_unsharded_model_says_how_to_shard_it(llama: nn.Module, name: str) -> None:
    with pytest.raises(ConfigurationError, match=rf"variant '{name}' sets FSDP2 mixed precision .*sharded\(model"):
        compare(llama, make_batch(), [name])


#: Formats below 16 bits have tests of their own (tests/engine/test_lowbit.py).
UNSHARDED_BUILTINS = sorted(
    name
    for name, variant in BUILTIN_VARIANTS.items()
    if not variant.fsdp_knobs
    and not variant.lowbit
    and not variant.replay_routing  # replay: tests/engine/test_routing.py
    and variant.compiled is None  # compiled: tests/engine/test_compiled_variants.py, compiling each once
)


@pytest.mark.parametrize("name", UNSHARDED_BUILTINS)
def test_every_builtin_variant_runs_on_cpu(llama: nn.Module, name: str) -> None:
    variant = BUILTIN_VARIANTS[name]
    report = compare(llama, make_batch(), [name])
    assert report.variants == [name]
    assert names(report.records(name, "fw")) == LLAMA_FW
    assert names(report.records(name, "logprob")) == ["logprob"]
    assert report.get(name, "logprob", "logprob").shape == (2, 31)
    forward_only = variant.arrangement is not None  # an arrangement: the tokens as a sampler computes them
    assert names(report.records(name, "bw")) == ([] if forward_only else LLAMA_BW)
    assert len(report.records(name, "grad")) == (0 if forward_only else len(list(llama.parameters())))
    assert len(report.records(name, "loss")) == (0 if forward_only else 1)
    assert report.missing[name] == []
    for record in report.records(name):
        assert record.count > 0 and record.nonfinite == 0, record.name
        assert record.rms_rel is not None and math.isfinite(record.rms_rel), record.name
    run = report.runs[name]
    assert run.variant["name"] == name and run.variant["dtype"] == variant.dtype
    assert run.parameter_dtypes == {variant.weight_dtype: len(list(llama.parameters()))}
    # Only fp16 runs scale the loss, by a power of two.
    if variant.dtype == "float16" and not forward_only:
        assert run.loss_scale is not None and run.loss_scale >= 1 and math.log2(run.loss_scale).is_integer()
    else:
        assert run.loss_scale is None
    lm_head = report.get(name, "lm_head").rms_rel
    if name in ("fp32", "fp32_eager"):  # tiny_llama computes eager attention already
        assert lm_head == 0
        assert all(r.rms_abs == 0 for r in report.records(name)), name
    elif name == "fp32_sdpa":  # another attention kernel in fp32: rounding-level differences at most
        assert lm_head < 1e-5
        assert all(r.rms_rel < 1e-5 for r in report.records(name)), name
    elif name == "tf32":
        assert lm_head < 0.01  # no effect on most CPUs; at most TF32-sized error where mkldnn has TF32
    elif variant.dtype == "float64":
        assert 0 < lm_head < 1e-5
    elif forward_only and variant.dtype == "float32":  # fp32 in another arrangement: rounding-level at most
        assert lm_head < 1e-5
    else:
        assert 1e-5 < lm_head < 0.05


def test_fp32_variant_is_exact(llama_report: PrecisionReport) -> None:
    records = llama_report.records("fp32")
    assert {r.kind for r in records} == {"fw", "logprob", "bw", "grad", "loss"}
    for record in records:
        assert record.rms_abs == 0, (record.name, record.kind)
        assert record.max_abs == 0, (record.name, record.kind)
        assert record.sqnr_db == math.inf
    # The log-ratio and whole-distribution statistics of the chosen-token log-probabilities are exact too.
    logprob = llama_report.get("fp32", "logprob", "logprob")
    assert logprob.delta_mean == 0 and logprob.delta_rms == 0 and logprob.delta_max_abs == 0
    assert logprob.seq_delta_max == 0 and logprob.clip_fraction == 0
    assert logprob.kl_mean == 0 and logprob.kl_max == 0
    assert logprob.top1_agreement == 1


def test_bf16_error_is_nonzero_and_grows_with_depth(llama_report: PrecisionReport) -> None:
    bf16 = llama_report.records("bf16")
    assert all(r.rms_abs > 0 for r in bf16), [r.name for r in bf16 if r.rms_abs == 0]
    first = llama_report.get("bf16", "model.layers.0").rms_rel
    last = llama_report.get("bf16", "model.layers.3").rms_rel
    assert last > first
    assert llama_report.get("bf16", "lm_head").rms_rel > llama_report.get("bf16", "model.embed_tokens").rms_rel


def test_fp16_error_well_below_bf16(llama_report: PrecisionReport) -> None:
    for name in LLAMA_FW:
        fp16 = llama_report.get("fp16", name).rms_rel
        bf16 = llama_report.get("bf16", name).rms_rel
        assert 0 < fp16 < bf16 / 3, name
    assert llama_report.get("fp16", "loss", "loss").rms_rel < llama_report.get("bf16", "loss", "loss").rms_rel


def test_bf16_reduced_reduction_equals_bf16_on_cpu(llama: nn.Module) -> None:
    report = compare(llama, make_batch(), ["bf16", "bf16_reduced_reduction"])
    assert report.records("bf16") == report.records("bf16_reduced_reduction")


def test_fp64_reference(llama: nn.Module) -> None:
    report = compare(llama, make_batch(), ["fp32", "fp64"], reference="fp64")
    assert report.reference.variant["name"] == "fp64"
    assert report.reference.parameter_dtypes == {"float64": len(list(llama.parameters()))}
    assert all(r.rms_abs == 0 for r in report.records("fp64"))
    fp32 = report.get("fp32", "lm_head").rms_rel
    assert 0 < fp32 < 1e-5


# --- rows --------------------------------------------------------------------------------------------------


def test_llama_rows_match_a_hand_written_capture(llama: nn.Module, llama_report: PrecisionReport) -> None:
    batch = make_batch()
    fw, bw, grads = fp32_oracle(llama, batch, LLAMA_FW)
    records = llama_report.records("bf16")
    assert names([r for r in records if r.kind == "fw"]) == LLAMA_FW
    assert names([r for r in records if r.kind == "logprob"]) == ["logprob"]
    # Backward order: the logits' gradient, then the modules' input gradients; no embedding row.
    assert names([r for r in records if r.kind == "bw"]) == LLAMA_BW
    grad_names = names([r for r in records if r.kind == "grad"])
    assert sorted(grad_names) == sorted(n for n, _ in llama.named_parameters())
    for name in LLAMA_FW:
        record = llama_report.get("bf16", name, "fw")
        assert record.shape == tuple(fw[name].shape)
        assert record.count == fw[name].numel()
        assert record.ref_rms == pytest.approx(rms(fw[name]), rel=1e-6), name
    record = llama_report.get("bf16", "logprob", "logprob")
    assert record.shape == tuple(fw["logprob"].shape) == (2, 31)
    assert record.count == fw["logprob"].numel()
    assert record.ref_rms == pytest.approx(rms(fw["logprob"]), rel=1e-6)
    for name in LLAMA_BW:
        record = llama_report.get("bf16", name, "bw")
        assert record.shape == tuple(bw[name].shape)
        # The last position's logits predict nothing: their gradient is zero and is not counted.
        counted = bw[name][:, :-1] if name == "logits" else bw[name]
        assert record.count == counted.numel(), name
        assert record.ref_rms == pytest.approx(rms(counted), rel=1e-5), name
    for name in grad_names:
        record = llama_report.get("bf16", name, "grad")
        assert record.shape == tuple(grads[name].shape)
        assert record.ref_rms == pytest.approx(rms(grads[name]), rel=1e-5), name
    assert llama_report.get("bf16", "lm_head").shape == (2, 32, 256)
    assert llama_report.get("bf16", "logits", "bw").shape == (2, 32, 256)
    assert llama_report.get("bf16", "loss", "loss").count == 1


@pytest.mark.parametrize(
    ("factory", "fw_names", "tied"),
    [
        (
            tiny_qwen2,
            ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2", "model.norm", "lm_head"],
            "model.embed_tokens.weight",
        ),
        (
            tiny_gpt2,
            ["transformer.wte", "transformer.h.0", "transformer.h.1", "transformer.h.2", "transformer.ln_f", "lm_head"],
            "transformer.wte.weight",
        ),
    ],
    ids=["qwen2", "gpt2"],
)
def test_tied_models_report_the_tied_parameter_once(factory: Any, fw_names: list[str], tied: str) -> None:
    model = factory()
    assert model.lm_head.weight is model.get_input_embeddings().weight
    report = compare(model, make_batch(), ["bf16"])
    assert names(report.records("bf16", "fw")) == fw_names
    bw_names = names(report.records("bf16", "bw"))
    assert fw_names[0] not in bw_names
    assert bw_names[:2] == ["logits", "lm_head"] and bw_names[-1] == fw_names[1]
    grad_names = names(report.records("bf16", "grad"))
    assert len(grad_names) == len(set(grad_names))
    assert Counter(grad_names)[tied] == 1
    assert "lm_head.weight" not in grad_names
    assert set(grad_names) == {n for n, _ in model.named_parameters()}
    assert report.runs["bf16"].parameter_dtypes == {"bfloat16": len(grad_names)}
    # The gradient categories hold the tied parameter once too, as the embedding.
    assert report.reference.tied_head is True
    assert set(report.reference.parameter_categories) == set(grad_names)
    assert report.reference.parameter_categories[tied] == "embedding"
    assert "n/a (tied)" in report.format(full=False)  # no separate head gradient to show


def test_bf16_keeps_floating_buffers_fp32(llama: nn.Module, llama_report: PrecisionReport) -> None:
    buffers = [b for b in llama.buffers() if b.is_floating_point()]
    assert buffers, "tiny_llama has a rotary inv_freq buffer"
    parameters = len(list(llama.parameters()))
    for name, dtype in [("bf16", "bfloat16"), ("fp16", "float16")]:
        run = llama_report.runs[name]
        assert run.buffer_dtypes == {"float32": len(buffers)}
        assert run.parameter_dtypes == {dtype: parameters}
    assert llama_report.reference.parameter_dtypes == {"float32": parameters}
    assert llama.model.rotary_emb.inv_freq.dtype == torch.float32


def test_modules_regex_selects_rows(llama: nn.Module) -> None:
    report = compare(llama, make_batch(), ["bf16"], modules=[r"model\.layers\.\d+", "lm_head"], backward=False)
    assert names(report.records("bf16", "fw")) == [*LLAMA_FW[1:5], "lm_head"]
    report = compare(llama, make_batch(), ["bf16"], modules=[r"model\.layers\.1\.mlp\.\w+_proj"], backward=False)
    assert names(report.records("bf16", "fw")) == [
        "model.layers.1.mlp.gate_proj",
        "model.layers.1.mlp.up_proj",
        "model.layers.1.mlp.down_proj",
    ]


# --- train mode, in-place ops, repeated modules ------------------------------------------------------------


def test_dropout_model_in_train_mode() -> None:
    model = tiny_gpt2(dropout=0.1)
    model.train()
    batch = make_batch()
    report = compare(model, batch, ["fp32", "bf16"])
    assert all(r.rms_abs == 0 for r in report.records("fp32"))
    assert model.training and all(m.training for m in model.modules())
    # The runs are in eval mode: the same numbers as the same model put in eval mode by the user.
    evaluated = copy.deepcopy(model).eval()
    assert compare(evaluated, batch, ["bf16"]).records("bf16") == report.records("bf16")
    assert model.training


class NoisyNet(nn.Module):
    """Draws random numbers in every forward, in eval mode too: in fp32, then cast, so that a bf16 run draws the
    same numbers as the fp32 one (torch's bf16 normal sampler on the CPU takes another path from fp32's on
    some versions, 2.6 among them: the same seed gives other numbers)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(h + torch.randn(h.shape, dtype=torch.float32).to(h.dtype))


def test_every_run_starts_from_the_same_seed() -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    torch.manual_seed(99)
    report = compare(NoisyNet(), x, ["fp32", "bf16"], loss_fn=lambda output, _inputs: output.sum())
    assert all(r.rms_abs == 0 for r in report.records("fp32"))
    assert report.get("bf16", "b").rms_rel < 0.02  # the same noise in both runs, not fresh noise


class NoisyInItsDtype(NoisyNet):
    """Draws noise in the run's own dtype (a bf16 run draws bf16 noise)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(h + torch.randn_like(h))


def test_runs_of_the_same_dtype_draw_the_same_numbers() -> None:
    """Two bf16 runs draw identical bf16 noise on every torch version: each run starts from the same seed."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    again = Variant("bf16_again", dtype="bfloat16")
    report = compare(NoisyInItsDtype(), x, ["bf16", again], loss_fn=lambda output, _inputs: output.sum())
    assert report.records("bf16") == report.records("bf16_again")
    assert report.get("bf16", "b").rms_abs > 0


class InPlaceNet(nn.Module):
    """`a`'s output is modified in place after `a` returns."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():  # small integers: every fp32 sum below is exact
            for linear in (self.a, self.b):
                linear.weight.copy_(torch.randint(-3, 4, (4, 4), generator=generator).float())
                linear.bias.copy_(torch.randint(-3, 4, (4,), generator=generator).float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h.mul_(2)
        return self.b(h)


def add_half_to_a(model: InPlaceNet) -> InPlaceNet:
    model.a.register_forward_hook(lambda _module, _inputs, output: output + 0.5)
    return model


def test_in_place_op_after_captured_module() -> None:
    net = InPlaceNet()
    x = torch.randint(-5, 6, (3, 4), generator=torch.Generator().manual_seed(1)).float()
    offset = Variant("offset", dtype="float32", prepare=add_half_to_a)
    report = compare(net, x, ["fp32", offset], loss_fn=lambda output, _inputs: output.sum())
    assert names(report.records("fp32", "fw")) == ["a", "b"]
    assert all(r.rms_abs == 0 for r in report.records("fp32"))
    with torch.no_grad():
        a_out = net.a(x)
    a_row = report.get("offset", "a")
    assert a_row.ref_rms == rms(a_out)  # the value `a` returned, not the doubled one
    assert a_row.bias_abs == 0.5 and a_row.rms_abs == 0.5 and a_row.max_abs == 0.5
    # b sees 2 * (a(x) + 0.5): every output j moves by sum_k W_jk.
    b_row = report.get("offset", "b")
    assert b_row.bias_abs == pytest.approx(float(net.b.weight.detach().sum(dim=1).mean()), abs=1e-12)


def test_the_reference_reruns_with_copies_only_when_a_kept_tensor_was_written_in_place() -> None:
    """Reference tensors are kept without a copy and checked by version counter: InPlaceNet's in-place
    doubling is detected and the reference runs once more, cloning; a model without one runs once."""
    x = torch.randint(-5, 6, (3, 4), generator=torch.Generator().manual_seed(1)).float()

    def loss(output: torch.Tensor, _inputs: object) -> torch.Tensor:
        return output.sum()

    for net, reference_runs in ((InPlaceNet(), 2), (TwoLinear(), 1)):
        calls: list[int] = []
        net.register_forward_pre_hook(lambda _module, _args, calls=calls: calls.append(1))  # copied into each run
        report = compare(net, x, ["fp32"], loss_fn=loss)
        assert len(calls) == reference_runs + 1, type(net).__name__
        assert all(r.rms_abs == 0 for r in report.records("fp32"))


class TwoLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class TwiceNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)
        self.repeat = 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.repeat):
            x = torch.tanh(self.lin(x))
        return x


def test_module_called_twice_gets_numbered_rows() -> None:
    net = TwiceNet()
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(2))
    report = compare(net, x, ["bf16"], loss_fn=lambda output, _inputs: output.pow(2).mean())
    assert names(report.records("bf16", "fw")) == ["lin", "lin#1"]
    assert names(report.records("bf16", "bw")) == ["lin#1"]  # the first call's input needs no gradient
    assert sorted(names(report.records("bf16", "grad"))) == ["lin.bias", "lin.weight"]
    with torch.no_grad():
        first = net.lin(x)
        second = net.lin(torch.tanh(first))
    assert report.get("bf16", "lin").ref_rms == pytest.approx(rms(first), rel=1e-6)
    assert report.get("bf16", "lin#1").ref_rms == pytest.approx(rms(second), rel=1e-6)


def test_variant_that_changes_structure() -> None:
    def three_calls(model: TwiceNet) -> TwiceNet:
        model.repeat = 3
        return model

    variant = Variant("three", dtype="bf16", prepare=three_calls)
    with pytest.raises(ModelRunError, match=r"three.*lin#2"):
        compare(TwiceNet(), torch.randn(2, 8), [variant], backward=False)


# --- isolation -----------------------------------------------------------------------------------------


def hook_counts(model: nn.Module) -> dict[str, tuple[int, ...]]:
    counts = {
        name: (
            len(module._forward_hooks),
            len(module._forward_pre_hooks),
            len(module._backward_hooks),
            len(module._backward_pre_hooks),
        )
        for name, module in model.named_modules()
    }
    for name, parameter in model.named_parameters():
        counts[name] = (
            len(parameter._backward_hooks or {}),
            len(getattr(parameter, "_post_accumulate_grad_hooks", None) or {}),
        )
    return counts


class UserState:
    """Everything about the user's model and the process that compare() must leave as it found it."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.dtypes = {k: v.dtype for k, v in model.state_dict().items()}
        self.devices = {k: v.device for k, v in model.state_dict().items()}
        self.requires_grad = {n: p.requires_grad for n, p in model.named_parameters()}
        self.grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
        self.grad_objects = {n: p.grad for n, p in model.named_parameters()}
        self.hooks = hook_counts(model)
        self.training = {n: m.training for n, m in model.named_modules()}
        self.torch_rng = torch.get_rng_state()
        self.python_rng = random.getstate()
        self.numpy_rng = np.random.get_state()
        self.backend = snapshot_backend_state()
        self.grad_enabled = torch.is_grad_enabled()
        self.default_dtype = torch.get_default_dtype()

    def assert_unchanged(self) -> None:
        model = self.model
        state = model.state_dict()
        assert state.keys() == self.weights.keys()
        for key, value in state.items():
            assert value.dtype == self.dtypes[key], key
            assert value.device == self.devices[key], key
            assert torch.equal(value, self.weights[key]), key
        assert {n: p.requires_grad for n, p in model.named_parameters()} == self.requires_grad
        for name, parameter in model.named_parameters():
            expected = self.grads[name]
            if expected is None:
                assert parameter.grad is None, name
            else:
                assert parameter.grad is self.grad_objects[name], name
                assert torch.equal(parameter.grad, expected), name
        assert hook_counts(model) == self.hooks
        assert {n: m.training for n, m in model.named_modules()} == self.training
        assert torch.equal(torch.get_rng_state(), self.torch_rng)
        assert random.getstate() == self.python_rng
        after = np.random.get_state()
        assert after[0] == self.numpy_rng[0] and np.array_equal(after[1], self.numpy_rng[1])
        assert after[2:] == self.numpy_rng[2:]
        assert snapshot_backend_state() == self.backend
        assert torch.is_grad_enabled() == self.grad_enabled
        assert torch.get_default_dtype() == self.default_dtype


@pytest.fixture
def restore_global_state() -> Iterator[None]:
    """Tests below set unusual process state on purpose; put it back afterwards."""
    torch_rng = torch.get_rng_state()
    python_rng = random.getstate()
    numpy_rng = np.random.get_state()
    bf16_rr = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    mkldnn = cpu_matmul_precision()
    yield
    torch.set_rng_state(torch_rng)
    random.setstate(python_rng)
    np.random.set_state(numpy_rng)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = bf16_rr
    set_cpu_matmul_precision(mkldnn)


def prepared_user_model() -> nn.Module:
    model = tiny_llama(layers=2)
    model.model.layers[0].mlp.up_proj.weight.requires_grad_(False)
    model.model.norm.weight.requires_grad_(False)
    model.lm_head.weight.grad = torch.full_like(model.lm_head.weight, 0.25)
    model.model.layers[1].self_attn.q_proj.weight.grad = torch.randn_like(model.model.layers[1].self_attn.q_proj.weight)
    model.model.layers[1].register_forward_hook(lambda *_: None)
    model.model.norm.register_forward_pre_hook(lambda *_: None)
    model.model.layers[0].self_attn.register_forward_hook(lambda *_: None)
    torch.manual_seed(1234)
    random.seed(5)
    np.random.seed(7)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    set_cpu_matmul_precision("tf32")
    return model


LLAMA2_FW = ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head"]


def consume_randomness(model: nn.Module) -> nn.Module:
    """A prepare step that draws from every global RNG, as user code in a run may."""
    random.random()
    np.random.rand(3)
    torch.rand(3)
    return model


@pytest.mark.usefixtures("restore_global_state")
def test_isolation_after_a_successful_compare() -> None:
    model = prepared_user_model()
    state = UserState(model)
    greedy = Variant("greedy", dtype="bfloat16", prepare=consume_randomness)
    report = compare(model, make_batch(), ["bf16", "fp16_fp32_head", "bf16_autocast", greedy])
    state.assert_unchanged()
    grad_names = names(report.records("bf16", "grad"))
    assert "model.layers.0.mlp.up_proj.weight" not in grad_names
    assert "model.norm.weight" not in grad_names
    assert len(grad_names) == sum(p.requires_grad for p in model.parameters())
    # Reduced-precision reductions are pinned off unless a variant asks for them, whatever the user set.
    assert torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction is True


def raise_in_block(model: nn.Module) -> nn.Module:
    def broken(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError("block exploded")

    model.model.layers[1].forward = broken
    return model


def raise_in_backward(model: nn.Module) -> nn.Module:
    def broken(*_args: Any) -> Any:
        raise RuntimeError("backward exploded")

    model.model.norm.register_full_backward_hook(broken)
    return model


@pytest.mark.usefixtures("restore_global_state")
def test_isolation_after_a_failing_forward() -> None:
    model = prepared_user_model()
    state = UserState(model)
    boom = Variant("boom", dtype="bfloat16", prepare=raise_in_block)
    with pytest.raises(ModelRunError, match="boom") as info:
        compare(model, make_batch(), ["bf16", boom])
    assert isinstance(info.value.__cause__, RuntimeError)
    assert "block exploded" in str(info.value)
    state.assert_unchanged()


@pytest.mark.usefixtures("restore_global_state")
def test_isolation_after_a_failing_backward() -> None:
    model = prepared_user_model()
    state = UserState(model)
    boom = Variant("boom", dtype="bfloat16", prepare=raise_in_backward)
    with pytest.raises((RuntimeError, ModelRunError), match="backward exploded"):
        compare(model, make_batch(), [boom])
    state.assert_unchanged()


@pytest.mark.usefixtures("restore_global_state")
def test_isolation_after_a_configuration_error() -> None:
    model = prepared_user_model()
    state = UserState(model)
    with pytest.raises(ConfigurationError):
        compare(model, make_batch(), ["bf16"], modules=["nope"])
    state.assert_unchanged()


def test_user_input_gradient_untouched() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    compare(net, x, ["bf16"], loss_fn=lambda output, _inputs: output.sum())
    assert x.grad is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_rng_state_preserved_by_a_cpu_run() -> None:
    torch.cuda.manual_seed_all(1234)
    before = torch.cuda.get_rng_state_all()
    compare(Plain(), torch.randn(2, 4), ["bf16"], backward=False)
    after = torch.cuda.get_rng_state_all()
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_user_input_tensors_unchanged(llama: nn.Module) -> None:
    batch = make_batch(attention_mask=torch.ones(2, 32, dtype=torch.long))
    saved = {k: v.clone() for k, v in batch.items()}
    compare(llama, batch, ["bf16"])
    assert batch.keys() == saved.keys()
    for key, value in batch.items():
        assert torch.equal(value, saved[key]) and value.dtype == saved[key].dtype, key


# --- factories -----------------------------------------------------------------------------------------


def test_factory_builds_each_run_in_its_dtype() -> None:
    calls: list[tuple[torch.dtype, torch.device]] = []

    def factory(dtype: torch.dtype, device: torch.device) -> nn.Module:
        calls.append((dtype, torch.device(device)))
        return load_tiny_llama(dtype, device)

    batch = make_batch()
    report = compare(factory, batch, ["bf16", "bf16_autocast", "fp32"])
    cpu = torch.device("cpu")
    assert calls == [(torch.float32, cpu), (torch.bfloat16, cpu), (torch.float32, cpu), (torch.float32, cpu)]
    assert report.runs["bf16"].parameter_dtypes == {"bfloat16": 39}
    # the rotary-embedding buffers stay float32 in a bf16 model (how many: 2 on transformers 5.24, 1 on 4.56)
    float_buffers = sum(b.is_floating_point() for b in load_tiny_llama().buffers())
    assert float_buffers >= 1
    assert report.runs["bf16"].buffer_dtypes == {"float32": float_buffers}
    assert report.runs["bf16_autocast"].parameter_dtypes == {"float32": 39}
    assert report.reference.parameter_dtypes == {"float32": 39}
    assert all(r.rms_abs == 0 for r in report.records("fp32"))
    from_module = compare(load_tiny_llama(), batch, ["bf16"])
    assert names(report.records("bf16")) == names(from_module.records("bf16"))
    for a, b in zip(report.records("bf16", "fw"), from_module.records("bf16", "fw"), strict=True):
        assert a.ref_rms == pytest.approx(b.ref_rms, rel=1e-9), a.name
        assert a.rms_rel == pytest.approx(b.rms_rel, rel=1e-3), a.name


def test_factory_must_return_a_module() -> None:
    with pytest.raises(ConfigurationError, match="factory"):
        compare(lambda dtype, device: "not a model", make_batch(), ["bf16"])


# --- padding and ignored labels ----------------------------------------------------------------------------


def test_padding_and_ignored_labels_are_excluded(llama: nn.Module) -> None:
    ids = random_tokens()
    attention = torch.ones(2, 32, dtype=torch.long)
    attention[1, -8:] = 0
    labels = ids.clone()
    labels[1, -8:] = -100
    labels[0, :4] = -100
    batch = {"input_ids": ids, "attention_mask": attention, "labels": labels}
    counted = (attention != 0) & (labels != -100)
    positions = int(counted.sum())
    assert positions == 64 - 8 - 4
    report = compare(llama, batch, ["bf16"])
    fw, bw, _ = fp32_oracle(llama, batch, LLAMA_FW)
    for name in LLAMA_FW:
        record = report.get("bf16", name)
        width = 256 if name == "lm_head" else 64
        assert record.count == positions * width, name
        assert record.shape == (2, 32, width)
        assert record.ref_rms == pytest.approx(rms(fw[name][counted]), rel=1e-6), name
    for name in LLAMA_MODULE_BW:
        record = report.get("bf16", name, "bw")
        assert record.count == positions * 64, name
        assert record.ref_rms == pytest.approx(rms(bw[name][counted]), rel=1e-5), name
    # Log-probabilities count a position t when it and t + 1 are attended and its target labels[t + 1] counts.
    predicted = (attention[:, 1:] != 0) & (attention[:, :-1] != 0) & (labels[:, 1:] != -100)
    assert int(predicted.sum()) == (31 - 3) + (31 - 8)
    record = report.get("bf16", "logprob", "logprob")
    assert record.shape == (2, 31)
    assert record.count == int(predicted.sum())
    assert record.ref_rms == pytest.approx(rms(fw["logprob"][predicted]), rel=1e-6)
    weight = report.get("bf16", "lm_head.weight", "grad")
    assert weight.count == llama.lm_head.weight.numel()  # parameter gradients are never masked
    assert report.runs["bf16"].token_count == positions


# --- bad input -------------------------------------------------------------------------------------------


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_module_regex_matching_nothing(llama: nn.Module) -> None:
    with pytest.raises(ConfigurationError, match="'nope'"):
        compare(llama, make_batch(), ["bf16"], modules=["nope"])
    with pytest.raises(ConfigurationError, match="regex"):
        compare(llama, make_batch(), ["bf16"], modules=["model.layers.("])


def test_backward_without_loss_asks_for_loss_fn(llama: nn.Module) -> None:
    with pytest.raises(ConfigurationError, match="loss_fn"):
        compare(llama, {"input_ids": random_tokens()}, ["bf16"])
    with pytest.raises(ConfigurationError, match="loss_fn"):
        compare(Plain(), torch.randn(2, 4), ["bf16"])


def test_forward_only_without_loss(llama: nn.Module) -> None:
    report = compare(llama, {"input_ids": random_tokens()}, ["bf16"], backward=False)
    assert {r.kind for r in report.records("bf16")} == {"fw", "logprob"}  # log-probabilities need no loss


def test_non_scalar_loss(llama: nn.Module) -> None:
    with pytest.raises(ConfigurationError, match="scalar"):
        compare(llama, make_batch(), ["bf16"], loss_fn=lambda output, _inputs: output.logits)
    with pytest.raises(ConfigurationError, match="scalar"):
        compare(llama, make_batch(), ["bf16"], loss_fn=lambda output, _inputs: 1.0)


def test_loss_fn_receives_output_and_inputs(llama: nn.Module) -> None:
    seen: list[Any] = []

    def loss_fn(output: Any, inputs: Any) -> torch.Tensor:
        seen.append(inputs)
        return output.logits.float().pow(2).mean()

    report = compare(llama, {"input_ids": random_tokens()}, ["bf16"], loss_fn=loss_fn)
    assert len(seen) == 2 and all(set(s) == {"input_ids"} for s in seen)
    assert report.get("bf16", "loss", "loss").count == 1
    assert report.records("bf16", "bw")


def test_inputs_the_model_rejects() -> None:
    with pytest.raises(ModelRunError, match="'fp32'") as info:
        compare(Plain(), {"y": torch.randn(2, 4)}, ["bf16"], backward=False)
    assert isinstance(info.value.__cause__, TypeError)
    with pytest.raises(ModelRunError, match="'fp32'"):
        compare(Plain(), torch.randn(2, 5), ["bf16"], backward=False)


def test_model_without_parameters() -> None:
    with pytest.raises(ConfigurationError, match="parameters"):
        compare(nn.ReLU(), torch.randn(2, 4), ["bf16"], backward=False)


def test_loss_without_grad(llama: nn.Module) -> None:
    frozen = copy.deepcopy(llama).requires_grad_(False)
    with pytest.raises(ConfigurationError, match="backward=False"):
        compare(frozen, make_batch(), ["bf16"])


@pytest.mark.parametrize(
    ("model", "inputs", "variants", "kwargs"),
    [
        (42, torch.randn(2, 4), ["bf16"], {}),
        ("plain", 42, ["bf16"], {}),
        ("plain", torch.randn(2, 4), [], {}),
        ("plain", torch.randn(2, 4), ["bf17"], {}),
        ("plain", torch.randn(2, 4), ["bf16"], {"reference": "bf16"}),
    ],
    ids=["model", "inputs", "no-variants", "unknown-variant", "bad-reference"],
)
def test_bad_arguments(model: Any, inputs: Any, variants: Any, kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError):
        compare(Plain() if model == "plain" else model, inputs, variants, backward=False, **kwargs)


def test_fp32_modules_matching_nothing(llama: nn.Module) -> None:
    variant = Variant("x", dtype="bf16", fp32_modules=("no_such_module",))
    with pytest.raises(ConfigurationError, match="no_such_module"):
        compare(llama, make_batch(), [variant])


def test_output_head_needs_get_output_embeddings() -> None:
    with pytest.raises(ConfigurationError, match="get_output_embeddings"):
        compare(Plain(), torch.randn(2, 4), ["bf16_fp32_head"], backward=False)


# --- backward=False ------------------------------------------------------------------------------------


def test_forward_only_gives_the_same_forward_numbers(llama: nn.Module, llama_report: PrecisionReport) -> None:
    report = compare(llama, make_batch(), ["fp32", "bf16", "fp16"], backward=False)
    for variant in ("fp32", "bf16", "fp16"):
        assert {r.kind for r in report.records(variant)} == {"fw", "logprob", "loss"}
        assert report.records(variant, "fw") == llama_report.records(variant, "fw")
        assert report.records(variant, "logprob") == llama_report.records(variant, "logprob")
        assert report.records(variant, "loss") == llama_report.records(variant, "loss")
        assert report.missing[variant] == []
        assert report.runs[variant].loss_scale is None  # nothing to scale without a backward pass


# --- the report ------------------------------------------------------------------------------------------


def test_report_round_trip(llama_report: PrecisionReport) -> None:
    data = llama_report.to_dict()
    restored = PrecisionReport.from_dict(data)
    assert restored.variants == llama_report.variants
    for variant in llama_report.variants:
        assert restored.records(variant) == llama_report.records(variant)
        assert restored.runs[variant] == llama_report.runs[variant]
    assert restored.reference == llama_report.reference
    assert restored == llama_report
    through_json = PrecisionReport.from_dict(json.loads(json.dumps(data)))
    assert through_json == llama_report
    assert through_json.get("fp32", "lm_head").sqnr_db == math.inf


def test_report_get(llama_report: PrecisionReport) -> None:
    record = llama_report.get("bf16", "model.layers.2")
    assert (record.name, record.kind) == ("model.layers.2", "fw")
    assert llama_report.get("bf16", "model.layers.2", "bw").kind == "bw"
    assert llama_report.get("bf16", "lm_head.weight", "grad").kind == "grad"
    with pytest.raises(KeyError) as info:
        llama_report.get("bf16", "model.layers.9")
    message = str(info.value)
    assert "model.layers.9" in message
    for name in LLAMA_FW:
        assert name in message
    with pytest.raises(KeyError, match="bf16"):
        llama_report.get("bf17", "lm_head")
    with pytest.raises(KeyError):
        llama_report.get("bf16", "model.embed_tokens", "bw")


def test_report_format(llama_report: PrecisionReport) -> None:
    text = llama_report.format()
    assert "first (model.embed_tokens)" in text
    assert "last (lm_head)" in text
    assert "first (logits)" in text and "last (model.layers.0)" in text  # the backward summary
    lines = text.splitlines()
    # Gradients by parameter category (the untied head has its own column), with each run's loss scale.
    (category,) = [i for i, line in enumerate(lines) if line.split()[:3] == ["grad", "lm_head", "linear"]]
    header = " ".join(lines[category].split())
    assert header == "grad lm_head linear med linear max norm med norm max embedding loss scale"  # no biases
    scales = {line.split()[0]: line.split()[-1] for line in lines[category + 1 : category + 4]}
    assert scales == {"fp32": "-", "bf16": "-", "fp16": f"{llama_report.runs['fp16'].loss_scale:g}"}
    # Chosen-token log-probabilities, one row per variant.
    (logprob,) = [i for i, line in enumerate(lines) if line.split()[:2] == ["logprob", "rms_rel"]]
    assert [line.split()[0] for line in lines[logprob + 1 : logprob + 4]] == ["fp32", "bf16", "fp16"]
    assert "n/a (tied)" not in text
    for variant in llama_report.variants:
        assert variant in text
    assert str(llama_report) == text
    short = llama_report.format(full=False)
    assert len(short) < len(text)
    assert "model.layers.1 " not in short and "model.layers.1 " in text


# --- fp32 modules ----------------------------------------------------------------------------------------


def test_fp32_head_on_untied_llama(llama: nn.Module) -> None:
    report = compare(llama, make_batch(), ["bf16", "bf16_fp32_head"])
    head = report.get("bf16_fp32_head", "lm_head")
    assert head.shape == (2, 32, 256)
    # Everything before the head computes exactly as in plain bf16 ...
    for name in LLAMA_FW[:-1]:
        assert report.get("bf16_fp32_head", name) == report.get("bf16", name), name
    # ... and fp32 logits drop the final bf16 rounding.
    assert 0 < head.rms_rel < report.get("bf16", "lm_head").rms_rel
    assert report.runs["bf16_fp32_head"].parameter_dtypes == {"bfloat16": 39}
    assert "lm_head.weight" in names(report.records("bf16_fp32_head", "grad"))
    assert report.runs["bf16_fp32_head"].variant["fp32_modules"] == ["<output head>"]


def test_fp32_head_on_tied_qwen2() -> None:
    model = tiny_qwen2()
    report = compare(model, make_batch(), ["bf16", "bf16_fp32_head"])
    run = report.runs["bf16_fp32_head"]
    assert list(run.parameter_dtypes) == ["bfloat16"]  # the tied embedding stayed bf16
    assert run.parameter_dtypes == report.runs["bf16"].parameter_dtypes
    assert names(report.records("bf16_fp32_head", "fw"))[-1] == "lm_head"
    grad_names = names(report.records("bf16_fp32_head", "grad"))
    assert grad_names.count("model.embed_tokens.weight") == 1
    assert report.get("bf16_fp32_head", "model.embed_tokens") == report.get("bf16", "model.embed_tokens")
    assert report.get("bf16_fp32_head", "lm_head").rms_rel < report.get("bf16", "lm_head").rms_rel


def test_prepare_that_raises_names_the_variant():
    def broken(model):
        raise RuntimeError("cannot patch this model")

    with pytest.raises(ModelRunError, match=r"variant 'patched': prepare raised RuntimeError: cannot patch this model"):
        compare(tiny_llama(), {"input_ids": random_tokens()}, [Variant("patched", prepare=broken)], backward=False)


def test_the_reference_never_holds_the_callers_input_storage() -> None:
    """Dropout in eval returns its input as is: the reference keeps a copy, not the caller's tensor, so a
    later in-place write by the caller cannot change a kept Reference."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Dropout(0.1), nn.Linear(4, 3))
    x = torch.randn(5, 4)
    ref = pytest_precision.reference(model, x, modules=["0", "1"], loss_fn=lambda output, _inputs: output.sum())
    kept = ref.stored[("0", "fw")]
    assert torch.equal(kept, x)
    assert kept.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    x.add_(1.0)
    assert not torch.equal(kept, x)
