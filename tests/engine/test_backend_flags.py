"""pinned_backend: what each variant sets, and that the user's settings come back, also after an error."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from pytest_precision.base.errors import ConfigurationError
from pytest_precision.engine.backend_flags import PINNED_FLAGS, FlagSetting, pinned_backend, snapshot_backend_state
from pytest_precision.engine.variants import BUILTIN_VARIANTS, Variant

BF16_RR = "cuda.matmul.allow_bf16_reduced_precision_reduction"
FP16_RR = "cuda.matmul.allow_fp16_reduced_precision_reduction"
PRECISION_KEYS = [
    (backend, op)
    for backend, op in [("generic", "all"), ("cuda", "all"), ("mkldnn", "all")]
    + [(b, op) for b in ("cuda", "mkldnn") for op in ("matmul", "conv", "rnn")]
]


def fp32_precision(backend: str, op: str) -> str:
    return torch._C._get_fp32_precision_getter(backend, op)  # type: ignore[no-any-return]


@pytest.fixture(autouse=True)
def restore_torch_backend() -> Iterator[None]:
    """These tests change the process-wide settings on purpose: put them back whatever happens."""
    precisions = [(b, op, fp32_precision(b, op)) for b, op in PRECISION_KEYS]
    flags = {path: getattr(torch.backends.cuda.matmul, path.rsplit(".", 1)[1]) for path in (BF16_RR, FP16_RR)}
    yield
    for backend, op, value in precisions:
        torch._C._set_fp32_precision_setter(backend, op, value)
    for path, value in flags.items():
        setattr(torch.backends.cuda.matmul, path.rsplit(".", 1)[1], value)


def current() -> dict[str, object]:
    """The settings read through torch's public attributes (independent of snapshot_backend_state)."""
    return {
        "cuda.matmul": torch.backends.cuda.matmul.fp32_precision,
        "mkldnn.matmul": torch.backends.mkldnn.matmul.fp32_precision,
        "mkldnn.conv": torch.backends.mkldnn.conv.fp32_precision,
        "mkldnn.rnn": torch.backends.mkldnn.rnn.fp32_precision,
        "cuda.conv": torch.backends.cudnn.conv.fp32_precision,
        "cuda.rnn": torch.backends.cudnn.rnn.fp32_precision,
        BF16_RR: torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        FP16_RR: torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
    }


def by_path(settings: list[FlagSetting]) -> dict[str, dict[str, object]]:
    """The settings by path; a path set twice (a variant overriding a pinned value) keeps the last."""
    return {s.path: {"value": s.value, "effective": s.effective} for s in settings}


def unusual_user_state() -> None:
    """Settings unlike both the defaults and anything a run pins."""
    torch._C._set_fp32_precision_setter("mkldnn", "matmul", "bf16")
    torch._C._set_fp32_precision_setter("cuda", "matmul", "tf32")
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False


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


def test_medium_precision() -> None:
    with pinned_backend(Variant("m", matmul_precision="medium"), "cpu"):
        inside = current()
    assert inside["mkldnn.matmul"] == "bf16"
    assert inside["cuda.matmul"] == "tf32"


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


@pytest.mark.parametrize(
    "setup",
    [
        lambda: None,
        unusual_user_state,
        lambda: torch._C._set_fp32_precision_setter("mkldnn", "all", "tf32"),
        lambda: torch._C._set_fp32_precision_setter("generic", "all", "ieee"),
    ],
    ids=["default", "unusual", "mkldnn-all-tf32", "generic-ieee"],
)
def test_every_fp32_precision_restored(setup: object) -> None:
    setup()  # type: ignore[operator]
    before = {(b, op): fp32_precision(b, op) for b, op in PRECISION_KEYS}
    for name in ("tf32", "fp32"):
        with pinned_backend(BUILTIN_VARIANTS[name], "cpu"):
            pass
        assert {(b, op): fp32_precision(b, op) for b, op in PRECISION_KEYS} == before


def test_restored_when_body_raises() -> None:
    unusual_user_state()
    before = snapshot_backend_state()
    before_public = current()
    with pytest.raises(RuntimeError, match="boom"), pinned_backend(BUILTIN_VARIANTS["bf16_reduced_reduction"], "cpu"):
        assert current() != before_public
        raise RuntimeError("boom")
    assert snapshot_backend_state() == before
    assert current() == before_public


def test_restored_when_a_flag_cannot_be_set() -> None:
    unusual_user_state()
    before = snapshot_backend_state()
    before_public = current()
    variant = Variant("bad", backend={"mkldnn.matmul.fp32_precision": "not-a-precision"})
    with pytest.raises(RuntimeError), pinned_backend(variant, "cpu"):
        pytest.fail("the body must not run")
    assert snapshot_backend_state() == before
    assert current() == before_public


def test_variant_backend_overrides_pinned_precision() -> None:
    variant = Variant("v", matmul_precision="highest", backend={"mkldnn.matmul.fp32_precision": "tf32"})
    with pinned_backend(variant, "cpu") as settings:
        assert torch.backends.mkldnn.matmul.fp32_precision == "tf32"
    assert by_path(settings)["mkldnn.matmul.fp32_precision"]["value"] == "tf32"


@pytest.mark.parametrize("path", ["cuda.matmul.no_such_flag", "nosuchbackend.flag", "mkldnn.nope"])
def test_unknown_flag_path(path: str) -> None:
    before = snapshot_backend_state()
    with pytest.raises(ConfigurationError) as info, pinned_backend(Variant("v", backend={path: True}), "cpu"):
        pytest.fail("the body must not run")
    assert repr(path) in str(info.value)
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
        if path.startswith("cuda."):
            assert cpu[path]["effective"] is False and cuda[path]["effective"] is True, path
        elif path.startswith("mkldnn."):
            assert cpu[path]["effective"] is True and cuda[path]["effective"] is False, path
    assert {BF16_RR, FP16_RR, "cuda.matmul.fp32_precision", "mkldnn.matmul.fp32_precision"} <= set(cpu)


def test_snapshot_reads_current_values() -> None:
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch._C._set_fp32_precision_setter("mkldnn", "matmul", "tf32")
    state = snapshot_backend_state()
    assert state[BF16_RR] is False
    assert state["fp32:mkldnn.matmul"] == "tf32"
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    assert snapshot_backend_state()[BF16_RR] is True
