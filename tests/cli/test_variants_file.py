"""Variants files (`pytest-precision run --variants-file FILE`): JSON and TOML, field checks, and how they mix with
the built-in names of `--variants` (checkpoint_run.chosen_variants)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pytest_precision.base.errors import ConfigurationError, PrecisionError
from pytest_precision.cli.run import DEFAULT_VARIANTS, RunOptions, chosen_variants
from pytest_precision.cli.variants_file import FILE_FIELDS, NAME_PATTERN, _toml_module, load_variants_file
from pytest_precision.engine.arrangements import BUILTIN_ARRANGEMENTS
from pytest_precision.engine.backend_flags import has_fp32_precision_settings
from pytest_precision.engine.variants import BUILTIN_VARIANTS, HEAD_MODULE, Variant

needs_toml = pytest.mark.skipif(_toml_module() is None, reason="reading TOML needs Python 3.11+ or tomli")

REDUCED_BF16 = "cuda.matmul.allow_bf16_reduced_precision_reduction"
#: torch >= 2.9 has string-valued backend flags (fp32_precision); older torch has none.
NEW_API = has_fp32_precision_settings()
new_api_only = pytest.mark.skipif(not NEW_API, reason="torch < 2.9 has no fp32_precision backend flags")

# One file's content, as JSON entries and as the equivalent TOML (no null in TOML: attn_implementation is left out
# where the JSON would give null).
ENTRIES: list[dict[str, Any]] = [
    {
        "name": "bf16_head_eager",
        "dtype": "bf16",
        "fp32_modules": [HEAD_MODULE, r"model\.layers\.0\..*"],
        "backend": {REDUCED_BF16: True},
        "attn_implementation": "eager",
    },
    {"name": "fp16_autocast_tf32", "dtype": "fp16", "autocast": True, "matmul_precision": "high"},
    {"name": "bf16_decode", "dtype": "bfloat16", "arrangement": "decode"},
    {"name": "plain.v-2+x"},
]
TOML_TEXT = f"""\
[[variants]]
name = "bf16_head_eager"
dtype = "bf16"
fp32_modules = ["{HEAD_MODULE}", 'model\\.layers\\.0\\..*']
backend = {{ "{REDUCED_BF16}" = true }}
attn_implementation = "eager"

[[variants]]
name = "fp16_autocast_tf32"
dtype = "fp16"
autocast = true
matmul_precision = "high"

[[variants]]
name = "bf16_decode"
dtype = "bfloat16"
arrangement = "decode"

