"""Compiled variants (Variant(compile=...)): the compiled program is what is measured, rows for every selected
module, what ran said and gated, and torch's compiler state left as found.

The Inductor runs share one comparison (`llama_report`): compiling is the slow part of these tests."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

from conftest import tiny_llama
from pytest_precision import (
    BUILTIN_VARIANTS,
    CompileSpec,
    ConfigurationError,
    ModelRunError,
    NotSupportedHere,
    PrecisionReport,
    Variant,
    compare,
)
from pytest_precision.base.torch_version import torch_version
from pytest_precision.engine.compile_build import _call_forward, cpu_vector_isa, inductor_settings, regions_of
from pytest_precision.gate.checks import check_against_baseline
from pytest_precision.gate.tolerance_rules import ToleranceRules
from pytest_precision.reports.tables import format_report

KINDS = ("fw", "bw", "grad", "fw_isolated", "bw_isolated", "grad_isolated")


def llama_batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


@pytest.fixture(scope="module")
def llama_report() -> PrecisionReport:
    variants = [
        Variant("bf16", dtype="bfloat16", isolate=True),
        Variant("bf16_compiled", dtype="bfloat16", compile=True, isolate=True),
        "bf16_compiled_emulated",
        "bf16_compiled_aot_eager",
        "fp32_compiled",
        Variant("bf16_dynamo_eager", dtype="bfloat16", compile="eager", isolate=True),
    ]
    return compare(tiny_llama(layers=2), llama_batch(), variants=variants)


def rows(report: PrecisionReport, variant: str, kinds: tuple[str, ...] = KINDS) -> dict[tuple[str, str], float]:
    return {(r.name, r.kind): r.rms_rel for r in report.records(variant) if r.kind in kinds}


def test_compiled_rows_cover_every_selected_module_forward_and_backward(llama_report: PrecisionReport) -> None:
    eager, compiled = rows(llama_report, "bf16"), rows(llama_report, "bf16_compiled")
    assert set(compiled) == set(eager)
    blocks = ["model.layers.0", "model.layers.1"]
    for kind in ("fw", "bw", "fw_isolated", "bw_isolated"):
        assert all((block, kind) in compiled for block in blocks)
    assert ("model.layers.1.mlp.down_proj.weight", "grad") in compiled
    assert llama_report.missing.get("bf16_compiled", []) == []


def test_inductor_bf16_is_not_eager_bf16_relabelled(llama_report: PrecisionReport) -> None:
    eager, compiled = rows(llama_report, "bf16"), rows(llama_report, "bf16_compiled")
    # The blocks fuse: their numbers move.
    for kind in ("fw", "bw", "fw_isolated"):
        assert compiled[("model.layers.1", kind)] != eager[("model.layers.1", kind)]
    differing = [key for key in compiled if compiled[key] != eager[key]]
    assert len(differing) > len(compiled) / 2


def test_an_inductor_option_changes_the_compiled_numbers(llama_report: PrecisionReport) -> None:
    default, emulated = rows(llama_report, "bf16_compiled"), rows(llama_report, "bf16_compiled_emulated", ("fw",))
    if torch_version() >= (2, 13):  # torch 2.6's CPU code generation ignores emulate_precision_casts
        assert any(emulated[key] != default[key] for key in emulated)
    settings = llama_report.runs["bf16_compiled_emulated"].compiled["numeric_settings"]  # type: ignore[index]
    assert settings["emulate_precision_casts"] is True
    assert llama_report.runs["bf16_compiled"].compiled["numeric_settings"]["emulate_precision_casts"] is False  # type: ignore[index]


def test_dynamo_with_the_eager_backend_measures_exactly_eager(llama_report: PrecisionReport) -> None:
    assert rows(llama_report, "bf16_dynamo_eager") == rows(llama_report, "bf16")


def test_every_compiled_builtin_gives_every_row(llama_report: PrecisionReport) -> None:
    expected = set(rows(llama_report, "bf16", ("fw", "bw", "grad", "logprob", "loss")))
    for name in ("bf16_compiled", "bf16_compiled_emulated", "bf16_compiled_aot_eager", "fp32_compiled"):
        assert set(rows(llama_report, name, ("fw", "bw", "grad", "logprob", "loss"))) == expected, name
        assert all(r.nonfinite == 0 and r.rms_rel is not None for r in llama_report.records(name)), name
        assert llama_report.missing[name] == [], name
    # Inductor's fp32 reorders sums: rounding-level differences, far below bf16's.
    fp32 = rows(llama_report, "fp32_compiled", ("fw", "bw", "grad"))
    assert 0 < max(fp32.values()) < 1e-5
    assert llama_report.runs["fp32_compiled"].parameter_dtypes == {"float32": 21}


def test_forward_only_gives_the_same_forward_numbers() -> None:
    full = compare(net(), net_input(), variants=[DYNAMO_EAGER_BF16], loss_fn=square_loss)
    forward = compare(net(), net_input(), variants=[DYNAMO_EAGER_BF16], loss_fn=square_loss, backward=False)
    assert forward.records("bf16_dynamo") == [r for r in full.records("bf16_dynamo") if r.kind in ("fw", "loss")]
    assert forward.runs["bf16_dynamo"].compiled == full.runs["bf16_dynamo"].compiled


def test_the_report_says_what_was_compiled(llama_report: PrecisionReport) -> None:
    compiled = llama_report.runs["bf16_compiled"].compiled
    assert compiled is not None and llama_report.runs["bf16"].compiled is None
    assert compiled["scope"] == "regional" and compiled["backend"] == "inductor" and compiled["graph_breaks"] == 0
    assert compiled["regions"] == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head"]
    cost = llama_report.compile_costs["bf16_compiled"]
    assert cost["runs"] == 2 and cost["compilations"] >= 10 and 0 < cost["compile_seconds"] <= cost["run_seconds"]
    text = format_report(llama_report)
    assert "  bf16_compiled: regional torch.compile, backend inductor; 5 region(s), 0 graph break(s); compiling" in text
    assert "  bf16_compiled_emulated: regional torch.compile, backend inductor, emulate_precision_casts=True;" in text
    isa = cpu_vector_isa("cpu")
    assert isa is not None and llama_report.runs["bf16_compiled"].compiled["cpu_isa"] == isa[0]  # type: ignore[index]
    assert f"    inductor (CPU code for {isa[0]}): emulate_precision_casts=False, fallback_random=False" in text
    assert "bf16:" not in text.split("\n\n")[0]  # eager variants get no compile line


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class CompiledOnlyRounding(Block):
    """A kernel choice made only when compiled (as code switching on torch.compiler.is_compiling() does): its
    output goes through bf16."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if torch.compiler.is_compiling():
            out = out.to(torch.bfloat16).to(out.dtype)
        return out


class BreakingBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(self.norm(x))
        torch._dynamo.graph_break()
        return x + self.down(torch.nn.functional.gelu(h))


class EagerBlock(Block):
    @torch._dynamo.disable  # type: ignore[misc]
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


class Net(nn.Module):
    def __init__(self, block: type[Block] = Block, planted: int | None = None, width: int = 16) -> None:
        super().__init__()
        self.proj_in = nn.Linear(8, width)
        self.blocks = nn.ModuleList((CompiledOnlyRounding if i == planted else block)(width) for i in range(3))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj_in(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def net(block: type[Block] = Block, planted: int | None = None) -> Net:
    torch.manual_seed(0)
    return Net(block, planted)


def net_input() -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1))


def square_loss(output: torch.Tensor, _inputs: Any) -> torch.Tensor:
    return output.float().square().mean()


DYNAMO_EAGER = Variant("fp32_dynamo_eager", dtype="float32", compile="eager")
DYNAMO_EAGER_BF16 = Variant("bf16_dynamo", dtype="bfloat16", compile="eager")


def test_a_change_only_the_compiled_path_takes_is_named_first_by_the_gate() -> None:
    clean = compare(net(), net_input(), variants=[DYNAMO_EAGER], loss_fn=square_loss)
    planted = compare(net(planted=1), net_input(), variants=[DYNAMO_EAGER], loss_fn=square_loss)
    eager = compare(net(planted=1), net_input(), variants=["fp32"], loss_fn=square_loss)
    # Eager, the planted block computes what the clean one does: only the compiled run sees it.
    assert all(r.rms_rel == 0 for r in eager.records("fp32"))
    assert all(r.rms_rel == 0 for r in clean.records("fp32_dynamo_eager"))
    result = check_against_baseline(
        {"fp32_dynamo_eager": clean.records("fp32_dynamo_eager")},
        {"fp32_dynamo_eager": planted.records("fp32_dynamo_eager")},
        ToleranceRules(rtol=0.1, atol=1e-7),
    )
    first = result.violations[0]
    assert (first.name, first.kind) == ("blocks.1", "fw")
    assert {(v.name, v.kind) for v in result.violations} >= {("blocks.2", "fw"), ("blocks.1", "bw")}
    assert ("blocks.0", "fw") not in {(v.name, v.kind) for v in result.violations}


