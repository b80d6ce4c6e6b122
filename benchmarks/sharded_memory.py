"""What a sharded (FSDP2) comparison keeps per rank and on paper per GPU for Llama-2-7B on 8 x 80 GB:

    .venv/bin/torchrun --nproc_per_node 2 benchmarks/sharded_memory.py

Measured (gloo, CPU, every rank): `pytest_precision.reference(sharded(model, fsdp_per_layer), inputs, ...)` on a
small transformers Llama, each rank on its own data-parallel rows, with backward=True/False and offload=False/True.
Every kept tensor's bytes (numel x element size) are checked against the per-rank formulas below, and
`Reference.nbytes` (each storage once) against their sum; any mismatch fails the script on every rank.

    fw   = 4 n H per embedding / decoder layer / final norm output, 4 n V for lm_head's (the logits' storage)
    bw   = 4 n H per decoder layer / final norm / lm_head input, 4 n V at the logits
    grad = 4 numel / W per parameter (FSDP2's dim-0 shard of this rank, a DTensor's local part)
    logits = 4 n V, logprob = 4 rows (tokens - 1), loss = 4

with n = rows x tokens of this rank, H hidden, V vocabulary, W world size, fp32 everywhere.

Computed (rank 0, on paper, from those formulas and the bytes autograd saves per token, measured on a small
unsharded probe): what a compare of Llama-2-7B on 8 x 80 GB GPUs under FSDP2 holds per GPU, with and without
offload, and with backward=False. Which numbers are measured and which computed is printed with them.
"""

from __future__ import annotations

import copy
import math
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import scale  # noqa: E402  (benchmarks/scale.py: the Llama, its parameter counts, the saved-activation probe)

GB = 1e9
#: The measured model (rank-local batch below): small, with distinct sizes so no two formulas coincide.
SMALL = {"layers": 4, "hidden": 128, "intermediate": 352, "heads": 4, "kv_heads": 2, "vocab": 1000}
ROWS, TOKENS = 2, 64
#: Llama-2-7B's shape, and the machine of the paper table.
SEVEN_B = {"layers": 32, "hidden": 4096, "intermediate": 11008, "heads": 32, "kv_heads": 32, "vocab": 32000}
GPUS, GPU_BYTES, PAPER_ROWS, PAPER_TOKENS = 8, 80 * GB, 1, 4096
#: Kinds in the order they are reported.
KINDS = ("fw", "logits", "bw", "grad", "logprob", "loss")


# ------------------------------------------------------------------------------------------- the model


