"""Each run is isolated: its own copy of the inputs, its own model, no ambient mode of the caller, a finite
reference; and errors in forward or backward say what failed, where."""

from __future__ import annotations

import copy
import warnings
from collections import namedtuple
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from conftest import random_tokens, tiny_llama
from pytest_precision.base.errors import ConfigurationError, ModelRunError
from pytest_precision.engine import runner
from pytest_precision.engine.batch import Batch, to_batch
from pytest_precision.engine.capture import trace_nonfinite
from pytest_precision.engine.compare import compare
from pytest_precision.engine.reference_run import LowPrecisionReferenceWarning, build_reference, reference
from pytest_precision.reports.report import PrecisionReport

Pair = namedtuple("Pair", ["x", "scale"])


def llama_batch() -> dict[str, torch.Tensor]:
    ids = random_tokens(length=12)
    return {"input_ids": ids, "labels": ids.clone()}


class Doubler(nn.Module):
    """Writes its inputs in place, at every depth of a nested input."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, extra: dict[str, Any]) -> torch.Tensor:
        x.mul_(2)
        extra["list"][0].add_(1)
        extra["tuple"][1][0] = 7.0
        extra["pair"].x.mul_(3)
        extra["ids"][0, 0] = 3
        summed = x + extra["list"][0] + extra["tuple"][1] + extra["pair"].x * extra["pair"].scale
        return self.second(torch.tanh(self.first(summed)))


def nested_inputs() -> tuple[torch.Tensor, dict[str, Any]]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, generator=generator)
    extra = {
        "list": [torch.randn(3, 4, generator=generator)],
        "tuple": (0, torch.randn(3, 4, generator=generator)),
        "pair": Pair(torch.randn(3, 4, generator=generator), torch.tensor(0.5)),
        "ids": torch.zeros(2, 2, dtype=torch.long),
    }
    return x, extra


def test_a_forward_writing_its_inputs_changes_neither_the_caller_nor_the_next_run() -> None:
    x, extra = nested_inputs()
    before = copy.deepcopy((x, extra))
    report = compare(Doubler(), (x, extra), ["fp32", "bf16"], loss_fn=lambda out, _inputs: out.square().mean())
    torch.testing.assert_close((x, extra), before, rtol=0, atol=0)
    assert isinstance(extra["pair"], Pair)
    for record in report.records("fp32"):
        assert record.rms_rel == 0 and record.max_abs == 0, record  # the same inputs in both runs
    assert all(r.rms_rel for r in report.records("bf16") if r.kind == "fw")


def test_batch_on_copies_every_tensor_at_any_depth_and_keeps_types() -> None:
    x, extra = nested_inputs()
    batch = to_batch((x, extra))
    args, kwargs = batch.on(torch.device("cpu"), torch.float32)  # no cast needed: still a copy
    assert kwargs == {}
    moved_x, moved_extra = args
    pairs = [
        (x, moved_x),
        (extra["list"][0], moved_extra["list"][0]),
        (extra["tuple"][1], moved_extra["tuple"][1]),
        (extra["pair"].x, moved_extra["pair"].x),
        (extra["ids"], moved_extra["ids"]),
    ]
    for original, moved in pairs:
        assert moved.untyped_storage().data_ptr() != original.untyped_storage().data_ptr()
        assert torch.equal(moved, original)
    assert type(moved_extra["pair"]) is Pair and type(moved_extra["list"]) is list
    assert moved_extra["tuple"][0] == 0


def test_batch_on_keeps_requires_grad_of_a_floating_input() -> None:
    x = torch.randn(2, 3, requires_grad=True)
    ids = torch.ones(2, 3, dtype=torch.long)
    (moved, moved_ids), _ = Batch((x, ids), {}).on(torch.device("cpu"), torch.bfloat16)
    assert moved.requires_grad and moved.is_leaf and moved.dtype == torch.bfloat16
    assert not moved_ids.requires_grad
    (plain,), _ = Batch((torch.randn(2, 3),), {}).on(torch.device("cpu"), None)
    assert not plain.requires_grad


def test_an_input_requiring_grad_gets_its_first_module_bw_row() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    x = torch.randn(5, 4, requires_grad=True)
    report = compare(net, x, ["bf16"], loss_fn=lambda out, _inputs: out.sum())
    bw = {r.name for r in report.records("bf16", "bw")}
    assert "0" in bw  # the gradient at the first module's input exists only when the input requires grad
    assert x.grad is None


def test_a_namedtuple_given_as_the_inputs_is_one_argument() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, pair: Pair) -> torch.Tensor:
            return self.linear(pair.x) * pair.scale

    pair = Pair(torch.randn(3, 4), torch.tensor(2.0))
    report = compare(Scaled(), pair, ["fp32"], loss_fn=lambda out, _inputs: out.sum())
    assert all(r.rms_rel == 0 for r in report.records("fp32"))
    report = compare(Scaled(), (pair,), ["bf16"], loss_fn=lambda out, _inputs: out.sum())
    assert report.records("bf16", "fw")


# A factory must build a new model each call.


def test_a_factory_returning_the_same_model_twice_is_refused() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))

    def same(dtype: torch.dtype, _device: torch.device) -> nn.Module:
        return net.to(dtype)  # .to returns the model itself

    with pytest.raises(ConfigurationError, match="the factory returned the same module object for two runs"):
        compare(same, torch.randn(3, 4), ["bf16"], loss_fn=lambda out, _inputs: out.sum())


def test_a_factory_returning_new_models_is_accepted() -> None:
    def fresh(dtype: torch.dtype, _device: torch.device) -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).to(dtype)

    report = compare(fresh, torch.randn(3, 4), ["fp32", "bf16"], loss_fn=lambda out, _inputs: out.sum(), repeats=2)
    assert all(r.rms_rel == 0 for r in report.records("fp32"))


def test_a_factorys_stale_grad_does_not_leak_into_the_gradients() -> None:
    calls = [0]

    def stale(dtype: torch.dtype, _device: torch.device) -> nn.Module:
        calls[0] += 1
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).to(dtype)
        for parameter in net.parameters():
            parameter.grad = torch.full_like(parameter, 100.0 * calls[0])  # differs per call
        return net

    x = torch.randn(3, 4)
    ref = reference(stale, x, loss_fn=lambda out, _inputs: out.sum())
    oracle = stale(torch.float32, torch.device("cpu"))
    oracle.zero_grad(set_to_none=True)
    oracle(x).sum().backward()
    for name, parameter in oracle.named_parameters():
        torch.testing.assert_close(ref.stored[(name, "grad")], parameter.grad)
    report = compare(ref, variants=["fp32"])
    assert all(r.rms_rel == 0 for r in report.records("fp32", "grad"))


# The caller's ambient modes do not reach the runs.


def run_records(wrap: Callable[[], Any]) -> dict[str, Any]:
    model = tiny_llama(layers=1)
    with wrap():
        report = compare(model, llama_batch(), ["bf16", "fp16"])
    return report.to_dict()


AMBIENT: dict[str, Callable[[], Any]] = {
    "autocast_bf16": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    "autocast_fp16": lambda: torch.autocast("cpu", dtype=torch.float16),
    "no_grad": torch.no_grad,
    "inference_mode": torch.inference_mode,
    "grad_disabled": lambda: torch.set_grad_enabled(False),
}


@pytest.fixture(scope="module")
def outside() -> dict[str, Any]:
    import contextlib

    return run_records(contextlib.nullcontext)


@pytest.mark.parametrize("mode", sorted(AMBIENT))
def test_a_call_inside_an_ambient_mode_runs_as_outside_it(mode: str, outside: dict[str, Any]) -> None:
    assert run_records(AMBIENT[mode]) == outside  # bit for bit: every metric of every record


def test_enable_grad_inside_no_grad_and_a_reference_built_inside_inference_mode(outside: dict[str, Any]) -> None:
    def nested() -> Any:
        import contextlib

        stack = contextlib.ExitStack()
        stack.enter_context(torch.no_grad())
        stack.enter_context(torch.enable_grad())
        return stack

    assert run_records(nested) == outside
    model = tiny_llama(layers=1)
    with torch.inference_mode():
        ref = reference(model, llama_batch())  # the caller's tensors are inference tensors here
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert compare(ref, variants=["bf16", "fp16"]).to_dict() == outside
    assert torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")


def test_a_low_precision_reference_model_is_warned_about() -> None:
    model = tiny_llama(layers=1).to(torch.bfloat16)
    with pytest.warns(LowPrecisionReferenceWarning, match=r"only an upcast of bfloat16 weights"):
        compare(model, llama_batch(), ["bf16"], backward=False)
    assert issubclass(LowPrecisionReferenceWarning, UserWarning)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LowPrecisionReferenceWarning)
        compare(tiny_llama(layers=1), llama_batch(), ["bf16"], backward=False)
        compare(tiny_llama(layers=1).double(), llama_batch(), ["bf16"], backward=False, reference="fp64")


# A reference that is not finite is an error of its own.


class Exp(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x)


class Overflow(nn.Module):
    """`boom` overflows fp32 in forward: exp of values near 100 * 4."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(4, 4)
        self.scale = nn.Linear(4, 4)
        self.boom = Exp()
        self.last = nn.Linear(4, 2)
        with torch.no_grad():
            self.scale.weight.fill_(100.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.boom(self.scale(self.first(x).abs() + 1)))


