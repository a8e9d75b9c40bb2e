"""The quality target: a tiny Qwen3 trained briefly on text whose next tokens depend on the context.

The random-init tiny target (tiny/target.py) repeats itself, so a drafter gets most of its acceptance
from the anchor token alone. Here every answer copies, repeats or swaps the 16 words that the prompt drew at
random from `WORDS`: past its `=`, an answer token is a function of the prompt, not of the token before it,
so a drafter can only predict it by reading the target's hidden states (docs/QUALITY.md).
The same arguments always give the same weights on the same machine and thread count.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

# Words that the tiny tokenizer (vocab 512) keeps as one token with their leading space.
WORDS = ("met near help car said old every dinner before day night right now today morning quickly monday after "
         "lunch slowly again simple answer line first garden tree big quiet room warm coat green house map paper "
         "seven apple window next step short story bright lamp number new book bridge letter long blue man water "
         "ball red").split()
TASKS = ("copy", "twice", "swap")


NUM_WORDS = 16  # copy and swap answers: 1 + 16 tokens + end of turn, above prepare's 2 x block 8 loss tokens


def quality_conversation(rng: random.Random, num_words: int = NUM_WORDS) -> list[dict]:
    """One user/assistant exchange of a random task: the answer is a function of the words in the prompt."""
    task = rng.choice(TASKS)
    words = rng.sample(WORDS, num_words)  # distinct: a word names its place
    if task == "twice":
        answer = words + words
    elif task == "swap":  # neighbours trade places: w2 w1 w4 w3 ...
        answer = [words[i ^ 1] for i in range(num_words)]
    else:
        answer = words
    return [{"role": "user", "content": f"{task}:" + "".join(" " + w for w in words)},
            {"role": "assistant", "content": "=" + "".join(" " + w for w in answer)}]


def quality_conversations(num: int = 64, seed: int = 0) -> list[dict]:
    """Deterministic OpenAI-form rows (`{"id", "messages"}`: the user turn and the answer the target learned)."""
    rng = random.Random(f"quality-prompts-{seed}")
    return [{"id": f"quality-{seed}-{i}", "messages": quality_conversation(rng)} for i in range(num)]


def quality_prompts(num: int = 64, seed: int = 0) -> list[dict]:
    """`quality_conversations` without the answers: prompt rows for evaluation and regeneration."""
    return [{**row, "messages": row["messages"][:1]} for row in quality_conversations(num, seed)]


def _encode(tokenizer, messages: list[dict]) -> tuple[list[int], int]:
    """Token ids of a whole conversation and the length of its prompt (user turn + generation header)."""
    prompt = tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    return ids, len(tokenizer(prompt, add_special_tokens=False)["input_ids"])


def make_quality_target(out_dir: str | Path, steps: int = 300, batch: int = 32, lr: float = 3e-3, seed: int = 0,
                        layers: int = 4, hidden: int = 128, vocab_size: int = 512, threads: int = 2,
                        force: bool = False, log_every: int = 0) -> Path:
    """Train a tiny Qwen3 (the tiny target's shape) on the quality tasks and save it with the tiny tokenizer.

    AdamW, linear warmup then cosine to 0, loss on the answers only (`batch` conversations a step).
    Deterministic by `seed` for a given `threads` (the reduction order of a matmul depends on it).
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash_ds.tiny.target import prepare_out_dir, save_tiny
    from dflash_ds.tiny.tokenizer import build_tokenizer

    out = prepare_out_dir(out_dir, force)
    tokenizer = build_tokenizer(vocab_size)
    config = Qwen3Config(
        vocab_size=max(vocab_size, len(tokenizer)), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
        max_position_embeddings=2048, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None, dtype="float32")
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
        train_on_tasks(model, tokenizer, steps, batch, lr, random.Random(f"quality-train-{seed}"), log_every)
    finally:
        torch.set_num_threads(old_threads)
    return save_tiny(model, tokenizer, out)


def train_on_tasks(model, tokenizer, steps: int, batch: int, lr: float, rng: random.Random, log_every: int = 0) -> None:
    """`steps` AdamW steps of next-token loss on the answers of fresh quality conversations."""
    import math

    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    model.train()
    start = time.time()
    for step in range(steps):
        rows = [_encode(tokenizer, quality_conversation(rng)) for _ in range(batch)]
        width = max(len(ids) for ids, _ in rows)
        ids = torch.full((batch, width), tokenizer.pad_token_id)
        labels = torch.full((batch, width), -100)
        for i, (seq, prompt_len) in enumerate(rows):
            ids[i, : len(seq)] = torch.tensor(seq)
            labels[i, prompt_len: len(seq)] = torch.tensor(seq[prompt_len:])
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"quality target step {step}: loss {loss.item():.3f} ({time.time() - start:.0f} s)", flush=True)
    model.eval()