def test_a_graph_break_is_reported_with_its_reason() -> None:
    report = compare(net(BreakingBlock), net_input(), variants=[DYNAMO_EAGER], loss_fn=square_loss)
    compiled = report.runs["fp32_dynamo_eager"].compiled
    assert compiled is not None and compiled["graph_breaks"] >= 1 and compiled["graphs_per_call"] == 2
    assert any("graph_break" in reason for reason in compiled["break_reasons"])  # dynamo's words, per torch
    breaks, reason = compiled["graph_breaks"], compiled["break_reasons"][0]
    assert f"3 region(s), {breaks} graph break(s) ({reason}), up to 2 graphs per region call" in format_report(report)
    # Split graphs still ran compiled code: measured, and equal to eager with the eager backend.
    assert all(r.rms_rel == 0 for r in report.records("fp32_dynamo_eager"))


def test_fullgraph_turns_a_graph_break_into_a_failure() -> None:
    variant = Variant("fp32_fullgraph", compile={"backend": "eager", "fullgraph": True})
    with pytest.raises(ModelRunError, match=r"Net raised Unsupported: .*graph_break"):
        compare(net(BreakingBlock), net_input(), variants=[variant], loss_fn=square_loss)


def test_a_region_that_ran_eager_fails_with_the_reason() -> None:
    with pytest.raises(ModelRunError) as error:
        compare(net(EagerBlock), net_input(), variants=[DYNAMO_EAGER], loss_fn=square_loss)
    message = str(error.value)
    assert "variant 'fp32_dynamo_eager' is compiled (regional torch.compile, backend eager)" in message
    assert "3 of 3 compiled region(s) ran eager (blocks.0, blocks.1, blocks.2)" in message
    assert "(blocks.0, blocks.1, blocks.2): graph break: " in message  # then dynamo's own words, per torch


def test_a_backend_error_suppressed_by_dynamo_fails_with_the_error() -> None:
    def broken_backend(graph: Any, example_inputs: Any) -> Any:
        raise RuntimeError("planted lowering failure")

    variant = Variant("fp32_broken", compile={"backend": broken_backend})
    with torch._dynamo.config.patch(suppress_errors=True):
        with pytest.raises(ModelRunError, match=r"suppress_errors.*planted lowering failure"):
            compare(net(), net_input(), variants=[variant], loss_fn=square_loss)
        assert torch._dynamo.config.suppress_errors is True


def compiler_state() -> dict[str, Any]:
    from torch._dynamo import convert_frame, eval_frame, utils

    with warnings.catch_warnings():  # reading a deprecated setting warns
        warnings.simplefilter("ignore")
        return {
            "dynamo": torch._dynamo.config.get_config_copy(),
            "inductor": torch._inductor.config.get_config_copy(),
            "counters": {key: dict(value) for key, value in utils.counters.items() if value},
            "codes": set(convert_frame.input_codes.seen_ids),
            "backends": set(eval_frame.cached_backends),
            "own entries": len(eval_frame._debug_get_cache_entry_list(_call_forward.__code__)),
            "block entries": len(eval_frame._debug_get_cache_entry_list(Block.forward.__code__)),
        }


@pytest.mark.parametrize("block", [Block, BreakingBlock, EagerBlock], ids=["compiled", "broken", "eager"])
def test_the_compiler_state_and_the_model_are_as_found(block: type[Block]) -> None:
    model = net(block)
    weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    before = compiler_state()
    try:
        compare(model, net_input(), variants=[DYNAMO_EAGER], loss_fn=square_loss)
    except ModelRunError:
        assert block is EagerBlock
    assert compiler_state() == before
    assert before["own entries"] == 0
    assert all("forward" not in module.__dict__ for module in model.modules())
    assert all(torch.equal(weights[name], tensor) for name, tensor in model.state_dict().items())
    assert all(parameter.grad is None for parameter in model.parameters())


def test_the_users_own_compile_afterwards_compiles_afresh() -> None:
    model = net()
    compare(model, net_input(), variants=[DYNAMO_EAGER], loss_fn=square_loss)
    graphs: list[Any] = []

    def counting(graph: Any, example_inputs: Any) -> Any:
        graphs.append(graph)
        return graph.forward

    compiled = torch.compile(model, backend=counting)
    assert torch.equal(compiled(net_input()), model(net_input()))
    assert len(graphs) == 1  # the user's whole model, none of the plugin's regions reused
    torch._dynamo.reset()


def test_whole_graph_compilation_measures_what_a_graph_can_give() -> None:
    variant = Variant("fp32_whole", compile={"backend": "eager", "scope": "whole"})
    report = compare(net(), net_input(), variants=[variant], loss_fn=square_loss)
    kinds = {r.kind for r in report.records("fp32_whole")}
    assert kinds == {"loss", "grad"}
    assert report.missing.get("fp32_whole", []) == []
    assert report.runs["fp32_whole"].compiled["regions"] == ["<whole model>"]  # type: ignore[index]


