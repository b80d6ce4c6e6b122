"""Open a local transformers checkpoint (`pytest-precision run`) without ever executing code from it.

Every from_pretrained gets trust_remote_code=False and local_files_only=True (no hub, and no prompt:
transformers asks only when trust_remote_code is left at None); a config.json naming custom code
(`auto_map`) is refused outright. Anything wrong with the folder or the options is a PrecisionError of
one line naming the file or option.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_precision.base import strict_json
from pytest_precision.base.errors import PrecisionError

if TYPE_CHECKING:
    import torch


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


def checked_device(name: str) -> Any:
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
        config = strict_json.loads(config_path.read_bytes().decode("utf-8"))
    except OSError as error:
        raise PrecisionError(f"cannot read {config_path}: {error.strerror or error}") from None
    except strict_json.StrictJsonError as error:
        raise PrecisionError(f"{config_path}: {error}; re-save the checkpoint") from None
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


#: The weight files transformers reads, by name: model.safetensors, pytorch_model.bin, ... and their shards
#: (model-00001-of-00004.safetensors). Other files in the folder (a saved reference, inputs.safetensors of a
#: run, a tokenizer) are not the model's and must not change its digest.
WEIGHT_FILE = re.compile(
    r"(model|pytorch_model|tf_model|flax_model)(-\d+-of-\d+)?\.(safetensors|bin|h5|msgpack)(\.index\.json)?"
)


def weight_files(directory: Path) -> list[Path]:
    """config.json and the weight files (and shard indexes) of a checkpoint folder, sorted by name."""
    files = [
        path
        for path in directory.iterdir()
        if path.is_file() and (path.name == "config.json" or WEIGHT_FILE.fullmatch(path.name))
    ]
    return sorted(files, key=lambda path: path.name)


def weights_digest(directory: Path) -> str:
    """SHA-256 over the names and bytes of weight_files(directory): which model a saved reference was computed
    from. It reads every weight file once (about 1-2 GB/s, much less than running the model)."""
    import hashlib

    hasher = hashlib.sha256()
    for path in weight_files(directory):
        hasher.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        try:
            with open(path, "rb") as handle:
                while chunk := handle.read(1 << 24):
                    hasher.update(chunk)
        except OSError as error:
            raise PrecisionError(f"cannot read {path}: {error.strerror or error}") from None
    return hasher.hexdigest()


@dataclass(frozen=True)
class Checkpoint:
    """A local transformers causal LM: its folder, configuration and a factory (dtype, device) -> model."""

    directory: Path
    config: Any
    factory: Callable[[torch.dtype, torch.device], Any]

    def inputs(self, *, batch: int, length: int, text_file: str | None, seed: int) -> dict[str, torch.Tensor]:
        """{"input_ids": ids, "labels": ids}: `batch` sequences of `length` tokens, random ones or the UTF-8
        text of `text_file` tokenized by the checkpoint's own tokenizer."""
        from pytest_precision.engine.inputs import from_text, random_tokens

        if length < 2:
            raise PrecisionError(f"--length must be >= 2 (got {length}): a next-token log-probability needs two tokens")
        if batch < 1:
            raise PrecisionError(f"--batch must be >= 1 (got {batch})")
        if text_file:
            try:
                text = Path(text_file).read_bytes().decode("utf-8")
            except OSError as error:
                raise PrecisionError(f"--text {text_file}: cannot read it: {error.strerror or error}") from None
            except UnicodeDecodeError:
                raise PrecisionError(f"--text {text_file}: not UTF-8 text; pass a UTF-8 text file") from None
            directory = self.directory
            if not any((directory / name).is_file() for name in TOKENIZER_FILES):
                raise PrecisionError(
                    f"{directory} has no tokenizer (none of {', '.join(TOKENIZER_FILES[:3])}, ...) to tokenize "
                    f"--text {text_file}; save one there (tokenizer.save_pretrained), or leave out --text for random "
                    "tokens"
                )
            from transformers import AutoTokenizer

            tokenizer = _loading(
                f"the tokenizer of {directory}", lambda: AutoTokenizer.from_pretrained(directory, **LOCAL)
            )
            try:
                ids = from_text(tokenizer, text, batch, length)
            except PrecisionError as error:
                raise PrecisionError(f"--text {text_file}: {error}") from None
        else:
            vocab = getattr(self.config, "vocab_size", None)
            if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
                raise PrecisionError(
                    f"{self.directory / 'config.json'}: vocab_size is {vocab!r}, not a positive integer; random "
                    "tokens need it"
                )
            ids = random_tokens(vocab, batch, length, seed=seed)
        return {"input_ids": ids, "labels": ids}


#: Every from_pretrained: never code from the checkpoint, never the hub. trust_remote_code=False also means
#: transformers never prompts (it asks only when the argument is left at None).
LOCAL = {"local_files_only": True, "trust_remote_code": False}


def open_checkpoint(directory: Path) -> Checkpoint:
    """The checkpoint in `directory`, its configuration read (the weights are read by each run's factory)."""
    _checkpoint_config(directory)
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise PrecisionError("`pytest-precision run` needs transformers: pip install 'pytest-precision[hf]'") from None
    config = _loading(f"the configuration of {directory}", lambda: AutoConfig.from_pretrained(directory, **LOCAL))

    def factory(dtype: torch.dtype, device: torch.device) -> Any:
        model: Any = _loading(
            f"the model in {directory}",
            lambda: AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **LOCAL),
        )
        return model.to(device)

    return Checkpoint(directory, config, factory)


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers without its progress bars and warnings (every run loads the weights again, and the
    tokenizer warns about a text longer than the model's context, which is cut to --length anyway): the
    command's own progress is what shows. Both settings are restored on exit."""
    try:
        from transformers.utils import logging as transformers_logging
    except ImportError:
        yield
        return
    logging: Any = transformers_logging  # its functions carry no annotations
    bars, verbosity = logging.is_progress_bar_enabled(), logging.get_verbosity()
    logging.disable_progress_bar()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()
