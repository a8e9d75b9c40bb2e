"""`dflash-ds long-conversations`: long multi-turn conversations for the target to continue (issue 56, point 4).

A drafter trained only on short rows loses acceptance on long contexts; training it long needs long rows that are
the target's own text, not short rows concatenated (a copied span is trivially predictable and inflates acceptance).
This builds conversations of user turns only, from a prompt file (`make-prompts` / `self-instruct` output), each
sized to about `--length` tokens once answered; `regenerate` (either engine: it answers every assistant turn in
order, each given the conversation so far) then writes the target's answers, and `prepare --max-length` /
`train --data.max_length` take the long rows. Each conversation opens with a prompt and goes on with, at random,
another prompt of the pool or a follow-up that refers back to what was said (the last answer, the first question, the
whole conversation: FOLLOW_UPS), so late answers depend on early context. No pool prompt is used twice, in one
conversation or across them; held-out conversations come from the held-out prompt file, whose topics the training
file does not hold.

Length: a conversation's tokens are its user turns as the chat template renders them (counted with the target's
tokenizer: each text's tokens plus the template's own around it, `template_tokens`) plus `--answer-tokens` for each
answer (regenerate's --max-new-tokens, an upper bound: answers that end
sooner make the row shorter); turns are added while the total stays within `--length`. SmolLM2's window is 8,192
tokens: `--length 7680 --answer-tokens 256` leaves room for the last answer's own header. Cost to answer: `turns x
answer tokens` new tokens a conversation, each turn's prefill the whole conversation so far (at ~60 new tokens/s
through vLLM on 2 AVX2 cores, 100 conversations of 7,680 tokens take ~3.5 hours).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

from dflash_ds.data import formats
from dflash_ds.errors import DFlashError

# Follow-ups that send the target back over its own earlier text; {n} is filled with an earlier question's number.
# The first AFTER_ONE need one earlier answer, the rest two.
FOLLOW_UPS = (
    "Can you expand on the most important point of your last answer?",
    "Give a concrete example of what you just described.",
    "Summarize everything we have talked about so far in a few sentences.",
    "Go back to my first question in this conversation and answer it again, more briefly.",
    "Explain your previous answer to someone who knows nothing about the subject.",
    "List the main ideas of your last two answers.",
    "Looking back at question {n} of this conversation: what would you add to your answer now?",
    "Which of your answers so far would you change, and how?",
)
AFTER_ONE = 5
PLACEHOLDER = {"role": "assistant", "content": ""}  # regenerate answers it; prepare needs the target's answer there


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the long-conversations flags."""
    parser.add_argument("--prompts", required=True, help="JSONL of one-user-turn rows (make-prompts' or "
                        "self-instruct's train.jsonl or held_out.jsonl): the pool, each prompt used at most once")
    parser.add_argument("--target", required=True, help="target folder: its chat template and tokenizer count the "
                        "user turns' tokens")
    parser.add_argument("--out", required=True, help="output JSONL: one conversation a row (user turns with empty "
                        "assistant turns between them), the input of `regenerate`; OUT.stats.json beside it")
    parser.add_argument("--length", type=int, default=7680, help="tokens per conversation once answered, at most "
                        "(default 7680: SmolLM2's 8,192-token window less one answer)")
    parser.add_argument("--answer-tokens", type=int, default=256, help="tokens counted per answer: regenerate's "
                        "--max-new-tokens (default 256)")
    parser.add_argument("--follow-up", type=float, default=0.5, help="chance that a turn after the first is a "
                        "follow-up about earlier turns rather than a new prompt (default 0.5)")
    parser.add_argument("--count", type=int, default=None, help="conversations to write at most (default: as many "
                        "as the pool allows)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the pool's order and of the follow-ups")


def user_prompts(path: Path) -> list[tuple[str, str]]:
    """(id, text) of each row's single user turn; a row with other turns is an error naming its line."""
    rows = []
    for line, raw in formats.iter_raw_rows(path):
        try:
            record = formats.parse_row(raw)
            messages = formats.to_messages(record, require_assistant=False)
        except formats.RowError as exc:
            raise DFlashError(f"{path}:{line}: {exc}") from None
        if [m["role"] for m in messages] != ["user"]:
            raise DFlashError(f"{path}:{line}: expected one user turn, found roles {[m['role'] for m in messages]}")
        rows.append((formats.row_id(record, path, line), messages[0]["content"]))
    if not rows:
        raise DFlashError(f"--prompts {path}: no rows")
    return rows


