"""pinned_backend: what each variant sets, and that the user's settings come back, also after an error.

torch >= 2.9 pins the per-backend `fp32_precision` settings; torch 2.6 to 2.8 the process-wide float32 matmul
precision and cuDNN's `allow_tf32`. Tests of one generation skip on the other; the rest hold on both. Every
setting is read here through torch's public API, independently of the module under test.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from pytest_precision.base.errors import ConfigurationError
from pytest_precision.engine import backend_flags
from pytest_precision.engine.backend_flag_names import BACKEND_FLAGS, BOOL_FLAGS, PRECISION_FLAGS
from pytest_precision.engine.backend_flags import (
    FP32_PRECISION_SINCE,
    PINNED_FLAGS,
    FlagSetting,
    has_fp32_precision_settings,
    pinned_backend,
    snapshot_backend_state,
)
from pytest_precision.engine.variants import BUILTIN_VARIANTS, Variant

BF16_RR = "cuda.matmul.allow_bf16_reduced_precision_reduction"
FP16_RR = "cuda.matmul.allow_fp16_reduced_precision_reduction"
NEW_API = has_fp32_precision_settings()
new_api_only = pytest.mark.skipif(not NEW_API, reason="torch < 2.9 has no per-backend fp32_precision settings")
legacy_only = pytest.mark.skipif(NEW_API, reason="torch >= 2.9 pins the per-backend fp32_precision settings")

# Public torch.backends objects holding an fp32_precision (torch >= 2.9), parents before children. The
# mkldnn parent is left out: its public setter sets the generic one.
PRECISION_OWNERS = (
    ("generic", lambda: torch.backends),
    ("cuda.all", lambda: torch.backends.cudnn),
    ("cuda.matmul", lambda: torch.backends.cuda.matmul),
    ("cuda.conv", lambda: torch.backends.cudnn.conv),
    ("cuda.rnn", lambda: torch.backends.cudnn.rnn),
    ("mkldnn.matmul", lambda: torch.backends.mkldnn.matmul),
    ("mkldnn.conv", lambda: torch.backends.mkldnn.conv),
    ("mkldnn.rnn", lambda: torch.backends.mkldnn.rnn),
)


def precisions() -> dict[str, str]:
    return {name: owner().fp32_precision for name, owner in PRECISION_OWNERS}  # type: ignore[attr-defined]


@pytest.fixture(autouse=True)
def restore_torch_backend() -> Iterator[None]:
    """These tests change the process-wide settings on purpose: put them back whatever happens."""
    saved = precisions() if NEW_API else {}
    legacy = None if NEW_API else (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)
    flags = {path: getattr(torch.backends.cuda.matmul, path.rsplit(".", 1)[1]) for path in (BF16_RR, FP16_RR)}
    yield
    for name, owner in PRECISION_OWNERS if NEW_API else ():
        owner().fp32_precision = saved[name]  # type: ignore[attr-defined]
    if legacy is not None:
        torch.set_float32_matmul_precision(legacy[0])
        torch.backends.cudnn.allow_tf32 = legacy[1]
    for path, value in flags.items():
        setattr(torch.backends.cuda.matmul, path.rsplit(".", 1)[1], value)


def current() -> dict[str, object]:
    """The settings read through torch's public attributes (independent of snapshot_backend_state)."""
    state: dict[str, object] = {
        BF16_RR: torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        FP16_RR: torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
    }
    if NEW_API:
        state.update(precisions())
    else:
        state["float32_matmul_precision"] = torch.get_float32_matmul_precision()
        state["cuda.matmul.allow_tf32"] = torch.backends.cuda.matmul.allow_tf32
        state["cudnn.allow_tf32"] = torch.backends.cudnn.allow_tf32
    return state


def by_path(settings: list[FlagSetting]) -> dict[str, dict[str, object]]:
    """The settings by path; a path set twice (a variant overriding a pinned value) keeps the last."""
    return {s.path: {"value": s.value, "effective": s.effective} for s in settings}


def unusual_user_state() -> None:
    """Settings unlike both the defaults and anything a run pins."""
    if NEW_API:
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
        torch.backends.cuda.matmul.fp32_precision = "tf32"
    else:
        torch.set_float32_matmul_precision("medium")
        torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False


