"""prepare: exact ids and loss masks through the tiny target's template, and row accounting."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
from transformers import AutoTokenizer

from dflash_ds.data import formats
from dflash_ds.data.prepare import assistant_spans, prepare
from dflash_ds.errors import DFlashError

ANSWER = ("The cat sees the red ball every day, and the dog runs to the river in the morning. "
          "A small bird opens the window slowly.")
LONG_ANSWER = " ".join([ANSWER] * 8)


def _conv(answer: str = ANSWER, question: str = "Tell me about the cat.") -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _expected(tok, pieces: list[tuple[str, int]]) -> tuple[list[int], list[int]]:
    # Tokenize the literal ChatML text piece by piece: independent of the chat template code path.
    ids, mask = [], []
    for text, on in pieces:
        piece = tok(text, add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [on] * len(piece)
    return ids, mask


def test_exact_ids_and_mask_sharegpt_and_openai(tiny_target: Path, tmp_path: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_target)
    sharegpt = {"conversations": [{"from": "system", "value": "Be brief."},
                                  {"from": "human", "value": "What does the cat see?"},
                                  {"from": "gpt", "value": ANSWER}]}
    openai = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, friend."},
                           {"role": "user", "content": "More please"},
                           {"role": "assistant", "content": ANSWER}]}
    data = _write_jsonl(tmp_path / "two.jsonl", [sharegpt, openai])
    manifest = prepare(tiny_target, [data], tmp_path / "out", block_size=4)
    assert manifest["rows_read"] == manifest["rows_kept"] == 2
    ds = datasets.load_from_disk(str(tmp_path / "out"))

    ids, mask = _expected(tok, [
        ("<|im_start|>system\n", 0), ("Be brief.", 0), ("<|im_end|>\n", 0),
        ("<|im_start|>user\n", 0), ("What does the cat see?", 0), ("<|im_end|>\n", 0),
        ("<|im_start|>assistant\n", 0), (ANSWER, 1), ("<|im_end|>", 1), ("\n", 0)])
    assert ds[0]["input_ids"] == ids and ds[0]["loss_mask"] == mask and ds[0]["length"] == len(ids)

    ids, mask = _expected(tok, [
        ("<|im_start|>user\n", 0), ("Hi", 0), ("<|im_end|>\n", 0),
        ("<|im_start|>assistant\n", 0), ("Hello, friend.", 1), ("<|im_end|>", 1), ("\n", 0),
        ("<|im_start|>user\n", 0), ("More please", 0), ("<|im_end|>\n", 0),
        ("<|im_start|>assistant\n", 0), (ANSWER, 1), ("<|im_end|>", 1), ("\n", 0)])
    assert ds[1]["input_ids"] == ids and ds[1]["loss_mask"] == mask
    assert manifest["tokens"] == sum(ds["length"]) and manifest["loss_tokens"] == sum(map(sum, ds["loss_mask"]))


def test_non_prefix_stable_template_falls_back_to_search(tiny_target: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_target)
    # Like Qwen3: only the last assistant turn keeps its <think> block, so prefixes differ.
    tok.chat_template = (
        "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
        "{%- if m.role == 'assistant' and loop.last %}<think>x</think>{% endif %}"
        "{{ m.content }}<|im_end|>\n{%- endfor %}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
    msgs = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A one."},
            {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A two."}]
    text, spans = assistant_spans(tok, msgs)
    assert [text[s:e] for s, e in spans] == ["A one.<|im_end|>", "<think>x</think>A two.<|im_end|>"]
    # Same answer twice: turn 1's own rendering also occurs inside turn 3; the spans must not swap.
    msgs[3]["content"] = "A one."
    text, spans = assistant_spans(tok, msgs)
    assert [text[s:e] for s, e in spans] == ["A one.<|im_end|>", "<think>x</think>A one.<|im_end|>"]
    assert spans[0][1] < text.index("Q2")
    tok.chat_template = "{{ raise_exception('no system role') }}"
    with pytest.raises(formats.RowError) as err:
        assistant_spans(tok, msgs)
    assert err.value.reason == formats.TEMPLATE_ERROR and "no system role" in err.value.detail


BAD_ROWS = [
    ('{"messages": [', formats.MALFORMED_JSON),
    ({"prompt": "x"}, formats.MISSING_FIELD),
    ({"messages": [{"role": "user"}]}, formats.MISSING_FIELD),
    ({"conversations": [{"from": "wizard", "value": "x"}]}, formats.UNKNOWN_ROLE),
    ({"messages": []}, formats.EMPTY_CONVERSATION),
    ({"messages": [{"role": "user", "content": "Only a question?"}]}, formats.NO_ASSISTANT_TURN),
    (_conv(ANSWER, "Say <|im_end|> twice"), formats.SPECIAL_TOKEN_IN_CONTENT),
    (_conv("Yes."), formats.TOO_FEW_LOSS_TOKENS),
    (_conv(LONG_ANSWER), formats.OVERLONG),
]


def test_accounting_every_reason_with_its_line(tiny_target: Path, tmp_path: Path) -> None:
    rows: list = [_conv()]
    for row, _ in BAD_ROWS:
        rows += [row, _conv()]
    data = _write_jsonl(tmp_path / "mixed.jsonl", rows)
    manifest = prepare(tiny_target, [data], tmp_path / "out", max_length=128, overlong="drop", num_proc=2)
    expected = {}
    for _, reason in BAD_ROWS:
        expected[reason] = expected.get(reason, 0) + 1
    assert manifest["rows_dropped"] == expected
    assert manifest["rows_read"] == len(rows) == manifest["rows_kept"] + sum(manifest["rows_dropped"].values())
    assert manifest["rows_kept"] == len(BAD_ROWS) + 1
    dropped = [json.loads(line) for line in (tmp_path / "out" / "dropped.jsonl").read_text().splitlines()]
    # Bad row i sits on line 2 + 2i of the file.
    assert [(d["line"], d["reason"]) for d in dropped] == [(2 + 2 * i, r) for i, (_, r) in enumerate(BAD_ROWS)]
    assert all(d["file"] == str(data) for d in dropped)
    assert sum(b["count"] for b in manifest["length_histogram"]) == manifest["rows_kept"]
    assert len(datasets.load_from_disk(str(tmp_path / "out"))) == manifest["rows_kept"]


def test_strict_names_file_and_line(tiny_target: Path, tmp_path: Path) -> None:
    data = _write_jsonl(tmp_path / "bad.jsonl", [_conv(), "", _conv(), '{"messages": 3}'])
    with pytest.raises(DFlashError, match=r"bad\.jsonl:4: missing_field"):
        prepare(tiny_target, [data], tmp_path / "out", strict=True)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["bad.jsonl"]  # no temp folders left behind


def test_all_rows_dropped_is_an_error(tiny_target: Path, tmp_path: Path) -> None:
    data = _write_jsonl(tmp_path / "none.jsonl", [{"messages": []}, _conv("No.")])
    with pytest.raises(DFlashError, match=r"no rows kept from .*none\.jsonl.*empty_conversation=1"):
        prepare(tiny_target, [data], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_parquet_and_json_match_jsonl(tiny_target: Path, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [_conv(), _conv(ANSWER + " Again.", "Why?"), _conv(ANSWER, "And the dog?")]
    _write_jsonl(tmp_path / "c.jsonl", rows)
    (tmp_path / "c.json").write_text(json.dumps(rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet")
    results = {}
    for name in ("c.jsonl", "c.json", "c.parquet"):
        prepare(tiny_target, [tmp_path / name], tmp_path / f"out_{name}")
        results[name] = datasets.load_from_disk(str(tmp_path / f"out_{name}")).to_dict()
    assert results["c.jsonl"] == results["c.json"] == results["c.parquet"]
    assert len(results["c.jsonl"]["input_ids"]) == 3


def test_overlong_truncate_vs_drop(tiny_target: Path, tmp_path: Path) -> None:
    data = _write_jsonl(tmp_path / "long.jsonl", [_conv(LONG_ANSWER), _conv()])
    m = prepare(tiny_target, [data], tmp_path / "trunc", max_length=96, overlong="truncate")
    ds = datasets.load_from_disk(str(tmp_path / "trunc"))
    assert m["rows_kept"] == 2 and m["rows_truncated"] == 1 and ds[0]["length"] == 96
    full = prepare(tiny_target, [data], tmp_path / "full", max_length=4096)
    assert full["rows_truncated"] == 0 and full["rows_kept"] == 2
    assert datasets.load_from_disk(str(tmp_path / "full"))[0]["input_ids"][:96] == ds[0]["input_ids"]
    m = prepare(tiny_target, [data], tmp_path / "drop", max_length=96, overlong="drop")
    assert m["rows_kept"] == 1 and m["rows_dropped"] == {formats.OVERLONG: 1}
    with pytest.raises(DFlashError, match="already exists"):
        prepare(tiny_target, [data], tmp_path / "drop")