[[variants]]
name = "plain.v-2+x"
"""
EXPECTED: list[Variant] = [
    Variant(
        "bf16_head_eager",
        dtype="bfloat16",
        fp32_modules=(HEAD_MODULE, r"model\.layers\.0\..*"),
        backend={REDUCED_BF16: True},
        attn_implementation="eager",
    ),
    Variant("fp16_autocast_tf32", dtype="float16", autocast=True, matmul_precision="high"),
    Variant("bf16_decode", dtype="bfloat16", arrangement="decode"),
    Variant("plain.v-2+x"),
]


def write(directory: Path, name: str, content: str | bytes | object) -> Path:
    """A file `name` in `directory` holding `content`: bytes or text as is, anything else as JSON."""
    path = directory / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, str):
        path.write_text(content, encoding="utf-8")
    else:
        path.write_text(json.dumps(content), encoding="utf-8")
    return path


# --- what a good file gives ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("file_name", "content"),
    [
        pytest.param("v.json", ENTRIES, id="json-list"),
        pytest.param("v.json", {"variants": ENTRIES}, id="json-object"),
        pytest.param("v.toml", TOML_TEXT, id="toml", marks=needs_toml),
        pytest.param("V.TOML", TOML_TEXT, id="toml-upper-suffix", marks=needs_toml),
    ],
)
def test_json_list_object_and_toml_give_the_same_variants(tmp_path: Path, file_name: str, content: object) -> None:
    """A JSON list, a {"variants": [...]} object and [[variants]] TOML tables give the Variants built directly."""
    loaded = load_variants_file(write(tmp_path, file_name, content))
    assert loaded == EXPECTED
    assert [v.name for v in loaded] == [e["name"] for e in ENTRIES]  # file order
    head, autocast, decode, plain = loaded
    assert head.dtype == "bfloat16"  # the alias "bf16" normalised
    assert isinstance(head.fp32_modules, tuple)
    assert head.fp32_modules == (HEAD_MODULE, r"model\.layers\.0\..*")
    assert head.backend == {REDUCED_BF16: True}
    assert head.attn_implementation == "eager"
    assert (autocast.dtype, autocast.autocast, autocast.matmul_precision) == ("float16", True, "high")
    assert autocast.weight_dtype == "float32"
    assert decode.arrangement_name == "decode"
    assert decode.arrangement is BUILTIN_ARRANGEMENTS["decode"]
    assert plain == Variant("plain.v-2+x")
    assert (plain.dtype, plain.autocast, plain.fp32_modules, plain.backend) == ("float32", False, (), {})
    assert (plain.matmul_precision, plain.attn_implementation, plain.arrangement) == ("highest", None, None)
    assert all(v.prepare is None and not v.fsdp_knobs and not v.isolate for v in loaded)


def test_the_three_forms_are_equal_to_each_other(tmp_path: Path) -> None:
    """The same entries give equal (and equally hashed) variants whichever form the file takes."""
    forms = [
        load_variants_file(write(tmp_path, "list.json", ENTRIES)),
        load_variants_file(write(tmp_path, "object.json", {"variants": ENTRIES})),
    ]
    if _toml_module() is not None:
        forms.append(load_variants_file(write(tmp_path, "v.toml", TOML_TEXT)))
    for form in forms[1:]:
        assert form == forms[0]
        assert [hash(v) for v in form] == [hash(v) for v in forms[0]]
        assert [v.to_dict() for v in form] == [v.to_dict() for v in forms[0]]


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("fp32", "float32"),
        ("float32", "float32"),
        ("bf16", "bfloat16"),
        ("bfloat16", "bfloat16"),
        ("fp16", "float16"),
        ("float16", "float16"),
        ("fp64", "float64"),
        ("float64", "float64"),
    ],
)
def test_dtype_aliases_become_long_names(tmp_path: Path, given: str, expected: str) -> None:
    """Each documented dtype spelling loads as its long name."""
    (variant,) = load_variants_file(write(tmp_path, "v.json", [{"name": "x", "dtype": given}]))
    assert variant.dtype == expected
    assert variant == Variant("x", dtype=expected)  # type: ignore[arg-type]


def test_null_attn_implementation_and_empty_fp32_modules_are_the_defaults(tmp_path: Path) -> None:
    """JSON null for attn_implementation and an empty fp32_modules list mean what leaving them out means."""
    (variant,) = load_variants_file(
        write(tmp_path, "v.json", [{"name": "x", "attn_implementation": None, "fp32_modules": []}])
    )
    assert variant.attn_implementation is None
    assert variant.fp32_modules == ()
    assert variant == Variant("x")


def test_every_arrangement_and_matmul_precision_loads(tmp_path: Path) -> None:
    """Every built-in arrangement and matmul precision is accepted and kept."""
    entries = [{"name": f"a_{a}", "arrangement": a} for a in BUILTIN_ARRANGEMENTS]
    entries += [{"name": f"m_{m}", "matmul_precision": m} for m in ("highest", "high", "medium")]
    loaded = load_variants_file(write(tmp_path, "v.json", entries))
    assert [v.arrangement_name for v in loaded[: len(BUILTIN_ARRANGEMENTS)]] == list(BUILTIN_ARRANGEMENTS)
    assert [v.matmul_precision for v in loaded[len(BUILTIN_ARRANGEMENTS) :]] == ["highest", "high", "medium"]


def test_backend_flags_of_each_type_are_kept(tmp_path: Path) -> None:
    """Backend flags given a value of their current type are kept as given (bool and str flags alike)."""
    backend: dict[str, Any] = {REDUCED_BF16: False, "cudnn.allow_tf32": True}
    if NEW_API:
        backend["cuda.matmul.fp32_precision"] = "ieee"
    (variant,) = load_variants_file(write(tmp_path, "v.json", [{"name": "x", "backend": backend}]))
    assert variant.backend == backend
    assert variant == Variant("x", backend=backend)


def test_utf8_bom_and_str_path_are_accepted(tmp_path: Path) -> None:
    """A UTF-8 file with a byte-order mark loads, and the path may be given as a str."""
    path = write(tmp_path, "v.json", b"\xef\xbb\xbf" + json.dumps([{"name": "x", "dtype": "bf16"}]).encode())
    assert load_variants_file(str(path)) == [Variant("x", dtype="bfloat16")]


def test_file_fields_are_the_documented_ones() -> None:
    """The fields a file may give are exactly the Variant fields that need no Python, all real Variant fields."""
    assert list(FILE_FIELDS) == [
        "name",
        "dtype",
        "autocast",
        "fp32_modules",
        "matmul_precision",
        "backend",
        "attn_implementation",
        "arrangement",
        "fp8_training",
        "quantize",
        "weight_storage",
        "replay_routing",
        "compile",
        "implementation",
    ]
    assert set(FILE_FIELDS) <= set(Variant.__dataclass_fields__)


# --- what a bad file gives ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bad:
    """A bad variants file: its name and content, the entry the error must name ("" for the file itself,
    else e.g. "variant 2 ('x')") and fragments of the reason the message must hold."""

    file_name: str
    content: str | bytes | object
    entry: str
    reasons: tuple[str, ...]


OK = {"name": "ok"}

BAD_FILES: dict[str, Bad] = {
    "unknown-field": Bad(
        "v.json",
        [OK, {"name": "x", "dtpye": "bf16", "zzz": 1}],
        "variant 2 ('x')",
        ("unknown field(s) 'dtpye', 'zzz'", "a variant takes " + ", ".join(FILE_FIELDS)),
    ),
    "python-only-field": Bad(
        "v.json",
        [{"name": "x", "prepare": "m.f", "isolate": True}],
        "variant 1 ('x')",
        ("unknown field(s) 'isolate', 'prepare'",),
    ),
    "missing-name": Bad("v.json", [OK, {"dtype": "bf16"}], "variant 2", ("'name' must be", "got None")),
    "name-not-str": Bad("v.json", [{"name": 5}], "variant 1", ("'name' must be", "got 5")),
    "name-with-slash": Bad("v.json", [{"name": "a/b"}], "variant 1 ('a/b')", ("'name' must be", "got 'a/b'")),
    "name-with-dot-first": Bad(
        "v.json", [{"name": ".hidden"}], "variant 1 ('.hidden')", ("'name' must be", "got '.hidden'")
    ),
    "name-empty": Bad("v.json", [{"name": ""}], "variant 1 ('')", ("'name' must be", "got ''")),
    "name-with-space": Bad("v.json", [{"name": "a b"}], "variant 1 ('a b')", ("'name' must be", "got 'a b'")),
    "name-reserved": Bad(
        "v.json", [OK, {"name": "reference"}], "variant 2 ('reference')", ("taken by the reference run's files",)
    ),
    "entry-not-object": Bad("v.json", [OK, "bf16"], "variant 2", ("a variant is an object of fields, got str",)),
    "dtype-unknown": Bad(
        "v.json", [{"name": "x", "dtype": "int8"}], "variant 1 ('x')", ("dtype must be one of float32", "got 'int8'")
    ),
    "dtype-not-str": Bad("v.json", [{"name": "x", "dtype": 16}], "variant 1 ('x')", ("dtype must be", "got 16")),
    "autocast-not-bool": Bad(
        "v.json",
        [{"name": "x", "dtype": "bf16", "autocast": "yes"}],
        "variant 1 ('x')",
        ("autocast must be true or false, got 'yes'",),
    ),
    "autocast-int": Bad(
        "v.json", [{"name": "x", "dtype": "bf16", "autocast": 1}], "variant 1 ('x')", ("autocast must be", "got 1")
    ),
    "autocast-with-float32": Bad(
        "v.json",
        [OK, {"name": "x", "dtype": "float32", "autocast": True}],
        "variant 2 ('x')",
        ("autocast needs dtype bfloat16 or float16",),
    ),
    "autocast-with-default-dtype": Bad(
        "v.json", [{"name": "x", "autocast": True}], "variant 1 ('x')", ("autocast needs dtype bfloat16 or float16",)
    ),
    "fp32-modules-a-string": Bad(
        "v.json",
        [{"name": "x", "fp32_modules": "lm_head"}],
        "variant 1 ('x')",
        ("fp32_modules must be a list of regexes", "got 'lm_head'"),
    ),
    "fp32-modules-not-strings": Bad(
        "v.json", [{"name": "x", "fp32_modules": ["lm_head", 3]}], "variant 1 ('x')", ("fp32_modules must be",)
    ),
    "fp32-modules-empty-pattern": Bad(
        "v.json", [{"name": "x", "fp32_modules": [""]}], "variant 1 ('x')", ("fp32_modules must be", "got ['']")
    ),
    "fp32-modules-bad-regex": Bad(
        "v.json",
        [{"name": "x", "fp32_modules": ["lm_head", "("]}],
        "variant 1 ('x')",
        ("fp32_modules: '(' is not a regex",),
    ),
    "matmul-precision-unknown": Bad(
        "v.json",
        [{"name": "x", "matmul_precision": "fast"}],
        "variant 1 ('x')",
        ("matmul_precision must be one of highest, high, medium, got 'fast'",),
    ),
    "backend-not-object": Bad(
        "v.json",
        [{"name": "x", "backend": "tf32"}],
        "variant 1 ('x')",
        ("backend must be an object of torch.backends flag paths", "got 'tf32'"),
    ),
    "backend-a-list": Bad(
        "v.json", [{"name": "x", "backend": [REDUCED_BF16]}], "variant 1 ('x')", ("backend must be an object",)
    ),
    "backend-unknown-flag": Bad(
        "v.json",
        [{"name": "x", "backend": {"cuda.matmul.no_such_flag": True}}],
        "variant 1 ('x')",
        (
            "backend flag 'cuda.matmul.no_such_flag' is not one of the torch.backends settings a variant may set: ",
            "cuda.matmul.allow_tf32, ",
        ),
    ),
    "backend-flag-wrong-type": Bad(
        "v.json",
        [{"name": "x", "backend": {"cuda.matmul.allow_tf32": "yes"}}],
        "variant 1 ('x')",
        ("backend flag 'cuda.matmul.allow_tf32' takes true or false, got 'yes'",),
    ),
    "backend-bool-flag-given-int": Bad(
        "v.json",
        [{"name": "x", "backend": {REDUCED_BF16: 1}}],
        "variant 1 ('x')",
        (f"backend flag '{REDUCED_BF16}' takes true or false, got 1",),
    ),
    "backend-str-flag-given-bool": Bad(
        "v.json",
        [{"name": "x", "backend": {"cuda.matmul.fp32_precision": True}}],
        "variant 1 ('x')",
        ("backend flag 'cuda.matmul.fp32_precision' takes one of 'ieee', 'tf32', 'none', got True",),
    ),
    "attn-implementation-not-str": Bad(
        "v.json",
        [{"name": "x", "attn_implementation": 3}],
        "variant 1 ('x')",
        ("attn_implementation must be", "got 3"),
    ),
    "attn-implementation-empty": Bad(
        "v.json", [{"name": "x", "attn_implementation": ""}], "variant 1 ('x')", ("attn_implementation must be",)
    ),
    "arrangement-unknown": Bad(
        "v.json",
        [{"name": "x", "arrangement": "sideways"}],
        "variant 1 ('x')",
        ("arrangement must be one of decode, batch_alone, left_padded, got 'sideways'",),
    ),
    "duplicate-names": Bad(
        "v.json",
        [{"name": "a"}, {"name": "b"}, {"name": "a", "dtype": "bf16"}],
        "variant 3 ('a')",
        ("the name 'a' is given twice in the file",),
    ),
    "empty-list": Bad("v.json", [], "", ("'variants' must be a non-empty list of variants, got an empty list",)),
    "empty-variants-object": Bad(
        "v.json", {"variants": []}, "", ("'variants' must be a non-empty list", "got an empty list")
    ),
    "variants-not-a-list": Bad("v.json", {"variants": "bf16"}, "", ("'variants' must be a non-empty list", "got str")),
    "object-with-extra-key": Bad(
        "v.json",
        {"variants": [OK], "extra": 1},
        "",
        ("an object with only 'variants'", "found key(s) 'extra', 'variants'"),
    ),
    "object-without-variants": Bad(
        "v.json", {"variant": [OK]}, "", ("an object with only 'variants'", "found key(s) 'variant'")
    ),
    "empty-object": Bad("v.json", {}, "", ("an object with only 'variants'", "found key(s) none")),
    "top-level-string": Bad("v.json", '"bf16"', "", ("'variants' must be a non-empty list of variants, got str",)),
    "top-level-number": Bad("v.json", 3, "", ("'variants' must be a non-empty list of variants, got int",)),
    "invalid-json": Bad(
        "v.json",
        '[\n  {"name": "a",}\n]',
        "",
        ("not valid JSON (line 2 column 16: Expecting property name",),
    ),
    "json-nested-too-deeply": Bad("v.json", "[" * 100_000, "", ("not valid JSON (nested too deeply)",)),
    "toml-in-a-json-file": Bad("v.json", '[[variants]]\nname = "x"\n', "", ("not valid JSON (line 1 column",)),
    "non-utf8": Bad("v.json", b"\xff\xfe\x00", "", ("not UTF-8 text",)),
    "non-utf8-toml": Bad("v.toml", b"\xff\xfe\x00", "", ("not UTF-8 text",)),
    "invalid-toml": Bad("v.toml", "[[variants]]\nname = \n", "", ("not valid TOML (", "line 2")),
    "toml-without-variants-tables": Bad(
        "v.toml", '[variant]\nname = "x"\n', "", ("(TOML: [[variants]] tables)", "found key(s) 'variant'")
    ),
    "empty-toml": Bad("v.toml", "", "", ("found key(s) none",)),
    "toml-entry-wrong-type": Bad(
        "v.toml",
        '[[variants]]\nname = "ok"\n\n[[variants]]\nname = "x"\nautocast = "yes"\n',
        "variant 2 ('x')",
        ("autocast must be true or false, got 'yes'",),
    ),
}


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(bad, id=key, marks=[new_api_only] if "fp32_precision" in repr(bad.content) else [])
        for key, bad in BAD_FILES.items()
    ],
)
def test_bad_file_is_a_configuration_error_naming_file_and_entry(tmp_path: Path, case: Bad) -> None:
    """Every bad file is a ConfigurationError that starts with the file (and the entry) and says what is wrong."""
    if case.file_name.endswith(".toml") and _toml_module() is None:
        pytest.skip("reading TOML needs Python 3.11+ or tomli")
    path = write(tmp_path, case.file_name, case.content)
    with pytest.raises(ConfigurationError) as raised:
        load_variants_file(path)
    message = str(raised.value)
    prefix = f"--variants-file {path}, {case.entry}: " if case.entry else f"--variants-file {path}: "
    assert message.startswith(prefix), message
    for reason in case.reasons:
        assert reason in message, message


def test_variant_refusal_is_wrapped_once_with_the_entry(tmp_path: Path) -> None:
    """A combination Variant itself refuses keeps Variant's words after the file and entry prefix."""
    path = write(tmp_path, "v.json", [{"name": "x", "autocast": True}])
    with pytest.raises(ConfigurationError) as raised:
        load_variants_file(path)
    assert str(raised.value) == (
        f"--variants-file {path}, variant 1 ('x'): variant 'x': autocast needs dtype bfloat16 or float16"
    )
    assert raised.value.__cause__ is None and raised.value.__suppress_context__


