"""Routing rows and routing replay of mixture-of-experts models (engine/routers.py, numbers/routing.py)."""

from __future__ import annotations

import copy
import math
import types
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import MOE_FAMILIES, load_trained_moe, random_tokens, requires_transformers_routers, tiny_moe
from pytest_precision import ConfigurationError, Routers, Variant, compare
from pytest_precision.gate.checks import check_against_baseline
from pytest_precision.gate.tolerance_rules import ToleranceRules

pytestmark = requires_transformers_routers


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def batch(rows: int = 2, length: int = 32, seed: int = 0) -> dict[str, torch.Tensor]:
    ids = random_tokens(batch=rows, length=length, seed=seed)
    return {"input_ids": ids, "labels": ids.clone()}


def is_router(module: nn.Module) -> bool:
    return type(module).__name__.endswith(("TopKRouter", "TopkRouter"))


def output_recorder(store: dict[str, tuple[np.ndarray, ...]]) -> Callable[[nn.Module], nn.Module]:
    """A prepare callable keeping each router's output of the run in `store`: (logits, weights, indices) in NumPy."""

    def keep(name: str, output: tuple[torch.Tensor, ...]) -> None:
        store[name] = tuple(value.detach().to(torch.float64).numpy().copy() for value in output[:3])

    def prepare(model: nn.Module) -> nn.Module:
        for name, module in model.named_modules():
            if is_router(module):
                module.register_forward_hook(lambda _m, _a, out, n=name: keep(n, out))
        return model

    return prepare


def numpy_top_k(logits: np.ndarray, router: nn.Module) -> tuple[np.ndarray, np.ndarray]:
    """Top-k experts by the router's rule and the margins (k-th chosen score minus the best other), NumPy float64."""
    k = router.top_k
    if hasattr(router, "e_score_correction_bias"):  # DeepSeek-V3: sigmoid + bias, best groups, top-k within them
        choice = 1 / (1 + np.exp(-logits)) + router.e_score_correction_bias.detach().double().numpy()
        size = choice.shape[1] // router.num_group
        group_scores = np.sort(choice.reshape(len(choice), router.num_group, size), axis=-1)[:, :, -2:].sum(-1)
        allowed = np.full_like(choice, -np.inf)
        for t, groups in enumerate(np.argsort(-group_scores, axis=-1)[:, : router.topk_group]):
            for g in groups:
                allowed[t, g * size : (g + 1) * size] = choice[t, g * size : (g + 1) * size]
        indices = np.argsort(-allowed, axis=-1, kind="stable")[:, :k]
        scores = choice
    else:  # softmax is monotone: the top-k of the probabilities are those of the logits
        indices = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
        scores = logits
    others = scores.copy()
    np.put_along_axis(others, indices, -np.inf, -1)
    return indices, np.take_along_axis(scores, indices, -1).min(-1) - others.max(-1)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_routing_rows_match_top_k_of_the_captured_router_logits(family: str) -> None:
    model = tiny_moe(family, seed=3)
    routers = {name: module for name, module in model.named_modules() if is_router(module)}
    assert len(routers) == 2
    reference_out: dict[str, tuple[np.ndarray, ...]] = {}
    variant_out: dict[str, tuple[np.ndarray, ...]] = {}
    report = compare(
        model,
        batch(length=48),
        [Variant("bf16", dtype="bfloat16", prepare=output_recorder(variant_out))],
        reference=Variant("fp32", prepare=output_recorder(reference_out)),
        backward=False,
    )
    rows = report.records("bf16", "routing")
    assert [r.name for r in rows] == list(routers)
    for record in rows:
        router = routers[record.name]
        sets = []
        for logits, _, returned in (reference_out[record.name], variant_out[record.name]):
            indices, margins = numpy_top_k(logits, router)
            # A bf16 logit can tie with another at the k-th place: there the router's own tie-break stands.
            tied = margins == 0
            assert all(set(a) == set(b) for a, b in zip(indices[~tied], returned[~tied], strict=True))
            indices[tied] = returned[tied]
            sets.append(indices)
        ref_idx, var_idx = sets
        margins = numpy_top_k(reference_out[record.name][0], router)[1]
        same = np.array([set(a) == set(b) for a, b in zip(ref_idx, var_idx, strict=True)])
        assert record.shape == (96, router.top_k)
        assert record.expert_agreement == pytest.approx(same.mean(), abs=1e-12)
        # The first choice: the expert of largest weight as the router returned it.
        firsts = [
            np.take_along_axis(out[2], out[1].argmax(-1)[:, None], -1)[:, 0]
            for out in (reference_out[record.name], variant_out[record.name])
        ]
        assert record.top1_changed == pytest.approx(np.mean(firsts[0] != firsts[1]), abs=1e-12)
        changed = [len(set(a) - set(b)) for a, b in zip(ref_idx, var_idx, strict=True)]
        assert record.experts_changed == pytest.approx(np.mean(changed), abs=1e-12)
        assert record.margin_median == pytest.approx(np.median(margins), rel=1e-5)
        if (~same).any():
            assert record.flip_margin_max == pytest.approx(margins[~same].max(), rel=1e-5)
        loads = [np.bincount(i.reshape(-1).astype(int), minlength=8) / i.size for i in (ref_idx, var_idx)]
        assert record.load_shift == pytest.approx(0.5 * np.abs(loads[0] - loads[1]).sum(), abs=1e-12)
    assert any(r.expert_agreement < 1 for r in rows) or family in ("olmoe", "deepseek_v3")


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_replaying_a_variants_own_routing_changes_nothing(family: str) -> None:
    """The replay rule computes the weights exactly as each family's router does: bf16 replaying its own routing is
    bf16, bit for bit, in every row (forward, log-probs, gradients)."""
    report = compare(
        tiny_moe(family, seed=1), batch(), ["bf16", Variant("bf16_again", dtype="bfloat16", replay_routing="bf16")]
    )
    own, again = report.records("bf16"), report.records("bf16_again")
    assert [(r.name, r.kind) for r in own] == [(r.name, r.kind) for r in again]
    for a, b in zip(own, again, strict=True):
        assert a.to_dict() == b.to_dict()


