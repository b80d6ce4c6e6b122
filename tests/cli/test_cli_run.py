"""`pytest-precision run` as an investigation tool, on the bundled checkpoints: progress on stderr, the files
of --output-dir read back, a saved reference reused (and refused on other weights, inputs or settings),
variants from a file, and the knobs (--tokens, --modules, --temperature, --loss-scale, --forward-only)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import TINY_LLAMA_DIR, TRAINED_LM_DIR
from pytest_precision import compare_logprobs
from pytest_precision.cli.main import main
from pytest_precision.gate.report_files import reports_in

CORPUS = TRAINED_LM_DIR / "corpus.txt"
LENGTH = 24
#: A progress line: "[   1.2s] reference fp32 (1/3): forward".
PROGRESS_LINE = re.compile(r"^\[ *[0-9.]+[hms][0-9hms]*\] (.*)$")


@dataclass
class Result:
    code: int
    out: str
    err: str

    @property
    def progress(self) -> list[str]:
        """The progress lines' text, without the elapsed time."""
        return [m.group(1) for line in self.err.splitlines() if (m := PROGRESS_LINE.match(line))]

    @property
    def error(self) -> str:
        """stderr without progress lines: the error message, if any."""
        return "\n".join(line for line in self.err.splitlines() if not PROGRESS_LINE.match(line))


def run(*args: str | Path) -> Result:
    """`pytest-precision run ARGS` in this process (stderr is not a terminal: plain progress lines)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["run", *map(str, args)])
    return Result(code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> tuple[Result, Path, Path]:
    """A full run on the trained LM's text: progress, --output-dir and --save-reference."""
    folder = tmp_path_factory.mktemp("first")
    output, reference = folder / "out", folder / "ref.safetensors"
    result = run(
        TRAINED_LM_DIR, "--text", CORPUS, "--length", LENGTH, "--output-dir", output, "--save-reference", reference
    )
    assert result.code == 0, result.err
    return result, output, reference


def test_progress_names_each_run_and_phase_and_estimates_the_rest(first: tuple[Result, Path, Path]) -> None:
    result, output, reference = first
    lines = result.progress
    assert lines[0].startswith(f"checkpoint {TRAINED_LM_DIR}: hashing its weights")
    runs = [line for line in lines if line.startswith(("reference ", "variant "))]
    assert runs == [
        "reference fp32 (1/3): build",
        "reference fp32 (1/3): forward",
        "reference fp32 (1/3): backward",
        "reference fp32 (1/3): measure",
        runs[4],
        "variant bf16 (2/3): build",
        "variant bf16 (2/3): forward",
        "variant bf16 (2/3): backward",
        "variant bf16 (2/3): measure",
        runs[9],
        *runs[10:],
    ]
    assert re.fullmatch(r"reference fp32 \(1/3\): done in [0-9.]+s, about [0-9.]+s left", runs[4])
    assert re.fullmatch(r"variant bf16 \(2/3\): done in [0-9.]+s, about [0-9.]+s left", runs[9])
    assert re.fullmatch(r"variant fp16 \(3/3\): done in [0-9.]+s", runs[-1])  # nothing left: no estimate
    assert f"saved the reference to {reference} (" in "\n".join(lines)
    assert lines[-1].startswith(f"wrote 7 files to {output}: precision-report.json, summary.md, error-vs-depth.png, ")
    assert "Loading weights" not in result.err  # transformers' own bars are off during the run
    assert result.error == ""
    assert result.out.startswith("precision: rms_rel against the fp32 reference on cpu")


def test_the_report_file_is_a_session_report_with_the_printed_numbers(first: tuple[Result, Path, Path]) -> None:
    result, output, _ = first
    document = json.loads((output / "precision-report.json").read_text())
    assert document["schema_version"] == 1 and document["stale"] == [] and document["drift"] == {}
    assert document["environment"]["torch"] == torch.__version__ and document["environment"]["date"]
    assert [v["name"] for v in document["command"]["variants"]] == ["bf16", "fp16"]
    (label, report), *others = reports_in(output / "precision-report.json").items()
    assert not others and label == f"run {TRAINED_LM_DIR}"
    assert report.variants == ["bf16", "fp16"]
    assert report.format(full=False) in result.out  # what was printed is what was written
    assert {r.kind for r in report.records("bf16")} >= {"fw", "bw", "grad", "logprob", "loss"}