def test_first_bad_entry_is_the_one_named(tmp_path: Path) -> None:
    """With several bad entries, the error is about the first one in file order."""
    path = write(tmp_path, "v.json", [OK, {"name": "b", "dtype": "int8"}, {"name": "c", "dtype": "int4"}])
    with pytest.raises(ConfigurationError, match=r"variant 2 \('b'\): dtype must be .*got 'int8'"):
        load_variants_file(path)


def test_missing_file_and_directory_cannot_be_read(tmp_path: Path) -> None:
    """A missing file, or a directory, is a ConfigurationError naming the path, not an OSError."""
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigurationError) as raised:
        load_variants_file(missing)
    assert str(raised.value) == f"--variants-file {missing}: cannot read it: No such file or directory"
    with pytest.raises(ConfigurationError, match="cannot read it") as raised:
        load_variants_file(tmp_path)
    assert str(raised.value).startswith(f"--variants-file {tmp_path}: ")


@pytest.mark.parametrize("arrangement", [["decode"], {"name": "decode"}])
def test_arrangement_of_the_wrong_type_is_a_configuration_error(tmp_path: Path, arrangement: object) -> None:
    """An arrangement given as a list or an object is refused like any other wrong value."""
    path = write(tmp_path, "v.json", [{"name": "x", "arrangement": arrangement}])
    with pytest.raises(ConfigurationError, match=r"variant 1 \('x'\): arrangement must be"):
        load_variants_file(path)