# --- torch >= 2.9: the per-backend fp32_precision settings ------------------------------------------------------


@new_api_only
@pytest.mark.parametrize(
    ("name", "cuda", "mkldnn"),
    [("fp32", "ieee", "ieee"), ("bf16", "ieee", "ieee"), ("tf32", "tf32", "tf32")],
)
def test_matmul_precision_is_pinned(name: str, cuda: str, mkldnn: str) -> None:
    unusual_user_state()
    with pinned_backend(BUILTIN_VARIANTS[name], "cpu") as settings:
        inside = current()
    assert inside["cuda.matmul"] == cuda
    assert inside["mkldnn.matmul"] == mkldnn
    assert inside["mkldnn.conv"] == mkldnn and inside["mkldnn.rnn"] == mkldnn
    assert inside["cuda.conv"] == cuda and inside["cuda.rnn"] == cuda
    assert inside[BF16_RR] is False
    assert inside[FP16_RR] is False
    table = by_path(settings)
    assert table["mkldnn.matmul.fp32_precision"] == {"value": mkldnn, "effective": True}
    assert table["cuda.matmul.fp32_precision"] == {"value": cuda, "effective": False}
    assert table["cuda.conv.fp32_precision"] == {"value": cuda, "effective": False}


@new_api_only
def test_medium_precision() -> None:
    with pinned_backend(Variant("m", matmul_precision="medium"), "cpu"):
        inside = current()
    assert inside["mkldnn.matmul"] == "bf16"
    assert inside["cuda.matmul"] == "tf32"


@new_api_only
@pytest.mark.parametrize(
    "setup",
    [
        lambda: None,
        unusual_user_state,
        lambda: setattr(torch.backends.cudnn, "fp32_precision", "tf32"),
        lambda: setattr(torch.backends, "fp32_precision", "ieee"),
    ],
    ids=["default", "unusual", "cuda-all-tf32", "generic-ieee"],
)
def test_every_fp32_precision_restored(setup: object) -> None:
    setup()  # type: ignore[operator]
    before = precisions()
    for name in ("tf32", "fp32"):
        with pinned_backend(BUILTIN_VARIANTS[name], "cpu"):
            pass
        assert precisions() == before


@new_api_only
def test_variant_backend_overrides_pinned_precision() -> None:
    variant = Variant("v", matmul_precision="highest", backend={"mkldnn.matmul.fp32_precision": "tf32"})
    with pinned_backend(variant, "cpu") as settings:
        assert torch.backends.mkldnn.matmul.fp32_precision == "tf32"
    assert by_path(settings)["mkldnn.matmul.fp32_precision"]["value"] == "tf32"


@new_api_only
def test_restored_when_a_flag_cannot_be_set(monkeypatch: pytest.MonkeyPatch) -> None:
    unusual_user_state()
    before = snapshot_backend_state()
    before_public = current()
    variant = Variant("bad", backend={"mkldnn.matmul.fp32_precision": "not-a-precision"})
    # Let the value through the name/value check, so that torch's setter is the one that refuses it.
    monkeypatch.setattr(backend_flags, "checked_flag_value", lambda path, value: value)
    with pytest.raises(RuntimeError), pinned_backend(variant, "cpu"):
        pytest.fail("the body must not run")
    assert snapshot_backend_state() == before
    assert current() == before_public


@new_api_only
def test_snapshot_reads_current_values() -> None:
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.backends.mkldnn.matmul.fp32_precision = "tf32"
    state = snapshot_backend_state()
    assert state[BF16_RR] is False
    assert state["precision:mkldnn.matmul.fp32_precision"] == "tf32"
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    assert snapshot_backend_state()[BF16_RR] is True


# --- torch 2.6 to 2.8: the process-wide float32 matmul precision and cuDNN's allow_tf32 -------------------------


@legacy_only
@pytest.mark.parametrize(
    ("name", "matmul", "tf32"), [("fp32", "highest", False), ("bf16", "highest", False), ("tf32", "high", True)]
)
def test_legacy_matmul_precision_is_pinned(name: str, matmul: str, tf32: bool) -> None:
    """`tf32` means TF32 on old torch too: cuBLAS matmuls and cuDNN convolutions both allow it."""
    unusual_user_state()
    with pinned_backend(BUILTIN_VARIANTS[name], "cpu") as settings:
        inside = current()
    assert inside["float32_matmul_precision"] == matmul
    assert inside["cuda.matmul.allow_tf32"] is tf32
    assert inside["cudnn.allow_tf32"] is tf32
    assert inside[BF16_RR] is False
    table = by_path(settings)
    assert table["float32_matmul_precision"] == {"value": matmul, "effective": True}
    assert table["cudnn.allow_tf32"] == {"value": tf32, "effective": False}