def test_the_summary_links_the_plot_and_holds_the_propagation_tables(first: tuple[Result, Path, Path]) -> None:
    _, output, _ = first
    summary = (output / "summary.md").read_text()
    assert summary.startswith(f"## Precision of run {TRAINED_LM_DIR}\n")
    assert "Plot: [error-vs-depth.png](error-vs-depth.png)." in summary
    assert "| fw | first (model.embed_tokens) |" in summary and "| bf16 |" in summary
    assert (output / "error-vs-depth.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (_, report), *_ = reports_in(output / "precision-report.json").items()
    logprob, loss = report.get("bf16", "logprob", "logprob"), report.get("bf16", "loss", "loss")
    assert f"| bf16 | {logprob.rms_rel:.3%} | {logprob.delta_mean:.3g} | {logprob.delta_rms:.3g} | " in summary
    assert f" | {loss.rms_rel:.3%} |\n" in summary


def test_the_inputs_file_holds_the_exact_tokens_of_the_text(first: tuple[Result, Path, Path]) -> None:
    from transformers import AutoTokenizer

    from pytest_precision.inputs import from_text

    _, output, _ = first
    saved = load_file(output / "inputs.safetensors")
    tokenizer = AutoTokenizer.from_pretrained(TRAINED_LM_DIR)
    expected = from_text(tokenizer, CORPUS.read_text(encoding="utf-8"), 2, LENGTH)
    assert sorted(saved) == ["input_ids", "labels"]
    assert torch.equal(saved["input_ids"], expected) and torch.equal(saved["labels"], expected)


def float64_logprobs(ids: torch.Tensor, *, temperature: float = 1.0) -> np.ndarray:
    """The trained LM's chosen-token log-probs of `ids`, computed independently: the fp32 model's logits over
    `temperature`, log_softmax in float64, the next token's entry; (batch, length - 1)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(TRAINED_LM_DIR, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.double() / temperature
    return torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0].numpy()


def test_the_logprob_files_are_aligned_for_compare_logprobs(first: tuple[Result, Path, Path]) -> None:
    """Each run's chosen-token log-probs, (batch, length - 1) float64; the reference's equal an independent
    float64 log_softmax of the fp32 model's logits on the saved tokens, and compare_logprobs of two files
    gives the report's own logprob row."""
    _, output, _ = first
    files = sorted(p.name for p in (output / "logprobs").iterdir())
    assert files == ["bf16.npy", "fp16.npy", "reference.npy"]
    reference = np.load(output / "logprobs" / "reference.npy")
    assert reference.shape == (2, LENGTH - 1) and reference.dtype == np.float64
    ids = load_file(output / "inputs.safetensors")["input_ids"]
    np.testing.assert_allclose(reference, float64_logprobs(ids), rtol=1e-5, atol=1e-5)
    (_, report), *_ = reports_in(output / "precision-report.json").items()
    for variant in ("bf16", "fp16"):
        pair = compare_logprobs(output / "logprobs" / f"{variant}.npy", output / "logprobs" / "reference.npy")
        mine, theirs = pair.records("a")[0], report.get(variant, "logprob", "logprob")
        assert mine.count == theirs.count == 2 * (LENGTH - 1)
        assert mine.rms_rel == pytest.approx(theirs.rms_rel, rel=1e-5)
        assert mine.delta_mean == pytest.approx(theirs.delta_mean, rel=1e-5)


def test_a_saved_reference_runs_only_the_new_variants_with_the_same_numbers(
    first: tuple[Result, Path, Path], tmp_path: Path
) -> None:
    _, output, reference = first
    again = run(
        TRAINED_LM_DIR, "--reference", reference, "--variants", "bf16,bf16_fp32_head", "--output-dir", tmp_path / "out"
    )
    assert again.code == 0, again.err
    assert not any(line.startswith("reference ") for line in again.progress)
    assert f"loading the reference {reference}" in again.progress
    assert next(line for line in again.progress if ": done in " in line).startswith("variant bf16 (1/2): done in ")
    (_, fresh), *_ = reports_in(output / "precision-report.json").items()
    (_, reused), *_ = reports_in(tmp_path / "out" / "precision-report.json").items()
    assert reused.variants == ["bf16", "bf16_fp32_head"]
    assert [r.to_dict() for r in reused.records("bf16")] == [r.to_dict() for r in fresh.records("bf16")]
    # The reference's inputs came from the file: the same tokens, the same reference log-probs.
    assert torch.equal(
        load_file(tmp_path / "out" / "inputs.safetensors")["input_ids"],
        load_file(output / "inputs.safetensors")["input_ids"],
    )
    assert np.array_equal(
        np.load(tmp_path / "out" / "logprobs" / "reference.npy"), np.load(output / "logprobs" / "reference.npy")
    )


def changed_copy(folder: Path) -> Path:
    """The trained LM with one weight nudged: the same architecture, other weights."""
    copy = shutil.copytree(TRAINED_LM_DIR, folder / "nudged")
    weights = load_file(copy / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * 1.001
    save_file(weights, copy / "model.safetensors", metadata={"format": "pt"})
    return copy


def test_a_reference_of_other_weights_is_refused_before_any_variant_runs(
    first: tuple[Result, Path, Path], tmp_path: Path
) -> None:
    _, _, reference = first
    for checkpoint in (changed_copy(tmp_path), TINY_LLAMA_DIR):
        result = run(checkpoint, "--reference", reference, "--variants", "bf16")
        assert result.code == 2
        assert result.error.startswith(f"pytest-precision run: --reference {reference} was computed from other weights")
        assert f"{TRAINED_LM_DIR} with weights digest" in result.error and str(checkpoint) in result.error
        assert not any(line.startswith("variant ") for line in result.progress)


def test_a_reference_of_other_inputs_or_settings_is_refused(first: tuple[Result, Path, Path]) -> None:
    _, _, reference = first
    refusals = {
        ("--length", "16"): "other inputs than --length 16 make: it holds input_ids 2x24, labels 2x24, these are "
        "input_ids 2x16",
        ("--text", TRAINED_LM_DIR / "SOURCE.md", "--length", str(LENGTH)): "(same shapes, other tokens)",
        ("--seed", "3"): "other inputs than --seed 3 make",
        ("--forward-only",): "other settings than --forward-only (it ran with backward)",
        ("--modules", "lm_head"): "other settings than --modules (it captured the default)",
        ("--temperature", "2"): "other settings than --temperature (it used 1.0)",
        ("--save-reference", "x.safetensors"): "--reference and --save-reference: give one",
    }
    for options, message in refusals.items():
        result = run(TRAINED_LM_DIR, "--reference", reference, *options)
        assert result.code == 2, options
        assert message in result.error, (options, result.error)
    # The same inputs given again are accepted.
    same = run(
        TRAINED_LM_DIR,
        "--reference",
        reference,
        "--text",
        CORPUS,
        "--length",
        LENGTH,
        "--batch",
        "2",
        "--variants",
        "bf16",
        "--quiet",
    )
    assert same.code == 0, same.err


def test_a_reference_saved_without_a_checkpoint_digest_is_refused(tmp_path: Path) -> None:
    """A Reference.save from Python records no digest: it cannot be checked, so it is not used."""
    import pytest_precision
    from conftest import load_trained_lm

    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    ref = pytest_precision.reference(load_trained_lm, {"input_ids": ids, "labels": ids})
    ref.save(tmp_path / "python.safetensors")
    result = run(TRAINED_LM_DIR, "--reference", tmp_path / "python.safetensors")
    assert result.code == 2 and "records no checkpoint digest" in result.error
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file")
    result = run(TRAINED_LM_DIR, "--reference", garbage)
    assert result.code == 2
    assert result.error.startswith(f"pytest-precision run: --reference {garbage}: Reference.load('{garbage}'): not a ")
    assert result.error.endswith("; write a new one with --save-reference")
    result = run(TRAINED_LM_DIR, "--reference", tmp_path / "absent.safetensors")
    assert result.code == 2 and "no such file; write one with --save-reference" in result.error


def test_a_non_empty_output_dir_is_refused_before_anything_runs(tmp_path: Path) -> None:
    output = tmp_path / "out"
    output.mkdir()
    (output / "notes.txt").write_text("mine")
    result = run(TINY_LLAMA_DIR, "--length", "8", "--output-dir", output)
    assert result.code == 2
    assert result.error == (
        f"pytest-precision run: --output-dir {output} is not empty: an earlier run's files would sit beside this "
        "run's and be read as its; choose a new folder, or pass --overwrite to replace the files a run writes there"
    )
    assert result.progress == []  # refused before loading anything
    (tmp_path / "file").write_text("")
    assert "a file is in its place" in run(TINY_LLAMA_DIR, "--output-dir", tmp_path / "file").error


def test_overwrite_replaces_an_earlier_runs_files_and_nothing_else(tmp_path: Path) -> None:
    output = tmp_path / "out"
    assert run(TINY_LLAMA_DIR, "--length", "8", "--variants", "fp16", "--output-dir", output, "--quiet").code == 0
    assert (output / "logprobs" / "fp16.npy").is_file()
    (output / "notes.txt").write_text("mine")
    result = run(TINY_LLAMA_DIR, "--length", "8", "--variants", "bf16", "--output-dir", output, "--overwrite")
    assert result.code == 0, result.err
    assert sorted(p.name for p in (output / "logprobs").iterdir()) == ["bf16.npy", "reference.npy"]
    assert (output / "notes.txt").read_text() == "mine"
    (_, report), *_ = reports_in(output / "precision-report.json").items()
    assert report.variants == ["bf16"]
    # A run that fails (a NaN weight: no finite reference) loses nothing of the earlier run.
    broken = shutil.copytree(TINY_LLAMA_DIR, tmp_path / "nan")
    weights = load_file(broken / "model.safetensors")
    weights["model.norm.weight"][0] = float("nan")
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    failed = run(broken, "--length", "8", "--variants", "fp16", "--output-dir", output, "--overwrite")
    assert failed.code == 2 and "the fp32 reference is not finite" in failed.error
    assert sorted(p.name for p in (output / "logprobs").iterdir()) == ["bf16.npy", "reference.npy"]
    assert (output / "precision-report.json").is_file() and (output / "notes.txt").read_text() == "mine"


def test_save_reference_refuses_to_replace_a_file_unless_overwrite(tmp_path: Path) -> None:
    target = tmp_path / "ref.safetensors"
    target.write_bytes(b"precious")
    result = run(TINY_LLAMA_DIR, "--length", "8", "--save-reference", target)
    assert result.code == 2 and f"--save-reference {target} exists; pass --overwrite" in result.error
    assert target.read_bytes() == b"precious"
    assert run(TINY_LLAMA_DIR, "--length", "8", "--save-reference", target, "--overwrite", "--quiet").code == 0
    assert target.read_bytes()[:8] != b"precious"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary file left
    missing = run(TINY_LLAMA_DIR, "--save-reference", tmp_path / "no" / "ref.safetensors")
    assert missing.code == 2 and "does not exist" in missing.error


def test_quiet_prints_no_progress() -> None:
    result = run(TINY_LLAMA_DIR, "--length", "8", "--variants", "bf16", "--quiet", "--forward-only")
    assert result.code == 0 and result.err == ""


def test_tokens_sets_the_length_from_the_total(tmp_path: Path) -> None:
    result = run(
        TINY_LLAMA_DIR,
        "--tokens",
        "24",
        "--batch",
        "3",
        "--variants",
        "bf16",
        "--forward-only",
        "--quiet",
        "--output-dir",
        tmp_path / "out",
    )
    assert result.code == 0, result.err
    assert load_file(tmp_path / "out" / "inputs.safetensors")["input_ids"].shape == (3, 8)
    both = run(TINY_LLAMA_DIR, "--tokens", "24", "--length", "8")
    assert both.code == 2 and "--tokens 24 and --length 8 both set the sequence length" in both.error
    odd = run(TINY_LLAMA_DIR, "--tokens", "25", "--batch", "2")
    assert odd.code == 2 and "--tokens 25 must be a multiple of --batch 2" in odd.error


def test_modules_forward_only_temperature_and_loss_scale_reach_the_runs(tmp_path: Path) -> None:
    output = tmp_path / "out"
    result = run(
        TRAINED_LM_DIR,
        "--length",
        "8",
        "--variants",
        "fp16",
        "--modules",
        "model.layers.[0-9]+",
        "--modules",
        "lm_head",
        "--temperature",
        "2",
        "--loss-scale",
        "1024",
        "--output-dir",
        output,
    )
    assert result.code == 0, result.err
    (_, report), *_ = reports_in(output / "precision-report.json").items()
    fw = [r.name for r in report.records("fp16", "fw")]
    assert fw == ["model.layers.0", "model.layers.1", "model.layers.2", "model.layers.3", "lm_head"]
    assert report.runs["fp16"].loss_scale == 1024
    ids = load_file(output / "inputs.safetensors")["input_ids"]
    expected = float64_logprobs(ids, temperature=2)
    np.testing.assert_allclose(np.load(output / "logprobs" / "reference.npy"), expected, rtol=1e-5, atol=1e-5)
    forward = run(
        TRAINED_LM_DIR, "--length", "8", "--variants", "bf16", "--forward-only", "--output-dir", tmp_path / "fw"
    )
    assert forward.code == 0
    assert not any(": backward" in line for line in forward.progress)
    (_, report), *_ = reports_in(tmp_path / "fw" / "precision-report.json").items()
    assert {r.kind for r in report.records("bf16")} == {"fw", "logprob", "loss"}


def test_bad_knob_values_are_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    for options, message in {
        ("--temperature", "0"): "argument --temperature: '0' must be a finite number > 0",
        ("--temperature", "nan"): "argument --temperature: 'nan' must be a finite number > 0",
        ("--loss-scale", "-1"): "argument --loss-scale: '-1' must be a finite number > 0 or 'calibrate'",
        ("--modules", "("): "argument --modules: '(' is not a regex",
    }.items():
        with pytest.raises(SystemExit) as stopped:
            main(["run", str(TINY_LLAMA_DIR), *options])
        assert stopped.value.code == 2
        assert message in capsys.readouterr().err


def test_variants_from_a_file_mix_with_built_in_names(tmp_path: Path) -> None:
    variants = tmp_path / "variants.json"
    variants.write_text(json.dumps([{"name": "bf16_head32", "dtype": "bf16", "fp32_modules": ["<output head>"]}]))
    output = tmp_path / "out"
    result = run(
        TRAINED_LM_DIR,
        "--length",
        "8",
        "--variants",
        "bf16",
        "--variants-file",
        variants,
        "--forward-only",
        "--output-dir",
        output,
    )
    assert result.code == 0, result.err
    assert "variant bf16_head32 (3/3): done in " in "\n".join(result.progress)
    (_, report), *_ = reports_in(output / "precision-report.json").items()
    assert report.variants == ["bf16", "bf16_head32"]
    assert report.runs["bf16_head32"].variant["fp32_modules"] == ["<output head>"]
    # The fp32 head changes the head's error, not the first block's.
    assert report.get("bf16_head32", "lm_head").rms_rel < report.get("bf16", "lm_head").rms_rel
    assert report.get("bf16_head32", "model.layers.0").rms_rel == report.get("bf16", "model.layers.0").rms_rel
    variants.write_text(json.dumps([{"name": "x", "dtype": "bf16", "precision": "high"}]))
    bad = run(TRAINED_LM_DIR, "--variants-file", variants)
    assert bad.code == 2 and bad.err.count("\n") == 1
    assert bad.error.startswith(f"pytest-precision run: --variants-file {variants}, variant 1 ('x'): unknown field")


def test_help_says_why_a_saved_reference_matters() -> None:
    from pytest_precision.cli.main import build_parser

    parser = build_parser()
    run_parser = parser._subparsers._group_actions[0].choices["run"]  # type: ignore[union-attr]
    text = " ".join(run_parser.format_help().split())
    assert "on a big model the fp32 reference is the most expensive run" in text
    for option in (
        "--save-reference PATH",
        "--reference PATH",
        "--variants-file FILE",
        "--output-dir DIR",
        "--overwrite",
        "--quiet",
        "--tokens N",
        "--modules REGEX",
        "--temperature T",
        "--loss-scale SCALE",
    ):
        assert option in text


def test_the_weights_are_hashed_only_for_a_reference_file_which_may_go_in_the_output_dir(tmp_path: Path) -> None:
    plain = run(TINY_LLAMA_DIR, "--length", "8", "--variants", "bf16", "--forward-only")
    assert plain.code == 0 and not any("hashing" in line for line in plain.progress)
    output = tmp_path / "new" / "out"
    saved = run(
        TINY_LLAMA_DIR,
        "--length",
        "8",
        "--variants",
        "bf16",
        "--forward-only",
        "--output-dir",
        output,
        "--save-reference",
        output / "ref.safetensors",
    )
    assert saved.code == 0, saved.err
    assert any("hashing its weights" in line for line in saved.progress)
    assert (output / "ref.safetensors").is_file() and (output / "precision-report.json").is_file()


def test_a_reference_saved_inside_the_checkpoint_folder_does_not_change_its_digest(tmp_path: Path) -> None:
    """Only config.json and the files transformers loads weights from count: a reference file (or a run's
    inputs.safetensors) written beside the weights leaves the checkpoint the same model."""
    checkpoint = shutil.copytree(TINY_LLAMA_DIR, tmp_path / "ckpt")
    reference = checkpoint / "reference.safetensors"
    first = run(checkpoint, "--length", "8", "--variants", "bf16", "--forward-only", "--save-reference", reference)
    assert first.code == 0, first.err
    (checkpoint / "inputs.safetensors").write_bytes(b"anything")
    again = run(checkpoint, "--reference", reference, "--variants", "fp16", "--quiet")
    assert again.code == 0, again.err
    (checkpoint / "config.json").write_text((checkpoint / "config.json").read_text().replace("1e-06", "1e-05"))
    changed = run(checkpoint, "--reference", reference, "--variants", "fp16")
    assert changed.code == 2 and "was computed from other weights" in changed.error


# --- Ctrl-C: one line saying what was (not) written, exit 130 --------------------------------------------------

#: `pytest-precision run` in a fresh interpreter; with argv[1:3] = MODULE NAME (not "-"), pytest_precision.MODULE's
#: NAME is replaced by a function that touches argv[3] and sleeps: a run held at that step until interrupted.
HELD_RUN = """
import signal, sys, time
from pathlib import Path

# A run started in the background by a non-interactive shell inherits SIGINT ignored, and Python then installs no
# KeyboardInterrupt handler: give the run the handler a terminal's Ctrl-C meets.
signal.signal(signal.SIGINT, signal.default_int_handler)

module, name, marker, *args = sys.argv[1:]
if module != "-":
    import importlib

    def held(*_, **__):
        Path(marker).write_text("")
        time.sleep(300)

    setattr(importlib.import_module(f"pytest_precision.{module}"), name, held)
from pytest_precision.cli.main import main

sys.exit(main(args))
"""


def interrupted_run(tmp_path: Path, args: list[str | Path], held: tuple[str, str] | None = None) -> Result:
    """`pytest-precision run ARGS` in a subprocess sent SIGINT once it is held: at `held` (module, function) or,
    with None, reading the FIFO given as --text (the real code, blocked in read). Never hangs: every wait has a
    deadline, and the process is killed in the end whatever happened."""
    import errno
    import os
    import signal
    import subprocess
    import sys
    import time

    marker = tmp_path / "held"
    fifo = next((Path(args[i + 1]) for i, arg in enumerate(args) if arg == "--text"), None)
    module, name = held or ("-", "-")
    command = [sys.executable, "-c", HELD_RUN, module, name, str(marker), "run", *map(str, args)]
    environment = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}

    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment)
    writer = None
    try:
        deadline = time.monotonic() + 180
        while process.poll() is None and time.monotonic() < deadline:
            if held is not None and marker.exists():
                break
            if fifo is not None:
                try:  # succeeds once the run has opened the FIFO and waits in read()
                    writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                    break
                except OSError as error:
                    if error.errno != errno.ENXIO:
                        raise
            time.sleep(0.05)
        assert process.poll() is None, f"the run ended before it was held: {process.communicate()}"
        time.sleep(0.2)  # into the blocking call
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=120)
        return Result(process.returncode, out, err)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
        if writer is not None:
            os.close(writer)


