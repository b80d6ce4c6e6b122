"""Arrangements: the same tokens computed the way a sampler computes them (one token at a time with a KV
cache, each sequence alone, left-padded in a batch of other requests), reassembled into the reference's
(batch, positions, ...) layout so that every row compares with the reference's full forward.

An Arrangement is a generator function `calls(inputs)` given the run's inputs (a dict of keyword arguments,
else the positional arguments). It yields `Call`s; the plugin runs the model on each (forward only, under
no_grad) and sends the output back into the generator (for a KV cache). For each call, `rows` and `offsets`
say where its outputs belong: row i, position p of every captured (rows, positions, ...) tensor of the call is
row `rows[i]`, position `p + offsets[i]` of the full batch; a row -1 (a filler sequence) and positions outside
the full sequence count nowhere. Every position that counts in the reference must be produced by some call.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pytest_precision.base.errors import ConfigurationError, ModelRunError, PrecisionError

if TYPE_CHECKING:
    import torch

    from pytest_precision.engine.batch import Batch
    from pytest_precision.engine.capture import CallCounts

#: What a call's inputs may be: keyword arguments, positional arguments, or one tensor.
CallInputs = Mapping[str, Any] | tuple[Any, ...] | Any


@dataclass(frozen=True)
class Call:
    """One model call of an arrangement and where its outputs go in the full batch.

    inputs: the model's arguments for this call: a dict of keywords, a tuple of positional arguments or a tensor.
    rows: per row of this call, the row of the full batch it computes (-1: a filler, counted nowhere);
        None: row i is row i.
    offsets: per row (or one int for all rows): full position = this call's position + offset.
    """

    inputs: CallInputs
    rows: Sequence[int] | None = None
    offsets: Sequence[int] | int = 0


CallPlan = Generator[Call, Any, None]


@dataclass(frozen=True)
class Arrangement:
    """A way of computing the reference's tokens other than one full forward (see the module docstring).

    name: its label ("decode", ...); calls: `calls(inputs) -> generator of Call` receiving each call's output.
    """

    name: str
    calls: Callable[[Any], CallPlan]
    description: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigurationError(f"Arrangement: name must be a non-empty string, got {self.name!r}")
        if not callable(self.calls):
            raise ConfigurationError(
                f"Arrangement {self.name!r}: calls must be a generator function inputs -> Call, ..., got "
                f"{type(self.calls).__name__}"
            )


def _token_inputs(inputs: Any, arrangement: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """input_ids (batch, seq) and attention_mask of a causal LM's inputs; anything else is refused."""
    import torch

    ids = inputs.get("input_ids") if isinstance(inputs, Mapping) else None
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
        raise ConfigurationError(
            f"arrangement {arrangement!r} needs a causal LM's inputs: a dict with input_ids (batch, seq) and "
            "optionally attention_mask; for another model, give your own pytest_precision.Arrangement"
        )
    extra = sorted(set(inputs) - {"input_ids", "attention_mask", "labels"})
    if extra:
        raise ConfigurationError(
            f"arrangement {arrangement!r} slices input_ids and attention_mask (labels are not needed: forward "
            f"only); the inputs also hold {', '.join(extra)}: give your own pytest_precision.Arrangement"
        )
    mask = inputs.get("attention_mask")
    if mask is not None and (not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(ids.shape)):
        raise ConfigurationError(f"arrangement {arrangement!r}: attention_mask must have input_ids' shape")
    return ids, mask


def _with_mask(inputs: dict[str, Any], mask: torch.Tensor | None) -> dict[str, Any]:
    return inputs if mask is None else {**inputs, "attention_mask": mask}


#: Where transformers models return their KV cache and take it back: `cache` (transformers >= 5.25), else
#: `past_key_values`.
CACHE_KEYS = ("cache", "past_key_values")


def _cache_of(output: Any, arrangement: str) -> tuple[str, Any]:
    """(keyword, cache) of a model output: the KV cache to pass to the next call under that keyword."""
    for key in CACHE_KEYS:
        cache = output.get(key) if isinstance(output, Mapping) else getattr(output, key, None)
        if cache is not None:
            return key, cache
    raise ConfigurationError(
        f"arrangement {arrangement!r} needs a model that returns its KV cache (`cache` or `past_key_values`) "
        "with use_cache=True (a transformers causal LM); for another model, give your own "
        "pytest_precision.Arrangement"
    )


