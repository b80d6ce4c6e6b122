"""A compiled variant's spec (Variant(compile=...)): what it accepts, what it refuses with which words, and how it
reads in a variants file (names only, under the data-file rules)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pytest_precision import CompileSpec, ConfigurationError, Variant
from pytest_precision.cli.variants_file import load_variants_file
from pytest_precision.engine.compile_build import check_compilable
from pytest_precision.engine.compile_spec import BACKEND_NAMES, OPTION_NAMES, compile_spec
from pytest_precision.engine.variants import resolve_reference


def my_backend(graph: Any, example_inputs: Any) -> Any:
    return graph.forward


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (None, None),
        (False, None),
        (True, CompileSpec()),
        ("aot_eager", CompileSpec(backend="aot_eager")),
        (
            {"mode": "max-autotune", "options": {"emulate_precision_casts": True}},
            CompileSpec(mode="max-autotune", options={"emulate_precision_casts": True}),
        ),
        (
            {"backend": "eager", "scope": "whole", "fullgraph": True, "dynamic": False},
            CompileSpec(backend="eager", scope="whole", fullgraph=True, dynamic=False),
        ),
        (CompileSpec(backend=my_backend), CompileSpec(backend=my_backend)),
    ],
)
def test_what_compile_accepts(given: object, expected: CompileSpec | None) -> None:
    assert compile_spec(given, "here") == expected
    assert Variant("v", compile=given).compiled == expected


@pytest.mark.parametrize(
    ("given", "words"),
    [
        ("tensorrt", "compile backend 'tensorrt' is not one the plugin runs; use one of inductor, aot_eager"),
        (42, "compile must be True, a backend name, a dict of torch.compile arguments or a CompileSpec, got int"),
        ({"backend": 3}, "compile backend must be a name or a callable, got 3"),
        ({"mode": "fast"}, "compile mode 'fast'; use one of default, reduce-overhead"),
        ({"backend": "aot_eager", "mode": "max-autotune"}, "compile mode and options are Inductor's; with backend"),
        ({"backend": "eager", "options": {"fallback_random": True}}, "mode and options are Inductor's"),
        ({"options": {"cpp.cxx": "sh -c 'rm -rf ~'"}}, "compile option 'cpp.cxx' is not one the plugin sets"),
        ({"options": {"__class__": 1}}, "compile option '__class__' is not one the plugin sets"),
        ({"options": {"emulate_precision_casts": "yes"}}, "'emulate_precision_casts' takes True or False, got 'yes'"),
        ({"options": {"cpp.simdlen": True}}, "'cpp.simdlen' takes an integer or None, got True"),
        ({"options": ["emulate_precision_casts"]}, "compile options must be a dict of option names to values"),
        ({"fullgraph": "yes"}, "compile fullgraph must be True or False, got 'yes'"),
        ({"dynamic": 1}, "compile dynamic must be True, False or None, got 1"),
        ({"scope": "blocks"}, "compile scope 'blocks'; use 'regional' or 'whole'"),
        ({"bakend": "eager", "mdoe": 1}, "compile has unknown key(s) bakend, mdoe; it takes backend, mode, fullgraph"),
        (CompileSpec(backend="tensorrt"), "compile backend 'tensorrt' is not one the plugin runs"),
    ],
)
def test_what_compile_refuses_and_says(given: object, words: str) -> None:
    with pytest.raises(ConfigurationError) as error:
        Variant("mine", compile=given)
    assert str(error.value).startswith("variant 'mine': ")
    assert words in str(error.value)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"arrangement": "decode"}, "an arrangement is not measured compiled"),
        ({"param_dtype": "bf16"}, "FSDP2 mixed precision is not measured compiled"),
        ({"replay_routing": True}, "routing replay is not measured compiled"),
        ({"isolate": True, "compile": {"scope": "whole"}}, "isolate=True measures each compiled block"),
    ],
)
def test_what_a_compiled_variant_does_not_combine_with(fields: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigurationError, match=words):
        Variant("mine", **{"compile": True, **fields})


def test_it_combines_with_dtype_autocast_flags_and_lowbit() -> None:
    Variant("a", dtype="bf16", autocast=True, compile=True)
    Variant("b", matmul_precision="high", backend={"cuda.matmul.allow_tf32": True}, compile="aot_eager")
    Variant("c", dtype="bf16", weight_storage="float8_e4m3fn", compile=True)


def test_the_reference_is_never_compiled() -> None:
    with pytest.raises(ConfigurationError, match="'fp32' is compiled; the reference runs eager"):
        resolve_reference(Variant("fp32", compile=True))


def test_the_spec_describes_itself_and_tells_variants_apart() -> None:
    spec = CompileSpec(mode="max-autotune", options={"fallback_random": True, "emulate_precision_casts": True})
    assert spec.describe() == (
        "regional torch.compile, backend inductor, mode max-autotune, emulate_precision_casts=True, "
        "fallback_random=True"
    )
    assert spec.to_dict() == {
        "backend": "inductor",
        "mode": "max-autotune",
        "fullgraph": False,
        "dynamic": None,
        "options": {"emulate_precision_casts": True, "fallback_random": True},
        "scope": "regional",
    }
    assert CompileSpec(backend=my_backend).to_dict()["backend"].endswith("test_compile_spec.my_backend")
    plain, emulated = Variant("v", compile=True), Variant("v", compile={"options": {"emulate_precision_casts": True}})
    assert plain != emulated and hash(plain) != hash(emulated)
    assert Variant("v").to_dict().get("compile") is None and emulated.to_dict()["compile"]["options"] == {
        "emulate_precision_casts": True
    }


def test_the_default_spec_reads_plainly_and_keeps_its_own_options() -> None:
    assert CompileSpec().describe() == "regional torch.compile, backend inductor"
    assert CompileSpec(backend="eager", fullgraph=True, dynamic=False, scope="whole").describe() == (
        "whole torch.compile, backend eager, fullgraph, dynamic=False"
    )
    given = {"fallback_random": True}
    spec = CompileSpec(options=given)
    given["emulate_precision_casts"] = True
    assert dict(spec.options) == {"fallback_random": True}


@pytest.mark.parametrize("name", sorted(OPTION_NAMES))
def test_every_listed_option_is_set_or_refused_before_the_run(name: str) -> None:
    import torch
    import torch._inductor.config as inductor_config

    owner: Any = inductor_config
    for part in name.split("."):
        owner = getattr(owner, part, None) if owner is not None else None
    value = {bool: True, str: "off"}.get(OPTION_NAMES[name], 256)  # type: ignore[call-overload]
    variant = Variant("v", compile={"options": {name: value}})
    if owner is None and name != "cpp.simdlen":  # a setting of newer torch: refused by name before anything runs
        with pytest.raises(ConfigurationError, match=f"compile option\\(s\\) {name} are not settings of torch"):
            check_compilable([variant], torch.device("cpu"))
    else:
        check_compilable([variant], torch.device("cuda"))  # no C++ check off the CPU: only the names


def test_every_named_backend_is_dynamos() -> None:
    import torch._dynamo

    for name in BACKEND_NAMES:
        assert callable(torch._dynamo.lookup_backend(name))


def write(tmp_path: Path, entries: object) -> Path:
    path = tmp_path / "variants.json"
    path.write_text(json.dumps(entries), encoding="utf-8")
    return path


def test_a_variants_file_names_a_compilation(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        [
            {"name": "c1", "dtype": "bf16", "compile": True},
            {"name": "c2", "dtype": "bf16", "compile": "aot_eager"},
            {"name": "c3", "compile": {"options": {"emulate_precision_casts": True}, "scope": "whole"}},
        ],
    )
    loaded = load_variants_file(path)
    assert [v.compiled for v in loaded] == [
        CompileSpec(),
        CompileSpec(backend="aot_eager"),
        CompileSpec(options={"emulate_precision_casts": True}, scope="whole"),
    ]


@pytest.mark.parametrize(
    ("compile", "words"),
    [
        ({"backend": {"module": "os", "name": "system"}}, "compile backend must be a backend name"),
        ({"backend": "builtins.exec"}, "compile backend 'builtins.exec' is not one the plugin runs"),
        ({"options": {"cpp.cxx": ["sh"]}}, "compile option 'cpp.cxx' is not one the plugin sets"),
        (3, "compile must be true, false, a backend name or an object"),
    ],
)
def test_a_variants_file_names_nothing_else(tmp_path: Path, compile: object, words: str) -> None:
    path = write(tmp_path, [{"name": "c", "compile": compile}])
    with pytest.raises(ConfigurationError) as error:
        load_variants_file(path)
    assert str(path) in str(error.value) and words in str(error.value)