needs_sigint = pytest.mark.skipif(not hasattr(__import__("os"), "mkfifo"), reason="needs POSIX signals and FIFOs")


@needs_sigint
def test_ctrl_c_during_the_reference_says_nothing_was_written_and_exits_130(tmp_path: Path) -> None:
    """The real code, held reading --text (a FIFO): interrupted after the output folder was checked and the
    weights hashed, before any file was written."""
    import os

    fifo = tmp_path / "prompt.txt"
    os.mkfifo(fifo)
    output, reference = tmp_path / "out", tmp_path / "ref.safetensors"
    args: list[str | Path] = [TINY_LLAMA_DIR, "--text", fifo, "--length", "8", "--output-dir", output]
    result = interrupted_run(tmp_path, [*args, "--save-reference", reference])
    assert result.code == 130, result.err
    assert result.error == (
        f"pytest-precision run: interrupted; nothing was written to --save-reference {reference} or "
        f"--output-dir {output}"
    )
    assert "Traceback" not in result.err and result.out == ""
    assert not reference.exists() and [p.name for p in output.iterdir()] == []


@needs_sigint
def test_ctrl_c_after_the_reference_was_saved_says_so(tmp_path: Path) -> None:
    output, reference = tmp_path / "out", tmp_path / "ref.safetensors"
    result = interrupted_run(
        tmp_path,
        [TINY_LLAMA_DIR, "--length", "8", "--forward-only", "--output-dir", output, "--save-reference", reference],
        held=("engine.compare", "compare"),
    )
    assert result.code == 130, result.err
    assert result.error == (
        f"pytest-precision run: interrupted; the reference was saved to {reference} (whole); nothing was written "
        f"to --output-dir {output}"
    )
    assert f"saved the reference to {reference}" in "\n".join(result.progress)
    assert reference.stat().st_size > 0 and [p.name for p in output.iterdir()] == []


