"""Train the tiny byte-level Llama committed under tests/data/tiny-trained-lm (run from the repository root).

python tests/data/train_tiny_lm.py

A model with random weights predicts a near-uniform next-token distribution, so the log-probabilities it produces
are all close to -ln 256 and their precision errors say little about a real model's. This script trains the same
kind of tiny Llama (vocabulary 256 = raw bytes, hidden 64, 4 layers) on public-domain prose (the opening chapters
of Jane Austen's "Pride and Prejudice", see tiny-trained-lm/SOURCE.md) for a few minutes on CPU, so that its
next-byte distributions are peaked the way a real language model's are. The last 10% of the corpus is held out.

It writes config.json, generation_config.json, model.safetensors (fp32), tokenizer.json, tokenizer_config.json and
TRAINING.md into tests/data/tiny-trained-lm/. With the same torch version and thread count the run is
deterministic.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
OUT_DIR = HERE / "tiny-trained-lm"
CORPUS = OUT_DIR / "corpus.txt"

VOCAB_SIZE = 256
SEQ_LEN = 128
BATCH_SIZE = 32
STEPS = 1000
WARMUP_STEPS = 50
PEAK_LR = 3e-3
MIN_LR_RATIO = 0.1
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0
HELD_OUT_FRACTION = 0.1
SEED = 20240607
LOG_EVERY = 50
EVAL_EVERY = 250


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-character map, the alphabet of the `tokenizers` ByteLevel pre-tokenizer."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def build_tokenizer() -> Any:
    """A byte-level tokenizer whose token id is the byte value: 256 tokens, no merges, no special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(VOCAB_SIZE)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=2 * SEQ_LEN)


def save_tokenizer(tokenizer: Any, out_dir: Path) -> None:
    tokenizer.save_pretrained(out_dir)
    # Name the class that both transformers 4.x and 5.x resolve (5.x writes its own "TokenizersBackend").
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("backend", None)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def check_tokenizer(out_dir: Path, sample: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    assert len(tokenizer) == VOCAB_SIZE, len(tokenizer)
    for text in (sample, "Mr. Darcy — café, naïve ✓\n\ttabs  and\x00bytes "):
        ids = tokenizer(text)["input_ids"]
        assert ids == list(text.encode("utf-8")), "token ids are not the UTF-8 bytes"
        assert all(0 <= i < VOCAB_SIZE for i in ids)
        assert tokenizer.decode(ids) == text, "decode does not round-trip"


def build_model(seed: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2 * SEQ_LEN,
        tie_word_embeddings=False,
        attn_implementation="eager",
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def lr_at(step: int, steps: int = STEPS) -> float:
    """Linear warm-up to PEAK_LR, then cosine decay to MIN_LR_RATIO * PEAK_LR at the last of `steps` steps."""
    if step < WARMUP_STEPS:
        return PEAK_LR * (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, steps - 1 - WARMUP_STEPS)
    return PEAK_LR * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))


def held_out_windows(data: torch.Tensor) -> torch.Tensor:
    """Non-overlapping windows of SEQ_LEN + 1 bytes (inputs plus the shifted targets) over the held-out bytes."""
    n = (data.numel() - 1) // SEQ_LEN
    starts = torch.arange(n) * SEQ_LEN
    return torch.stack([data[s : s + SEQ_LEN + 1] for s in starts.tolist()])


@torch.no_grad()
def next_token_stats(
    model: Any, windows: torch.Tensor, batch_size: int = 64, collect: list[torch.Tensor] | None = None
) -> dict[str, float]:
    """Mean -log p(next byte), mean max-probability and mean entropy (nats) over every position of the windows.

    With `collect`, the log-probability of each next byte is appended to it (one tensor per batch).
    """
    was_training = model.training
    model.eval()
    nll_sum = max_p_sum = entropy_sum = 0.0
    count = 0
    for i in range(0, windows.shape[0], batch_size):
        batch = windows[i : i + batch_size]
        logits = model(input_ids=batch[:, :-1]).logits.float()
        logp = F.log_softmax(logits, dim=-1)
        target_logp = logp.gather(-1, batch[:, 1:, None]).squeeze(-1)
        nll_sum += float(-target_logp.sum())
        max_p_sum += float(logp.max(dim=-1).values.exp().sum())
        entropy_sum += float(-(logp.exp() * logp).sum(dim=-1).sum())
        count += target_logp.numel()
        if collect is not None:
            collect.append(target_logp.flatten())
    model.train(was_training)
    return {"nll": nll_sum / count, "max_p": max_p_sum / count, "entropy": entropy_sum / count, "count": count}