def test_replay_gives_an_fp32_variant_the_references_routing_and_keeps_its_error() -> None:
    model = load_trained_moe()
    inputs = batch(length=64)
    exact = compare(model, inputs, ["fp32_replay"])
    for record in exact.records("fp32_replay"):
        assert record.rms_abs == 0, record
    assert all(r.expert_agreement == 1 and r.experts_changed == 0 for r in exact.records("fp32_replay", "routing"))

    # An fp32 variant with an error of its own (its attention projections off by one part in 1e6, as another
    # kernel's rounding) flips no expert here: replaying the reference's routing leaves every error as it was.
    def other_kernel(model: nn.Module) -> nn.Module:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(1 + 1e-6)
        return model

    kernel = Variant("fp32_kernel", prepare=other_kernel)
    report = compare(model, inputs, [kernel, Variant("fp32_kernel_replay", prepare=other_kernel, replay_routing=True)])
    assert all(r.expert_agreement == 1 for r in report.records("fp32_kernel", "routing"))
    errors = {(r.name, r.kind): r.rms_rel for r in report.records("fp32_kernel")}
    assert errors[("model.layers.3", "fw")] > 0 and errors[("logprob", "logprob")] > 0
    for record in report.records("fp32_kernel_replay"):
        assert record.rms_rel == errors[(record.name, record.kind)]