@needs_sigint
def test_ctrl_c_while_writing_the_output_dir_names_what_was_written_and_removed(tmp_path: Path) -> None:
    """--overwrite over an earlier run's files, held before the log-prob files: the line names the files written
    and the earlier ones removed, not "nothing"."""
    output = tmp_path / "out"
    (output / "logprobs").mkdir(parents=True)
    (output / "logprobs" / "old.npy").write_bytes(b"earlier")
    (output / "summary.md").write_text("earlier")
    result = interrupted_run(
        tmp_path,
        [
            TINY_LLAMA_DIR,
            "--length",
            "8",
            "--forward-only",
            "--variants",
            "bf16",
            "--output-dir",
            output,
            "--overwrite",
        ],
        held=("cli.run_outputs", "write_logprobs"),
    )
    assert result.code == 130, result.err
    written = sorted(p.relative_to(output).as_posix() for p in output.rglob("*") if p.is_file())
    assert "summary.md" in written and "logprobs/old.npy" not in written
    assert (output / "summary.md").read_text() != "earlier"
    said = re.fullmatch(
        rf"pytest-precision run: interrupted; it had written (.*) in --output-dir {re.escape(str(output))}; it had "
        rf"removed an earlier run's logprobs/old\.npy from --output-dir {re.escape(str(output))}",
        result.error,
    )
    assert said is not None, result.error
    assert sorted(said.group(1).split(", ")) == written


