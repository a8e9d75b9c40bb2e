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


DIALOGUE_STEPS = 100  # steps on dialogues after the one-exchange training (make_quality_target's row_tokens)
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


def dialogue(rng: random.Random, tokenizer, max_tokens: int) -> tuple[list[dict], list[int], list[tuple[int, int]]]:
    """Quality exchanges, one after another in one conversation, while its tokens stay within `max_tokens` (at
    least one exchange): the messages, their token ids and each answer's [start, end) token span (its end-of-turn
    token and the template's newline after it included, as the one-exchange training has them). Each answer is a
    function of its own prompt: on a sliding-window target it is the same at any depth of the conversation, so the
    target answers correctly at 32K after training on rows of a few turns. The tiny chat template renders each
    message alone, so the ids are the exchanges' own, one after another."""
    messages, ids, spans = [], [], []
    while True:
        exchange = quality_conversation(rng)
        more, (start, end) = _encode(tokenizer, exchange)
        if messages and len(ids) + len(more) > max_tokens:
            return messages, ids, spans
        messages += exchange
        spans.append((len(ids) + start, len(ids) + end))
        ids += more


def _tokens(tokenizer, messages: list[dict], generation_prompt: bool = False) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _encode(tokenizer, messages: list[dict]) -> tuple[list[int], tuple[int, int]]:
    """Token ids of one exchange and its answer's [start, end) span (start: the prompt's length)."""
    ids = _tokens(tokenizer, messages)
    return ids, (len(_tokens(tokenizer, messages[:1], generation_prompt=True)), len(ids))


def _one(tokenizer, messages: list[dict]) -> tuple[list[int], list[tuple[int, int]]]:
    ids, span = _encode(tokenizer, messages)
    return ids, [span]


def make_quality_target(out_dir: str | Path, steps: int = 300, batch: int = 32, lr: float = 3e-3, seed: int = 0,
                        layers: int = 4, hidden: int = 128, vocab_size: int = 512, threads: int = 2,
                        force: bool = False, log_every: int = 0, sliding_window: int | None = None,
                        row_tokens: int = 0) -> Path:
    """Train a tiny Qwen3 (the tiny target's shape) on the quality tasks and save it with the tiny tokenizer.

    AdamW, linear warmup then cosine to 0, loss on the answers only (`batch` conversations a step).
    Deterministic by `seed` for a given `threads` (the reduction order of a matmul depends on it).
    `sliding_window` W: every layer attends to the last W positions only (a long-context target: its answers do not
    depend on how long the conversation is, so it holds at 32K, `max_position_embeddings` 65,536); `row_tokens` > 0:
    then `DIALOGUE_STEPS` more steps (8 rows, lr / 3) on `dialogue`s of that many tokens at most (several exchanges,
    the loss on every answer): a target trained on one exchange alone answers 24% of a dialogue's tokens right.
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
        max_position_embeddings=65536 if sliding_window else 2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None, dtype="float32",
        **({"sliding_window": sliding_window, "use_sliding_window": True, "max_window_layers": 0}
           if sliding_window else {}))
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
        rng = random.Random(f"quality-train-{seed}")
        train_on_tasks(model, tokenizer, steps, batch, lr, rng, log_every)
        if row_tokens:  # from scratch on dialogues the loss stalls at ~3.5 for 150 steps; after one exchange, 100 do
            train_on_tasks(model, tokenizer, DIALOGUE_STEPS, 8, lr / 3, rng, log_every, row_tokens)
    finally:
        torch.set_num_threads(old_threads)
    return save_tiny(model, tokenizer, out)


def train_on_tasks(model, tokenizer, steps: int, batch: int, lr: float, rng: random.Random, log_every: int = 0,
                   row_tokens: int = 0) -> None:
    """`steps` AdamW steps of next-token loss on the answers of fresh quality conversations (`dialogue`s of
    `row_tokens` tokens when > 0)."""
    import math

    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    model.train()
    start = time.time()
    for step in range(steps):
        rows = [dialogue(rng, tokenizer, row_tokens)[1:] if row_tokens else _one(tokenizer, quality_conversation(rng))
                for _ in range(batch)]
        width = max(len(ids) for ids, _ in rows)
        ids = torch.full((batch, width), tokenizer.pad_token_id)
        labels = torch.full((batch, width), -100)
        for i, (seq, spans) in enumerate(rows):
            ids[i, : len(seq)] = torch.tensor(seq)
            for lo, hi in spans:
                labels[i, lo:hi] = torch.tensor(seq[lo:hi])
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"quality target step {step}: loss {loss.item():.3f} ({time.time() - start:.0f} s)", flush=True)
    model.eval()
