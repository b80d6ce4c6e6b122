"""A run makes a bounded number of host synchronisations, independent of the number of tensors captured.

Every call that would block the host on a GPU's queue (a scalar read, a host copy, a data-dependent shape)
is counted with a TorchFunctionMode while `compare` runs a small causal LM whose own forward and backward
make none. The count must be a small constant: one value read per run and a transfer per variant, not one
per tensor or per chunk.
"""

from __future__ import annotations

import collections
import math
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import pytest_precision
import pytest_precision.numbers.metrics as metrics_module

PACKAGE_DIR = str(Path(pytest_precision.__file__).parent)
VOCAB, HIDDEN, SEQ, BATCH = 64, 32, 8, 2
#: Host synchronisations allowed for a compare() with one variant: the reference run's checks plus one
#: transfer per variant.
MAX_SYNCS_ONE_VARIANT = 8
#: Extra synchronisations allowed per additional variant.
MAX_SYNCS_PER_EXTRA_VARIANT = 2

#: Methods and functions that force a device-to-host synchronisation whatever their arguments.
SYNCING = frozenset(
    {
        "item",
        "tolist",
        "__bool__",
        "__float__",
        "__int__",
        "__index__",
        "cpu",
        "numpy",
        "nonzero",
        "masked_select",
        "unique",
        "unique_consecutive",
        "_unique2",
    }
)


def _is_boolean_index(index: Any) -> bool:
    """Whether a __getitem__ index holds a boolean tensor (a result whose size depends on the data)."""
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(part, torch.Tensor) and part.dtype == torch.bool for part in parts)


class SyncCounter(TorchFunctionMode):
    """Counts host-synchronising calls by name, and where in pytest_precision each one was made."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        self.sites: collections.Counter[str] = collections.Counter()

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in SYNCING or (name == "__getitem__" and len(args) > 1 and _is_boolean_index(args[1])):
            self.counts[name] += 1
            self.sites[f"{name} at {self._library_frame()}"] += 1
        if func is torch.Tensor.backward and len(args) == 1 and not any(kwargs.values()):
            # A mode is off while its handler runs, and torch.autograd.backward dispatches to it again: run
            # loss.backward() through the engine itself with the mode on, so that the backward hooks (where
            # the plugin measures gradients) are counted too.
            loss = args[0]
            with self:
                torch.autograd.graph._engine_run_backward(
                    (loss,), (torch.ones_like(loss),), False, False, (), allow_unreachable=True, accumulate_grad=True
                )
            return None
        return func(*args, **kwargs)

    @staticmethod
    def _library_frame() -> str:
        """The innermost frame of the call stack inside pytest_precision, else the innermost frame."""
        frames = traceback.extract_stack()[:-2]
        inside = [f for f in frames if f.filename.startswith(PACKAGE_DIR)]
        frame = (inside or frames)[-1]
        return f"{Path(frame.filename).name}:{frame.lineno} ({frame.name}: {frame.line})"

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def describe(self) -> str:
        """The counted calls, most frequent site first, for a failure message."""
        lines = [f"  {count} x {site}" for site, count in self.sites.most_common()]
        return f"{self.total} host syncs:\n" + "\n".join(lines)


class RMSNorm(nn.Module):
    """RMS norm in plain ops (no data-dependent control flow)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Block(nn.Module):
    """Pre-norm MLP block with a residual."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden)
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class TinyCausalLM(nn.Module):
    """Embedding, `depth` blocks, final norm and LM head; returns {"logits", "loss"} like transformers."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(depth)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block(HIDDEN) for _ in range(depth))
        self.norm = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2 + (parameter.dim() == 1))

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        x = self.embed(input_ids)
        if attention_mask is not None:
            x = x * attention_mask.unsqueeze(-1).to(x.dtype)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        output = {"logits": logits}
        if labels is not None:
            output["loss"] = nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, VOCAB).float(), labels[:, 1:].reshape(-1), ignore_index=-100
            )
        return output


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One intra-op thread: these tiny matmuls only pay for thread hand-offs (4 s against 0.25 s a compare
    on a busy 2-core machine); the counts do not depend on it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def token_inputs(*, padded: bool = False) -> dict[str, torch.Tensor]:
    """input_ids and labels; with `padded`, a left-padded sequence whose padding is masked and ignored."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = input_ids.clone()
    if not padded:
        return {"input_ids": input_ids, "labels": labels}
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :3] = 0
    labels[0, :3] = -100
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def counted_compare(depth: int, variants: list[str], **options: Any) -> tuple[SyncCounter, Any]:
    """compare() of a fresh TinyCausalLM(depth) under a SyncCounter."""
    model = TinyCausalLM(depth)
    inputs = token_inputs(padded=options.pop("padded", False))
    with SyncCounter() as counter:
        report = pytest_precision.compare(model, inputs, variants, **options)
    return counter, report


def test_the_model_itself_makes_no_host_syncs() -> None:
    """A bare forward and backward of the test model counts 0, so the counts below are the plugin's."""
    for padded in (False, True):
        model = TinyCausalLM(4)
        with SyncCounter() as counter:
            output = model(**token_inputs(padded=padded))
            output["loss"].backward()
        assert counter.total == 0, counter.describe()