def test_an_interrupted_run_without_output_options_wrote_nothing(tmp_path: Path) -> None:
    from pytest_precision.cli.run import RunOptions, interrupted_message, written_files

    options = RunOptions(directory=tmp_path)
    assert interrupted_message(options, written_files(options)) == "interrupted; no file was written"


def test_bad_tokens_are_refused_up_front_naming_only_the_options_given(tmp_path: Path) -> None:
    """--batch left at its default is not named as if given; with --reference the refusal comes before the
    weights are hashed and the reference read."""
    default_batch = run(TINY_LLAMA_DIR, "--tokens", "1")
    assert default_batch.code == 2 and default_batch.err.count("\n") == 1
    assert default_batch.error == (
        "pytest-precision run: --tokens 1 must be a multiple of 2 and at least 4: the tokens are split into 2 "
        "sequences (the default; --batch N sets it) of 2 tokens or more"
    )
    given = run(TINY_LLAMA_DIR, "--tokens", "2", "--batch", "2")
    assert given.code == 2 and given.error == (
        "pytest-precision run: --tokens 2 must be a multiple of --batch 2 and at least 4 (sequences of 2 tokens "
        "or more)"
    )
    junk = tmp_path / "ref.safetensors"
    junk.write_bytes(b"not a reference")
    with_reference = run(TINY_LLAMA_DIR, "--reference", junk, "--tokens", "2", "--batch", "2")
    assert with_reference.code == 2 and with_reference.err == given.err  # no hashing line, no word on the file