# --- --variants and --variants-file together (checkpoint_run.chosen_variants) ----------------------------------


def test_builtin_names_come_first_then_the_file_in_file_order(tmp_path: Path) -> None:
    """--variants bf16 with a file gives bf16, then the file's variants in the file's order."""
    path = write(tmp_path, "v.json", [{"name": "zeta", "dtype": "fp16"}, {"name": "alpha"}, {"name": "mid"}])
    variants = chosen_variants(RunOptions(directory=Path("x"), variants="bf16", variants_file=path))
    assert [v.name for v in variants] == ["bf16", "zeta", "alpha", "mid"]
    assert variants[0] is BUILTIN_VARIANTS["bf16"]
    assert variants[1:] == [Variant("zeta", dtype="float16"), Variant("alpha"), Variant("mid")]


def test_file_alone_gives_only_its_variants(tmp_path: Path) -> None:
    """With --variants-file and no --variants, the defaults are not added."""
    path = write(tmp_path, "v.json", [{"name": "mine", "dtype": "bf16"}])
    assert chosen_variants(RunOptions(directory=Path("x"), variants_file=path)) == [Variant("mine", dtype="bfloat16")]


def test_name_in_both_variants_and_file_is_refused(tmp_path: Path) -> None:
    """A name given by --variants and by the file is a PrecisionError naming the file and the variant."""
    path = write(tmp_path, "v.json", [{"name": "mine"}, {"name": "fp16", "dtype": "fp16"}])
    with pytest.raises(PrecisionError) as raised:
        chosen_variants(RunOptions(directory=Path("x"), variants="bf16,fp16", variants_file=path))
    message = str(raised.value)
    assert message.startswith(f"--variants-file {path}: ")
    assert "variant 'fp16' is also named by --variants" in message


