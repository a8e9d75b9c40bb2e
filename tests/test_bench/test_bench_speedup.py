"""bench speedup: its arithmetic against hand-computed figures, and its output check: a speculative output that
differs from plain decoding fails the bench (exit 2) after its table and JSON are written."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from dflash_ds.bench.speedup_stats import Round, format_table, mismatches, summarize, tau_needed
from dflash_ds.cli import main


def rounds_by_hand() -> list[Round]:
    out = [[7] * 25 for _ in range(4)]  # 4 prompts x 25 tokens = 100 tokens a round
    return [
        # a warm-up pair at absurd times: checked, never counted
        Round("vllm", "plain", 1, -1, 100.0, out, [25.0] * 4, steps=96, decode_seconds=99.0),
        Round("vllm", "spec", 1, -1, 0.01, out, [0.0025] * 4, steps=1, decode_seconds=0.01, accepted=90),
        # repeat 0: plain 10 tok/s (a step 0.1 s), spec 20 tok/s (40 steps of 0.125 s yielding 1 + 60/40 = 2.5)
        Round("vllm", "plain", 1, 0, 10.0, out, [2.5] * 4, steps=96, decode_seconds=9.6),
        Round("vllm", "spec", 1, 0, 5.0, out, [1.25] * 4, steps=40, decode_seconds=5.0, accepted=60),
        # repeat 1: plain 12.5 tok/s, spec 20 tok/s
        Round("vllm", "plain", 1, 1, 8.0, out, [2.0] * 4, steps=96, decode_seconds=9.6),
        Round("vllm", "spec", 1, 1, 5.0, out, [1.25] * 4, steps=40, decode_seconds=5.0, accepted=60),
    ]


def test_speedup_spread_tau_and_the_step_model_by_hand():
    [row] = summarize(rounds_by_hand())
    assert row["repeats"] == 2 and row["tokens_per_round"] == 100
    assert row["plain_tok_s"]["mean"] == pytest.approx(11.25)
    assert (row["plain_tok_s"]["min"], row["plain_tok_s"]["max"]) == (10.0, 12.5)
    # per repeat: 20 / 10 = 2.0 and 20 / 12.5 = 1.6; sample std sqrt(2 * 0.2^2 / 1)
    assert row["speedup"]["mean"] == pytest.approx(1.8)
    assert (row["speedup"]["min"], row["speedup"]["max"]) == (pytest.approx(1.6), pytest.approx(2.0))
    assert row["speedup"]["std"] == pytest.approx(math.sqrt(0.08))
    assert row["plain_ms_per_token"]["mean"] == pytest.approx((100.0 + 80.0) / 2)  # 2.5 s / 25 tokens, 2.0 / 25
    assert row["spec_ms_per_token"]["mean"] == pytest.approx(50.0)
    assert row["tau"] == pytest.approx(2.5)  # 1 + 120 accepted / 80 steps
    assert row["plain_step_ms"] == pytest.approx(100.0) and row["spec_step_ms"] == pytest.approx(125.0)
    assert row["step_ratio"] == pytest.approx(1.25)
    assert row["predicted_speedup"] == pytest.approx(2.0)  # 2.5 / 1.25
    assert row["tau_for_1.5x"] == pytest.approx(1.875) == tau_needed(1.5, 1.25)
    assert "step_split" not in row  # vLLM times no forward on its own
    table = format_table([row])
    assert "1.80 (1.60-2.00)" in table and "tau needed for 1.5x 1.88, to break even 1.25" in table


def test_step_split_of_our_decoder_by_hand():
    out = [[1] * 10]
    plain = Round("dflash", "plain", 1, 0, 1.0, out, [1.0], steps=9, decode_seconds=0.9, one_token_s=[0.08] * 9)
    spec = Round("dflash", "spec", 1, 0, 0.5, out, [0.5], steps=3, decode_seconds=0.45, accepted=6,
                 verify_s=[0.1, 0.1, 0.5], draft_s=[0.02, 0.04, 0.03])  # medians 0.1 and 0.03
    [row] = summarize([plain, spec])
    s = row["step_split"]
    assert s["one_token_forward_ms"] == pytest.approx(80.0)
    assert s["verify_over_one"] == pytest.approx(1.25) and s["draft_over_one"] == pytest.approx(0.375)
    assert s["bookkeeping_over_one"] == pytest.approx((0.15 - 0.1 - 0.03) / 0.08)  # a step 0.45 / 3 = 0.15 s
    assert s["plain_bookkeeping_over_one"] == pytest.approx((0.1 - 0.08) / 0.08)
    assert row["forward_predicted_speedup"] == pytest.approx(3.0 / ((0.1 + 0.03) / 0.08))
    assert row["predicted_speedup"] == pytest.approx(3.0 / 1.5)  # tau 3, step 0.15 s over 0.1 s


def test_mismatches_name_the_round_prompt_and_token():
    rounds = rounds_by_hand()
    assert mismatches(rounds) == []
    rounds[3].outputs = [list(o) for o in rounds[3].outputs]
    rounds[3].outputs[2][11] = 8  # repeat 0's speculative output of prompt 2
    rounds[4].outputs = rounds[4].outputs[:3] + [rounds[4].outputs[3][:20]]  # a plain round that moved (shorter)
    assert mismatches(rounds) == [
        {"engine": "vllm", "concurrency": 1, "repeat": 0, "mode": "spec", "drafts": None, "prompt": 2, "token": 11,
         "got": [8], "plain": [7]},
        {"engine": "vllm", "concurrency": 1, "repeat": 1, "mode": "plain", "drafts": None, "prompt": 3, "token": 20,
         "got": [], "plain": [7]},
        {"engine": "vllm", "concurrency": 1, "repeat": 1, "mode": "spec", "drafts": None, "prompt": 3, "token": 20,
         "got": [7], "plain": []}]  # checked against its own repeat's plain round, which moved


@pytest.fixture(scope="module")
def small_pair(tiny_target: Path, tmp_path_factory) -> tuple[Path, Path, Path]:
    from dflash_ds.tiny.corpus import tiny_prompts
    from dflash_ds.tools.init_drafter import init_drafter

    root = tmp_path_factory.mktemp("speedup")
    init_drafter(tiny_target, root / "drafter", num_layers=1, block_size=4, seed=0)
    data = root / "held_out.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in tiny_prompts(3, seed=11)))
    return tiny_target, root / "drafter", data


def test_a_changed_output_fails_the_bench_after_its_report(small_pair, tmp_path, monkeypatch, capsys):
    """A verifier that lets one wrong token through (prompt 1's third decode step) changes an output: the bench
    writes its figures, names the prompt and token, and exits 2."""
    from dflash_ds.eval import speculative

    target, drafter, data = small_pair
    real, calls = speculative._verify_chain, {"n": 0}

    def corrupting(tgt, anchor, draft_logits, start, *args):
        accepted, bonus, feats = real(tgt, anchor, draft_logits, start, *args)
        calls["n"] += 1
        return accepted, (bonus + 1 if calls["n"] == 3 else bonus), feats

    monkeypatch.setattr(speculative, "_verify_chain", corrupting)
    out = tmp_path / "bench"
    assert main(["bench", "speedup", "--engine", "dflash", "--target", str(target), "--drafter", str(drafter),
                 "--data", str(data), "--num-prompts", "3", "--max-new-tokens", "12", "--repeats", "1",
                 "--warmup", "0", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    result = json.loads((out / "speedup.json").read_text())
    [bad] = result["mismatches"]  # the warm-up-free run: one speculative round, its first prompt, 3rd step
    assert (bad["engine"], bad["mode"], bad["prompt"]) == ("dflash", "spec", 0)
    assert f"prompt 0 differs from plain decoding at generated token {bad['token']}" in err
    assert (out / "speedup.txt").is_file() and (out / "speedup.png").read_bytes()[:4] == b"\x89PNG"
    monkeypatch.setattr(speculative, "_verify_chain", real)  # the same bench with the real verifier passes
    assert main(["bench", "speedup", "--engine", "dflash", "--target", str(target), "--drafter", str(drafter),
                 "--data", str(data), "--num-prompts", "3", "--max-new-tokens", "12", "--repeats", "1",
                 "--warmup", "0", "--out", str(tmp_path / "clean")]) == 0
    clean = json.loads((tmp_path / "clean" / "speedup.json").read_text())
    assert clean["mismatches"] == [] and [r["engine"] for r in clean["rows"]] == ["dflash"]


def test_bad_flags_are_one_clear_error(small_pair, capsys):
    target, drafter, data = small_pair
    base = ["bench", "speedup", "--target", str(target), "--drafter", str(drafter), "--data", str(data)]
    assert main(base + ["--concurrency", "1,x"]) == 2
    assert "--concurrency '1,x': expected comma-separated integers" in capsys.readouterr().err
    assert main(base + ["--engine", "vllm", "--concurrency", "1,4"]) == 2  # 3 prompts: 4 never in flight
    assert "--concurrency 4: a round has 3 prompts" in capsys.readouterr().err
    assert main(base + ["--engine", "sglang"]) == 2
    assert "--engine 'sglang': expected auto or a comma-separated subset of vllm, dflash" in capsys.readouterr().err
    vllm = base + ["--engine", "vllm", "--draft-tokens"]
    assert main(vllm + ["2,4"]) == 2  # the export's block is 4: it drafts 1..3
    assert "num_speculative_tokens 4:" in capsys.readouterr().err
    assert main(vllm + ["2,x"]) == 2
    assert "--draft-tokens '2,x': expected comma-separated integers" in capsys.readouterr().err
    assert main(vllm + ["2", '--vllm-arg=--speculative-config={"num_speculative_tokens": 3}']) == 2
    assert "--draft-tokens and a --vllm-arg --speculative-config with num_speculative_tokens" in \
        capsys.readouterr().err


def test_each_draft_length_pairs_with_the_same_plain_round():
    """--draft-tokens 3,7: one row per draft length, each against the one plain server's rounds of its repeat, a
    mismatch found in either; the table says k."""
    out = [[7] * 25 for _ in range(4)]
    rounds = []
    for rep in (0, 1):
        rounds += [Round("vllm", "plain", 1, rep, 10.0, out, [2.5] * 4, steps=96, decode_seconds=9.6),
                   # k 3: 50 steps of 0.12 s yielding 2.0; k 7: 40 steps of 0.2 s yielding 2.5
                   Round("vllm", "spec", 1, rep, 6.0, out, [1.5] * 4, steps=50, decode_seconds=6.0, accepted=50,
                         drafts=3),
                   Round("vllm", "spec", 1, rep, 8.0, out, [2.0] * 4, steps=40, decode_seconds=8.0, accepted=60,
                         drafts=7)]
    k3, k7 = summarize(rounds)
    assert (k3["draft_tokens"], k7["draft_tokens"]) == (3, 7)
    assert k3["speedup"]["mean"] == pytest.approx(10.0 / 6.0) and k7["speedup"]["mean"] == pytest.approx(1.25)
    assert k3["plain_tok_s"] == k7["plain_tok_s"] and k3["plain_step_ms"] == pytest.approx(100.0)
    assert (k3["tau"], k3["step_ratio"]) == (pytest.approx(2.0), pytest.approx(1.2))
    assert (k7["tau"], k7["step_ratio"]) == (pytest.approx(2.5), pytest.approx(2.0))
    table = format_table([k3, k7])
    assert "vllm at 1, k 3: plain step 100.0 ms, speculative step 120.0 ms" in table
    assert "vllm at 1, k 7: plain step 100.0 ms, speculative step 200.0 ms" in table
    rounds[5].outputs = [list(o) for o in out]
    rounds[5].outputs[1][3] = 9  # repeat 1's k-7 output of prompt 1
    [bad] = mismatches(rounds)
    assert (bad["repeat"], bad["drafts"], bad["prompt"], bad["token"]) == (1, 7, 1, 3)


def test_servers_share_a_gpu_unless_told():
    """On a GPU the plain and speculative servers split 0.9 of its memory (two at vLLM's own 0.92 cannot both
    start); a given fraction is kept, and a CPU keeps VLLMServer's own share of RAM."""
    from dflash_ds.bench.speedup import server_memory_fraction

    assert server_memory_fraction(None, 2, cpu=False) == 0.45 and server_memory_fraction(None, 3, cpu=False) == 0.3
    assert server_memory_fraction(0.2, 3, cpu=False) == 0.2
    assert server_memory_fraction(None, 3, cpu=True) is None and server_memory_fraction(0.3, 2, cpu=True) == 0.3