def test_fp8_matmuls_on_a_cpu_are_refused_before_the_reference_runs() -> None:
    pytest.importorskip("torchao", reason="the lowbit extra (torchao) is not installed")
    result = run(TINY_LLAMA_DIR, "--variants", "bf16,fp8_dynamic", "--length", "8")
    assert result.code == 2 and result.progress == []
    assert result.error == (
        "pytest-precision run: variant 'fp8_dynamic': Float8DynamicActivationFloat8WeightConfig runs fp8 matmuls, "
        "which need CUDA of compute capability 8.9 or higher (this run is on cpu); use fp8_weight_only here, or run "
        "on such a GPU"
    )


def test_an_unknown_variant_points_to_the_variants_file(tmp_path: Path) -> None:
    result = run(TINY_LLAMA_DIR, "--variants", "bf16,bf17")
    assert result.code == 2
    assert result.error.startswith("pytest-precision run: --variants: unknown variant 'bf17'. Built-in variants: ")
    assert result.error.endswith(
        "; or describe your own in a --variants-file FILE (JSON or TOML; fields name, dtype, autocast, "
        "fp32_modules, matmul_precision, backend, attn_implementation, arrangement, fp8_training, quantize, "
        "weight_storage, replay_routing, compile, implementation)"
    )
    assert "pytest_precision.Variant" not in result.error
    sharded = run(TINY_LLAMA_DIR, "--variants", "bf16,fsdp_bf16", "--length", "8")
    assert sharded.code == 2 and sharded.progress == []  # refused before the reference runs
    assert sharded.error.startswith("pytest-precision run: --variants fsdp_bf16: FSDP2 mixed precision (")