@legacy_only
def test_legacy_medium_precision() -> None:
    with pinned_backend(Variant("m", matmul_precision="medium"), "cuda") as settings:
        assert torch.get_float32_matmul_precision() == "medium"
        assert torch.backends.cudnn.allow_tf32 is True
    assert by_path(settings)["cudnn.allow_tf32"] == {"value": True, "effective": True}


@legacy_only
def test_fp32_precision_flag_is_refused_naming_the_version() -> None:
    before = current()
    variant = Variant("v", backend={"cuda.matmul.fp32_precision": "tf32"})
    with pytest.raises(ConfigurationError) as info, pinned_backend(variant, "cpu"):
        pytest.fail("the body must not run")
    since = ".".join(map(str, FP32_PRECISION_SINCE))
    assert f"'cuda.matmul.fp32_precision' needs torch >= {since}" in str(info.value)
    assert torch.__version__ in str(info.value)
    assert current() == before


@legacy_only
def test_legacy_restored_when_a_flag_cannot_be_set(monkeypatch: pytest.MonkeyPatch) -> None:
    unusual_user_state()
    before = current()
    monkeypatch.setattr(backend_flags, "checked_flag_value", lambda path, value: value)
    with pytest.raises(RuntimeError), pinned_backend(Variant("bad", backend={"cudnn.allow_tf32": "yes"}), "cpu"):
        pytest.fail("the body must not run")
    assert current() == before


# --- both generations --------------------------------------------------------------------------------------------


def test_reduced_reduction_variant_sets_flag() -> None:
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    with pinned_backend(BUILTIN_VARIANTS["bf16_reduced_reduction"], "cpu") as settings:
        assert torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction is True
        assert torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction is False
    assert torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction is False
    assert by_path(settings)[BF16_RR] == {"value": True, "effective": False}


def test_defaults_pin_reduced_reduction_off() -> None:
    assert PINNED_FLAGS == {BF16_RR: False, FP16_RR: False}
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    with pinned_backend(BUILTIN_VARIANTS["bf16"], "cpu"):
        assert torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction is False
    assert torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction is True


@pytest.mark.parametrize("name", sorted(BUILTIN_VARIANTS))
def test_everything_restored(name: str) -> None:
    unusual_user_state()
    before_snapshot = snapshot_backend_state()
    before = current()
    with pinned_backend(BUILTIN_VARIANTS[name], "cpu"):
        assert current() != before
    assert current() == before
    assert snapshot_backend_state() == before_snapshot


def test_restored_when_body_raises() -> None:
    unusual_user_state()
    before = snapshot_backend_state()
    before_public = current()
    with pytest.raises(RuntimeError, match="boom"), pinned_backend(BUILTIN_VARIANTS["bf16_reduced_reduction"], "cpu"):
        assert current() != before_public
        raise RuntimeError("boom")
    assert snapshot_backend_state() == before
    assert current() == before_public


@pytest.mark.parametrize("path", ["cuda.matmul.no_such_flag", "nosuchbackend.flag", "mkldnn.nope"])
def test_unknown_flag_path(path: str) -> None:
    before = snapshot_backend_state()
    with pytest.raises(ConfigurationError) as info, pinned_backend(Variant("v", backend={path: True}), "cpu"):
        pytest.fail("the body must not run")
    assert str(info.value).startswith(
        f"backend flag {path!r} is not one of the torch.backends settings a variant may set: "
    )
    assert "cuda.matmul.allow_tf32" in str(info.value)
    assert snapshot_backend_state() == before


