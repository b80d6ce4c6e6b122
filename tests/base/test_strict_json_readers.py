"""Every JSON data file the plugin reads is read strictly: a key given twice (both sides of a merge conflict) or a
number beyond the largest float (1e400, which json reads as infinity) is refused naming the file, never read as
"the last key wins". Baselines have their own tests (tests/gate/test_baseline_validation.py); these are the
other readers: variants files, report files (show / diff), reference files and checkpoint configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import random_tokens, tiny_llama
from pytest_precision import ConfigurationError, Reference, reference
from pytest_precision.base.errors import PrecisionError
from pytest_precision.cli.checkpoint import _checkpoint_config
from pytest_precision.cli.variants_file import load_variants_file
from pytest_precision.engine.references import METADATA_KEY
from pytest_precision.gate.report_files import _read_json

TWICE = '{"name": "bf16", "dtype": "bfloat16", "dtype": "float16"}'
HUGE = '{"name": "bf16", "dtype": "bfloat16", "extra": 1e400}'


@pytest.mark.parametrize(
    ("text", "problem"),
    [(f"[{TWICE}]", "dtype appears twice"), (f"[{HUGE}]", "extra is 1e400, beyond the largest float")],
)
def test_a_variants_file_with_a_key_twice_or_an_overflow_is_refused(tmp_path: Path, text: str, problem: str) -> None:
    path = tmp_path / "variants.json"
    path.write_text(text)
    with pytest.raises(ConfigurationError, match=rf"--variants-file {path}: \[0\]\.{problem}"):
        load_variants_file(path)


def test_a_report_file_with_a_key_twice_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "report.json"
    path.write_text('{"schema_version": 1, "schema_version": 2}')
    with pytest.raises(PrecisionError, match=rf"{path}: schema_version appears twice"):
        _read_json(path)


def test_a_checkpoint_config_with_a_key_twice_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama", "rms_norm_eps": 1e-6, "rms_norm_eps": 1e-5}')
    with pytest.raises(PrecisionError, match=r"config\.json: rms_norm_eps appears twice.*re-save the checkpoint"):
        _checkpoint_config(tmp_path)


def test_a_reference_file_whose_metadata_holds_a_key_twice_is_refused(tmp_path: Path) -> None:
    model = tiny_llama(layers=1)
    ids = random_tokens(length=4)
    saved = tmp_path / "ref.safetensors"
    reference(model, {"input_ids": ids}, backward=False).save(saved)
    with safe_open(str(saved), framework="pt") as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
        raw = (handle.metadata() or {})[METADATA_KEY]
    meta = json.loads(raw)
    # The same document with "backward" written twice, the second value the one json.loads would keep.
    doubled = raw[:-1] + f', "backward": {json.dumps(not meta["backward"])}}}'
    tampered = tmp_path / "tampered.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tampered), metadata={METADATA_KEY: doubled})
    with pytest.raises(ConfigurationError, match=r"backward appears twice"):
        Reference.load(tampered, model)