class BackwardNaN(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("nan")


class Poison(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return BackwardNaN.apply(x)  # type: ignore[no-any-return]


class NaNInBackward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(4, 4)
        self.poison = Poison()
        self.last = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.poison(self.first(x)))


def loss_sum(out: torch.Tensor, _inputs: Any) -> torch.Tensor:
    return out.sum()


@pytest.mark.parametrize("api", ["compare", "reference", "build_reference"])
def test_a_reference_overflowing_in_forward_is_an_error_naming_where(api: str) -> None:
    model = Overflow()
    x = torch.randn(3, 4)
    with pytest.raises(ModelRunError, match=r"the fp32 reference is not finite: NaN/Inf first appear in boom \(fw\)"):
        if api == "compare":
            compare(model, x, ["bf16"], loss_fn=loss_sum)
        elif api == "reference":
            reference(model, x, loss_fn=loss_sum, backward=False)
        else:
            build_reference(model, x, loss_fn=loss_sum)


def test_a_reference_overflowing_in_backward_is_an_error_naming_where() -> None:
    with pytest.raises(ModelRunError, match=r"the fp32 reference is not finite: NaN/Inf first appear in poison \(bw\)"):
        compare(NaNInBackward(), torch.randn(3, 4), ["bf16"], loss_fn=loss_sum)


def test_a_non_finite_input_is_named_not_a_module() -> None:
    x = torch.randn(3, 4)
    x[0, 0] = float("nan")
    with pytest.raises(ModelRunError, match="the fp32 reference is not finite: an input tensor is already NaN/Inf"):
        compare(Overflow(), x, ["bf16"], loss_fn=loss_sum, backward=False)


def test_trace_blames_no_module_whose_inputs_were_already_non_finite() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    x = torch.randn(2, 4)
    x[1, 2] = float("inf")
    with trace_nonfinite(net, backward=False) as trace:
        net(x)
    assert trace.origin() is None
    y = torch.randn(2, 4)
    with torch.no_grad():
        net[1].weight[0, 0] = float("nan")
    with trace_nonfinite(net, backward=False) as trace:
        net(y)
    assert trace.origin() == "1 (fw)"


def test_a_non_finite_reference_is_not_cached() -> None:
    from pytest_precision import ReferenceCache

    cache = ReferenceCache()
    for _ in range(2):
        with pytest.raises(ModelRunError, match="not finite"):
            compare(Overflow(), torch.randn(3, 4), ["bf16"], loss_fn=loss_sum, cache=cache)
    assert len(cache) == 0


def test_a_finite_reference_costs_no_extra_run(monkeypatch: pytest.MonkeyPatch) -> None:

    runs: list[bool] = []
    original = runner.Runner.run

    def counted(self: Any, variant: Any, *args: Any, **kwargs: Any) -> Any:
        runs.append(kwargs.get("origin") is not None)
        return original(self, variant, *args, **kwargs)

    monkeypatch.setattr(runner.Runner, "run", counted)
    reference(tiny_llama(layers=1), llama_batch())
    assert runs == [False]


# Errors name the phase, and blame the inputs' keys only for an argument error.


class RaisesInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("no gradient for you")


class BrokenBackward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return RaisesInBackward.apply(self.linear(x))


class BrokenForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("shape trouble inside")


def test_an_exception_in_backward_is_wrapped_naming_the_run() -> None:
    with pytest.raises(ModelRunError) as info:
        compare(BrokenBackward(), torch.randn(2, 4), ["bf16"], loss_fn=loss_sum)
    message = str(info.value)
    assert message.startswith("BrokenBackward raised ValueError: no gradient for you in backward of run 'fp32'")
    assert "keys" not in message
    assert isinstance(info.value.__cause__, ValueError)


def test_a_forward_error_that_is_not_about_arguments_does_not_blame_the_keys() -> None:
    with pytest.raises(ModelRunError) as info:
        compare(BrokenForward(), torch.randn(2, 4), ["bf16"], loss_fn=loss_sum)
    message = str(info.value)
    assert message.startswith("BrokenForward raised RuntimeError: shape trouble inside in forward of run 'fp32'")
    assert "keys" not in message


def test_an_argument_error_blames_the_keys() -> None:
    with pytest.raises(ModelRunError, match=r"check that the inputs' keys match forward\(\)'s arguments") as info:
        compare(BrokenForward(), {"y": torch.randn(2, 4)}, ["bf16"], loss_fn=loss_sum)
    assert isinstance(info.value.__cause__, TypeError)


def test_user_report_is_plain_data() -> None:
    report: PrecisionReport = compare(Doubler(), nested_inputs(), ["bf16"], loss_fn=lambda out, _i: out.sum())
    assert np.isfinite([r.rms_rel for r in report.records("bf16", "fw")]).all()


def test_a_reference_whose_loss_is_nan_because_no_label_counts_says_so() -> None:
    model = tiny_llama(layers=1)
    ids = random_tokens(length=6)
    labels = torch.full_like(ids, -100)
    with pytest.raises(ModelRunError, match=r"the fp32 reference is not finite: .*is every label -100") as info:
        compare(model, {"input_ids": ids, "labels": labels}, ["bf16"])
    assert "non-finite kinds: loss" in str(info.value)


def test_a_non_finite_intermediate_with_a_finite_output_is_still_refused() -> None:
    torch.manual_seed(0)
    scale = nn.Linear(4, 4)
    with torch.no_grad():
        scale.weight.fill_(100.0)
    model = nn.Sequential(scale, Exp(), nn.Tanh())  # exp overflows to inf; tanh(inf) = 1 is finite again
    with pytest.raises(ModelRunError, match=r"the fp32 reference is not finite: NaN/Inf first appear in 1 \(fw\)"):
        compare(model, torch.rand(3, 4) + 1, ["bf16"], backward=False, modules=r"\d")  # every child captured


def test_a_reference_reaching_plus_inf_beside_finite_values_is_an_error() -> None:
    # Only the largest value is +inf: the check reads each tensor's extremes, both of them.
    model = nn.Sequential(nn.Linear(3, 3), Exp())
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(3))
        model[0].bias.zero_()
    x = torch.tensor([[1.0, 100.0, -3.0]])
    with pytest.raises(ModelRunError, match=r"the fp32 reference is not finite: NaN/Inf first appear in 1 \(fw\)"):
        compare(model, x, ["bf16"], modules=["1"], backward=False)
