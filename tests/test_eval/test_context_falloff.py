"""`bench context-falloff` (issue 56, point 4): its conversations, the chunked prefill it relies on, its refusal of a
target that does not hold at length, and a whole run at a small size."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

# The quality target fixture trains a target (about 50 s idle; a loaded 2-core machine needs more than 300 s).
pytestmark = pytest.mark.timeout(900)


def test_dialogue_is_the_templates_tokens_with_each_answers_span():
    from dflash_ds.tiny.quality import dialogue
    from dflash_ds.tiny.tokenizer import build_tokenizer

    tok = build_tokenizer(512)
    messages, ids, spans = dialogue(random.Random(3), tok, 600)
    full = tok(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]
    assert ids == full and len(ids) <= 600 and len(spans) == len(messages) // 2 >= 8
    end = tok.convert_tokens_to_ids("<|im_end|>")
    for (a, b), answer in zip(spans, messages[1::2]):
        assert ids[b - 2] == end and tok.decode(ids[b - 1:b]) == "\n" and tok.decode(ids[a: b - 2]) == answer["content"]
    # the exchange that did not fit would have crossed 600
    assert len(ids) + 30 > 600


@pytest.mark.parametrize("window", [None, 16])
def test_chunked_prefill_equals_one_forward(monkeypatch, window):
    """`TargetSession.prefill` over chunks of 32 positions gives the one-forward logits and features, full attention
    and a 16-position sliding window alike (a chunk at the wrong positions, or a window that forgets the previous
    chunk, moves them by far more than the tolerance)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash_ds.eval import speculative
    from dflash_ds.eval.speculative import TargetSession

    extra = {"sliding_window": window, "use_sliding_window": True, "max_window_layers": 0} if window else {}
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, **extra)).eval()
    ids = torch.randint(0, 64, (150,)).tolist()
    with TargetSession(model, [0, 1]) as one:
        logits, feats = one.forward(ids, torch.arange(150))
    monkeypatch.setattr(speculative, "PREFILL_CHUNK", 32)
    with TargetSession(model, [0, 1]) as tgt:
        last, chunked = tgt.prefill(ids)
        assert tgt.length == 150
    torch.testing.assert_close(chunked, feats, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(last[-1], logits[-1], atol=1e-5, rtol=1e-5)


def test_falloff_refuses_a_target_that_fails_at_length(quality_target, cli_here, tmp_path):
    """The default quality target (full attention, one exchange a row) answers a dialogue's later turns wrong: the
    bench names it and stops before training anything."""
    r = cli_here("bench", "context-falloff", "--out", tmp_path / "out", "--target", quality_target,
                 "--length", "1024", "--short", "512")
    assert r.returncode == 2, r.stdout + r.stderr
    assert str(quality_target) in r.stderr and "--min-accuracy 0.99" in r.stderr and "sliding window" in r.stderr
    assert not (tmp_path / "out" / "result.json").exists()


def test_falloff_runs_at_a_small_size(tiny_target, cli_here, tmp_path):
    """The base and its two continuations, two seeds, every bucket up to --length, served equal to greedy decoding
    (the bench raises otherwise): the tiny random target with a sliding window (its accuracy waived: the run's
    plumbing is tested; the figures are docs/QUALITY.md's)."""
    target = tmp_path / "target"
    shutil.copytree(tiny_target, target)
    cfg = json.loads((target / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    cfg.update(sliding_window=32, use_sliding_window=True, max_window_layers=0, layer_types=["sliding_attention"] * n)
    (target / "config.json").write_text(json.dumps(cfg))
    r = cli_here("bench", "context-falloff", "--out", tmp_path / "out", "--target", target, "--length", "1024",
                 "--short", "512", "--rows", "1", "--steps", "2", "--long-steps", "2", "--anchors", "8", "--seeds", "0,1",
                 "--per-bucket", "1", "--max-new-tokens", "12", "--min-accuracy", "0")
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert set(result["runs"]) == {f"{name}/seed{s}" for name in ("base", "short", "long") for s in (0, 1)}
    for run in result["runs"].values():
        assert list(run["tau_by_context"]) == ["<512", "512-1K"] and run["tau"] >= 1
    table = (tmp_path / "out" / "table.md").read_text().splitlines()
    assert [line.split("|")[1].strip() for line in table[2:]] == ["<512", "512-1K", "all"]


def test_held_out_cuts_fill_each_bucket_at_an_answers_start():
    """A real target's held-out prompts: per bucket, a conversation cut where an answer's labels start, the prompt
    and the decode within the bucket, each bucket's prompts from different conversations; a bucket no conversation
    can fill is named."""
    from dflash_ds.bench.context_falloff_data import cut_prompts
    from dflash_ds.errors import DFlashError

    def row(turn: int, offset: int) -> tuple[list[int], list[int]]:  # turns of `turn` tokens: 10 prompt, rest answer
        mask = ([0] * 10 + [1] * (turn - 10)) * (2000 // turn)
        return list(range(offset, offset + len(mask))), mask

    rows = [row(100, 0), row(130, 10_000), row(170, 20_000)]
    prompts = cut_prompts(rows, 2048, 32, 2, "held")
    assert len(prompts) == 6
    for k, (lo, hi) in enumerate([(0, 512), (0, 512), (512, 1024), (512, 1024), (1024, 2048), (1024, 2048)]):
        p = prompts[k]
        ids, mask = next(r for r in rows if r[0][0] == p[0])
        assert lo <= len(p) and len(p) + 32 <= hi and mask[len(p)] == 1 and mask[len(p) - 1] == 0
        assert ids[: len(p)] == p
    assert all(prompts[2 * k][0] != prompts[2 * k + 1][0] for k in range(3))  # two conversations a bucket
    mask = rows[prompts[4][0] // 10_000][1]  # the longest cut that fits, not merely one that does
    assert len(prompts[4]) == max(i for i in range(1, len(mask)) if mask[i] and not mask[i - 1] and i + 32 <= 2048)
    with pytest.raises(DFlashError, match="bucket 1K-2K"):
        cut_prompts([(r[0][:1030], r[1][:1030]) for r in rows], 2048, 32, 1, "held")


def test_falloff_runs_on_prepared_data(tiny_target, cli_here, tmp_path):
    """The real-target route at a small size: prepared short rows, long conversations and held-out conversations
    (text of our own, not the target's: the accuracy check waived), the base and both continuations served equal to
    greedy decoding on prompts cut from the held-out rows."""
    from dflash_ds.data.prepare import prepare

    words = "the cat sees the red ball today and the dog runs far away".split()

    def conversation(seed: int, turns: int) -> dict:
        rng = random.Random(seed)
        messages = []
        for _ in range(turns):
            messages += [{"role": "user", "content": " ".join(rng.choices(words, k=8)) + "?"},
                         {"role": "assistant", "content": " ".join(rng.choices(words, k=40)) + "."}]
        return {"messages": messages}

    folders = {}
    for name, rows in (("short", [conversation(s, 1) for s in range(12)]), ("long", [conversation(100 + s, 14)
                                                                                  for s in range(2)]),
                       ("held", [conversation(200 + s, 14) for s in range(2)])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        prepare(tiny_target, [tmp_path / f"{name}.jsonl"], tmp_path / name, max_length=1024, block_size=4)
        folders[name] = tmp_path / name
    r = cli_here("bench", "context-falloff", "--out", tmp_path / "out", "--target", tiny_target, "--length", "1024",
                 "--short-data", folders["short"], "--long-data", folders["long"], "--held-out", folders["held"],
                 "--short-batch", "4", "--steps", "2", "--long-steps", "2", "--anchors", "8", "--seeds", "0",
                 "--block-size", "4", "--per-bucket", "2", "--max-new-tokens", "12", "--min-accuracy", "0")
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert set(result["runs"]) == {"base/seed0", "short/seed0", "long/seed0"}
    assert [t < 512 for t in result["prompt_tokens"]] == [True, True, False, False]
    assert all(list(run["tau_by_context"]) == ["<512", "512-1K"] for run in result["runs"].values())
    assert set(result["accuracy"]) == {"<512", "512-1K"}
    r = cli_here("bench", "context-falloff", "--out", tmp_path / "bad", "--target", tiny_target, "--length", "512",
                 "--short-data", folders["short"], "--long-data", folders["long"], "--held-out", folders["held"])
    assert r.returncode == 2 and str(folders["held"]) in r.stderr and "--length 512" in r.stderr