def biased_router(layer: int, expert: int, bias: float) -> Callable[[nn.Module], nn.Module]:
    """A prepare callable adding `bias` to one expert's logit in one layer's Qwen3-MoE router (a planted bug)."""

    def prepare(model: nn.Module) -> nn.Module:
        router = model.model.layers[layer].mlp.gate

        def forward(self: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            hidden = hidden.reshape(-1, self.hidden_dim)
            logits = F.linear(hidden, self.weight)
            logits = logits + F.one_hot(torch.tensor(expert), self.num_experts).to(logits.dtype) * bias
            probs = torch.softmax(logits, dtype=torch.float, dim=-1)
            top, indices = torch.topk(probs, self.top_k, dim=-1)
            top = top / top.sum(dim=-1, keepdim=True)
            return logits, top.to(logits.dtype), indices

        router.forward = types.MethodType(forward, router)
        return model

    return prepare


def test_a_planted_router_bias_is_named_first_as_that_layers_routing_row() -> None:
    inputs = batch(length=64)
    baseline = compare(load_trained_moe, inputs, ["bf16"])
    planted = compare(load_trained_moe, inputs, [Variant("bf16", dtype="bfloat16", prepare=biased_router(2, 5, 0.5))])
    expected = {"bf16": baseline.records("bf16")}
    obtained = {"bf16": planted.records("bf16")}
    check = check_against_baseline(expected, obtained, ToleranceRules())
    from pytest_precision.plugin.messages import execution_order

    order = {("bf16", r.name, r.kind): i for i, r in enumerate(planted.records("bf16"))}
    first = execution_order(check.violations, order)[0]
    assert (first.name, first.kind) == ("model.layers.2.mlp.gate", "routing")
    flagged = {v.metric for v in check.violations if v.name == first.name and v.kind == "routing"}
    assert "experts_changed" in flagged
    # The layers before it route as before.
    for layer in (0, 1):
        assert planted.get("bf16", f"model.layers.{layer}.mlp.gate", "routing") == baseline.get(
            "bf16", f"model.layers.{layer}.mlp.gate", "routing"
        )


def test_routing_rows_under_arrangements_and_isolation() -> None:
    inputs = {"input_ids": random_tokens(batch=3, length=24, seed=2)}
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    inputs["attention_mask"][1, 18:] = 0
    inputs["attention_mask"][2, :5] = 0
    model = load_trained_moe()
    report = compare(
        model,
        inputs,
        ["fp32_decode", "fp32_batch_alone", "fp32_left_padded", "bf16_decode", "bf16"],
        isolate=True,
        backward=False,
    )
    counted = int(inputs["attention_mask"].sum())
    for variant in ("fp32_decode", "fp32_batch_alone", "fp32_left_padded", "bf16_decode", "bf16"):
        rows = report.records(variant, "routing")
        assert len(rows) == 4 and all(r.shape == (counted, 2) for r in rows), variant
    for variant in ("fp32_decode", "fp32_batch_alone", "fp32_left_padded"):
        assert all(r.expert_agreement == 1 for r in report.records(variant, "routing")), variant
    isolated = report.records("bf16", "routing_isolated")
    assert [r.name for r in isolated] == [r.name for r in report.records("bf16", "routing")]
    # Each layer isolated routes from the reference's own input: flips it makes are its own, never more than with
    # the error of the layers before it (on this text, equal or fewer).
    assert (
        sum(1 - r.expert_agreement for r in isolated)
        <= sum(1 - r.expert_agreement for r in report.records("bf16", "routing")) + 1e-12
    )
    decode_routing = report.routing_mismatch("bf16_decode")
    assert set(decode_routing) == {r.name for r in report.records("bf16", "routing")}


def test_routing_mismatch_replay_of_a_sampler_into_the_trainer() -> None:
    inputs = {"input_ids": random_tokens(batch=2, length=48, seed=5)}
    trainer_replaying = Variant("bf16_replaying_decode", dtype="bfloat16", replay_routing="bf16_decode")
    report = compare(load_trained_moe, inputs, ["bf16", "bf16_decode", trainer_replaying], backward=False)
    assert all(share == 0 for share in report.routing_mismatch("bf16_replaying_decode", "bf16_decode").values())
    replayed = report.records("bf16_replaying_decode", "routing")
    sampled = report.records("bf16_decode", "routing")
    assert [r.expert_agreement for r in replayed] == [r.expert_agreement for r in sampled]
    with pytest.raises(ConfigurationError, match=r"no routing of variant 'nope'.*bf16, bf16_decode"):
        report.routing_mismatch("nope")


class TinyMoE(nn.Module):
    """A user's own MoE: a router returning only logits, top-k taken by the block."""

    def __init__(self, experts: int = 6, k: int = 2, width: int = 16) -> None:
        super().__init__()
        self.k = k
        self.embed = nn.Linear(4, width)
        self.router = nn.Linear(width, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(experts))
        self.head = nn.Linear(width, 1)
        #: Set by the replay callable: the experts to use in the next forward.
        self.forced: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(x)  # (B, T, width)
        logits = self.router(hidden)
        weights, indices = torch.softmax(logits.float(), -1).topk(self.k, dim=-1)
        if self.forced is not None:
            indices = self.forced.reshape(indices.shape)
            weights = torch.softmax(logits.float(), -1).gather(-1, indices)
            self.forced = None
        self.chosen = (indices, weights)
        out = sum(
            weights[..., j : j + 1].to(hidden.dtype)
            * torch.stack([e(hidden) for e in self.experts], -2)
            .gather(-2, indices[..., j, None, None].expand(*indices.shape[:-1], 1, hidden.shape[-1]))
            .squeeze(-2)
            for j in range(self.k)
        )
        return self.head(out).sum()


def read_tiny(module: nn.Module, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    weights, indices = torch.softmax(logits.float(), -1).topk(2, dim=-1)
    return indices, weights, logits


def replay_tiny(module: nn.Module, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    # The block takes top-k itself: a logit far above the others makes it choose `indices`; the callable returns
    # logits whose softmax at the chosen experts keeps their order (a user's replay rule, for the test).
    boost = torch.zeros_like(logits.reshape(indices.shape[0], -1)).scatter(1, indices, 1e4).reshape(logits.shape)
    return logits + boost


def test_a_users_own_moe_with_routers() -> None:
    torch.manual_seed(0)
    model = TinyMoE()
    x = torch.randn(2, 10, 4)
    routers = Routers(modules=r"router", read=read_tiny, replay=replay_tiny, experts=6)
    report = compare(model, (x,), ["bf16", "fp32_replay"], loss_fn=lambda out, _: out, routers=routers)
    rows = report.records("bf16", "routing")
    assert [r.name for r in rows] == ["router"] and rows[0].shape == (20, 2)
    assert rows[0].margin_median is not None and rows[0].margin_median > 0
    assert report.records("fp32_replay", "routing")[0].expert_agreement == 1
    off = compare(model, (x,), ["bf16"], loss_fn=lambda out, _: out, routers=False)
    assert off.records("bf16", "routing") == []


def test_no_margins_without_scores() -> None:
    torch.manual_seed(0)
    model = TinyMoE()
    read = lambda module, logits: read_tiny(module, logits)[:2]  # noqa: E731
    report = compare(model, (torch.randn(2, 10, 4),), ["bf16"], loss_fn=lambda o, _: o, routers=Routers("router", read))
    row = report.records("bf16", "routing")[0]
    assert row.margin_median is None and row.flip_margin_max is None and row.expert_agreement is not None


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Variant("x", replay_routing=1), "replay_routing must be True"),
        (lambda: Variant("x", replay_routing=""), "replay_routing must be True"),
        (lambda: Variant("x", replay_routing="x"), "names the variant itself"),
        (
            lambda: Variant("x", arrangement="decode", replay_routing=True),
            "replay_routing replays routing into one full",
        ),
        (lambda: Routers(modules="[", read=read_tiny), "not a valid regex"),
        (lambda: Routers(modules="router", read=None), "read=...\\) must be a callable"),
        (lambda: Routers(modules="router", read=read_tiny, replay=3), "replay=...\\) must be a callable"),
        (lambda: Routers(modules="router", read=read_tiny, experts=2.5), "experts=...\\) must be an int"),
    ],
)
def test_bad_routing_settings_are_refused(make: Callable[[], Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        make()


def test_bad_routing_use_names_what_to_do() -> None:
    torch.manual_seed(0)
    model, x = TinyMoE(), torch.randn(1, 4, 4)
    loss = lambda out, _: out  # noqa: E731
    with pytest.raises(ConfigurationError, match="routers must be None"):
        compare(model, (x,), ["bf16"], loss_fn=loss, routers=123)
    with pytest.raises(ConfigurationError, match="matches no module of TinyMoE"):
        compare(model, (x,), ["bf16"], loss_fn=loss, routers=Routers("gate", read_tiny))
    with pytest.raises(ConfigurationError, match="no router the plugin knows"):
        compare(model, (x,), ["bf16_replay"], loss_fn=loss)
    with pytest.raises(ConfigurationError, match="the replay rule of Linear is not known"):
        compare(model, (x,), ["bf16_replay"], loss_fn=loss, routers=Routers("router", read_tiny))
    with pytest.raises(ConfigurationError, match=r"Routers\.read must return"):
        compare(model, (x,), ["bf16"], loss_fn=loss, routers=Routers("router", lambda m, o: (o,)))
    with pytest.raises(ConfigurationError, match=r"Routers\.read raised ValueError"):
        compare(model, (x,), ["bf16"], loss_fn=loss, routers=Routers("router", lambda m, o: int("x")))
    moe = tiny_moe(seed=0)
    with pytest.raises(ConfigurationError, match=r"replay_routing='bf16_decode' names no variant.*list 'bf16_decode'"):
        compare(moe, batch(), [Variant("r", dtype="bfloat16", replay_routing="bf16_decode"), "bf16_decode"])


def test_under_torch_distributed_routing_is_refused_or_off() -> None:
    from pytest_precision.engine.batch import to_batch
    from pytest_precision.engine.runner import Runner

    model = tiny_moe(seed=0)
    for routers, replay, refused in (
        (None, False, False),
        (None, True, True),
        (Routers("model.*gate", read_tiny), False, True),
    ):
        runner = Runner(
            model,
            to_batch(batch()),
            torch.device("cpu"),
            None,
            False,
            None,
            temperature=1.0,
            clip_eps=0.2,
            logprob_dtype=torch.float32,
            routers=routers,
        )
        runner.distributed = True
        variant = Variant("v", replay_routing=replay)
        if refused:
            with pytest.raises(ConfigurationError, match=r"not under torch\.distributed.*routers=False"):
                runner._routers(model, variant)
        else:
            assert runner._routers(model, variant) == {}


def test_the_users_model_is_left_as_it_was() -> None:
    model = tiny_moe(seed=0)
    before = copy.deepcopy(model.state_dict())
    hooks = [(m._forward_hooks.copy(), m._forward_pre_hooks.copy()) for m in model.modules()]
    compare(model, batch(), ["bf16_replay", "bf16_decode"], isolate=True)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert hooks == [(m._forward_hooks.copy(), m._forward_pre_hooks.copy()) for m in model.modules()]


def test_packed_routing_follows_the_calls_token_grid() -> None:
    from pytest_precision.engine.routers import RouterChoice, packed

    indices = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2], [0, 2], [1, 3]])
    weights = torch.rand(6, 2)
    choice = RouterChoice(indices, weights, torch.arange(6, dtype=torch.float64))
    on_grid = packed(choice, (2, 3))
    assert on_grid.shape == (2, 3, 5) and on_grid.dtype == torch.float64
    assert torch.equal(on_grid[1, 0, :2], torch.tensor([3.0, 2.0])) and on_grid[1, 2, 4] == 5
    assert torch.equal(on_grid[..., 2:4].reshape(6, 2), weights.double())
    # No grid, or one whose tokens are not the router's: one row of all tokens.
    assert packed(choice, None).shape == (1, 6, 5)
    assert packed(choice, (2, 4)).shape == (1, 6, 5)