def template_tokens(tok) -> tuple[int, int, int]:
    """(start, user, answer): the chat template's own tokens, counted once: before the first user turn's text
    (a default system prompt, its header), around each user turn's text, around each answer's."""
    def n(messages: list[dict]) -> int:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        return len(tok(text, add_special_tokens=False)["input_ids"])

    u, a = {"role": "user", "content": ""}, dict(PLACEHOLDER)
    one, two, three = n([u]), n([u, a]), n([u, a, u])
    return one - (three - two), three - two, two - one


def build(pool: list[tuple[str, str]], text_tokens, *, template: tuple[int, int, int], length: int,
          answer_tokens: int, follow_up: float, seed: int, count: int | None = None) -> list[dict]:
    """Conversations from `pool` ((id, text), each used at most once); `text_tokens(text)` counts a text's tokens,
    `template` is `template_tokens`' count. A conversation keeps at least two turns; one the pool cannot extend to
    two is not written (its opening prompt is not used)."""
    start, user, answer = template
    rng = random.Random(seed)
    order = list(pool)
    rng.shuffle(order)
    out: list[dict] = []
    while order and (count is None or len(out) < count):
        sources, turns, total, questions = [], [], start, 0
        while True:
            if questions and rng.random() < follow_up:
                k = rng.randrange(len(FOLLOW_UPS) if questions >= 2 else AFTER_ONE)
                text, source = FOLLOW_UPS[k].format(n=rng.randrange(1, questions)) if "{n}" in FOLLOW_UPS[k] \
                    else FOLLOW_UPS[k], None
            elif order:
                (source, text) = order[-1]
            else:
                break
            cost = text_tokens(text) + user + answer_tokens + answer
            if total + cost > length:
                break
            if source is not None:
                order.pop()
                sources.append(source)
            turns.append(text)
            total += cost
            questions += 1
        if questions < 2:
            if not sources:  # the next prompt alone is longer than --length: not used
                order.pop()
            continue
        messages = []
        for text in turns:
            messages += [{"role": "user", "content": text}, dict(PLACEHOLDER)]
        out.append({"id": f"long-{seed}-{len(out)}", "kind": "long", "turns": len(turns), "estimated_tokens": total,
                    "sources": sources, "messages": messages[:-1]})
    return out


def stats(rows: list[dict], pool: int) -> dict:
    turns = [r["turns"] for r in rows]
    est = sorted(r["estimated_tokens"] for r in rows)
    used = sum(len(r["sources"]) for r in rows)
    pick = (lambda q: est[min(len(est) - 1, int(q * len(est)))]) if est else (lambda q: 0)
    return {"conversations": len(rows), "pool_prompts": pool, "prompts_used": used, "prompts_not_used": pool - used,
            "turns_min_median_max": [min(turns, default=0), statistics.median(turns) if turns else 0,
                                     max(turns, default=0)],
            "follow_ups": sum(turns) - used, "estimated_tokens_p10_p50_p90": [pick(0.1), pick(0.5), pick(0.9)]}


def run(args: argparse.Namespace) -> int:
    """CLI entry: read the pool, build, write the conversations and their stats."""
    from dflash_ds.data.chat import load_tokenizer

    if args.answer_tokens < 1 or args.length < 2 * args.answer_tokens:
        raise DFlashError(f"--length {args.length} must hold at least two answers of --answer-tokens "
                          f"{args.answer_tokens} (>= 1)")
    if not 0.0 <= args.follow_up < 1.0:
        raise DFlashError(f"--follow-up {args.follow_up}: a chance in [0, 1)")
    pool = user_prompts(Path(args.prompts))
    tok = load_tokenizer(str(args.target))

    def text_tokens(text: str) -> int:
        return len(tok(text, add_special_tokens=False)["input_ids"])

    rows = build(pool, text_tokens, template=template_tokens(tok), length=args.length,
                 answer_tokens=args.answer_tokens, follow_up=args.follow_up, seed=args.seed, count=args.count)
    if not rows:
        raise DFlashError(f"--prompts {args.prompts}: no conversation of two turns fits --length {args.length}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    tmp.replace(out)
    summary = stats(rows, len(pool))
    out.with_name(out.name + ".stats.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    print(f"{out}: {summary['conversations']} conversations of {summary['turns_min_median_max']} turns "
          f"(min/median/max), ~{summary['estimated_tokens_p10_p50_p90'][1]:,} tokens each once answered (p50); "
          f"{summary['prompts_used']} of {summary['pool_prompts']} prompts used, {summary['follow_ups']} follow-ups")
    return 0