# --- a saved reference: tampering refused, ordinary file mode ---------------------------------------------------


def _edited_copy(saved: Path, copy: Path, offset_of: str | None, new: bytes) -> Path:
    """A copy of the safetensors file `saved` with `new` written at the start of tensor `offset_of`'s bytes
    (None: over the file's last bytes)."""
    data = bytearray(saved.read_bytes())
    header_length = int.from_bytes(data[:8], "little")
    if offset_of is None:
        offset = len(data) - len(new)
    else:
        offset = 8 + header_length + json.loads(data[8 : 8 + header_length])[offset_of]["data_offsets"][0]
    assert data[offset : offset + len(new)] != new
    data[offset : offset + len(new)] = new
    copy.write_bytes(bytes(data))
    return copy


def test_a_tampered_reference_file_is_refused_naming_the_tensor(
    first: tuple[Result, Path, Path], tmp_path: Path
) -> None:
    """The issue's case: one fp32 log-prob set to -50 measured fp16's log-probs at 32 % instead of 0.05 %."""
    import struct

    _, _, reference = first
    copy = _edited_copy(reference, tmp_path / "edited.safetensors", "logprob/logprob", struct.pack("<f", -50.0))
    result = run(TRAINED_LM_DIR, "--reference", copy, "--variants", "fp16")
    assert result.code == 2 and result.out == ""
    count = len(load_file(reference))
    assert result.error == (
        f"pytest-precision run: --reference {copy}: Reference.load('{copy}'): 1 of its {count} tensors differs from "
        "the SHA-256 digests it records: 'logprob/logprob', so the file was changed after Reference.save wrote it; "
        "write a new one with --save-reference"
    )
    flipped = _edited_copy(reference, tmp_path / "flipped.safetensors", None, bytes([reference.read_bytes()[-1] ^ 1]))
    result = run(TRAINED_LM_DIR, "--reference", flipped, "--variants", "fp16")
    assert result.code == 2 and f"1 of its {count} tensors differs from the SHA-256 digests" in result.error