def test_nan_median_is_numpys_median_of_the_values_that_are_not_nan() -> None:
    from pytest_precision.numbers.routing import nan_median

    nan = math.nan
    for values in ([1.0, 3.0], [5.0], [nan, 2.0, 4.0, nan], [3.0, nan, 1.0, 2.0], [7.0, 1.0, 4.0, 2.0]):
        finite = [v for v in values if not math.isnan(v)]
        assert float(nan_median(torch.tensor(values, dtype=torch.float64))) == pytest.approx(np.median(finite))
    assert math.isnan(float(nan_median(torch.tensor([nan, nan], dtype=torch.float64))))


def test_routers_know_their_expert_count_and_take_a_list_of_patterns() -> None:
    from pytest_precision.engine.routers import find_routers

    found = find_routers(tiny_moe("mixtral", seed=0), None)
    assert {router.experts for router in found.values()} == {8}
    spec = Routers(modules=[r"nothing", r"model\.layers\.1\.mlp\.gate"], read=read_tiny, experts=5)
    assert spec.modules == ("nothing", r"model\.layers\.1\.mlp\.gate")
    chosen = find_routers(tiny_moe("mixtral", seed=0), spec)
    assert list(chosen) == ["model.layers.1.mlp.gate"] and chosen["model.layers.1.mlp.gate"].experts == 5
    assert find_routers(tiny_moe("mixtral", seed=0), False) == {}
    for bad in ([], [1], None):
        with pytest.raises(ConfigurationError, match=r"Routers\(modules=\.\.\.\): give a regex or a list"):
            Routers(modules=bad, read=read_tiny)  # type: ignore[arg-type]