def decode(prefill: int = 1) -> Arrangement:
    """Prefill the first `prefill` tokens in one call, then one token per call with the model's KV cache."""
    if isinstance(prefill, bool) or not isinstance(prefill, int) or prefill < 1:
        raise ConfigurationError(f"decode(prefill=...): a number of tokens >= 1, got {prefill!r}")

    def calls(inputs: Any) -> CallPlan:
        ids, mask = _token_inputs(inputs, "decode")
        length = ids.shape[1]
        first = min(prefill, length)
        head = {"input_ids": ids[:, :first], "use_cache": True}
        output = yield Call(_with_mask(head, None if mask is None else mask[:, :first]), offsets=0)
        for position in range(first, length):
            key, cache = _cache_of(output, "decode")
            step = {"input_ids": ids[:, position : position + 1], key: cache, "use_cache": True}
            output = yield Call(_with_mask(step, None if mask is None else mask[:, : position + 1]), offsets=position)

    return Arrangement(
        "decode" if prefill == 1 else f"decode_prefill{prefill}",
        calls,
        f"prefill {prefill} token(s), then one token per call with the KV cache",
    )


def _counted_span(mask: torch.Tensor | None, row: int, length: int, arrangement: str) -> tuple[int, int]:
    """[start, end) of a row's counted tokens, which must be contiguous."""
    if mask is None:
        return 0, length
    where = mask[row].nonzero().reshape(-1).tolist()
    if not where:
        return 0, 0
    start, end = where[0], where[-1] + 1
    if end - start != len(where):
        raise ConfigurationError(
            f"arrangement {arrangement!r}: row {row} of attention_mask has gaps; each row's tokens must be one "
            "contiguous span (left or right padding)"
        )
    return start, end


def _batch_alone(inputs: Any) -> CallPlan:
    ids, mask = _token_inputs(inputs, "batch_alone")
    for row in range(ids.shape[0]):
        start, end = _counted_span(mask, row, ids.shape[1], "batch_alone")
        if end == start:
            continue
        alone = {"input_ids": ids[row : row + 1, :end]}
        yield Call(_with_mask(alone, None if mask is None else mask[row : row + 1, :end]), rows=[row], offsets=0)