def test_save_reference_writes_the_umasks_ordinary_mode_or_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno
    import os
    import stat

    import safetensors.torch

    target = tmp_path / "ref.safetensors"
    previous = os.umask(0o022)
    try:
        result = run(
            TINY_LLAMA_DIR, "--length", "8", "--variants", "bf16", "--forward-only", "--save-reference", target
        )
    finally:
        os.umask(previous)
    assert result.code == 0, result.err
    assert stat.S_IMODE(target.stat().st_mode) == 0o644  # not the 0600 of a temporary file
    assert [p.name for p in tmp_path.iterdir()] == ["ref.safetensors"]

    def full_disk(*_: object, **__: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    failed = run(TINY_LLAMA_DIR, "--length", "8", "--forward-only", "--save-reference", tmp_path / "new.safetensors")
    assert failed.code == 2
    assert failed.error == (
        f"pytest-precision run: --save-reference {tmp_path / 'new.safetensors'}: cannot write it "
        f"({os.strerror(errno.ENOSPC)})"
    )
    assert [p.name for p in tmp_path.iterdir()] == ["ref.safetensors"]  # nothing half-written left


def test_a_saved_reference_is_checked_by_the_checkpoint_digest_without_loading_fp32_weights(
    first: tuple[Result, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checkpoint's SHA-256 stands for the weights' checksum: the fp32 model a factory check would build (the
    load --reference is there to spare) is never built."""
    import dataclasses

    from pytest_precision.cli import checkpoint as checkpoint_module

    asked: list[torch.dtype] = []
    opened = checkpoint_module.open_checkpoint

    def recording(directory: Path) -> checkpoint_module.Checkpoint:
        found = opened(directory)

        def factory(dtype: torch.dtype, device: torch.device) -> object:
            asked.append(dtype)
            return found.factory(dtype, device)

        return dataclasses.replace(found, factory=factory)

    monkeypatch.setattr(checkpoint_module, "open_checkpoint", recording)
    _, _, reference = first
    result = run(TRAINED_LM_DIR, "--reference", reference, "--variants", "bf16", "--quiet")
    assert result.code == 0, result.err
    assert asked == [torch.bfloat16]
