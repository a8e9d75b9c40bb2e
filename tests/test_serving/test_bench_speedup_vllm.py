"""bench speedup through vLLM and our decoder on the served test drafter: the counters each round reads are the
decode steps and tokens themselves (plain: one step per token after the first; speculative: vLLM's drafts equal our
decoder's steps), vLLM's tau equals our decoder's, every speculative output equals plain decoding, and the table's
speedups are the rounds' tokens/s ratios; a second draft length (--draft-tokens 3,7) is a third server, its own row
against the same plain rounds."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from dflash_ds.cli import main


def test_speedup_through_vllm_and_our_decoder(vllm_python, eos_target, served_drafter, tmp_path, capsys):
    from dflash_ds.tiny.corpus import tiny_prompts

    data = tmp_path / "held_out.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in tiny_prompts(6, seed=11)))
    out = tmp_path / "speedup"
    assert main(["bench", "speedup", "--target", str(eos_target), "--drafter", str(served_drafter), "--data",
                 str(data), "--num-prompts", "6", "--max-new-tokens", "48", "--concurrency", "1,3", "--repeats", "2",
                 "--warmup", "0", "--draft-tokens", "3,7", "--out", str(out)]) == 0
    r = json.loads((out / "speedup.json").read_text())
    assert r["settings"]["engines"] == ["vllm", "dflash"]  # auto: vLLM serves a full-attention DFlash export here
    assert r["mismatches"] == []
    assert [c["num_speculative_tokens"] for c in r["settings"]["speculative_configs"]] == [3, 7]
    short = {x["concurrency"]: x for x in r["rows"] if x["draft_tokens"] == 3}
    rows = {(x["engine"], x["concurrency"]): x for x in r["rows"] if x["draft_tokens"] == 7}
    assert sorted(rows) == [("dflash", 1), ("vllm", 1), ("vllm", 3)] and sorted(short) == [1, 3]
    rounds = r["rounds"]
    assert len(rounds) == 3 * 2 * 2 + 2 * 2  # vLLM: 3 servers x 2 rounds x 2 concurrencies; ours: 2 x 2 at 1
    for conc, row in short.items():  # 3 drafts a step: at most 4 tokens a step, so more steps than at 7
        assert 1.0 <= row["tau"] <= 4.0 and row["plain_tok_s"] == rows["vllm", conc]["plain_tok_s"], row
    k3 = [x for x in rounds if x["drafts"] == 3]
    assert k3 and all(x["steps"] >= x_7["steps"] for x in k3 for x_7 in rounds if x_7["drafts"] == 7
                      and x_7["engine"] == "vllm")
    rounds = [x for x in rounds if x["drafts"] != 3]
    by_tokens = {x["engine"]: x for x in r["rows"]}
    assert rows["vllm", 1]["tokens_per_round"] == rows["vllm", 3]["tokens_per_round"] == \
        by_tokens["dflash"]["tokens_per_round"]
    n_tokens = rows["vllm", 1]["tokens_per_round"]
    for x in rounds:
        if x["mode"] == "plain":  # one step per token after each request's first (prefill)
            assert x["steps"] == n_tokens - 6, x
        assert x["decode_seconds"] > 0 and len(x["request_seconds"]) == 6
    spec_steps = {(x["engine"], x["concurrency"]) for x in rounds if x["mode"] == "spec"}
    assert spec_steps == set(rows)
    ours = [x for x in rounds if x["engine"] == "dflash" and x["mode"] == "spec"]
    served = [x for x in rounds if x["engine"] == "vllm" and x["mode"] == "spec"]
    # vLLM drafts once per speculative step: its step count and acceptance are our decoder's (within 1%)
    assert all(x["steps"] == ours[0]["steps"] for x in ours)
    for x in served:
        assert abs(x["steps"] - ours[0]["steps"]) <= 0.01 * ours[0]["steps"], x
    assert rows["vllm", 1]["tau"] == pytest.approx(rows["dflash", 1]["tau"], rel=0.01)
    assert rows["dflash", 1]["tau"] > 1.05  # the trained drafter gets drafts accepted
    for (engine, conc), row in rows.items():
        timed = [x for x in rounds if x["engine"] == engine and x["concurrency"] == conc and x["repeat"] >= 0]
        plain = {x["repeat"]: n_tokens / x["seconds"] for x in timed if x["mode"] == "plain"}
        spec = {x["repeat"]: n_tokens / x["seconds"] for x in timed if x["mode"] == "spec"}
        assert row["speedup"]["mean"] == pytest.approx(statistics.mean(spec[i] / plain[i] for i in (0, 1)))
        assert row["predicted_speedup"] == pytest.approx(row["tau"] / row["step_ratio"])
    split = rows["dflash", 1]["step_split"]  # our decoder times its forwards; vLLM's rows have no split
    assert split["verify_over_one"] > 0 and split["draft_over_one"] > 0
    assert "step_split" not in rows["vllm", 1]
    table = capsys.readouterr().out
    assert table.count("tau needed for 1.5x") == 5 and (out / "speedup.txt").read_text() in table
    assert (out / "speedup.png").read_bytes()[:4] == b"\x89PNG"
    logs = {"vllm_plain.log", "vllm_spec_k3.log", "vllm_spec_k7.log"}
    assert {p.name for p in (out / "vllm").iterdir()} == logs
    for k in (3, 7):
        log = (out / "vllm" / f"vllm_spec_k{k}.log").read_text()
        assert "speculative_config=SpeculativeConfig(method='dflash'" in log and f"num_spec_tokens={k}" in log
    assert "speculative_config=None" in (out / "vllm" / "vllm_plain.log").read_text()
    for log in logs:  # both servers with Intel OpenMP preloaded (cpu_preload)
        assert "without Intel OpenMP in LD_PRELOAD" not in (out / "vllm" / log).read_text()
        assert "libiomp is not found in LD_PRELOAD" not in (out / "vllm" / log).read_text()
