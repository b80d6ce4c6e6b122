"""Train the tiny byte-level mixture-of-experts LM committed under tests/data/tiny-trained-moe (from the repo root).

python tests/data/train_tiny_moe.py

The recipe of train_tiny_lm.py (same corpus, tokenizer, held-out split, optimiser and schedule) on a Qwen3-MoE of
the same size: 4 layers, hidden 64, each MLP 8 experts of width 64 with top-2 routing (normalised top-k weights)
and the load-balancing loss. A router with random weights is near-uniform: its top-k choices are near-ties, so
precision flips them at random and the flips mean little. Trained, each router prefers a few experts per token
with a clear margin, as a real MoE's does; TRAINING.md records how peaked the routers are.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import train_tiny_lm as recipe  # noqa: E402  (the dense model's recipe: corpus, tokenizer, schedule)

OUT_DIR = HERE / "tiny-trained-moe"
STEPS = 800
EXPERTS = 8
TOP_K = 2
AUX_LOSS_COEF = 0.01


def build_model(seed: int) -> Any:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=recipe.VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=True,
        router_aux_loss_coef=AUX_LOSS_COEF,
        max_position_embeddings=2 * recipe.SEQ_LEN,
        tie_word_embeddings=False,
        attn_implementation="eager",
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config)


@torch.no_grad()
def router_stats(model: Any, windows: torch.Tensor) -> dict[str, float]:
    """How peaked the routers are on held-out text: the mean top-1 probability, the median gap between the k-th and
    (k+1)-th logit, and the largest share of tokens any expert gets (uniform: 1/EXPERTS, 0 gap, TOP_K/EXPERTS)."""
    logits: list[torch.Tensor] = []
    handles = [
        module.register_forward_hook(lambda _m, _a, out: logits.append(out[0].float()))
        for name, module in model.named_modules()
        if name.endswith("mlp.gate")
    ]
    model.eval()
    model(input_ids=windows[:32, :-1])
    for handle in handles:
        handle.remove()
    model.train()
    joined = torch.cat(logits)
    top = joined.topk(TOP_K + 1, dim=-1).values
    load = torch.zeros(EXPERTS).index_add_(
        0, joined.topk(TOP_K, dim=-1).indices.reshape(-1), torch.ones(joined.numel() // EXPERTS * TOP_K)
    )
    return {
        "top1_p": float(joined.softmax(-1).max(-1).values.mean()),
        "margin": float((top[:, TOP_K - 1] - top[:, TOP_K]).median()),
        "max_load": float(load.max() / load.sum() * TOP_K),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    text = recipe.CORPUS.read_text(encoding="utf-8")
    data = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
    split = int(len(data) * (1 - recipe.HELD_OUT_FRACTION))
    train_data, held_out_data = data[:split], data[split:]
    windows = recipe.held_out_windows(held_out_data)

    model = build_model(recipe.SEED)
    n_params = sum(p.numel() for p in model.parameters())
    init_stats, init_routers = recipe.next_token_stats(model, windows), router_stats(model, windows)
    print(f"model: {n_params} parameters; step 0 held-out {recipe.fmt(init_stats)} routers {init_routers}")

    optimizer = torch.optim.AdamW(recipe.param_groups(model), lr=recipe.PEAK_LR, betas=(0.9, 0.95), eps=1e-8)
    generator = torch.Generator().manual_seed(recipe.SEED)
    offsets = torch.arange(recipe.SEQ_LEN + 1)
    model.train()
    recent: list[float] = []
    start = time.perf_counter()
    for step in range(STEPS):
        for group in optimizer.param_groups:
            group["lr"] = recipe.lr_at(step, STEPS)
        starts = torch.randint(0, len(train_data) - recipe.SEQ_LEN - 1, (recipe.BATCH_SIZE,), generator=generator)
        batch = train_data[starts[:, None] + offsets]
        output = model(input_ids=batch[:, :-1], output_router_logits=True)
        loss = F.cross_entropy(output.logits.reshape(-1, recipe.VOCAB_SIZE), batch[:, 1:].reshape(-1))
        total = loss + AUX_LOSS_COEF * output.aux_loss
        optimizer.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.GRAD_CLIP)
        optimizer.step()
        recent = [*recent[-(recipe.LOG_EVERY - 1) :], float(loss.detach())]
        if (step + 1) % recipe.LOG_EVERY == 0:
            print(
                f"step {step + 1:4d}  train loss {sum(recent) / len(recent):.4f}  {time.perf_counter() - start:6.1f}s"
            )
            sys.stdout.flush()
    train_seconds = time.perf_counter() - start
    final_stats, final_routers = recipe.next_token_stats(model, windows), router_stats(model, windows)
    print(f"step {STEPS} held-out {recipe.fmt(final_stats)} routers {final_routers} ({train_seconds:.0f}s)")

    model.eval()
    model.config.output_router_logits = False
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(OUT_DIR, safe_serialization=True)
    recipe.save_tokenizer(recipe.build_tokenizer(), OUT_DIR)
    write_report(n_params, args.threads, train_seconds, init_stats, final_stats, init_routers, final_routers)
    for path in OUT_DIR.iterdir():
        if path.is_file():
            path.chmod(0o644)
    print(f"wrote {OUT_DIR}")


def write_report(
    n_params: int,
    threads: int,
    train_seconds: float,
    init_stats: dict[str, float],
    final_stats: dict[str, float],
    init_routers: dict[str, float],
    final_routers: dict[str, float],
) -> None:
    import transformers

    rows = "\n".join(
        f"| {name} | {s['nll']:.4f} | {r['top1_p']:.3f} | {r['margin']:.3f} | {r['max_load']:.3f} |"
        for name, s, r in (
            ("random init", init_stats, init_routers),
            (f"trained ({STEPS} steps)", final_stats, final_routers),
        )
    )
    (OUT_DIR / "TRAINING.md").write_text(
        f"""# tiny-trained-moe: how it was trained

Written by `tests/data/train_tiny_moe.py` (rerun from the repository root: `python tests/data/train_tiny_moe.py`),
with the recipe of `tests/data/train_tiny_lm.py` (corpus, byte tokenizer, held-out 10%, AdamW, schedule, seed).

- Model: `Qwen3MoeForCausalLM`, vocabulary 256, hidden 64, 4 layers, 4 heads, 2 KV heads, each MLP {EXPERTS}
  experts of width 64, top-{TOP_K} routing with normalised top-k weights, untied head, eager attention;
  {n_params} parameters, fp32 safetensors.
- Training: {STEPS} steps, batch {recipe.BATCH_SIZE} x {recipe.SEQ_LEN} bytes, cross-entropy plus {AUX_LOSS_COEF} x the
  load-balancing loss; torch {torch.__version__}, transformers {transformers.__version__}, Python
  {platform.python_version()}, {threads} thread(s); {train_seconds:.0f} s.

Held-out text (routers: 32 windows of {recipe.SEQ_LEN} bytes, every layer): uniform routing has top-1 probability
{1 / EXPERTS:.3f}, margin 0 and each expert {TOP_K / EXPERTS:.3f} of the tokens.

| model | held-out nats/byte | mean top-1 router p | median k-th minus (k+1)-th logit | busiest expert's share |
| --- | --- | --- | --- | --- |
{rows}
""",
        encoding="utf-8",
    )


if __name__ == "__main__":
    main()
