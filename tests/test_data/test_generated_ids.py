"""Rows with token_ids: prepare trains on the ids the target generated, so every label is the target's greedy token.

The repo's tiny target never ends an answer within a few dozen tokens (its <|im_end|> logit is
one random row among 512), so the target here is the tiny target with that LM-head row scaled by
3: greedy answers then stop within 28 tokens, or are cut by max_new_tokens.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import datasets
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_ds.data import formats
from dflash_ds.data.prepare import prepare
from dflash_ds.data.regenerate import regenerate
from dflash_ds.errors import DFlashError
from dflash_ds.tiny.corpus import tiny_prompts

# At 28 new tokens the smallest top-1 / top-2 logit gap at a loss position is 1.4e-4 (at 24 it is
# 1e-5): far above the float rounding between batched, left-padded generate and one plain forward.
NEW = 28
EOT_SCALE = 3.0


@pytest.fixture(scope="module")
def target(tiny_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny target with its end-of-turn LM-head row scaled, so greedy answers both stop and get cut."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("stopping_target") / "target"
    shutil.copytree(tiny_target, out)
    eot = AutoTokenizer.from_pretrained(out).eos_token_id
    weights = load_file(out / "model.safetensors")
    weights["lm_head.weight"][eot] *= EOT_SCALE
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _prompts() -> list[dict]:
    # 30 single-turn prompts and 6 multi-turn ones (their old answers are replaced).
    rows = tiny_prompts(30)
    for i, row in enumerate(tiny_prompts(6, seed=1)):
        question = row["messages"][0]["content"]
        if i % 2:
            msgs = [{"role": "user", "content": question}, {"role": "assistant", "content": "old"},
                    {"role": "user", "content": "And why?"}]
        else:
            msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": question},
                    {"role": "assistant", "content": "old"}, {"role": "user", "content": "Tell me more."},
                    {"role": "assistant", "content": "old"}]
        rows.append({"id": f"multi{i}", "messages": msgs})
    return rows


@pytest.fixture(scope="module")
def regenerated(target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target's greedy answers to the prompts, with token_ids."""
    tmp = tmp_path_factory.mktemp("generated")
    data = tmp / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _prompts()))
    out = tmp / "regen.jsonl"
    regenerate(target, data, out, batch_size=8, max_new_tokens=NEW, rank=0, world=1)
    return out


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _expected(tok, row: dict) -> tuple[list[int], list[int]]:
    # The ChatML layout written out by hand: template text is input, the ids (+ <|im_end|> after 'stop') are loss.
    ids, mask, text = [], [], ""
    answers = iter(zip(row["token_ids"], row["finish_reasons"]))

    def flush() -> None:
        nonlocal text
        piece = tok(text, add_special_tokens=False)["input_ids"]
        ids.extend(piece)
        mask.extend([0] * len(piece))
        text = ""

    for k, m in enumerate(row["messages"]):
        if m["role"] != "assistant":
            text += f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
            continue
        text += "<|im_start|>assistant\n"
        flush()
        answer, finish = next(answers)
        ids.extend(answer + ([tok.eos_token_id] if finish == "stop" else []))
        mask.extend([1] * (len(answer) + (finish == "stop")))
        if finish == "stop":
            text += "\n"
        elif k < len(row["messages"]) - 1:
            text += "<|im_end|>\n"  # input for the turns after it, never a label
    flush()
    return ids, mask


def _greedy_share(model, ds) -> tuple[int, int]:
    # Loss positions t whose label input_ids[t] is the target's argmax at t - 1, over the prepared sequence.
    hits = total = 0
    for ids, mask in zip(ds["input_ids"], ds["loss_mask"]):
        with torch.no_grad():
            greedy = model(torch.tensor([ids])).logits[0].argmax(-1).tolist()
        for t in range(1, len(ids)):
            if mask[t]:
                total += 1
                hits += greedy[t - 1] == ids[t]
    return hits, total


def test_regenerated_rows_carry_the_generated_ids(target: Path, regenerated: Path) -> None:
    tok = AutoTokenizer.from_pretrained(target)
    rows = _rows(regenerated)
    assert len(rows) == 36
    finishes = [f for r in rows for f in r["finish_reasons"]]
    assert finishes.count("stop") >= 10 and finishes.count("length") >= 10
    retokenized_differently = 0
    for row in rows:
        answers = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        assert len(row["token_ids"]) == len(row["finish_reasons"]) == len(answers)
        for text, ids, finish in zip(answers, row["token_ids"], row["finish_reasons"]):
            assert tok.eos_token_id not in ids and (len(ids) == NEW) == (finish == "length")
            assert text == tok.decode(ids, skip_special_tokens=True)
            retokenized_differently += tok(text, add_special_tokens=False)["input_ids"] != ids
    # The round trip text -> ids changes some answers: what the text path trains on is not what was generated.
    assert retokenized_differently >= 2
    multi = [r for r in rows if len(r["finish_reasons"]) == 2]
    assert any(r["finish_reasons"][0] == "length" for r in multi)  # a cut answer followed by more turns
    # ... and one whose first answer does: its second turn was prompted with the ids, not the text.
    first = [(next(m["content"] for m in r["messages"] if m["role"] == "assistant"), r["token_ids"][0]) for r in multi]
    assert any(tok(text, add_special_tokens=False)["input_ids"] != ids for text, ids in first)