def test_default_is_bf16_and_fp16() -> None:
    """With neither option the variants are the built-in bf16 and fp16."""
    variants = chosen_variants(RunOptions(directory=Path("x")))
    assert DEFAULT_VARIANTS == "bf16,fp16"
    assert variants == [BUILTIN_VARIANTS["bf16"], BUILTIN_VARIANTS["fp16"]]


def test_names_are_stripped_and_empty_items_skipped() -> None:
    """Spaces around names and empty items between commas do not count."""
    variants = chosen_variants(RunOptions(directory=Path("x"), variants=" bf16 ,, fp16_autocast ,"))
    assert [v.name for v in variants] == ["bf16", "fp16_autocast"]


@pytest.mark.parametrize("names", [" , ", "", ","])
def test_variants_naming_nothing_is_refused(tmp_path: Path, names: str) -> None:
    """--variants with no name in it is refused, also when a file is given, rather than falling back."""
    with pytest.raises(PrecisionError, match="names no variant"):
        chosen_variants(RunOptions(directory=Path("x"), variants=names))
    path = write(tmp_path, "v.json", [{"name": "mine"}])
    with pytest.raises(PrecisionError, match="names no variant"):
        chosen_variants(RunOptions(directory=Path("x"), variants=names, variants_file=path))


def test_repeated_builtin_name_is_refused() -> None:
    """A built-in name given twice in --variants is refused."""
    with pytest.raises(PrecisionError, match="--variants names bf16 more than once"):
        chosen_variants(RunOptions(directory=Path("x"), variants="bf16,fp16,bf16"))


