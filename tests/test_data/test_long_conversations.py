"""`dflash-ds long-conversations` (data/long_conversations.py): long rows the target writes itself, from a prompt pool
used once each, sized by the chat template's own count; regenerated (HF engine, the tiny target) and prepared, a
row is exactly its estimate less what its answers fell short of --answer-tokens."""

from __future__ import annotations

import json

from dflash_ds.cli import main
from dflash_ds.data.long_conversations import FOLLOW_UPS


def _conversations(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_long_conversations_use_each_prompt_once_and_fill_the_length(tiny_target, tmp_path):
    from dflash_ds.data.prompt_grid import natural_prompts, split_prompts, write_jsonl

    train, _ = split_prompts(natural_prompts(seed=0), seed=0)
    write_jsonl(train[:200], tmp_path / "pool.jsonl")
    args = ["long-conversations", "--prompts", str(tmp_path / "pool.jsonl"), "--target", str(tiny_target),
            "--length", "640", "--answer-tokens", "48", "--seed", "3"]
    assert main([*args, "--out", str(tmp_path / "a.jsonl")]) == 0
    rows = _conversations(tmp_path / "a.jsonl")
    stats = json.loads((tmp_path / "a.jsonl.stats.json").read_text())
    used = [s for r in rows for s in r["sources"]]
    assert len(used) == len(set(used)) == stats["prompts_used"] and set(used) <= {r["id"] for r in train[:200]}
    texts = {r["id"]: r["messages"][0]["content"] for r in train[:200]}
    for r in rows:
        roles = [m["role"] for m in r["messages"]]
        assert roles == ["user", "assistant"] * (r["turns"] - 1) + ["user"], roles
        users = [m["content"] for m in r["messages"] if m["role"] == "user"]
        assert all(m["content"] == "" for m in r["messages"] if m["role"] == "assistant")
        assert [u for u in users if u in texts.values()] == [texts[s] for s in r["sources"]]  # the pool's, in order
        follow = [u for u in users if u not in texts.values()]
        assert all(any(u == f.format(n=n) for f in FOLLOW_UPS for n in range(1, r["turns"])) for u in follow), follow
        assert r["turns"] >= 2 and r["estimated_tokens"] <= 640
    assert stats["conversations"] == len(rows) and stats["follow_ups"] == sum(r["turns"] for r in rows) - len(used)
    assert stats["follow_ups"] > 0 and stats["estimated_tokens_p10_p50_p90"][1] > 640 - 2 * 48  # filled, not short
    # the same seed writes the same file; another seed another one
    assert main([*args, "--out", str(tmp_path / "b.jsonl")]) == 0
    assert (tmp_path / "b.jsonl").read_text() == (tmp_path / "a.jsonl").read_text()
    assert main([*args[:-1], "4", "--out", str(tmp_path / "c.jsonl")]) == 0
    assert (tmp_path / "c.jsonl").read_text() != (tmp_path / "a.jsonl").read_text()

    # Answered by the target (every assistant turn in order, each given the conversation so far) and prepared:
    # a row's length is its estimate less its answers' shortfall (here each answer runs to --answer-tokens or ends
    # early on the tiny target's end-of-turn), to a token or two where the template's pieces merge.
    write_jsonl(rows[:3], tmp_path / "three.jsonl")
    assert main(["regenerate", "--target", str(tiny_target), "--data", str(tmp_path / "three.jsonl"), "--out",
                 str(tmp_path / "answers.jsonl"), "--max-new-tokens", "48", "--batch-size", "3"]) == 0
    assert main(["prepare", "--target", str(tiny_target), "--data", str(tmp_path / "answers.jsonl"), "--out",
                 str(tmp_path / "prep"), "--max-length", "640"]) == 0
    import datasets

    prepared = datasets.load_from_disk(str(tmp_path / "prep"))
    answered = _conversations(tmp_path / "answers.jsonl")
    assert len(prepared) == 3
    for src, ans, row in zip(rows[:3], answered, prepared):
        assert len(ans["token_ids"]) == src["turns"]  # every turn answered
        shortfall = sum(48 - len(ids) for ids in ans["token_ids"])
        assert 0 <= src["estimated_tokens"] - shortfall - len(row["input_ids"]) <= 2, (src, len(row["input_ids"]))
        assert sum(row["loss_mask"]) >= sum(len(ids) for ids in ans["token_ids"])  # each answer trained on


def test_bad_pool_rows_and_lengths_are_named(tiny_target, tmp_path, capsys):
    pool = tmp_path / "pool.jsonl"
    pool.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}]}) + "\n"
                    + json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})
                    + "\n")
    base = ["long-conversations", "--prompts", str(pool), "--target", str(tiny_target), "--out",
            str(tmp_path / "o.jsonl")]
    assert main(base) == 2
    assert f"{pool}:2: expected one user turn" in capsys.readouterr().err
    assert main([*base, "--length", "100", "--answer-tokens", "64"]) == 2
    assert "--length 100 must hold at least two answers" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()