def test_whole_graph_compilation_has_nothing_to_isolate() -> None:
    with pytest.raises(ConfigurationError, match=r"isolate=True measures each compiled block .* needs regional"):
        Variant("x", compile={"scope": "whole"}, isolate=True)
    report = compare(
        net(),
        net_input(),
        variants=[Variant("w", compile={"backend": "eager", "scope": "whole"})],
        isolate=True,
        loss_fn=square_loss,
    )
    assert not any(r.kind.endswith("_isolated") for r in report.records("w"))


def test_no_cpp_compiler_refuses_inductor_before_the_reference_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._inductor.cpp_builder as cpp_builder

    def no_compiler() -> str:
        raise RuntimeError("Failed to find C++ compiler")

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", no_compiler)
    built: list[torch.dtype] = []

    def factory(dtype: torch.dtype, device: torch.device) -> Net:
        built.append(dtype)
        return net().to(dtype)

    with pytest.raises(NotSupportedHere, match=r"'bf16_compiled': Inductor compiles C\+\+ on a CPU and found no C\+\+"):
        compare(factory, net_input(), variants=["bf16", "bf16_compiled"], loss_fn=square_loss)
    assert built == []
    # aot_eager generates no code: it runs.
    compare(factory, net_input(), variants=[Variant("a", compile="aot_eager")], loss_fn=square_loss)


def test_inductor_cpu_code_is_cached_under_its_vector_isa() -> None:
    # Inductor's FX-graph cache key leaves out the ISA ATEN_CPU_CAPABILITY picks: without the explicit width, a kernel
    # cached by an AVX-512 process was served to an AVX2-pinned one and computed 1e38 for a norm (torch 2.13).
    isa = cpu_vector_isa("cpu")
    assert isa is not None
    assert inductor_settings(CompileSpec(), "cpu") == {"cpp.simdlen": isa[1]}
    assert inductor_settings(CompileSpec(options={"cpp.simdlen": 128}), "cpu") == {"cpp.simdlen": 128}
    assert inductor_settings(CompileSpec(), "cuda") == {}
    assert inductor_settings(CompileSpec(backend="aot_eager"), "cpu") == {}
    # Set for the run only.
    assert torch._inductor.config.cpp.simdlen is None
    compare(net(), net_input(), variants=[Variant("a", compile="aot_eager")], loss_fn=square_loss)
    assert torch._inductor.config.cpp.simdlen is None


def test_regions_are_the_leaves_of_the_selection() -> None:
    names = ["embed", "layers.0", "layers.0.mlp", "layers.1", "norm"]
    assert regions_of(names, "regional") == ["embed", "layers.0.mlp", "layers.1", "norm"]
    assert regions_of(names, "whole") == [""]


def test_builtins() -> None:
    assert BUILTIN_VARIANTS["bf16_compiled"].compiled.backend == "inductor"  # type: ignore[union-attr]
    assert BUILTIN_VARIANTS["fp32_compiled"].dtype == "float32"
    assert BUILTIN_VARIANTS["bf16_compiled_aot_eager"].compiled.backend == "aot_eager"  # type: ignore[union-attr]
    emulated = BUILTIN_VARIANTS["bf16_compiled_emulated"].compiled
    assert emulated is not None and dict(emulated.options) == {"emulate_precision_casts": True}
    assert BUILTIN_VARIANTS["bf16"].compiled is None


def test_a_sharded_model_is_not_compiled_here() -> None:
    from pytest_precision import sharded

    with pytest.raises(ConfigurationError, match="compiled variants are measured on an unsharded model in one process"):
        compare(sharded(net(), lambda model, variant: model), net_input(), variants=[DYNAMO_EAGER], loss_fn=square_loss)


class CompiledOnlyNan(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if torch.compiler.is_compiling():
            out = out * float("nan")
        return out


def test_where_nan_first_appears_is_found_at_the_compiled_regions() -> None:
    torch.manual_seed(0)
    model = Net()
    model.blocks[1] = CompiledOnlyNan(16)
    report = compare(model, net_input(), variants=[DYNAMO_EAGER], loss_fn=square_loss)
    assert report.nonfinite_origin == {"fp32_dynamo_eager": "blocks.1 (fw)"}
    assert report.get("fp32_dynamo_eager", "blocks.0").nonfinite == 0
    assert report.get("fp32_dynamo_eager", "blocks.1").nonfinite == 64