def test_unknown_builtin_name_is_a_configuration_error() -> None:
    """--variants takes built-in names only."""
    with pytest.raises(ConfigurationError, match="--variants: unknown variant 'bf17'"):
        chosen_variants(RunOptions(directory=Path("x"), variants="bf16,bf17"))


def test_bad_file_error_reaches_chosen_variants(tmp_path: Path) -> None:
    """A bad file's ConfigurationError comes through chosen_variants unchanged."""
    path = write(tmp_path, "v.json", [{"name": "x", "dtype": "int8"}])
    with pytest.raises(ConfigurationError) as raised:
        chosen_variants(RunOptions(directory=Path("x"), variants="bf16", variants_file=path))
    assert str(raised.value).startswith(f"--variants-file {path}, variant 1 ('x'): dtype must be")


def test_names_that_differ_only_in_case_are_one_name(tmp_path: Path) -> None:
    """logprobs/<name>.npy of BF16 and bf16 is one file on macOS and Windows: refused in the file, against
    --variants, and "Reference" is the reference's file."""
    path = write(tmp_path, "v.json", [{"name": "x"}, {"name": "X"}])
    with pytest.raises(ConfigurationError, match=r"variant 2 \('X'\): the name 'X' is given twice in the file"):
        load_variants_file(path)
    path = write(tmp_path, "r.json", [{"name": "Reference"}])
    with pytest.raises(ConfigurationError, match="taken by the reference run's files"):
        load_variants_file(path)
    path = write(tmp_path, "b.json", [{"name": "BF16", "dtype": "bf16"}])
    with pytest.raises(PrecisionError, match="variant 'BF16' is also named by --variants"):
        chosen_variants(RunOptions(directory=Path("x"), variants="bf16", variants_file=path))


@pytest.mark.skipif(NEW_API, reason="torch >= 2.9 has the fp32_precision flags")
def test_an_fp32_precision_flag_on_old_torch_names_the_version(tmp_path: Path) -> None:
    import torch

    path = write(tmp_path, "v.json", [{"name": "x", "backend": {"cuda.matmul.fp32_precision": "tf32"}}])
    with pytest.raises(ConfigurationError) as info:
        load_variants_file(path)
    message = str(info.value)
    assert message.startswith(f"--variants-file {path}, variant 1 ('x'): ")
    assert "'cuda.matmul.fp32_precision' needs torch >= 2.9" in message
    assert f"this is torch {torch.__version__}" in message