def test_effective_per_device() -> None:
    with pinned_backend(BUILTIN_VARIANTS["bf16_reduced_reduction"], "cpu") as on_cpu:
        pass
    with pinned_backend(BUILTIN_VARIANTS["bf16_reduced_reduction"], "cuda") as on_cuda:
        pass
    cpu = by_path(on_cpu)
    cuda = by_path(on_cuda)
    assert set(cpu) == set(cuda)
    for path in cpu:
        if path.startswith(("cuda.", "cudnn.")):
            assert cpu[path]["effective"] is False and cuda[path]["effective"] is True, path
        elif path.startswith("mkldnn."):
            assert cpu[path]["effective"] is True and cuda[path]["effective"] is False, path
        else:
            assert cpu[path]["effective"] is True and cuda[path]["effective"] is True, path
    assert {BF16_RR, FP16_RR} <= set(cpu)
    precision_keys = {"cuda.matmul.fp32_precision", "mkldnn.matmul.fp32_precision"}
    assert precision_keys <= set(cpu) if NEW_API else {"float32_matmul_precision", "cudnn.allow_tf32"} <= set(cpu)


def test_generation_matches_the_torch_version() -> None:
    """The choice of API follows the version torch reports, and the new API is there exactly when chosen."""
    major, minor = (int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    assert ((major, minor) >= FP32_PRECISION_SINCE) == NEW_API
    assert hasattr(torch.backends.cuda.matmul, "fp32_precision") == NEW_API


@pytest.mark.parametrize(("version", "new"), [((2, 6), False), ((2, 8), False), ((2, 9), True), ((3, 0), True)])
def test_the_fp32_precision_api_is_chosen_from_2_9(
    monkeypatch: pytest.MonkeyPatch, version: tuple[int, int], new: bool
) -> None:
    from pytest_precision.engine import backend_flags

    monkeypatch.setattr(backend_flags, "torch_version", lambda: version)
    assert backend_flags.has_fp32_precision_settings() is new


@pytest.mark.parametrize(
    ("text", "version"),
    [
        ("2.6.0+cu124", (2, 6)),
        ("2.6+cpu", (2, 6)),
        ("2.15.0", (2, 15)),
        ("2.10.0a0+git1234", (2, 10)),
        ("3.0.1", (3, 0)),
    ],
)
def test_torch_version_reads_major_and_minor(
    monkeypatch: pytest.MonkeyPatch, text: str, version: tuple[int, int]
) -> None:
    from pytest_precision.base.torch_version import torch_version

    monkeypatch.setattr(torch, "__version__", text)
    assert torch_version() == version


# --- only the listed torch.backends settings: no path reaches a module, a class attribute or a dunder ----------

#: Paths that torch.backends attribute walks would reach: sys.path (code imported from a folder the file names),
#: the interpreter's arguments, torch.hub's cache folder (through torch.backends.torch), class attributes, dunders,
#: modules, and a real leaf reached through a dunder.
OUTSIDE_PATHS = [
    "sys.path",
    "sys.argv",
    "sys.dont_write_bytecode",
    "torch.hub._hub_dir",
    "__class__.__name__",
    "cudnn.__class__.__name__",
    "cuda.matmul.__class__.__name__",
    "cudnn",
    "cuda.matmul",
    "__dict__.cudnn.benchmark",
    "cudnn.torch.backends.cudnn.benchmark",
    "cudnn.benchmark.real",
    "mkldnn.verbose",
    "cudnn.benchmark_limit",
    "",
]


@pytest.mark.parametrize("path", OUTSIDE_PATHS)
def test_a_path_outside_the_list_is_refused_before_anything_is_set(path: str) -> None:
    """Variant(backend=...) names a real setting or nothing: here `sys.path` would let the next lazy import
    come from a folder of the caller's choosing. Refused before any setting is touched."""
    import sys

    sys_path, argv, bytecode, hub = list(sys.path), list(sys.argv), sys.dont_write_bytecode, torch.hub.get_dir()
    before = snapshot_backend_state()
    backends_class = type(torch.backends).__name__  # torch 2.6: module; newer: GenericModule
    variant = Variant("v", backend={path: ["/nowhere"], BF16_RR: True})
    with pytest.raises(ConfigurationError) as info, pinned_backend(variant, "cpu"):
        pytest.fail("the body must not run")
    assert f"backend flag {path!r} is not one of the torch.backends settings a variant may set" in str(info.value)
    assert (sys.path, sys.argv, sys.dont_write_bytecode, torch.hub.get_dir()) == (sys_path, argv, bytecode, hub)
    assert type(torch.backends).__name__ == backends_class
    assert snapshot_backend_state() == before


@pytest.mark.parametrize(
    ("path", "value", "takes"),
    [
        (BF16_RR, 1, "takes true or false"),
        ("cudnn.benchmark", "yes", "takes true or false"),
        ("cuda.matmul.allow_tf32", None, "takes true or false"),
        ("cuda.matmul.fp32_precision", "bf16", "takes one of 'ieee', 'tf32', 'none'"),
        ("mkldnn.matmul.fp32_precision", True, "takes one of 'ieee', 'tf32', 'bf16', 'none'"),
        ("fp32_precision", "highest", "takes one of 'ieee', 'tf32', 'bf16', 'none'"),
    ],
)
def test_a_value_the_setting_does_not_take_is_refused_before_anything_is_set(
    path: str, value: object, takes: str
) -> None:
    before = current()
    with pytest.raises(ConfigurationError) as info, pinned_backend(Variant("v", backend={path: value}), "cpu"):
        pytest.fail("the body must not run")
    assert str(info.value) == f"backend flag {path!r} {takes}, got {value!r}"
    assert current() == before


def _leaf(path: str) -> tuple[object, str]:
    """(owner, attribute) walked independently of the module under test."""
    *parents, attribute = path.split(".")
    owner: object = torch.backends
    for part in parents:
        owner = getattr(owner, part)
    return owner, attribute


@pytest.mark.parametrize("path", sorted(BOOL_FLAGS))
def test_every_listed_true_false_setting_is_a_bool_leaf_of_this_torch(path: str) -> None:
    """Each listed flag exists in this torch (2.9+: all of them), holds a bool, and is set and restored by a run;
    one an older torch lacks is refused naming this torch, before anything is set."""
    try:
        owner, attribute = _leaf(path)
        getattr(owner, attribute)
    except (AttributeError, RuntimeError, AssertionError):
        assert not has_fp32_precision_settings(), f"{path} is missing from torch {torch.__version__}"
        before = snapshot_backend_state()
        with (
            pytest.raises(ConfigurationError, match=r"is not in this torch"),
            pinned_backend(Variant("v", backend={path: True}), "cpu"),
        ):
            pytest.fail("the body must not run")
        assert snapshot_backend_state() == before
        return
    value = getattr(owner, attribute)
    assert type(value) is bool, (path, value)
    assert not path.startswith("_") and all(not part.startswith("_") for part in path.split("."))
    with pinned_backend(Variant("v", backend={path: not value}), "cpu"):
        assert getattr(owner, attribute) is (not value)
    assert getattr(owner, attribute) is value


@new_api_only
@pytest.mark.parametrize("path", sorted(PRECISION_FLAGS))
def test_every_listed_precision_takes_exactly_its_listed_values(path: str) -> None:
    """torch itself accepts each listed value and refuses the others of {ieee, tf32, bf16, none}."""
    owner, attribute = _leaf(path)
    saved = precisions()
    accepted = []
    for value in ("ieee", "tf32", "bf16", "none"):
        try:
            setattr(owner, attribute, value)
            accepted.append(value)
        except RuntimeError:
            pass
    for name, precision_owner in PRECISION_OWNERS:
        precision_owner().fp32_precision = saved[name]  # type: ignore[attr-defined]
    assert tuple(accepted) == PRECISION_FLAGS[path]


def test_the_list_is_the_two_kinds() -> None:
    assert BOOL_FLAGS | set(PRECISION_FLAGS) == BACKEND_FLAGS and not BOOL_FLAGS & set(PRECISION_FLAGS)
    assert set(PINNED_FLAGS) <= BACKEND_FLAGS
    assert "cudnn.allow_tf32" in BACKEND_FLAGS  # the legacy TF32 switch a run pins on torch < 2.9


def test_a_listed_setting_this_torch_lacks_names_the_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(type(torch.backends.cuda.matmul), "__getattr__")  # cuBLASModule answers every flag there
    with pytest.raises(ConfigurationError) as info:
        backend_flags.resolve_flag("cuda.matmul.allow_fp16_accumulation")
    assert str(info.value) == (
        f"backend flag 'cuda.matmul.allow_fp16_accumulation' is not in this torch ({torch.__version__}); leave it out "
        "or use another torch"
    )
