"""Conversations that carry the target's own answer ids: the `token_ids` of a regenerated row, checked and laid out.

Decoding an answer to text and tokenizing the text again need not give back the ids the target
generated ("ka" may come back as "k" + "a"), and a cut answer never emitted the end-of-turn token
the chat template puts after it. So `regenerate` writes, beside `finish_reasons`, `token_ids`: per
assistant turn the ids the target generated, without the stop token that ended the turn. A row
with them is laid out turn by turn:

    tokens(the rendered text before assistant turn k, generation prompt included)   input
    + token_ids[k]                                                                   loss
    + the template's end-of-turn token, only if finish_reasons[k] == 'stop'          loss (it stopped there)
    + tokens(the rendered text up to the next assistant turn's answer) + ...         input

The text between answers is the chat template's rendering. After a cut answer ('length') the
end-of-turn token is input only, there for the turns rendered after it; a conversation whose
last answer was cut ends after its ids. `regenerate` prompts turn k+1 with the layout of the
history (`generation_prompt=True`), which is the prefix `prepare` lays out for the same row, so
every loss label is the token the target produced there.

A template that rewrites earlier turns (Qwen3 drops the <think> block of all but the last answer)
does not render the history as a prefix of the next turn: `layout` returns None and the caller
takes the text path for the row.
"""

from __future__ import annotations

import re
from typing import Any

from dflash_ds.data import formats

FINISH_REASONS = ("stop", "length")
# A text part is rendered template text (input only); an id part is answer ids or an end-of-turn id (loss).
Part = str | list[int]


def read_token_ids(record: dict[str, Any], messages: list[dict[str, str]],
                   vocab_size: int) -> tuple[list[list[int]], list[str]] | None:
    """A row's `(token_ids, finish_reasons)`, checked against its assistant turns; None when it has no `token_ids`."""
    token_ids = record.get("token_ids")
    if token_ids is None:  # absent, or null in a Parquet file that mixes both kinds of row
        return None
    turns = sum(m["role"] == "assistant" for m in messages)
    if not isinstance(token_ids, list) or not all(isinstance(ids, list) for ids in token_ids):
        raise formats.RowError(formats.BAD_TOKEN_IDS, "token_ids must be a list of id lists, one per assistant turn")
    if len(token_ids) != turns:
        raise formats.RowError(formats.BAD_TOKEN_IDS, f"{len(token_ids)} token_ids lists for {turns} assistant turns")
    for k, ids in enumerate(token_ids):
        for j, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
                raise formats.RowError(formats.BAD_TOKEN_IDS, f"token_ids[{k}][{j}] = {t!r} is not a token id "
                                                              f"(an int in [0, {vocab_size}))")
    finishes = record.get("finish_reasons")
    if (not isinstance(finishes, list) or len(finishes) != turns
            or not all(isinstance(f, str) and f in FINISH_REASONS for f in finishes)):
        raise formats.RowError(formats.BAD_TOKEN_IDS, f"finish_reasons must be 'stop' or 'length' for each of "
                                                      f"the {turns} assistant turns, got {finishes!r}")
    return token_ids, finishes


def _render(tok, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def layout(tok, messages: list[dict[str, str]], token_ids: list[list[int]], finishes: list[str],
           specials: re.Pattern | None, generation_prompt: bool = False) -> list[Part] | None:
    """The conversation as text and id parts (see the module doc); None where the template rewrites earlier turns."""
    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    prompts = [_render(tok, messages[:k], True) for k in turns]
    end = _render(tok, messages, generation_prompt)
    parts: list[Part] = []
    done = ""  # the rendered text that `parts` stand for so far
    for j, k in enumerate(turns):
        if not prompts[j].startswith(done):
            return None
        parts += [prompts[j][len(done):], list(token_ids[j])]
        done = prompts[j] + messages[k]["content"]
        if finishes[j] == "length" and k == len(messages) - 1 and not generation_prompt:
            return parts  # a cut last answer: nothing the target emitted follows it
        after = prompts[j + 1] if j + 1 < len(turns) else end
        if not after.startswith(done):
            return None
        if finishes[j] == "stop":
            eot = specials.match(after, len(done)) if specials else None
            if eot is None:  # the template ends a turn with something other than one special token
                return None
            parts.append([tok.convert_tokens_to_ids(eot.group())])
            done += eot.group()
    parts.append(end[len(done):])
    return parts


def encode(tok, layouts: list[list[Part]]) -> list[tuple[list[int], list[int]]]:
    """`(input_ids, loss_mask)` of each layout; the text parts of all of them tokenized in one batched call."""
    texts = [p for parts in layouts for p in parts if isinstance(p, str) and p]
    # The rendered text holds every special token; the backend call is what the text path uses too.
    encoded = iter(tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False) if texts else [])
    out = []
    for parts in layouts:
        ids: list[int] = []
        mask: list[int] = []
        for part in parts:
            if isinstance(part, str):
                piece, loss = (next(encoded).ids if part else []), 0
            else:
                piece, loss = part, 1
            ids += piece
            mask += [loss] * len(piece)
        out.append((ids, mask))
    return out


def prompt_ids(tok, specials: re.Pattern | None, history: list[dict[str, str]], token_ids: list[list[int]],
               finishes: list[str]) -> list[int]:
    """Prompt ids for the next answer: earlier answers as generated, the rest as the template renders it."""
    parts = layout(tok, history, token_ids, finishes, specials, generation_prompt=True)
    if parts is None:  # the template rewrites earlier turns: the rendered text, as prepare's text path reads it
        text = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        return tok(text, add_special_tokens=False)["input_ids"]
    return encode(tok, [parts])[0][0]
