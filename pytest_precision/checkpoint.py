"""Measure a local transformers checkpoint (`pytest-precision run`) without ever executing code from it.

Every from_pretrained gets trust_remote_code=False and local_files_only=True (no hub, and no prompt:
transformers asks only when trust_remote_code is left at None); a config.json naming custom code
(`auto_map`) is refused outright. Anything wrong with the folder or the options is a PrecisionError of
one line naming the file or option.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import PrecisionError

if TYPE_CHECKING:
    import torch

    from .report import PrecisionReport


def _one_line(error: BaseException) -> str:
    """An exception's message on one line (transformers' messages span several), at most 300 characters."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 300 else text[:297] + "..."


#: Files a transformers tokenizer is read from; a checkpoint with none of them has no tokenizer.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
)


def _checked_device(name: str) -> Any:
    """The torch.device of --device, after checking that this machine has it."""
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as error:
        raise PrecisionError(f"--device {name}: not a device name ({_one_line(error)}); e.g. cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise PrecisionError(f"--device {name}: CUDA is not available on this machine; use --device cpu")
    try:
        torch.empty(1, device=device)
    except Exception as error:  # each backend fails in its own way (AssertionError, RuntimeError, ...)
        raise PrecisionError(f"--device {name}: not usable here ({_one_line(error)}); use --device cpu") from None
    return device


def _checkpoint_config(directory: Path) -> dict[str, Any]:
    """config.json of a local checkpoint folder, refused when it is corrupt or names custom code."""
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise PrecisionError(
            f"{directory} is not a transformers checkpoint folder (no config.json); pass a local folder written by "
            "save_pretrained (the hub is not used)"
        )
    try:
        config = json.loads(config_path.read_bytes().decode("utf-8"))
    except OSError as error:
        raise PrecisionError(f"cannot read {config_path}: {error.strerror or error}") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise PrecisionError(f"{config_path} is not valid JSON ({_one_line(error)}); re-save the checkpoint") from None
    if not isinstance(config, dict):
        raise PrecisionError(f"{config_path} holds a JSON {type(config).__name__}, not a model configuration")
    if "auto_map" in config:
        # transformers would run the checkpoint's own .py files (with trust_remote_code) or silently measure
        # its built-in class instead of the model the checkpoint means; neither is acceptable here.
        named = config["auto_map"]
        shown = ", ".join(f"{k} -> {v}" for k, v in named.items()) if isinstance(named, dict) else repr(named)
        raise PrecisionError(
            f"{config_path} names custom code (auto_map: {shown}); pytest-precision run never executes code from a "
            "checkpoint: load the model yourself (trust_remote_code=True, if you trust it) and call "
            "pytest_precision.compare"
        )
    return config


def _loading(what: str, load: Any) -> Any:
    """load(), with any error of transformers (OSError, ValueError, safetensors', ...) as one line."""
    try:
        return load()
    except PrecisionError:
        raise
    except Exception as error:
        raise PrecisionError(f"cannot load {what}: {type(error).__name__}: {_one_line(error)}") from None


def measure_checkpoint(
    directory: Path,
    *,
    variants: str,
    length: int,
    batch: int,
    text_file: str | None,
    seed: int,
    device: str,
    backward: bool,
    isolate: bool = False,
) -> PrecisionReport:
    """compare() of the causal LM in `directory` on `batch` sequences of `length` tokens: random ones, or the
    UTF-8 text of `text_file` tokenized by the checkpoint's own tokenizer. `variants` is comma-separated;
    `isolate` adds each module's isolated error."""
    from .comparison import compare
    from .inputs import from_text, random_tokens
    from .variants import resolve_variant

    if length < 2:
        raise PrecisionError(f"--length must be >= 2 (got {length}): a next-token log-probability needs two tokens")
    if batch < 1:
        raise PrecisionError(f"--batch must be >= 1 (got {batch})")
    names = [v.strip() for v in variants.split(",") if v.strip()]
    if not names:
        raise PrecisionError(f"--variants {variants!r} names no variant; e.g. --variants bf16,fp16")
    for name in names:
        resolve_variant(name, argument="--variants")
    chosen_device = _checked_device(device)
    text = None
    if text_file:
        try:
            text = Path(text_file).read_bytes().decode("utf-8")
        except OSError as error:
            raise PrecisionError(f"--text {text_file}: cannot read it: {error.strerror or error}") from None
        except UnicodeDecodeError:
            raise PrecisionError(f"--text {text_file}: not UTF-8 text; pass a UTF-8 text file") from None
    _checkpoint_config(directory)
    try:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise PrecisionError("`pytest-precision run` needs transformers: pip install 'pytest-precision[hf]'") from None
    # Never code from the checkpoint, never the hub: trust_remote_code=False also means transformers never
    # prompts (it asks only when the argument is left at None).
    local = {"local_files_only": True, "trust_remote_code": False}
    config = _loading(f"the configuration of {directory}", lambda: AutoConfig.from_pretrained(directory, **local))

    def factory(dtype: torch.dtype, device: torch.device) -> Any:
        model: Any = _loading(
            f"the model in {directory}",
            lambda: AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **local),
        )
        return model.to(device)

    if text is not None:
        if not any((directory / name).is_file() for name in TOKENIZER_FILES):
            raise PrecisionError(
                f"{directory} has no tokenizer (none of {', '.join(TOKENIZER_FILES[:3])}, ...) to tokenize --text "
                f"{text_file}; save one there (tokenizer.save_pretrained), or leave out --text for random tokens"
            )
        tokenizer = _loading(f"the tokenizer of {directory}", lambda: AutoTokenizer.from_pretrained(directory, **local))
        ids = from_text(tokenizer, text, batch, length)
    else:
        vocab = getattr(config, "vocab_size", None)
        if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
            raise PrecisionError(
                f"{directory / 'config.json'}: vocab_size is {vocab!r}, not a positive integer; random tokens need it"
            )
        ids = random_tokens(vocab, batch, length, seed=seed)
    return compare(
        factory, {"input_ids": ids, "labels": ids}, names, device=chosen_device, backward=backward, isolate=isolate
    )