def test_a_backend_value_the_setting_does_not_take_is_refused_when_the_file_is_read(tmp_path: Path) -> None:
    """A string flag takes only its documented settings: refused naming the file, before any run."""
    path = write(tmp_path, "v.json", [{"name": "odd", "backend": {"cuda.matmul.fp32_precision": "bogus"}}])
    with pytest.raises(ConfigurationError) as info:
        load_variants_file(path)
    assert str(info.value) == (
        f"--variants-file {path}, variant 1 ('odd'): backend flag 'cuda.matmul.fp32_precision' takes one of "
        "'ieee', 'tf32', 'none', got 'bogus'"
    )


# --- names Windows reserves for devices: one check for every name that becomes a file name -------------------

DEVICE_NAMES = ["CON", "con", "Nul", "aux.x", "prn.v2", "COM1", "com9.bf16", "LPT1", "lpt9"]
ORDINARY_NAMES = ["console", "con_", "com10", "lpt0x", "x.con", "nul-bf16", "aux_"]


@pytest.mark.parametrize("name", DEVICE_NAMES)
def test_a_windows_device_name_is_refused_as_a_variant_name(tmp_path: Path, name: str) -> None:
    """logprobs/<name>.npy of "CON" or "nul.x" opens a device on Windows: the file refuses the name, naming the
    entry and the device, and says what to use instead."""
    path = write(tmp_path, "v.json", [OK, {"name": name, "dtype": "bf16"}])
    with pytest.raises(ConfigurationError) as raised:
        load_variants_file(path)
    device = name.split(".")[0]
    base, dot, rest = name.partition(".")
    assert str(raised.value).startswith(
        f"--variants-file {path}, variant 2 ({name!r}): {device!r} is a device name Windows reserves"
    )
    assert f"choose another name, e.g. {base + '_' + dot + rest!r}" in str(raised.value)
    with pytest.raises(PrecisionError, match="is a device name Windows reserves"):
        chosen_variants(RunOptions(directory=Path("x"), variants="bf16", variants_file=path))


@pytest.mark.parametrize("name", ORDINARY_NAMES)
def test_names_that_only_contain_a_device_name_are_accepted(tmp_path: Path, name: str) -> None:
    path = write(tmp_path, "v.json", [{"name": name}])
    assert [v.name for v in load_variants_file(path)] == [name]


@pytest.mark.parametrize("name", [*DEVICE_NAMES, *ORDINARY_NAMES, "con .x", "COM¹", "lpt³.x", "nul..x"])
def test_variants_the_file_and_baseline_names_agree_on_device_names(tmp_path: Path, name: str) -> None:
    """The one check (file_names.windows_device_name) decides for Variant(...), the variants file and baseline=:
    a name refused as a device by one is refused as a device by all, an ordinary name by none."""
    from pytest_precision.base.file_names import windows_device_name
    from pytest_precision.gate.baseline import stem_problem

    device = windows_device_name(name)
    refused_by = []
    try:
        Variant(name)
    except ConfigurationError as error:
        assert "device name Windows reserves" in str(error)
        refused_by.append("Variant")
    if "device name Windows reserves" in (stem_problem(name) or ""):
        refused_by.append("baseline=")
    if NAME_PATTERN.fullmatch(name):  # else the file refuses it for its characters first
        try:
            load_variants_file(write(tmp_path, "v.json", [{"name": name}]))
        except ConfigurationError as error:
            assert "device name Windows reserves" in str(error)
            refused_by.append("file")
        expected = ["Variant", "baseline=", "file"]
    else:
        expected = ["Variant", "baseline="]
    assert refused_by == (expected if device is not None else [])
    assert (device is not None) == (name not in ORDINARY_NAMES)


def test_an_unknown_name_in_variants_points_to_the_variants_file_not_to_python() -> None:
    """On the command line a variant of one's own comes from --variants-file; the Python API's advice stays."""
    from pytest_precision.engine.variants import resolve_variant

    with pytest.raises(ConfigurationError) as raised:
        chosen_variants(RunOptions(directory=Path("x"), variants="bf16,bf17"))
    message = str(raised.value)
    assert message.startswith(f"--variants: unknown variant 'bf17'. Built-in variants: {', '.join(BUILTIN_VARIANTS)}")
    assert message.endswith(
        f"; or describe your own in a --variants-file FILE (JSON or TOML; fields {', '.join(FILE_FIELDS)})"
    )
    with pytest.raises(
        ConfigurationError, match=r"; or pass pytest_precision\.Variant\(name=\.\.\., dtype=\.\.\., \.\.\.\)$"
    ):
        resolve_variant("bf17")