def left_padded(extra_padding: int = 3) -> Arrangement:
    """Each sequence left-padded, as a sampler batches requests, in a batch twice as large: its rows alternate
    with filler sequences (other rows' tokens, of other lengths); position_ids from the mask's cumulative sum, as
    samplers set them (a row the reference held left-padded keeps the positions it had there)."""
    if isinstance(extra_padding, bool) or not isinstance(extra_padding, int) or extra_padding < 0:
        raise ConfigurationError(f"left_padded(extra_padding=...): an integer >= 0, got {extra_padding!r}")

    def calls(inputs: Any) -> CallPlan:
        import torch

        ids, mask = _token_inputs(inputs, "left_padded")
        batch, length = ids.shape
        width = length + extra_padding
        spans = [_counted_span(mask, row, length, "left_padded") for row in range(batch)]
        tokens = torch.zeros((2 * batch, width), dtype=ids.dtype, device=ids.device)
        attention = torch.zeros((2 * batch, width), dtype=torch.long, device=ids.device)
        rows: list[int] = []
        offsets: list[int] = []
        for row, (start, end) in enumerate(spans):
            donor_start, donor_end = spans[(row + 1) % batch]
            donor = ids[(row + 1) % batch, donor_start:donor_end]
            filler_length = max(1, width - (row % 3))
            if donor.numel():
                filler = donor.repeat((filler_length + donor.numel() - 1) // donor.numel())[:filler_length]
                tokens[2 * row, width - filler_length :] = filler
                attention[2 * row, width - filler_length :] = 1
            own = end - start
            if own:
                tokens[2 * row + 1, width - own :] = ids[row, start:end]
                attention[2 * row + 1, width - own :] = 1
            rows += [-1, row]
            offsets += [0, start - (width - own)]
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        # A row the reference already held left-padded ran at positions start..end-1 there (transformers numbers
        # positions by index): it keeps them, so that only the arrangement differs, not the positions.
        for row, (start, end) in enumerate(spans):
            positions[2 * row + 1, width - (end - start) :] += start
        yield Call({"input_ids": tokens, "attention_mask": attention, "position_ids": positions}, rows, offsets)

    return Arrangement(
        "left_padded" if extra_padding == 3 else f"left_padded{extra_padding}",
        calls,
        f"left-padded (+{extra_padding}) among as many filler sequences",
    )


BUILTIN_ARRANGEMENTS: dict[str, Arrangement] = {
    a.name: a
    for a in (
        decode(),
        Arrangement("batch_alone", _batch_alone, "each sequence alone, its trailing padding removed"),
        left_padded(),
    )
}


def resolve_arrangement(spec: object, variant: str) -> Arrangement | None:
    """An Arrangement from a built-in name, an Arrangement, or None."""
    if spec is None or isinstance(spec, Arrangement):
        return spec
    if isinstance(spec, str):
        try:
            return BUILTIN_ARRANGEMENTS[spec]
        except KeyError:
            raise ConfigurationError(
                f"variant {variant!r}: unknown arrangement {spec!r}; built-in arrangements: "
                f"{', '.join(BUILTIN_ARRANGEMENTS)}, or pass a pytest_precision.Arrangement"
            ) from None
    raise ConfigurationError(
        f"variant {variant!r}: arrangement must be a name or a pytest_precision.Arrangement, got {type(spec).__name__}"
    )


class Assembler:
    """Reassembles the captured tensors of an arrangement's calls into the full (rows, positions, ...) layout."""

    def __init__(self, arrangement: str, rows: int, length: int) -> None:
        self.arrangement = arrangement
        self.rows = rows
        self.length = length
        self.full: dict[tuple[str, str], torch.Tensor] = {}
        self.covered: torch.Tensor | None = None
        self.pending: list[tuple[str, str, torch.Tensor]] = []

    def __call__(self, name: str, kind: str, tensor: torch.Tensor) -> None:
        """The sink of one call's tensors (placed when the call ends)."""
        if kind in ("fw", "logits", "routing"):
            self.pending.append((name, kind, tensor.detach()))

    def place(self, call: Call, call_rows: int, call_length: int) -> None:
        """Put every tensor the call produced where `call` says it belongs."""
        import torch

        pending, self.pending = self.pending, []
        if not pending:
            return
        device = pending[0][2].device
        rows = list(range(call_rows)) if call.rows is None else [int(r) for r in call.rows]
        offsets = [int(call.offsets)] * call_rows if isinstance(call.offsets, int) else [int(o) for o in call.offsets]
        if len(rows) != call_rows or len(offsets) != call_rows:
            raise ConfigurationError(
                f"arrangement {self.arrangement!r}: a call of {call_rows} rows gave {len(rows)} rows and "
                f"{len(offsets)} offsets; give one per row of the call"
            )
        if any(not -1 <= r < self.rows for r in rows):
            raise ConfigurationError(
                f"arrangement {self.arrangement!r}: rows {rows} name a row outside the batch of {self.rows} (or -1)"
            )
        row_grid = torch.tensor(rows, device=device)[:, None].expand(call_rows, call_length)
        position_grid = (
            torch.arange(call_length, device=device)[None, :] + torch.tensor(offsets, device=device)[:, None]
        )
        keep = (row_grid >= 0) & (position_grid >= 0) & (position_grid < self.length)
        source = keep.reshape(-1).nonzero().reshape(-1)
        target = (row_grid * self.length + position_grid).reshape(-1)[source]
        if self.covered is None:
            self.covered = torch.zeros(self.rows * self.length, dtype=torch.bool, device=device)
        self.covered[target] = True
        for name, kind, tensor in pending:
            if tensor.dim() < 2 or tuple(tensor.shape[:2]) != (call_rows, call_length):
                raise ModelRunError(
                    f"arrangement {self.arrangement!r}: {name}'s output has shape {tuple(tensor.shape)}, not "
                    f"(rows, positions, ...) = ({call_rows}, {call_length}, ...) of the call; select modules "
                    "whose outputs are laid out by position (modules=[...])"
                )
            whole = self.full.get((name, kind))
            if whole is None:
                whole = self.full[(name, kind)] = tensor.new_zeros((self.rows * self.length, *tensor.shape[2:]))
            whole[target.to(whole.device)] = tensor.reshape(-1, *tensor.shape[2:])[source.to(tensor.device)]

    def tensors(
        self, counted: torch.Tensor | None, predicting: torch.Tensor | None
    ) -> dict[tuple[str, str], torch.Tensor]:
        """The full tensors, once every counted position (flat indices `counted`; None: all) and every position
        predicting a counted token (`predicting`) was computed by some call."""
        import torch

        if self.covered is None:
            raise ModelRunError(f"arrangement {self.arrangement!r} made no call that captured anything")
        for what, index in (("counted position", counted), ("position predicting a counted token", predicting)):
            needed = torch.arange(self.rows * self.length, device=self.covered.device) if index is None else index
            missed = needed[~self.covered[needed.to(self.covered.device)]]
            if missed.numel():
                first = int(missed[0])
                raise ConfigurationError(
                    f"arrangement {self.arrangement!r} computed no output for {missed.numel()} {what}(s), the "
                    f"first at row {first // self.length}, position {first % self.length}; its calls must cover "
                    "every position that counts"
                )
        return {key: t.reshape(self.rows, self.length, *t.shape[1:]) for key, t in self.full.items()}


def run_calls(
    model: Any,
    arrangement: Arrangement,
    inputs: Any,
    assembler: Assembler,
    counts: CallCounts,
    *,
    variant: str,
    logits_of: Callable[[Any], torch.Tensor | None],
) -> None:
    """Run `model` on each call of `arrangement` (forward only), sending each output back to it; every call's
    captured tensors (collected by `assembler`, the capture's sink) and logits are placed as the call says."""
    import inspect

    import torch

    plan = arrangement.calls(inputs)
    if not inspect.isgenerator(plan):
        raise ConfigurationError(
            f"arrangement {arrangement.name!r}: calls(inputs) returned {type(plan).__name__}, not a generator; "
            "write it with `yield Call(...)`"
        )
    output: Any = None
    with torch.no_grad():
        while True:
            try:
                call = plan.send(output)
            except StopIteration:
                break
            if not isinstance(call, Call):
                raise ConfigurationError(
                    f"arrangement {arrangement.name!r} yielded {type(call).__name__}, not a "
                    "pytest_precision.engine.arrangements.Call"
                )
            counts.restart()  # each call is a new forward: labels start again at `name`
            call_rows, call_positions = call_length(call)
            try:
                if isinstance(call.inputs, Mapping):
                    output = model(**call.inputs)
                elif isinstance(call.inputs, tuple):
                    output = model(*call.inputs)
                else:
                    output = model(call.inputs)
            except PrecisionError:
                raise
            except Exception as error:
                raise ModelRunError(
                    f"{type(model).__name__} raised {type(error).__name__}: {error} in a call of arrangement "
                    f"{arrangement.name!r} (variant {variant!r})"
                ) from error
            logits = logits_of(output)
            if logits is not None:
                assembler("logits", "logits", logits)
            assembler.place(call, call_rows, call_positions)


def token_grid(batch: Batch, variant: str, arrangement: str) -> tuple[int, int]:
    """(rows, positions) of the reference's batch, where an arrangement's outputs are reassembled."""
    import torch

    ids = batch.kwargs.get("input_ids")
    if isinstance(ids, torch.Tensor) and ids.dim() == 2:
        return int(ids.shape[0]), int(ids.shape[1])
    for value in (*batch.args, *batch.kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return int(value.shape[0]), int(value.shape[1])
    raise ConfigurationError(
        f"variant {variant!r}: arrangement {arrangement!r} needs inputs laid out as (rows, positions, ...) "
        "(input_ids, or a tensor of two or more dimensions)"
    )


def call_length(call: Call) -> tuple[int, int]:
    """(rows, positions) of a call: from its input_ids, else its first tensor argument of two or more dims."""
    import torch

    inputs = call.inputs
    values: list[Any]
    if isinstance(inputs, Mapping):
        first = inputs.get("input_ids")
        values = [first, *inputs.values()]
    elif isinstance(inputs, tuple):
        values = list(inputs)
    else:
        values = [inputs]
    for value in values:
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return int(value.shape[0]), int(value.shape[1])
    raise ConfigurationError(
        "an arrangement's Call needs a (rows, positions, ...) tensor among its inputs (input_ids), to place its outputs"
    )


__all__ = [
    "BUILTIN_ARRANGEMENTS",
    "Arrangement",
    "Assembler",
    "Call",
    "decode",
    "left_padded",
    "resolve_arrangement",
    "run_calls",
    "token_grid",
]
