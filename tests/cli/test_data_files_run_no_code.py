"""Data files run no code: a variants file names only listed settings, configs and dtypes, the whole file is
checked before anything runs, and `run` never imports from a checkpoint folder (issue 34, items 1 and 11)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import TINY_LLAMA_DIR
from pytest_precision.base.errors import ConfigurationError
from pytest_precision.cli.run import RunOptions, chosen_variants
from pytest_precision.cli.variants_file import load_variants_file

ROOT = Path(__file__).parents[2]
#: A package's code that leaves a marker file when it is imported.
MARKER_CODE = 'from pathlib import Path\nPath(__file__).parents[{depth}].joinpath("IMPORTED").write_text("{name}")\n'
#: Packages a checkpoint may ship: its own, and ones named like the modules a run imports (lazily or not).
SHIPPED_PACKAGES = ("hostile", "torchao", "transformers", "safetensors", "matplotlib", "tomli", "numpy")


def shipping_checkpoint(folder: Path) -> Path:
    """The tiny Llama checkpoint, plus Python packages at its top and in pkgs/ that mark their import."""
    shutil.copytree(TINY_LLAMA_DIR, folder)
    for where, depth in ((folder, 1), (folder / "pkgs", 2)):
        for name in SHIPPED_PACKAGES:
            (where / name).mkdir(parents=True)
            (where / name / "__init__.py").write_text(MARKER_CODE.format(depth=depth, name=name))
    return folder


def cli_process(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "pytest_precision.cli.main", *map(str, args)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
        env=environment,
        cwd=cwd,
    )


def write(path: Path, entries: Any) -> Path:
    path.write_text(json.dumps(entries))
    return path


def test_a_variants_file_pointing_sys_path_at_a_checkpoint_is_refused_before_anything_runs(tmp_path: Path) -> None:
    """The attack of issue 34: `backend: {"sys.path": [<the checkpoint's package folder>, ...]}` made the next
    lazy import come from the checkpoint, exit 0. Now one line naming the file and the field, exit 2, and the
    shipped code never runs (no marker, no output folder)."""
    folder = shipping_checkpoint(tmp_path / "ckpt")
    hijacked = [str(folder / "pkgs"), str(folder), *sys.path]
    variants = write(tmp_path / "v.json", [{"name": "x", "dtype": "bf16", "backend": {"sys.path": hijacked}}])
    output = tmp_path / "out"
    result = cli_process(
        "run", folder, "--variants-file", variants, "--length", "4", "--forward-only", "--output-dir", output,
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr == (
        f"pytest-precision run: --variants-file {variants}, variant 1 ('x'): backend flag 'sys.path' is not one of "
        "the torch.backends settings a variant may set: " + result.stderr.split("may set: ", 1)[1]
    )
    assert result.stderr.count("\n") == 1 and "cuda.matmul.allow_tf32" in result.stderr
    assert not (folder / "IMPORTED").exists()
    assert not output.exists()


def test_run_never_imports_from_the_checkpoint_folder(tmp_path: Path) -> None:
    """A full run of a checkpoint that ships packages named like the ones a run imports (torchao, transformers,
    safetensors, ...): none of them is imported, the run measures the model as usual."""
    folder = shipping_checkpoint(tmp_path / "ckpt")
    int8 = {"name": "int8", "dtype": "bf16", "quantize": "Int8WeightOnlyConfig"}
    variants = write(tmp_path / "v.json", [int8, {"name": "e5m2", "weight_storage": "float8_e5m2"}])
    try:
        import torchao  # noqa: F401
    except ImportError:  # the lowbit extra is not installed: fp8 weight storage needs no torchao
        variants = write(tmp_path / "v.json", [{"name": "e5m2", "weight_storage": "float8_e5m2"}])
    result = cli_process(
        "run", folder, "--variants", "bf16", "--variants-file", variants, "--length", "4", "--forward-only",
        "--output-dir", tmp_path / "out", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert not (folder / "IMPORTED").exists(), (folder / "IMPORTED").read_text()
    assert "int8" in result.stdout or "e5m2" in result.stdout


def test_the_checkpoint_loaders_never_trust_remote_code() -> None:
    from pytest_precision.cli.checkpoint import LOCAL

    assert LOCAL == {"local_files_only": True, "trust_remote_code": False}


# --- every name a file resolves is one of a fixed list, refused naming the file and the field ------------------

HOSTILE_BACKENDS = {
    "sys.path": ["/somewhere"],
    "sys.argv": ["python", "-c", "print(1)"],
    "sys.dont_write_bytecode": True,
    "torch.hub._hub_dir": "/somewhere",
    "__class__.__name__": "x",
    "cudnn.__class__.__name__": "x",
    "__dict__.cudnn.benchmark": True,
    "cudnn": True,
}


@pytest.mark.parametrize("path", sorted(HOSTILE_BACKENDS))
def test_a_backend_path_outside_the_list_is_refused_naming_the_file_and_field(tmp_path: Path, path: str) -> None:
    import torch

    before = (list(sys.path), list(sys.argv), sys.dont_write_bytecode, torch.hub.get_dir())
    backends_class = type(torch.backends).__name__  # torch 2.6: module; newer: GenericModule
    file = write(tmp_path / "v.json", [{"name": "ok"}, {"name": "x", "backend": {path: HOSTILE_BACKENDS[path]}}])
    with pytest.raises(ConfigurationError) as info:
        load_variants_file(file)
    assert str(info.value).startswith(
        f"--variants-file {file}, variant 2 ('x'): backend flag {path!r} is not one of the torch.backends settings "
        "a variant may set: "
    )
    assert (list(sys.path), list(sys.argv), sys.dont_write_bytecode, torch.hub.get_dir()) == before
    assert type(torch.backends).__name__ == backends_class


HOSTILE_QUANTIZE: list[tuple[Any, str]] = [
    ("PerRow", "quantize: torchao has no config 'PerRow' a variant may name"),
    ("AOPerModuleConfig", "quantize: torchao has no config 'AOPerModuleConfig' a variant may name"),
    ("__class__", "quantize: torchao has no config '__class__' a variant may name"),
    ("Path", "quantize: torchao has no config 'Path' a variant may name"),
    (
        {"config": "Int8WeightOnlyConfig", "layout": {"config": "Int4WeightOnlyQuantizer"}},
        "quantize: 'Int4WeightOnlyQuantizer' is not a torchao argument object a variant may name",
    ),
    (
        {"config": "Float8WeightOnlyConfig", "weight_dtype": "torch.load"},
        "quantize: 'load' is not a torch dtype (torch.<name>) a variant may name",
    ),
    (
        {"config": "Float8WeightOnlyConfig", "weight_dtype": "torch.sys"},
        "quantize: 'sys' is not a torch dtype (torch.<name>) a variant may name",
    ),
    (
        {"config": "Float8WeightOnlyConfig", "weight_dtype": ["torch.float8_e5m2", "torch.hub"]},
        "quantize: 'hub' is not a torch dtype (torch.<name>) a variant may name",
    ),
]


@pytest.mark.parametrize(("quantize", "message"), HOSTILE_QUANTIZE)
def test_a_quantize_name_outside_the_lists_is_refused_before_torchao_is_imported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, quantize: Any, message: str
) -> None:
    """The names are checked against their lists before anything is looked up: with torchao hidden, the
    refusal is still the name's, not "needs torchao"."""
    monkeypatch.setitem(sys.modules, "torchao", None)
    file = write(tmp_path / "v.json", [{"name": "x", "dtype": "bf16", "quantize": quantize}])
    with pytest.raises(ConfigurationError) as info:
        load_variants_file(file)
    assert str(info.value).startswith(f"--variants-file {file}, variant 1 ('x'): {message}; "), info.value