@pytest.mark.parametrize("name", ["fsdp_bf16", "fsdp_bf16_reduce_bf16"])
def test_fsdp_variants_are_refused_by_the_command_before_any_run(name: str) -> None:
    with pytest.raises(PrecisionError, match=f"^--variants {name}: FSDP2 mixed precision .* needs the model sharded"):
        chosen_variants(RunOptions(directory=Path("x"), variants=f"bf16,{name}"))


# --- formats below 16 bits ----------------------------------------------------------------------------------------

LOWBIT_TOML = """
[[variants]]
name = "fp8_rw"
dtype = "bf16"
fp8_training = "rowwise"

[[variants]]
name = "int8"
dtype = "bf16"
quantize = "Int8WeightOnlyConfig"

[[variants]]
name = "fp8_e5m2_wo"
dtype = "bf16"
quantize = { config = "Float8WeightOnlyConfig", weight_dtype = "torch.float8_e5m2" }

[[variants]]
name = "fp8_rows_dyn"
dtype = "bf16"
quantize = { config = "Float8DynamicActivationFloat8WeightConfig", granularity = { config = "PerRow" } }

[[variants]]
name = "e5m2"
dtype = "bf16"
weight_storage = "float8_e5m2"
"""


@needs_toml
def test_lowbit_fields_load_from_toml_as_the_python_variants(tmp_path: Path) -> None:
    pytest.importorskip("torchao", reason="the lowbit extra (torchao) is not installed")
    from pytest_precision.engine.lowbit_formats import QuantizeConfig

    loaded = load_variants_file(write(tmp_path, "v.toml", LOWBIT_TOML))
    assert loaded[0] == Variant("fp8_rw", dtype="bfloat16", fp8_training="rowwise")
    assert loaded[1] == Variant("int8", dtype="bfloat16", quantize="Int8WeightOnlyConfig")
    assert loaded[1].to_dict()["quantize"] == BUILTIN_VARIANTS["int8_weight_only"].to_dict()["quantize"]
    assert loaded[2].quantize == QuantizeConfig("Float8WeightOnlyConfig", (("weight_dtype", "torch.float8_e5m2"),))
    assert loaded[2].to_dict()["quantize"] == "Float8WeightOnlyConfig(weight_dtype='torch.float8_e5m2')"
    assert loaded[3].to_dict()["quantize"] == ("Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())")
    assert loaded[4].weight_storage == "float8_e5m2" and loaded[4].forward_only is False
    assert [v.forward_only for v in loaded] == [False, True, True, True, False]


@pytest.mark.parametrize(
    ("entry", "reasons"),
    [
        ({"fp8_training": "blockwise"}, ("fp8_training must be one of tensorwise, rowwise, rowwise_with_gw_hp",)),
        ({"fp8_training": True}, ("fp8_training must be one of",)),
        ({"weight_storage": "int4"}, ("weight_storage must be one of float8_e4m3fn, float8_e5m2", "got 'int4'")),
        ({"quantize": 3}, ("quantize must be a torchao config class name", "got 3")),
        ({"quantize": ""}, ("quantize must be a torchao config class name",)),
        ({"quantize": {"group_size": 32}}, ("quantize as a table needs 'config'",)),
        (
            {"quantize": "Int3WeightOnlyConfig"},
            ("quantize: torchao has no config 'Int3WeightOnlyConfig' a variant may name; its configs: ",),
        ),
        ({"quantize": {"config": "Int8WeightOnlyConfig", "bits": 3}}, ("Int8WeightOnlyConfig(bits=3) was refused",)),
        ({"quantize": "Int8WeightOnlyConfig", "weight_storage": "float8_e5m2"}, ("two formats; a variant takes one",)),
    ],
)
def test_a_wrong_lowbit_field_names_the_file_and_the_entry(
    tmp_path: Path, entry: dict[str, Any], reasons: tuple[str, ...]
) -> None:
    pytest.importorskip("torchao", reason="the lowbit extra (torchao) is not installed")
    path = write(tmp_path, "v.json", [OK, {"name": "x", "dtype": "bf16", **entry}])
    with pytest.raises(ConfigurationError) as error:
        load_variants_file(path)
    message = str(error.value)
    assert message.startswith(f"--variants-file {path}, variant 2 ('x'): "), message
    for reason in reasons:
        assert reason in message, message


def test_a_quantize_variant_without_torchao_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "torchao", None)
    path = write(tmp_path, "v.json", [{"name": "x", "dtype": "bf16", "quantize": "Int8WeightOnlyConfig"}])
    with pytest.raises(ConfigurationError, match=r"variant 1 \('x'\).*needs torchao.*pytest-precision\[lowbit\]"):
        load_variants_file(path)