def param_groups(model: Any) -> list[dict[str, Any]]:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}]


def fmt(stats: dict[str, float]) -> str:
    return f"-log p {stats['nll']:.4f}  max p {stats['max_p']:.4f}  entropy {stats['entropy']:.4f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a shared 2-core machine two threads ran ~10x slower)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    text = CORPUS.read_text(encoding="utf-8")
    data = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
    split = int(len(data) * (1 - HELD_OUT_FRACTION))
    train_data, held_out_data = data[:split], data[split:]
    windows = held_out_windows(held_out_data)
    print(f"corpus: {len(data)} bytes, train {len(train_data)}, held-out {len(held_out_data)}")
    print(f"held-out: {windows.shape[0]} windows of {SEQ_LEN}")

    tokenizer = build_tokenizer()
    model = build_model(SEED)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params} parameters")
    init_stats = next_token_stats(model, windows)
    print(f"step    0  held-out {fmt(init_stats)}")

    optimizer = torch.optim.AdamW(param_groups(model), lr=PEAK_LR, betas=(0.9, 0.95), eps=1e-8)
    generator = torch.Generator().manual_seed(SEED)
    offsets = torch.arange(SEQ_LEN + 1)
    model.train()
    recent: list[float] = []
    start = time.perf_counter()
    for step in range(STEPS):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        starts = torch.randint(0, len(train_data) - SEQ_LEN - 1, (BATCH_SIZE,), generator=generator)
        batch = train_data[starts[:, None] + offsets]
        logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), batch[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        recent = [*recent[-(LOG_EVERY - 1) :], float(loss.detach())]
        if (step + 1) % LOG_EVERY == 0:
            elapsed = time.perf_counter() - start
            mean = sum(recent) / len(recent)
            print(
                f"step {step + 1:4d}  train loss {mean:.4f} (last {len(recent)})  lr {lr_at(step):.2e}  {elapsed:6.1f}s"
            )
        if (step + 1) % EVAL_EVERY == 0 and step + 1 < STEPS:
            print(f"step {step + 1:4d}  held-out {fmt(next_token_stats(model, windows))}")
            sys.stdout.flush()
    train_seconds = time.perf_counter() - start
    final_train_loss = sum(recent) / len(recent)
    final_stats = next_token_stats(model, windows)
    print(f"step {STEPS:4d}  held-out {fmt(final_stats)}  (training took {train_seconds:.1f}s)")

    model.eval()
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(OUT_DIR, safe_serialization=True)
    save_tokenizer(tokenizer, OUT_DIR)
    check_tokenizer(OUT_DIR, text[:200])

    # Reload what was written, offline, in fp32 and bf16, and measure it again.
    from transformers import AutoModelForCausalLM

    reloaded = {}
    target_logps = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        loaded = AutoModelForCausalLM.from_pretrained(OUT_DIR, dtype=dtype)
        collected: list[torch.Tensor] = []
        reloaded[name] = next_token_stats(loaded, windows, collect=collected)
        target_logps[name] = torch.cat(collected)
        print(f"reloaded {name:8s} held-out {fmt(reloaded[name])}")
    assert abs(reloaded["float32"]["nll"] - final_stats["nll"]) < 1e-4
    bf16_error = (target_logps["bfloat16"] - target_logps["float32"]).abs()
    bf16_vs_fp32 = {"mean": float(bf16_error.mean()), "max": float(bf16_error.max())}
    print(
        f"bfloat16 vs float32: |delta log p(next byte)| mean {bf16_vs_fp32['mean']:.4f} max {bf16_vs_fp32['max']:.4f}"
    )

    write_report(
        n_params=n_params,
        corpus_bytes=len(data),
        train_bytes=len(train_data),
        held_out_bytes=len(held_out_data),
        threads=args.threads,
        train_seconds=train_seconds,
        final_train_loss=final_train_loss,
        init_stats=init_stats,
        final_stats=final_stats,
        reloaded=reloaded,
        bf16_vs_fp32=bf16_vs_fp32,
    )
    for path in OUT_DIR.iterdir():
        if path.is_file():
            path.chmod(0o644)
    print(f"wrote {OUT_DIR}")


def write_report(
    *,
    n_params: int,
    corpus_bytes: int,
    train_bytes: int,
    held_out_bytes: int,
    threads: int,
    train_seconds: float,
    final_train_loss: float,
    init_stats: dict[str, float],
    final_stats: dict[str, float],
    reloaded: dict[str, dict[str, float]],
    bf16_vs_fp32: dict[str, float],
) -> None:
    import transformers

    uniform = math.log(VOCAB_SIZE)
    rows = [
        ("random init (step 0), fp32", init_stats),
        (f"trained (step {STEPS}), fp32", final_stats),
        ("trained, reloaded as bfloat16", reloaded["bfloat16"]),
    ]
    table = "\n".join(
        f"| {name} | {s['nll']:.4f} | {s['nll'] / math.log(2):.3f} | {s['max_p']:.4f} | {s['entropy']:.4f} |"
        for name, s in rows
    )
    report = f"""# tiny-trained-lm: how it was trained

Written by `tests/data/train_tiny_lm.py`; rerun from the repository root with

    python tests/data/train_tiny_lm.py

## Setup

- Model: `LlamaForCausalLM`, vocabulary {VOCAB_SIZE} (raw bytes), hidden 64, intermediate 192, 4 layers,
  4 heads, 2 KV heads, max positions {2 * SEQ_LEN}, untied head, eager attention; {n_params} parameters,
  saved as fp32 safetensors.
- Tokenizer: byte-level, token id = byte value (UTF-8), no merges, no special tokens.
- Data: `corpus.txt` ({corpus_bytes} bytes, see SOURCE.md); first {train_bytes} bytes for training,
  last {held_out_bytes} bytes (10%) held out.
- Training: {STEPS} steps, batch {BATCH_SIZE} x {SEQ_LEN} bytes drawn at random offsets, AdamW (betas 0.9/0.95,
  weight decay {WEIGHT_DECAY} on matrices), peak lr {PEAK_LR:g} with {WARMUP_STEPS} warm-up steps and cosine
  decay to {MIN_LR_RATIO * PEAK_LR:g}, gradient clipping {GRAD_CLIP}, seed {SEED}.
- Software: torch {torch.__version__}, transformers {transformers.__version__}, Python {platform.python_version()},
  {threads} CPU thread(s).

## Results

- Wall time of the training loop: {train_seconds:.0f} s.
- Final train loss (mean over the last {LOG_EVERY} steps): {final_train_loss:.4f} nats/byte.
- Held-out loss: {final_stats["nll"]:.4f} nats/byte ({final_stats["nll"] / math.log(2):.3f} bits/byte).

Next-byte statistics over all {final_stats["count"]:.0f} held-out positions (non-overlapping windows of
{SEQ_LEN}); for comparison a uniform distribution over {VOCAB_SIZE} bytes has -log p = entropy = ln {VOCAB_SIZE}
= {uniform:.4f} and max p = {1 / VOCAB_SIZE:.4f}.

| model | mean \\|log p\\| of next byte (nats) | bits | mean max p | mean entropy (nats) |
| --- | --- | --- | --- | --- |
{table}

Loaded as bfloat16 (`AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)`), the log-probability of
each held-out next byte differs from the float32 one by {bf16_vs_fp32["mean"]:.4f} nats on average and by at most
{bf16_vs_fp32["max"]:.4f}; the means above agree because those errors largely cancel.

The model was trained with eager attention; `config.json` does not record the attention implementation, so
`from_pretrained` picks its default (SDPA) unless given `attn_implementation="eager"`. The reloaded rows above used
the default.
"""
    (OUT_DIR / "TRAINING.md").write_text(report)


if __name__ == "__main__":
    main()