def test_every_label_is_the_targets_greedy_token(target: Path, regenerated: Path, tmp_path: Path) -> None:
    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    rows = _rows(regenerated)
    m = prepare(target, [regenerated], tmp_path / "ids", block_size=1)
    # A row is dropped only when it has fewer than 2 loss tokens (an empty answer that stopped at once).
    too_few = [i + 1 for i, r in enumerate(rows)
               if sum(map(len, r["token_ids"])) + r["finish_reasons"].count("stop") < 2]
    assert m["rows_dropped"] == ({formats.TOO_FEW_LOSS_TOKENS: len(too_few)} if too_few else {})
    assert m["rows_from_token_ids"] == m["rows_kept"] == len(rows) - len(too_few) and m["rows_ids_fallback"] == 0
    ds = datasets.load_from_disk(str(tmp_path / "ids"))
    kept = [r for i, r in enumerate(rows) if i + 1 not in too_few]
    for row, ids, mask in zip(kept, ds["input_ids"], ds["loss_mask"]):
        assert (ids, mask) == _expected(tok, row)
        # End-of-turn labels: one per 'stop' answer, none after a cut one.
        assert sum(mk and t == tok.eos_token_id for t, mk in zip(ids, mask)) == row["finish_reasons"].count("stop")
        if row["finish_reasons"][-1] == "length":
            assert ids[-NEW:] == row["token_ids"][-1] and mask[-1] == 1
    hits, total = _greedy_share(model, ds)
    assert hits == total > 500

    # The same rows without token_ids (the text path, as before): re-tokenized answers and an
    # end-of-turn label after every cut answer are not what the target produces.
    plain = _write(tmp_path / "plain.jsonl", [{k: v for k, v in r.items() if k != "token_ids"} for r in rows])
    m = prepare(target, [plain], tmp_path / "text", block_size=1)
    assert m["rows_from_token_ids"] == m["rows_ids_fallback"] == 0
    text_hits, text_total = _greedy_share(model, datasets.load_from_disk(str(tmp_path / "text")))
    print(f"target-greedy labels: token_ids {hits}/{total} = {hits / total:.1%}, "
          f"text path {text_hits}/{text_total} = {text_hits / text_total:.1%}")
    assert text_hits / text_total < 0.97


def test_template_that_rewrites_earlier_turns_falls_back_and_is_counted(target: Path, regenerated: Path,
                                                                         tmp_path: Path) -> None:
    # Like Qwen3: only the last assistant turn renders a <think> block, so a finished last answer is
    # not the generation prompt + its text; a cut last answer needs no rendering after it.
    qwen_like = tmp_path / "target"
    shutil.copytree(target, qwen_like)
    (qwen_like / "chat_template.jinja").write_text(
        "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
        "{%- if m.role == 'assistant' and loop.last %}<think>x</think>{% endif %}"
        "{{ m.content }}<|im_end|>\n{%- endfor %}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
    rows = [r for r in _rows(regenerated) if sum(map(len, r["token_ids"])) >= 2]
    data = _write(tmp_path / "rows.jsonl", rows)
    m = prepare(qwen_like, [data], tmp_path / "out", block_size=1)
    assert m["rows_kept"] == len(rows)
    assert m["rows_ids_fallback"] == sum(r["finish_reasons"][-1] == "stop" for r in rows) > 0
    assert m["rows_from_token_ids"] == sum(r["finish_reasons"][-1] == "length" for r in rows) > 0
    # The fallback still gives a cut answer no end-of-turn label.
    tok = AutoTokenizer.from_pretrained(qwen_like)
    ds = datasets.load_from_disk(str(tmp_path / "out"))
    for row, ids, mask in zip(rows, ds["input_ids"], ds["loss_mask"]):
        assert sum(mk and t == tok.eos_token_id for t, mk in zip(ids, mask)) == row["finish_reasons"].count("stop")


def _good(ids: list[int] | None = None, finish: str = "stop") -> dict:
    row = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The cat."}],
           "token_ids": [ids if ids is not None else [40, 41, 42]], "finish_reasons": [finish]}
    return row


BAD = [
    ({**_good(), "token_ids": [[40, 41], [42]]}, "2 token_ids lists for 1 assistant turns"),
    (_good([40, 10 ** 6]), "token_ids[0][1] = 1000000 is not a token id"),
    (_good([40, "41"]), "token_ids[0][1] = '41' is not a token id"),
    (_good([40, True]), "token_ids[0][1] = True is not a token id"),
    ({**_good(), "token_ids": "40 41"}, "token_ids must be a list of id lists"),
    (_good(finish="eos"), "finish_reasons must be 'stop' or 'length'"),
    ({k: v for k, v in _good().items() if k != "finish_reasons"}, "finish_reasons must be"),
]


def test_malformed_token_ids_are_dropped_with_file_and_line(target: Path, tmp_path: Path) -> None:
    rows: list = [_good()]
    for row, _ in BAD:
        rows += [row, _good([43, 44], "length")]
    data = _write(tmp_path / "bad.jsonl", rows)
    m = prepare(target, [data], tmp_path / "out", block_size=1)
    assert m["rows_dropped"] == {formats.BAD_TOKEN_IDS: len(BAD)}
    assert m["rows_kept"] == m["rows_from_token_ids"] == len(BAD) + 1
    dropped = [json.loads(line) for line in (tmp_path / "out" / "dropped.jsonl").read_text().splitlines()]
    assert [(d["file"], d["line"], d["reason"]) for d in dropped] == [
        (str(data), 2 + 2 * i, formats.BAD_TOKEN_IDS) for i in range(len(BAD))]
    for d, (_, detail) in zip(dropped, BAD):
        assert detail in d["detail"]
    with pytest.raises(DFlashError, match=r"bad\.jsonl:2: bad_token_ids: 2 token_ids lists"):
        prepare(target, [data], tmp_path / "strict", block_size=1, strict=True)
    # A null token_ids (a Parquet file mixing both kinds of row) is a plain text row.
    plain = _write(tmp_path / "null.jsonl", [{**_good(), "token_ids": None}])
    assert prepare(target, [plain], tmp_path / "null", block_size=1)["rows_from_token_ids"] == 0