def fsdp_per_layer(model: Any, variant: Any) -> None:
    """FSDP2 as training scripts apply it (tests/distributed/sharded_models.fsdp_per_layer): each decoder layer,
    then the root."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mp_policy=variant.mp_policy())
    fully_shard(model, mp_policy=variant.mp_policy())


# ------------------------------------------------------------------------------------------- formulas


def tensor_formula(name: str, kind: str, spec: dict[str, int], rows: int, tokens: int) -> tuple[str, int]:
    """(the formula, its bytes) of one kept non-grad tensor of this rank."""
    n, hidden, vocab = rows * tokens, spec["hidden"], spec["vocab"]
    if (kind == "fw" and name == "lm_head") or (kind in ("logits", "bw") and name == "logits"):
        return "4 n V", 4 * n * vocab
    if kind in ("fw", "bw"):
        return "4 n H", 4 * n * hidden
    if kind == "logprob":
        return "4 rows (tokens - 1)", 4 * rows * (tokens - 1)
    if kind == "loss":
        return "4", 4
    raise AssertionError(f"no formula for {kind} {name}")


def shard_rows(length: int, world: int, rank: int) -> int:
    """Rows of dim 0 FSDP2 gives `rank` (torch.chunk's split: ceil(length / world) each, the last ones less)."""
    each = math.ceil(length / world)
    return max(0, min(each, length - rank * each))


def kept_per_rank(spec: dict[str, int], rows: int, tokens: int, world: int) -> dict[str, int]:
    """Bytes per kind a rank's fp32 Reference keeps (backward=True), by the formulas of the module docstring
    (grad: 4 P / W, exact when every parameter's dim 0 divides by W, as in both models here)."""
    n, hidden, vocab, layers = rows * tokens, spec["hidden"], spec["vocab"], spec["layers"]
    return {
        "fw": 4 * n * hidden * (layers + 2) + 4 * n * vocab,
        "logits": 4 * n * vocab,
        "bw": 4 * n * hidden * (layers + 2) + 4 * n * vocab,
        "grad": 4 * scale.llama_parameter_counts(spec)[0] // world,
        "logprob": 4 * rows * (tokens - 1),
        "loss": 4,
    }


def expected_keys(model: Any, backward: bool) -> set[tuple[str, str]]:
    names = ["model.embed_tokens", *(f"model.layers.{i}" for i in range(len(model.model.layers))), "model.norm"]
    keys = {(name, "fw") for name in [*names, "lm_head"]} | {("logits", "logits"), ("logprob", "logprob")}
    keys.add(("loss", "loss"))
    if backward:
        keys |= {(name, "bw") for name in [*names[1:], "lm_head", "logits"]}
        keys |= {(name, "grad") for name, _ in model.named_parameters()}
    return keys


# ------------------------------------------------------------------------------------------- measured


def measure(model: Any, backward: bool, offload: bool) -> dict[str, Any]:
    """This rank's Reference under FSDP2, checked tensor by tensor against the formulas."""
    import torch
    import torch.distributed as dist

    from pytest_precision import reference, sharded

    rank, world = dist.get_rank(), dist.get_world_size()
    everyone = torch.randint(0, SMALL["vocab"], (world * ROWS, TOKENS), generator=torch.Generator().manual_seed(1))
    ids = everyone[rank * ROWS : (rank + 1) * ROWS]  # this rank's data-parallel rows
    ref = reference(
        sharded(model, fsdp_per_layer), {"input_ids": ids, "labels": ids}, backward=backward, offload=offload
    )
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    failures: list[str] = []
    kinds = dict.fromkeys(KINDS, 0)
    groups: dict[tuple[str, str], list[int]] = {}  # (kind, formula) -> [tensors, bytes per tensor, bytes]
    keys = set(ref.stored)
    if keys != expected_keys(model, backward):
        failures.append(f"kept keys differ: {sorted(keys ^ expected_keys(model, backward))}")
    for (name, kind), tensor in ref.stored.items():
        size = tensor.numel() * tensor.element_size()
        if tensor.dtype != torch.float32 or type(tensor) is not torch.Tensor:
            failures.append(f"{kind} {name}: {type(tensor).__name__} {tensor.dtype}, expected a plain fp32 tensor")
        if kind == "grad":
            whole = shapes[name]
            local = (shard_rows(whole[0], world, rank), *whole[1:])
            formula, wanted = "4 numel / W", 4 * math.prod(local)
            if whole[0] % world or wanted * world != 4 * math.prod(whole):
                failures.append(f"grad {name}: dim 0 of {whole} does not divide by {world}")
            if tuple(tensor.shape) != local:
                failures.append(f"grad {name}: kept shape {tuple(tensor.shape)}, this rank's shard is {local}")
        else:
            formula, wanted = tensor_formula(name, kind, SMALL, ROWS, TOKENS)
        if size != wanted:
            failures.append(f"{kind} {name}: {size:,} bytes kept, formula {formula} = {wanted:,}")
        kinds[kind] += size
        group = groups.setdefault((kind, formula), [0, size, 0])
        group[0] += 1
        group[2] += size
        if group[1] != size:
            group[1] = -1  # differs per tensor (the grads)
    formulas = kept_per_rank(SMALL, ROWS, TOKENS, world)
    for kind in KINDS:
        wanted = formulas[kind] if backward or kind not in ("bw", "grad") else 0
        if kinds[kind] != wanted:
            failures.append(f"{kind}: {kinds[kind]:,} bytes kept, formula {wanted:,}")
    shared = (
        ref.stored[("lm_head", "fw")].untyped_storage().data_ptr()
        == ref.stored[("logits", "logits")].untyped_storage().data_ptr()
    )
    total = sum(kinds.values())
    if ref.nbytes != total - (formulas["logits"] if shared else 0):
        failures.append(f"nbytes {ref.nbytes:,} != the tensors' {total:,} less the logits if shared ({shared})")
    placed = {t.device.type for t in ref.stored.values()}
    return {
        "kinds": kinds,
        "groups": {f"{kind}|{formula}": values for (kind, formula), values in groups.items()},
        "nbytes": ref.nbytes,
        "total": total,
        "shared": shared,
        "tensors": len(ref.stored),
        "devices": sorted(placed),
        "failures": failures,
    }


def own_gradients(model: Any) -> dict[str, int]:
    """How FSDP2 itself holds a sharded model's gradients: views into each group's reduce-scatter output."""
    import torch
    import torch.distributed as dist

    from pytest_precision import Variant

    copied = copy.deepcopy(model)
    fsdp_per_layer(copied, Variant("fp32", dtype="float32"))
    ids = torch.randint(0, SMALL["vocab"], (ROWS, TOKENS), generator=torch.Generator().manual_seed(2 + dist.get_rank()))
    copied(input_ids=ids, labels=ids).loss.backward()
    locals_ = [p.grad.to_local() for p in copied.parameters()]  # type: ignore[union-attr]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in locals_}
    return {
        "parameters": len(locals_),
        "views": sum(t._base is not None for t in locals_),
        "shard_bytes": sum(t.numel() * t.element_size() for t in locals_),
        "storages": len(storages),
        "storage_bytes": sum(storages.values()),
    }


# ------------------------------------------------------------------------------------------- on paper


def backward_scan(base: float, start: float, layer_act: float, layers: int, per_layer: float, end: float) -> float:
    """The peak of a backward: `base` throughout, `start` at its start (all activations saved, the root's
    unsharded head gradient...), then per layer (last first) `layer_act` freed and `per_layer` gained, `end`
    added by the embedding's gradient last."""
    points = [start + k * (per_layer - layer_act) for k in range(layers + 1)]
    points.append(start + layers * (per_layer - layer_act) + end)
    return base + max(points)


def paper(rates: dict[str, dict[str, dict[str, float]]], offload_copies_logits: bool) -> list[str]:
    spec, n, world = SEVEN_B, PAPER_ROWS * PAPER_TOKENS, GPUS
    params, layer_params, root_params = scale.llama_parameter_counts(spec)
    layers, hidden, vocab = spec["layers"], spec["hidden"], spec["vocab"]
    kept = kept_per_rank(spec, PAPER_ROWS, PAPER_TOKENS, world)
    fw_hidden = 4 * n * hidden * (layers + 2)  # the distinct storages: lm_head's fw is the logits
    logits, bw_logits, bw_layer = kept["logits"], 4 * n * vocab, 4 * n * hidden
    stored_fw = fw_hidden + logits + kept["logprob"] + kept["loss"]
    stored_all = stored_fw + kept["bw"] + kept["grad"]
    largest = max(logits, 4 * vocab * hidden // world)  # offload: one kept tensor at a time on the GPU
    act: dict[str, tuple[float, float]] = {}
    for dtype, dtype_rates in rates.items():
        act[dtype] = scale.activations_bytes(dtype_rates, spec, n)  # (outside the layers, per layer)
    full32 = 4 * params
    shards32, layer_grad_shard = 4 * params / world, 4 * layer_params / world
    head_grad, embedding_grad = vocab * hidden + hidden, vocab * hidden  # elements, unsharded in backward (root)
    # FSDP2 working set (from its implementation, not measured): the current and the prefetched layer unsharded
    # plus one all-gather output (3 layers in the parameters' compute dtype); in backward also one layer's
    # unsharded gradients (compute dtype) and its reduce-scatter input (reduce dtype).
    work32_fw, work32_bw = 3 * 4 * layer_params, 3 * 4 * layer_params + 2 * 4 * layer_params
    work16_fw, work16_bw = 3 * 2 * layer_params, 3 * 2 * layer_params + 2 * layer_params + 4 * layer_params
    col: dict[str, dict[str, float]] = {}
    for label, backward, offload in (
        ("no offload", True, False),
        ("offload", True, True),
        ("bw=False", False, False),
        ("bw=False, offload", False, True),
    ):
        c: dict[str, float] = {}
        kept_fw = 0.0 if offload else stored_fw
        kept_run = 0.0 if offload else (stored_all if backward else stored_fw)
        kept_variant = largest if offload else kept_run
        c["ref build"] = full32  # build_run_model: the whole fp32 copy on the GPU before fully_shard
        c["shards32"] = shards32
        c["root32"] = 4 * root_params
        if backward:
            fixed32, layer32 = act["float32"]
            c["work ref"] = work32_bw
            c["act ref"] = fixed32 + layers * layer32
            c["grads ref"] = 4 * head_grad + shards32
            start = fixed32 + layers * layer32 + 4 * head_grad + kept_fw + (0 if offload else bw_logits + 2 * bw_layer)
            per_layer = layer_grad_shard + (0 if offload else bw_layer)
            base = shards32 + 4 * root_params + work32_bw
            c["ref run"] = backward_scan(base, start, layer32, layers, per_layer, 4 * embedding_grad)
            c["ref run"] = max(c["ref run"], shards32 + shards32 + kept_run)  # after backward: grads + kept copies
        else:
            fixed32, layer32 = act["float32"]
            c["work ref"] = work32_fw
            c["act ref"] = fixed32 + layer32  # no_grad: one layer's transients and the loss (bound)
            c["grads ref"] = 0
            c["ref run"] = shards32 + 4 * root_params + work32_fw + fixed32 + layer32 + kept_fw
        c["kept ref"] = kept_fw
        c["kept after"] = kept_run
        # variant fsdp_bf16: fp32 shards, bf16 compute (param_dtype), fp32 reduce
        c["var build"] = full32 + kept_run
        c["root16"] = 2 * root_params
        c["kept var"] = kept_variant
        fixed16, layer16 = act["bfloat16"]
        if backward:
            c["work var"] = work16_bw
            c["act var"] = fixed16 + layers * layer16
            c["grads var"] = 2 * head_grad + shards32
            start = fixed16 + layers * layer16 + 2 * head_grad
            base = shards32 + 2 * root_params + work16_bw + kept_variant
            c["var run"] = backward_scan(base, start, layer16, layers, layer_grad_shard, 2 * embedding_grad)
        else:
            c["work var"] = work16_fw
            c["act var"] = fixed16 + layer16
            c["grads var"] = 0
            c["var run"] = shards32 + 2 * root_params + work16_fw + fixed16 + layer16 + kept_variant
        c["peak"] = max(c["ref build"], c["ref run"], c["var build"], c["var run"])
        kept_host = (stored_all if backward else stored_fw) + (logits if offload_copies_logits else 0)
        c["host"] = kept_host if offload else 0.0
        c["caller"] = full32
        col[label] = c
    labels = list(col)

    def row(text: str, key: str, fmt: str = "{:.1f}") -> str:
        return f"| {text} | " + " | ".join(fmt.format(col[label][key] / GB) for label in labels) + " |"

    sizes = (
        f"P = {params / 1e9:.3f} B parameters (one decoder layer {layer_params / 1e6:.1f} M, the root: embedding, "
        f"final norm and lm_head {root_params / 1e6:.1f} M); per GPU 1 x {PAPER_TOKENS} tokens. Kept per rank by "
        f"the verified formulas: fw {fw_hidden / GB:.2f} GB (+ lm_head's = the logits {logits / GB:.2f} GB), "
        f"bw {kept['bw'] / GB:.2f} GB (of which {bw_logits / GB:.2f} at the logits), grad shards "
        f"{kept['grad'] / GB:.2f} GB (4 P / 8): {stored_all / GB:.2f} GB in all, {stored_fw / GB:.2f} GB with "
        "backward=False."
    )
    return [
        f"Llama-2-7B (32 layers, hidden 4096, intermediate 11008, vocabulary 32000, untied head) on {world} x 80 GB "
        f"GPUs, FSDP2 per decoder layer then the root; compare(..., ['fsdp_bf16']): fp32 reference, then the "
        "variant with fp32 shards, bf16 compute, fp32 reduce. " + sizes,
        "",
        "| per GPU, GB (1e9 bytes) | " + " | ".join(labels) + " |",
        "|---|" + "---|" * len(labels),
        "| **reference run** (fp32) | | | | |",
        row("whole fp32 copy on the GPU before fully_shard (build_run_model; transient)", "ref build"),
        row("sharded fp32 parameters (4 P / 8)", "shards32"),
        row("root unsharded from forward through backward (FSDP2's root default)", "root32"),
        row("FSDP2 working set: 3 layers unsharded (+ in backward a layer's grads, reduce-scatter input)", "work ref"),
        row("activations saved for backward, at its start (backward=False: one layer + the loss, bound)", "act ref"),
        row("parameter gradients: the root's unsharded lm_head + every shard (at the end)", "grads ref"),
        row("kept fw + logits on this GPU from the forward on (bw added during backward)", "kept ref"),
        row("kept on this GPU after backward (fw, bw, logits, copies of the grad shards)", "kept after"),
        row("phase peak (scan over backward; after it the model's grad shards + their copies)", "ref run"),
        "| **variant run** (fsdp_bf16) | | | | |",
        row("whole fp32 copy before fully_shard + the kept reference tensors (transient)", "var build"),
        row("root unsharded in bf16", "root16"),
        row("FSDP2 working set (bf16 layers and grads, fp32 reduce-scatter input)", "work var"),
        row("bf16 activations saved for backward, at its start", "act var"),
        row("parameter gradients: root's unsharded bf16 lm_head + fp32 shards (at the end)", "grads var"),
        row("kept reference tensors on this GPU (offload: the largest, one at a time)", "kept var"),
        row("phase peak (scan over backward)", "var run"),
        row("**compare() peak per GPU** (the largest of the four above)", "peak", "**{:.1f}**"),
        row(
            "host memory per rank: the kept tensors"
            + (" (offload copies lm_head's fw and the logits apart)" if offload_copies_logits else ""),
            "host",
        ),
        row("host memory per rank: the caller's fp32 model (device='cuda'; every rank holds one)", "caller"),
        "",
        "Measured: the kept bytes per tensor (above, on the small model; the 7B's by the same formulas) and the "
        "bytes autograd saves per token (the probe above; FSDP2 does not shard activations, so a rank's are those "
        "of its own rows on one GPU). Read from the code, not measured: build_run_model copies the whole model "
        "to the GPU before the shard function runs; FSDP2 keeps the root unsharded from forward through backward "
        "and its working set (3 layers' parameters, a layer's gradients and reduce-scatter input, approximate); "
        "FSDP2's gradient shards are views of its reduce-scatter outputs (measured above), so the reference keeps "
        "copies of them. Not counted: the CUDA context, NCCL buffers, fragmentation, kernel workspaces, "
        "the loss's transient copies of the logits.",
    ]


# ------------------------------------------------------------------------------------------- main


def main() -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.set_num_threads(1)
        model = scale.build_model(SMALL, TOKENS)
        configs = [(True, False), (False, False), (True, True), (False, True)]
        mine = {f"{backward}|{offload}": measure(model, backward, offload) for backward, offload in configs}
        gradients = own_gradients(model)
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, (mine, gradients))
        failures = [
            f"rank {r}, backward={c.replace('|', ', offload=')}: {f}"
            for r, (m, _) in enumerate(everyone)
            for c in m
            for f in m[c]["failures"]
        ]
        if rank == 0:
            report(everyone, world)
            if not failures:
                print(
                    "\nActivations autograd saves per token (measured on a 1- and 2-layer unsharded probe)...",
                    flush=True,
                )
                rates = {dtype: scale.saved_activation_rates(dtype) for dtype in ("float32", "bfloat16")}
                for dtype, dtype_rates in rates.items():
                    print(f"- {dtype}: {scale.describe_rates(dtype_rates)}")
                print("\nComputed (on paper) from the formulas verified above:\n")
                copies = not everyone[0][0]["True|True"]["shared"]
                print("\n".join(paper(rates, copies)))
        dist.barrier()
        if failures:
            raise AssertionError("the kept bytes do not match the formulas:\n" + "\n".join(failures))
        if rank == 0:
            print("\nall formulas hold on every rank", flush=True)
    finally:
        dist.destroy_process_group()


def report(everyone: list[Any], world: int) -> None:
    params = scale.llama_parameter_counts(SMALL)[0]
    spec = ", ".join(f"{k} {v}" for k, v in SMALL.items())
    print(
        f"Measured: pytest_precision.reference(sharded(model, fsdp_per_layer), ...) on {world} gloo ranks, Llama "
        f"({spec}; P = {params:,}), {ROWS} x {TOKENS} tokens per rank (its own rows): n = {ROWS * TOKENS}, "
        f"H = {SMALL['hidden']}, V = {SMALL['vocab']}, W = {world}.\n"
    )
    ranks = " | ".join(f"rank {r} bytes" for r in range(world))
    print(f"| kind | formula | tensors | bytes per tensor | {ranks} |")
    print("|---|---|---|---|" + "---|" * world)
    first = everyone[0][0]["True|False"]["groups"]
    for group in first:
        kind, formula = group.split("|")
        count, each, _ = first[group]
        per = "varies" if each < 0 else f"{each:,}"
        cells = " | ".join(f"{m['True|False']['groups'][group][2]:,}" for m, _ in everyone)
        print(f"| {kind} | {formula} | {count} | {per} | {cells} |")
    print("\n| backward | offload | kind sums (fw, logits, bw, grad, logprob, loss) | nbytes | logits shared | rank |")
    print("|---|---|---|---|---|---|")
    for r, (m, _) in enumerate(everyone):
        for config, result in m.items():
            backward, offload = config.split("|")
            sums = ", ".join(f"{result['kinds'][k]:,}" for k in KINDS)
            print(f"| {backward} | {offload} | {sums} | {result['nbytes']:,} | {result['shared']} | {r} |")
    g = everyone[0][1]
    print(
        f"\nFSDP2's own gradients (rank 0): {g['views']} of {g['parameters']} local shards are views, into "
        f"{g['storages']} storages of {g['storage_bytes']:,} bytes for {g['shard_bytes']:,} bytes of shards (the "
        "reduce-scatter outputs): the Reference keeps a copy of each shard, so right after backward a rank holds "
        "its gradient shards twice until the run's model is freed."
    )


if __name__ == "__main__":
    if "RANK" not in os.environ:
        sys.exit("run under torchrun: .venv/bin/torchrun --nproc_per_node 2 benchmarks/sharded_memory.py")
    main()
