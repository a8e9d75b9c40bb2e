"""regenerate: greedy answers equal direct `generate`, resume skips done rows, torchrun shards merge in order."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_ds.data.prepare import prepare
from dflash_ds.data.regen_io import end_bar_at_done, progress_bar
from dflash_ds.data.regenerate import regenerate
from proc_utils import run_bounded

ROOT = Path(__file__).resolve().parents[2]
NEW = 12

ROWS = [
    {"id": "q1", "messages": [{"role": "user", "content": "What is the red ball?"},
                              {"role": "assistant", "content": "An old answer."}]},
    {"conversations": [{"from": "human", "value": "Tell me about the dog."}]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "old one"}, {"role": "user", "content": "More about the city"},
                  {"role": "assistant", "content": "old two"}]},
    {"id": "q4", "messages": [{"role": "user", "content": "Write a sentence about the sun."}]},
    "{not json",
    {"messages": [{"role": "user", "content": "Ignore this <|im_end|> marker"}]},
]


@pytest.fixture
def data(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in ROWS))
    return path


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _direct(model, tok, history: list[dict]) -> str:
    ids = tok.apply_chat_template(history, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(ids["input_ids"], max_new_tokens=NEW, do_sample=False)[0, ids["input_ids"].shape[1]:]
    out = out.tolist()
    out = out[: out.index(tok.eos_token_id)] if tok.eos_token_id in out else out
    return tok.decode(out, skip_special_tokens=True)


def test_greedy_matches_direct_generate(tiny_target: Path, data: Path, tmp_path: Path) -> None:
    out = tmp_path / "regen.jsonl"
    stats = regenerate(tiny_target, data, out, batch_size=3, max_new_tokens=NEW, rank=0, world=1)
    assert stats == {"rows": 6, "skipped_done": 0, "bad": 2, "written": 4}
    rows = _rows(out)
    assert [r["id"] for r in rows][0] == "q1" and rows[3]["id"] == "q4" and len({r["id"] for r in rows}) == 4
    tok = AutoTokenizer.from_pretrained(tiny_target)
    model = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    for row in rows:
        msgs = row["messages"]
        assert len(row["finish_reasons"]) == sum(m["role"] == "assistant" for m in msgs)
        for k, m in enumerate(msgs):
            if m["role"] == "assistant":  # each answer is the target's greedy answer to the regenerated history
                assert m["content"] == _direct(model, tok, msgs[:k])
    multi = rows[2]["messages"]
    assert [m["role"] for m in multi] == ["system", "user", "assistant", "user", "assistant"]
    assert multi[3]["content"] == "More about the city" and "old" not in multi[2]["content"] + multi[4]["content"]


def test_resume_skips_done_rows_and_repairs_torn_line(tiny_target: Path, data: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    """...and the progress bar (stderr, one line a redraw off a terminal) counts only the rows left to do."""
    full = tmp_path / "full.jsonl"
    regenerate(tiny_target, data, full, batch_size=2, max_new_tokens=NEW, rank=0, world=1)
    out = tmp_path / "resumed.jsonl"
    first = regenerate(tiny_target, data, out, batch_size=2, max_new_tokens=NEW, limit=2, rank=0, world=1)
    assert first["written"] == 2
    with open(out, "a") as f:
        f.write('{"id": "q4", "messages": [{"role"')  # a kill in the middle of a write
    capsys.readouterr()
    second = regenerate(tiny_target, data, out, batch_size=2, max_new_tokens=NEW, rank=0, world=1)
    assert second["skipped_done"] == 2 and second["written"] == 2
    bar = [line for line in capsys.readouterr().err.splitlines() if line.startswith("regenerate[rank 0]: ")]
    # Counted before the run: 2 good rows left + the row with a literal special token (skipped when reached).
    assert bar[0].startswith("regenerate[rank 0]: 0/3 rows   0%") and "ETA ?" in bar[0], bar
    assert bar[-1].startswith("regenerate[rank 0]: 2/2 rows 100%") and " rows/s" in bar[-1], bar
    assert "ETA 00:00" in bar[-1] and "tok/s" in bar[-1], bar
    assert out.read_text() == full.read_text()
    third = regenerate(tiny_target, data, out, batch_size=2, max_new_tokens=NEW, rank=0, world=1)
    assert third["written"] == 0 and third["skipped_done"] == 4
    assert "0 written, 4 already done" in capsys.readouterr().out
    with progress_bar(0, 0) as bar:  # nothing at all left to do: no bar (it drew "0/0 rows" twice), the summary
        end_bar_at_done(bar)
    assert capsys.readouterr().err == ""


def test_output_feeds_prepare(tiny_target: Path, data: Path, tmp_path: Path) -> None:
    out = tmp_path / "regen.jsonl"
    regenerate(tiny_target, data, out, batch_size=4, max_new_tokens=24, rank=0, world=1)
    manifest = prepare(tiny_target, [out], tmp_path / "prepared", block_size=4)
    assert manifest["rows_read"] == 4 and manifest["rows_kept"] + sum(manifest["rows_dropped"].values()) == 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_two_ranks_merge_equals_single(tiny_target: Path, data: Path, tmp_path: Path) -> None:
    single = tmp_path / "single.jsonl"
    regenerate(tiny_target, data, single, batch_size=2, max_new_tokens=NEW, rank=0, world=1)
    merged = tmp_path / "merged.jsonl"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           "-m", "dflash_ds", "regenerate", "--target", str(tiny_target), "--data", str(data), "--out", str(merged),
           "--batch-size", "2", "--max-new-tokens", str(NEW)]
    proc = run_bounded(cmd, 180, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _rows(merged) == _rows(single)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged.jsonl", "prompts.jsonl", "single.jsonl"]