def test_the_listed_names_build_what_they_name(tmp_path: Path) -> None:
    pytest.importorskip("torchao", reason="the lowbit extra (torchao) is not installed")
    import torch
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig

    e5m2 = {"config": "Float8WeightOnlyConfig", "weight_dtype": "torch.float8_e5m2"}
    file = write(
        tmp_path / "v.json",
        [{"name": "a", "dtype": "bf16", "quantize": "Int8WeightOnlyConfig"}, {"name": "b", "quantize": e5m2}],
    )
    a, b = load_variants_file(file)
    assert isinstance(a.quantize.build("a"), Int8WeightOnlyConfig)
    built = b.quantize.build("b")
    assert isinstance(built, Float8WeightOnlyConfig) and built.weight_dtype is torch.float8_e5m2


# --- item 11: the whole file is checked before anything runs, naming the file ----------------------------------


def test_a_replay_routing_name_of_no_earlier_variant_is_refused_when_the_file_is_read(tmp_path: Path) -> None:
    file = write(
        tmp_path / "v.json",
        [{"name": "bf16_moe", "dtype": "bf16"}, {"name": "replayed", "dtype": "bf16", "replay_routing": "bf16_mo"}],
    )
    with pytest.raises(ConfigurationError) as info:
        load_variants_file(file)
    assert str(info.value) == (
        f"--variants-file {file}, variant 2 ('replayed'): replay_routing 'bf16_mo' names no variant listed before "
        "this one ('bf16_moe'); list 'bf16_mo' first, or give true for the reference's routing"
    )