def test_routers_false_turns_transformers_routers_off() -> None:
    report = compare(tiny_moe(seed=0), batch(), ["bf16"], routers=False)
    assert report.records("bf16", "routing") == [] and report.records("bf16", "fw")


class OldStyleTopkRouter(nn.Module):
    """transformers 4.56's DeepseekV3TopkRouter returned (indices, weights): not a router the plugin can read."""

    def __init__(self) -> None:
        super().__init__()
        self.top_k = 2
        self.weight = nn.Parameter(torch.randn(4, 8))

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, indices = F.linear(hidden, self.weight).softmax(-1).topk(2, dim=-1)
        return indices, weights


class WithOldRouter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = OldStyleTopkRouter()
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, weights = self.gate(x)
        return (self.out(x).squeeze(-1) * weights.sum(-1)).sum()


@pytest.mark.parametrize(
    "read, message",
    [
        (lambda m, o: (o[0].float(), o[1]), "its indices must be integers, got torch.float32"),
        (lambda m, o: (o[0], o[1].long()), "expected integer indices and float weights of one shape"),
        (lambda m, o: (o[0], o[1][..., :1]), "expected integer indices and float weights of one shape"),
        (lambda m, o: (o[0].tolist(), o[1]), "its indices and weights must be tensors"),
        (lambda m, o: (o[0], o[1].tolist()), "its indices and weights must be tensors"),
    ],
)
def test_a_routers_read_giving_the_wrong_things_is_refused(read: Any, message: str) -> None:
    model, x = WithOldRouter(), torch.randn(2, 3, 8)
    with pytest.raises(ConfigurationError, match=f"router 'gate': {message}"):
        compare(model, (x,), ["bf16"], loss_fn=lambda out, _: out, routers=Routers("gate", read))


def test_a_transformers_like_router_of_another_output_is_refused_naming_it() -> None:
    model, x = WithOldRouter(), torch.randn(2, 3, 8)
    with pytest.raises(
        ConfigurationError, match=r"router 'gate' \(OldStyleTopkRouter\) does not return \(router_logits"
    ):
        compare(model, (x,), ["bf16"], loss_fn=lambda out, _: out)
    report = compare(model, (x,), ["bf16"], loss_fn=lambda out, _: out, routers=False)
    assert report.records("bf16", "routing") == []