@pytest.mark.parametrize("variant", ["bf16", "tf32"])
def test_syncs_are_bounded_and_do_not_scale_with_tensors(variant: str) -> None:
    """At most MAX_SYNCS_ONE_VARIANT syncs, and depth 4 costs exactly as many as depth 16."""
    deep, report = counted_compare(16, [variant])
    # The bound is meaningful: 30+ records, including the logits and the log-probability rows.
    records = report.records(variant)
    assert len(records) >= 30
    assert {"fw", "bw", "grad", "logprob"} <= {record.kind for record in records}
    assert any(record.name == "logits" for record in records)
    assert deep.total <= MAX_SYNCS_ONE_VARIANT, deep.describe()
    shallow, _ = counted_compare(4, [variant])
    assert shallow.counts == deep.counts, f"depth 4: {shallow.describe()}\ndepth 16: {deep.describe()}"


@pytest.mark.parametrize(
    "options",
    [{"padded": True}, {"backward": False}, {"offload": True}],
    ids=["padded", "forward-only", "offload"],
)
def test_syncs_are_bounded_with_options(options: dict[str, Any]) -> None:
    """The same bound with a padding mask (masked positions), forward only, and host-offloaded references."""
    counter, report = counted_compare(16, ["bf16"], **options)
    assert len(report.records("bf16")) >= (30 if options.get("backward", True) else 18)
    assert counter.total <= MAX_SYNCS_ONE_VARIANT, counter.describe()


def test_each_extra_variant_costs_a_bounded_number_of_syncs() -> None:
    """Three variants cost at most MAX_SYNCS_PER_EXTRA_VARIANT more syncs per extra variant than one."""
    one, _ = counted_compare(8, ["bf16"])
    three, report = counted_compare(8, ["bf16", "fp16", "tf32"])
    assert report.variants == ["bf16", "fp16", "tf32"]
    assert three.total <= one.total + 2 * MAX_SYNCS_PER_EXTRA_VARIANT, (
        f"one variant: {one.describe()}\nthree variants: {three.describe()}"
    )


def test_syncs_do_not_scale_with_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """With 1024-element chunks every captured tensor spans several chunks; the count stays the same."""
    whole, _ = counted_compare(8, ["bf16"])
    monkeypatch.setattr(metrics_module, "CPU_CHUNK_ELEMENTS", 1 << 10)
    chunked, report = counted_compare(8, ["bf16"])
    assert max(math.prod(record.shape) for record in report.records("bf16")) > 1 << 10
    assert chunked.total <= MAX_SYNCS_ONE_VARIANT, chunked.describe()
    assert chunked.counts == whole.counts, f"whole: {whole.describe()}\nchunked: {chunked.describe()}"


def test_the_counter_sees_every_kind_of_sync() -> None:
    """The counter itself: each listed call is counted once, and plain indexing or arithmetic is not."""
    x = torch.arange(6.0)
    with SyncCounter() as counter:
        x.item() if x.numel() == 1 else x[0].item()
        x.tolist()
        bool(x[0])
        float(x[1])
        int(x[2])
        x[x > 2]
        torch.nonzero(x)
        torch.masked_select(x, x > 1)
        x.cpu()
        x[1:3] * 2 + x.sum()
        # A sync in a backward hook (where the plugin measures gradients) is counted too.
        leaf = torch.ones(3, requires_grad=True)
        leaf.register_hook(lambda grad: grad * grad.sum().item())
        (leaf * 2).sum().backward()
    assert leaf.grad is not None
    assert leaf.grad.tolist() == [12.0, 12.0, 12.0]
    assert counter.counts == {
        "item": 2,
        "tolist": 1,
        "__bool__": 1,
        "__float__": 1,
        "__int__": 1,
        "__getitem__": 1,
        "nonzero": 1,
        "masked_select": 1,
        "cpu": 1,
    }, counter.describe()