def test_a_replay_routing_name_of_a_later_variant_is_refused(tmp_path: Path) -> None:
    file = write(
        tmp_path / "v.json",
        [{"name": "replayed", "dtype": "bf16", "replay_routing": "later"}, {"name": "later", "dtype": "bf16"}],
    )
    with pytest.raises(ConfigurationError, match=r"variant 1 \('replayed'\): replay_routing 'later' names no variant"):
        load_variants_file(file)


def test_a_replay_routing_name_may_be_an_earlier_file_variant_or_a_variants_option(tmp_path: Path) -> None:
    file = write(
        tmp_path / "v.json",
        [
            {"name": "first", "dtype": "bf16"},
            {"name": "r1", "dtype": "bf16", "replay_routing": "first"},
            {"name": "r2", "dtype": "bf16", "replay_routing": "fp16"},
            {"name": "r3", "dtype": "bf16", "replay_routing": True},
        ],
    )
    chosen = chosen_variants(RunOptions(directory=tmp_path, variants="fp16", variants_file=file))
    assert [(v.name, v.replay_routing) for v in chosen] == [
        ("fp16", False),
        ("first", False),
        ("r1", "first"),
        ("r2", "fp16"),
        ("r3", True),
    ]
    with pytest.raises(ConfigurationError, match=r"variant 3 \('r2'\): replay_routing 'fp16' names no variant"):
        load_variants_file(file)  # without --variants fp16 before it


def test_a_quantize_value_that_is_not_a_config_names_the_file_and_entry(tmp_path: Path) -> None:
    file = write(tmp_path / "v.json", [{"name": "ok"}, {"name": "rows", "dtype": "bf16", "quantize": "PerRow"}])
    with pytest.raises(ConfigurationError) as info:
        chosen_variants(RunOptions(directory=tmp_path, variants_file=file))
    assert str(info.value).startswith(
        f"--variants-file {file}, variant 2 ('rows'): quantize: torchao has no config 'PerRow' a variant may name; "
        "its configs: "
    )


def test_a_listed_dtype_this_torch_lacks_names_the_file_and_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("torchao", reason="the lowbit extra (torchao) is not installed")
    import torch

    monkeypatch.delattr(torch, "float8_e8m0fnu", raising=False)  # as on a torch that predates it
    spec = {"config": "Float8WeightOnlyConfig", "weight_dtype": "torch.float8_e8m0fnu"}
    file = write(tmp_path / "v.json", [{"name": "x", "dtype": "bf16", "quantize": spec}])
    with pytest.raises(ConfigurationError) as info:
        load_variants_file(file)
    assert str(info.value) == (
        f"--variants-file {file}, variant 1 ('x'): quantize argument 'torch.float8_e8m0fnu' is not a dtype of this "
        f"torch ({torch.__version__})"
    )


def test_a_bad_file_stops_the_command_before_the_reference_runs(tmp_path: Path) -> None:
    """End to end: an unknown replay_routing name is one line naming the file, exit 2, no run, no output."""
    file = write(tmp_path / "v.json", [{"name": "r", "dtype": "bf16", "replay_routing": "nowhere"}])
    output = tmp_path / "out"
    result = cli_process(
        "run", TINY_LLAMA_DIR, "--variants-file", file, "--length", "4", "--forward-only", "--output-dir", output,
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        f"pytest-precision run: --variants-file {file}, variant 1 ('r'): replay_routing 'nowhere' names no variant "
        "listed before this one (none); list 'nowhere' first, or give true for the reference's routing\n"
    )
    assert "reference" not in result.stdout and not output.exists()
