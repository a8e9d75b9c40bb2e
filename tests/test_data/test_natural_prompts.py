"""make-prompts: a seeded set of real questions, split by whole topics, written as rows regenerate reads."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from dflash_ds.data.prompt_grid import TASKS, natural_prompts, split_prompts
from dflash_ds.data.regen_io import iter_rows


def test_split_is_seeded_by_topic_and_covers_every_task_type() -> None:
    rows = natural_prompts(0)
    assert len({r["id"] for r in rows}) == len(rows) == len({r["messages"][0]["content"] for r in rows})
    train, held = split_prompts(rows, seed=0, held_out=64)
    assert len(held) == 64 and len(train) + len(held) <= len(rows)
    # No held-out topic (a country, a sentence to rewrite, one math problem) is in training.
    assert not {(r["kind"], r["topic"]) for r in held} & {(r["kind"], r["topic"]) for r in train}
    kinds = Counter(r["kind"] for r in held)
    assert set(kinds) == set(TASKS) | {"math"} and min(kinds.values()) >= 3, kinds
    assert split_prompts(natural_prompts(0), seed=0, held_out=64) == (train, held)
    other = natural_prompts(1)
    assert {r["id"] for r in split_prompts(other, seed=1, held_out=64)[1]} != {r["id"] for r in held}
    # Only the math numbers and the split depend on the seed: the other prompts are the same set.
    ids = [({r["id"] for r in rs if r["kind"] != "math"}, {r["id"] for r in rs if r["kind"] == "math"})
           for rs in (rows, other)]
    assert ids[0][0] == ids[1][0] and ids[0][1] != ids[1][1]

def test_make_prompts_writes_rows_regenerate_reads(cli_here, tmp_path: Path) -> None:
    r = cli_here("make-prompts", "--out", tmp_path, "--seed", "3", "--held-out", "70", "--train", "100")
    assert r.returncode == 0, r.stderr
    assert "held_out.jsonl: 70 prompts (" in r.stdout and "train.jsonl: 100 prompts (" in r.stdout
    for name, n in (("train.jsonl", 100), ("held_out.jsonl", 70)):
        parsed = list(iter_rows(tmp_path / name, None))
        assert len(parsed) == n and all(isinstance(m, list) and m[0]["role"] == "user" for *_, m in parsed)
        assert [rid for _, _, rid, _ in parsed] == [json.loads(x)["id"] for x in (tmp_path / name).open()]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["held_out.jsonl", "train.jsonl"]
    bad = cli_here("make-prompts", "--out", tmp_path / "x", "--held-out", "100000")
    assert bad.returncode == 2 and bad.stderr.strip().startswith("dflash-ds make-prompts: error: --held-out 100000")
    assert not (tmp_path / "x").exists()
