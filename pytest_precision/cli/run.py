"""`pytest-precision run CKPT`: the fp32 reference (computed, or loaded with --reference) and each variant
of a local checkpoint, with progress on stderr, the tables on stdout and, with --output-dir, files to read
and compare later (see run_outputs). A saved reference records the digest of the checkpoint's weights and
of its inputs: reusing it with other weights or other inputs is refused, never measured.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from pytest_precision.base.errors import PrecisionError

if TYPE_CHECKING:
    import torch

    from pytest_precision.cli.checkpoint import Checkpoint
    from pytest_precision.cli.progress_printer import ProgressPrinter
    from pytest_precision.engine.progress import Role
    from pytest_precision.engine.references import Reference
    from pytest_precision.engine.variants import Variant
    from pytest_precision.reports.report import PrecisionReport

DEFAULT_VARIANTS = "bf16,fp16"
DEFAULT_LENGTH = 128
DEFAULT_BATCH = 2
DEFAULT_SEED = 0


@dataclass(frozen=True)
class RunOptions:
    """The options of `pytest-precision run`; None: not given (a default, or the loaded reference's own)."""

    directory: Path
    variants: str | None = None
    variants_file: Path | None = None
    length: int | None = None
    batch: int | None = None
    tokens: int | None = None
    text: str | None = None
    seed: int | None = None
    device: str = "cpu"
    forward_only: bool | None = None
    isolate: bool = False
    modules: tuple[str, ...] | None = None
    temperature: float | None = None
    loss_scale: float | str | None = None
    output_dir: Path | None = None
    overwrite: bool = False
    save_reference: Path | None = None
    reference: Path | None = None
    quiet: bool = False
    full: bool = False

    @property
    def input_options(self) -> list[str]:
        """The input options given on the command line, with their values ("--length 64")."""
        given = {
            "--length": self.length,
            "--batch": self.batch,
            "--tokens": self.tokens,
            "--text": self.text,
            "--seed": self.seed,
        }
        return [f"{name} {value}" for name, value in given.items() if value is not None]


def chosen_variants(options: RunOptions) -> list[Variant]:
    """--variants (built-in names) then --variants-file's, names unique; bf16,fp16 when neither is given."""
    from pytest_precision.cli.variants_file import FILE_FIELDS, load_variants_file
    from pytest_precision.engine.variants import resolve_variant

    names = options.variants
    if names is None and options.variants_file is None:
        names = DEFAULT_VARIANTS
    variants: list[Variant] = []
    if names is not None:
        listed = [name.strip() for name in names.split(",") if name.strip()]
        if not listed:
            raise PrecisionError(f"--variants {names!r} names no variant; e.g. --variants bf16,fp16")
        # On the command line a variant of one's own comes from a file, not from pytest_precision.Variant(...).
        own = f"describe your own in a --variants-file FILE (JSON or TOML; fields {', '.join(FILE_FIELDS)})"
        for name in listed:
            variant = resolve_variant(name, argument="--variants", own=own)
            if variant.fsdp_knobs:
                raise PrecisionError(
                    f"--variants {name}: FSDP2 mixed precision ({variant.fsdp_description()}) needs the model sharded "
                    "under torch.distributed, which pytest-precision run does not do; measure it in a test with "
                    "pytest_precision.sharded(model, shard)"
                )
            variants.append(variant)
    if options.variants_file is not None:
        for variant in load_variants_file(options.variants_file, earlier=[v.name for v in variants]):
            if any(v.name.lower() == variant.name.lower() for v in variants):
                raise PrecisionError(
                    f"--variants-file {options.variants_file}: variant {variant.name!r} is also named by --variants "
                    "(case apart: the names name files); give each run once"
                )
            variants.append(variant)
    names_seen = [v.name for v in variants]
    repeated = sorted({n for n in names_seen if names_seen.count(n) > 1})
    if repeated:
        raise PrecisionError(f"--variants names {', '.join(repeated)} more than once")
    return variants


def check_backends(variants: list[Variant], device: torch.device) -> None:
    """Set and restore each variant's backend flags and matmul precision now: a value torch refuses (a string
    flag given an unknown setting) fails here, not after the reference has run."""
    from pytest_precision.engine.backend_flags import pinned_backend

    for variant in variants:
        try:
            with pinned_backend(variant, device.type):
                pass
        except PrecisionError as error:
            raise PrecisionError(f"variant {variant.name!r}: {error}") from None
        except (RuntimeError, ValueError, TypeError) as error:
            raise PrecisionError(
                f"variant {variant.name!r}: torch refuses its backend settings {dict(variant.backend)} ({error})"
            ) from None


def input_shape(options: RunOptions) -> tuple[int, int]:
    """(batch, length) of the inputs: --tokens N is N tokens in all, --batch sequences of N / batch."""
    batch = DEFAULT_BATCH if options.batch is None else options.batch
    if batch < 1:
        raise PrecisionError(f"--batch must be >= 1 (got {batch})")
    if options.tokens is None:
        length = DEFAULT_LENGTH if options.length is None else options.length
        if length < 2:
            raise PrecisionError(f"--length must be >= 2 (got {length}): a next-token log-probability needs two tokens")
        return batch, length
    if options.length is not None:
        raise PrecisionError(
            f"--tokens {options.tokens} and --length {options.length} both set the sequence length; give one"
        )
    if options.tokens < 2 * batch or options.tokens % batch:
        if options.batch is None:  # name the default, not an option the user did not give
            raise PrecisionError(
                f"--tokens {options.tokens} must be a multiple of {batch} and at least {2 * batch}: the tokens are "
                f"split into {batch} sequences (the default; --batch N sets it) of 2 tokens or more"
            )
        raise PrecisionError(
            f"--tokens {options.tokens} must be a multiple of --batch {batch} and at least {2 * batch} "
            "(sequences of 2 tokens or more)"
        )
    return batch, options.tokens // batch


def _check_files(options: RunOptions) -> contextlib.AbstractContextManager[object]:
    """Everything about the files the run reads and writes that can be refused before it runs. Returns the
    claim on --output-dir (see run_outputs), to hold until the run ends; a null context without one."""
    from pytest_precision.cli.run_outputs import prepare_output_dir

    if options.reference is not None and options.save_reference is not None:
        raise PrecisionError(
            "--reference and --save-reference: give one (--reference reuses a saved reference, "
            "--save-reference writes a new one)"
        )
    if options.reference is not None and not options.reference.is_file():
        raise PrecisionError(f"--reference {options.reference}: no such file; write one with --save-reference")
    with contextlib.ExitStack() as claimed:  # a refusal below releases the claim
        if options.output_dir is not None:  # first: --save-reference may name a file in it
            claimed.enter_context(prepare_output_dir(options.output_dir, overwrite=options.overwrite))
        if options.save_reference is not None:
            target = options.save_reference
            if target.is_dir():
                raise PrecisionError(
                    f"--save-reference {target} is a folder; give a file name, e.g. reference.safetensors"
                )
            if target.exists() and not options.overwrite:
                raise PrecisionError(
                    f"--save-reference {target} exists; pass --overwrite to replace it, or choose another name"
                )
            if not target.parent.is_dir():
                raise PrecisionError(f"--save-reference {target}: the folder {target.parent} does not exist")
        return claimed.pop_all()


def _save_reference(ref: Reference, path: Path) -> None:
    """Reference.save, which writes atomically (never half a file) in the umask's ordinary mode."""
    try:
        ref.save(path)
    except OSError as error:
        raise PrecisionError(f"--save-reference {path}: cannot write it ({error.strerror or error})") from None


def _loaded_reference(options: RunOptions, checkpoint: Checkpoint, digest: str, device: torch.device) -> Reference:
    """The reference saved at --reference, refused when it was made from other weights or other inputs, or
    with settings the options contradict."""
    from pytest_precision.base.errors import ConfigurationError
    from pytest_precision.engine.batch import to_batch
    from pytest_precision.engine.references import Reference

    path = options.reference
    assert path is not None
    try:
        # The checkpoint's SHA-256 is checked below: checking what the factory builds too would load the fp32
        # weights, which a saved reference is there to spare.
        ref = Reference.load(path, checkpoint.factory, device=device, check_weights=False)
    except ConfigurationError as error:
        # Reference.load's advice is the Python API's; on the command line a new file comes from --save-reference.
        advice = str(error).replace("re-create it with Reference.save", "write a new one with --save-reference")
        raise PrecisionError(f"--reference {path}: {advice}") from None
    origin = ref.origin or {}
    recorded = origin.get("weights_sha256")
    if not isinstance(recorded, str):
        raise PrecisionError(
            f"--reference {path} records no checkpoint digest (it was not written by pytest-precision run "
            "--save-reference), so it cannot be checked against these weights; write one with --save-reference"
        )
    if recorded != digest:
        raise PrecisionError(
            f"--reference {path} was computed from other weights: it records the checkpoint "
            f"{origin.get('checkpoint')} with weights digest {recorded[:16]}..., and {options.directory} has "
            f"{digest[:16]}...; measuring variants of these weights against it would be meaningless: compute a "
            "new reference (leave out --reference, or write one with --save-reference)"
        )
    if options.input_options:
        batch, length = input_shape(options)
        seed = DEFAULT_SEED if options.seed is None else options.seed
        wanted = to_batch(checkpoint.inputs(batch=batch, length=length, text_file=options.text, seed=seed))
        if wanted.digest() != ref.batch.digest():
            theirs = ", ".join(f"{k} {'x'.join(map(str, v))}" for k, v in ref.batch.shapes().items())
            ours = ", ".join(f"{k} {'x'.join(map(str, v))}" for k, v in wanted.shapes().items())
            same = " (same shapes, other tokens)" if theirs == ours else ""
            raise PrecisionError(
                f"--reference {path} was computed on other inputs than {', '.join(options.input_options)} make: "
                f"it holds {theirs}, these are {ours}{same}; leave out those options to use the reference's own "
                "inputs, or compute a new reference"
            )
    contradictions = []
    if options.modules is not None and tuple(options.modules) != ref.modules:
        contradictions.append(f"--modules (it captured {list(ref.modules) if ref.modules else 'the default'})")
    if options.forward_only is not None and options.forward_only == ref.backward:
        contradictions.append(f"--forward-only (it ran {'with' if ref.backward else 'without'} backward)")
    if options.temperature is not None and options.temperature != ref.temperature:
        contradictions.append(f"--temperature (it used {ref.temperature})")
    if contradictions:
        raise PrecisionError(
            f"--reference {path} was computed with other settings than {', '.join(contradictions)}; leave those "
            "options out to use the reference's, or compute a new reference"
        )
    return ref


def _computed_reference(
    options: RunOptions,
    checkpoint: Checkpoint,
    digest: str | None,
    device: torch.device,
    printer: ProgressPrinter | None,
) -> Reference:
    """The fp32 reference of the checkpoint on the options' inputs, with its origin recorded (`digest`: of the
    checkpoint's weights, when it is to be saved)."""
    from pytest_precision.engine.batch import to_batch
    from pytest_precision.engine.reference_run import reference

    batch, length = input_shape(options)
    seed = DEFAULT_SEED if options.seed is None else options.seed
    inputs = checkpoint.inputs(batch=batch, length=length, text_file=options.text, seed=seed)
    ref = reference(
        checkpoint.factory,
        inputs,
        backward=not options.forward_only,
        modules=options.modules,
        device=device,
        temperature=1.0 if options.temperature is None else options.temperature,
        progress=printer,
    )
    ref.origin = {
        "tool": "pytest-precision run",
        "checkpoint": os.fspath(options.directory),
        "weights_sha256": digest,
        "inputs_sha256": to_batch(inputs).digest(),
        "text": options.text,
        "seed": None if options.text else seed,
    }
    return ref


def run_checkpoint(options: RunOptions, *, out: TextIO | None = None, err: TextIO | None = None) -> PrecisionReport:
    """Run `pytest-precision run`: print the tables on `out`, progress on `err` (unless quiet; default stdout and
    stderr), write the reference and output files asked for. Every refusal that needs no run comes before any
    run."""
    from pytest_precision.cli.checkpoint import checked_device, open_checkpoint, quiet_transformers
    from pytest_precision.cli.progress_printer import ProgressPrinter
    from pytest_precision.engine.compile_build import check_compilable
    from pytest_precision.engine.lowbit_build import check_runnable

    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    variants = chosen_variants(options)
    if options.reference is None or options.input_options:
        input_shape(options)  # refuse bad shapes now, not after hashing the weights and loading the reference
    device = checked_device(options.device)
    check_backends(variants, device)
    check_runnable(variants, device)  # torchao, its configs, fp8 matmuls: before the reference runs
    check_compilable(variants, device)  # Inductor on a CPU needs a C++ compiler
    claim = _check_files(options)
    planned: list[tuple[Role, str]] = [("variant", v.name) for v in variants]
    if options.reference is None:
        planned.insert(0, ("reference", "fp32"))
    printer = None if options.quiet else ProgressPrinter(err, live=err.isatty(), planned=planned)
    with claim, quiet_transformers():
        try:
            checkpoint = open_checkpoint(options.directory)
            return _measured(options, checkpoint, variants, device, printer, out)
        finally:
            if printer is not None:
                printer.close()


def _measured(
    options: RunOptions,
    checkpoint: Checkpoint,
    variants: list[Variant],
    device: torch.device,
    printer: ProgressPrinter | None,
    out: TextIO,
) -> PrecisionReport:
    """The reference (computed and maybe saved, or loaded), the variants against it, the tables and files."""
    from pytest_precision.cli.checkpoint import weights_digest
    from pytest_precision.engine.compare import compare

    def note(text: str) -> None:
        if printer is not None:
            printer.note(text)

    digest = None
    if options.reference is not None or options.save_reference is not None:
        note(f"checkpoint {options.directory}: hashing its weights (to record or check which model a reference is of)")
        digest = weights_digest(options.directory)
    if options.reference is not None:
        assert digest is not None
        note(f"loading the reference {options.reference}")
        ref = _loaded_reference(options, checkpoint, digest, device)
    else:
        ref = _computed_reference(options, checkpoint, digest, device, printer)
        if options.save_reference is not None:
            _save_reference(ref, options.save_reference)
            size = options.save_reference.stat().st_size / 2**20
            note(f"saved the reference to {options.save_reference} ({size:.1f} MiB)")
    report = compare(ref, variants=variants, loss_scale=options.loss_scale, isolate=options.isolate, progress=printer)
    out.write(report.format(full=options.full) + "\n")
    out.flush()
    if options.output_dir is not None:
        from pytest_precision.cli.run_outputs import write_outputs

        written = write_outputs(
            options.output_dir,
            report,
            label=f"run {options.directory}",
            inputs={k: v for k, v in ref.batch.kwargs.items() if hasattr(v, "shape")},
            command=_command_record(options, variants),
            overwrite=options.overwrite,
        )
        shown = ", ".join(os.path.relpath(path, options.output_dir) for path in written)
        note(f"wrote {len(written)} files to {options.output_dir}: {shown}")
    return report


#: A file's identity and content stamp: (device, inode, size, modification time in ns).
FileStamp = tuple[int, int, int, int]


def written_files(options: RunOptions) -> dict[Path, FileStamp]:
    """The files the run may write (--save-reference's, and run_outputs' own in --output-dir) that exist now,
    each with its stamp: two snapshots tell which the run wrote (a new stamp: written whole, through a temporary
    file and os.replace) and which it removed (--overwrite)."""
    from pytest_precision.cli.run_outputs import LOGPROBS_DIR, OWN_FILES

    candidates: list[Path] = []
    if options.save_reference is not None:
        candidates.append(options.save_reference)
    if options.output_dir is not None:
        candidates += [options.output_dir / name for name in OWN_FILES]
        candidates += sorted((options.output_dir / LOGPROBS_DIR).glob("*.npy"))
    stamps = {}
    for path in candidates:
        try:
            stat = path.stat()
        except OSError:
            continue
        stamps[path] = (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
    return stamps


def interrupted_message(options: RunOptions, before: dict[Path, FileStamp]) -> str:
    """What an interrupted run says, from written_files before it and now: which of its files it had written or
    removed, and where it wrote nothing ("interrupted; nothing was written to --output-dir out")."""
    now = written_files(options)
    written = [path for path, stamp in now.items() if before.get(path) != stamp]
    removed = [path for path in before if path not in now]
    said: list[str] = []
    untouched: list[str] = []
    if options.save_reference is not None:
        if options.save_reference in written:
            said.append(f"the reference was saved to {options.save_reference} (whole)")
        else:
            untouched.append(f"--save-reference {options.save_reference}")
    if options.output_dir is not None:
        folder = options.output_dir

        def names(paths: list[Path]) -> str:
            return ", ".join(os.path.relpath(path, folder) for path in paths if path != options.save_reference)

        if names(written):
            said.append(f"it had written {names(written)} in --output-dir {folder}")
        if names(removed):
            said.append(f"it had removed an earlier run's {names(removed)} from --output-dir {folder}")
        if not names(written) and not names(removed):
            untouched.append(f"--output-dir {folder}")
    if untouched:
        said.append(f"nothing was written to {' or '.join(untouched)}")
    return "interrupted; " + ("; ".join(said) if said else "no file was written")


def _command_record(options: RunOptions, variants: list[Variant]) -> dict[str, Any]:
    """The run's options as JSON, for precision-report.json."""
    return {
        "checkpoint": os.fspath(options.directory),
        "variants": [v.to_dict() for v in variants],
        "reference": None if options.reference is None else os.fspath(options.reference),
        "text": options.text,
        "device": options.device,
        "modules": None if options.modules is None else list(options.modules),
        "loss_scale": options.loss_scale,
        "isolate": options.isolate,
    }


__all__ = ["RunOptions", "chosen_variants", "input_shape", "interrupted_message", "run_checkpoint", "written_files"]
