"""Every supported target family, tiny and random: loading, hidden-state capture, head, lossless decoding.

Each model is written by `make_tiny_family` (save_pretrained + the chat-template tokenizer) and loaded through
the real path (`load_target` = AutoModelForCausalLM.from_pretrained on the local folder). Oracle drafters give
partial acceptances of known lengths, so the cache rollback (cut back, or snapshot/restore/replay for sliding
and linear-attention caches) is exercised on every step; lossless needs no trained drafter.
"""

from __future__ import annotations

import json

import pytest
import torch

from dflash_ds.eval.speculative import TargetSession, greedy_generate, speculative_generate
from dflash_ds.tiny.families import FAMILIES, make_tiny_family
from dflash_ds.models.target import capture_layers, load_target, load_target_head, read_target_config, target_parts

BS = 4  # block size of the oracle and random drafters
NEW = 16  # generated tokens per run
# Families whose cache holds state that cannot be cut back (linear attention, sliding windows).
STATEFUL = {"qwen3_5", "qwen3_5_moe", "gpt_oss"}
DISAGGREGATED_E2E = {"qwen3_5", "gpt_oss", "deepseek_v3"}  # 1 target + 1 drafter in the end-to-end test; the rest colocated
# The end-to-end run, one per code path the trainer takes: the Qwen3.5 wrapper with a sliding + full drafter,
# gpt-oss's sliding target, DeepSeek's MLA (disaggregated); a dense target without head_dim (qwen2) and an MoE
# (qwen3_moe) colocated. The other families run exactly these paths (qwen3: every trainer test's target; llama,
# glm4_moe: dense and MoE like qwen2 and qwen3_moe; qwen3_5_moe: the wrapper of qwen3_5) and keep their own load,
# capture and lossless-decoding test above; folded to save the suite ~2 minutes of torchrun jobs.
E2E_FAMILIES = ["qwen2", "qwen3_moe", "qwen3_5", "gpt_oss", "deepseek_v3"]


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny forwards on a shared 2-core machine: extra threads only contend.
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def chat_prompt(path) -> list[int]:
    """One chat-template prompt of the tiny tokenizer (about 20 tokens: past gpt-oss's toy window of 8)."""
    from transformers import AutoTokenizer

    from dflash_ds.tiny.corpus import tiny_prompts

    tok = AutoTokenizer.from_pretrained(str(path))
    text = tok.apply_chat_template(tiny_prompts(1)[0]["messages"], add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def decoy_oracle(sequence: list[int], vocab: int):
    """A draft_fn returning logits: the true token everywhere, outbid by a decoy at position `step % (BS-1)`.

    Chain drafting then accepts exactly `step % (BS-1)` tokens; a tree of budget 2 (BS-1) holds the true
    path as the decoy's sibling, so it accepts the whole block.
    """
    step = [0]

    def draft(_ctx, _block, start: int) -> torch.Tensor:
        logits = torch.full((BS - 1, vocab), float("-inf"))
        for k, tok in enumerate(sequence[start + 1: start + BS]):
            logits[k, tok] = 0.0
            if k == step[0] % (BS - 1):
                logits[k, (tok + 1) % vocab] = 0.5
        step[0] += 1
        return logits

    return draft


def expected_chain_lengths() -> list[int]:
    """Accepted lengths of decoy_oracle's chain run: the decoy position + the bonus, until NEW tokens exist."""
    lengths, have = [], 1  # the prefill gives the first token
    while have < NEW:
        lengths.append(len(lengths) % (BS - 1) + 1)
        have += lengths[-1]
    return lengths


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_loads_captures_and_decodes_losslessly(family, tmp_path, monkeypatch):
    import transformers

    from dflash_ds.eval import tree as tree_mod
    from dflash_ds.tools.init_drafter import init_drafter

    # One path per batched verify forward, so a tree of two leaves takes two (the chunking is exercised).
    monkeypatch.setattr(tree_mod, "ROWS_PER_FORWARD", 1)

    path = make_tiny_family(tmp_path / family, family)
    raw = json.loads((path / "config.json").read_text())
    cfg = read_target_config(path)
    text = raw.get("text_config", raw)  # the wrapper's decoder shapes are under text_config
    assert (family in ("qwen3_5", "qwen3_5_moe")) == ("text_config" in raw)
    for key in ("hidden_size", "num_hidden_layers", "vocab_size"):
        assert cfg[key] == text[key]

    target = load_target(path)
    parts = target_parts(target)
    n_layers, hidden, vocab = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    assert len(parts.layers) == n_layers
    if "text_config" in raw:  # the wrapper loaded as itself: its text decoder is found under language_model
        wrapper = getattr(transformers, raw["architectures"][0]).from_pretrained(str(path))
        assert type(target_parts(wrapper).body) is type(parts.body)
    prompt = chat_prompt(path)
    ids = torch.tensor([prompt])

    # Hooks read the layer outputs HF reports as hidden_states[i + 1]; the final hidden is after the last norm.
    layer_ids = [0, n_layers - 2]
    layers, last = capture_layers(target, ids, None, layer_ids)
    with torch.no_grad():
        ref = target(input_ids=ids, output_hidden_states=True)
    for i, got in zip(layer_ids, layers):
        assert got.shape == (1, len(prompt), hidden)
        torch.testing.assert_close(got, ref.hidden_states[i + 1], rtol=0, atol=0)
    embed, head = load_target_head(path)
    assert embed.weight.shape == head.weight.shape == (vocab, hidden)
    torch.testing.assert_close(embed.weight, parts.embed.weight, rtol=0, atol=0)
    torch.testing.assert_close(head(last), ref.logits, rtol=1e-5, atol=1e-5)

    with TargetSession(target, []) as tgt:
        tgt.forward(prompt, torch.arange(len(prompt)))
        assert tgt.croppable == (family not in STATEFUL)

    greedy = greedy_generate(target, prompt, NEW + BS, [])
    oracle_kw = dict(block_size=BS, max_new_tokens=NEW, eos_ids=[])
    chain = speculative_generate(target, prompt, draft_fn=decoy_oracle(prompt + greedy, vocab), **oracle_kw)
    assert chain.tokens == greedy[:NEW]
    assert chain.accept_lengths == expected_chain_lengths()
    partial = sum(1 for n in chain.accept_lengths if n < BS)
    assert chain.replay_forwards == (partial if family in STATEFUL else 0)
    tree = speculative_generate(target, prompt, draft_fn=decoy_oracle(prompt + greedy, vocab),
                                tree_budget=2 * (BS - 1), **oracle_kw)
    assert tree.tokens == greedy[:NEW]
    assert tree.accept_lengths == [BS] * len(tree.accept_lengths)

    # The real drafter reads the captured features of every family (untrained: it only has to stay lossless).
    drafter = init_drafter(path, tmp_path / "drafter", num_layers=1, block_size=BS).eval()
    assert drafter.arch.hidden_size == hidden and drafter.arch.num_target_layers == n_layers
    for budget in (None, 2 * (BS - 1)):
        out = speculative_generate(target, prompt, drafter=drafter, max_new_tokens=8, eos_ids=[], tree_budget=budget)
        assert out.tokens == greedy[:8]
    # Speculative sampling rolls back the same way (speculative_generate checks the cache length every step).
    sampled = speculative_generate(target, prompt, drafter=drafter, max_new_tokens=8, eos_ids=[], temperature=0.8,
                                   generator=torch.Generator().manual_seed(0))
    assert len(sampled.tokens) == 8


def test_make_tiny_target_family_flag(tmp_path, capsys):
    from dflash_ds.cli import main

    assert main(["make-tiny-target", "--out", str(tmp_path / "llama"), "--family", "llama"]) == 0
    assert json.loads((tmp_path / "llama" / "config.json").read_text())["model_type"] == "llama"
    assert "tiny target (llama): 4 layers, hidden 64, vocab 512" in capsys.readouterr().out
    assert main(["make-tiny-target", "--out", str(tmp_path / "oss"), "--family", "gpt_oss", "--layers", "3"]) == 2
    assert "--layers applies to --family qwen3 only" in capsys.readouterr().err


S, F = "sliding_attention", "full_attention"


@pytest.mark.parametrize("family", E2E_FAMILIES)
def test_family_prepare_train_export_eval(family, tmp_path):
    """prepare -> 2 steps of training (torchrun, gloo: 1 target + 1 drafter rank for the hybrid, sliding and MLA
    families, one colocated rank for the others) -> export -> eval lossless at temperature 0.

    The Qwen3.5/3.6 target trains the drafter layout of the released Qwen3.6 drafters (sliding-window
    layers + a full one; window 5 < block 8, so it cuts inside the block too): the export and the trainer
    state keep the layer types, the export reloads with them, and the eval is lossless with them.
    """
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "test_runtime"))  # shared torchrun helpers
    from runtime_utils import REPO, make_dataset, torchrun

    from dflash_ds.cli import main
    from dflash_ds.models.drafter_arch import default_target_layer_ids
    from dflash_ds.models.drafter import DFlashDrafter

    sliding = family == "qwen3_5"
    target = make_tiny_family(tmp_path / "target", family)
    data = make_dataset(target, tmp_path / "prepared", n=12, max_length=128, block_size=8)
    out = tmp_path / "run"
    layout = ["--model.layer_types", f"[{S}, {F}]", "--model.sliding_window", "5"] if sliding else []
    # Colocated (one rank runs the target and trains) for the families whose layers are all full attention;
    # 1 target + 1 drafter for the hybrid, sliding and MLA ones, so both paths see the unusual targets.
    colocated = family not in DISAGGREGATED_E2E
    r = torchrun(1 if colocated else 2,
                 ["--config", str(REPO / "configs/tiny.yaml"), "--target", str(target), "--data", str(data),
                  "--output-dir", str(out), "--no-wandb", "--max-steps", "2", "--train.save_interval", "2",
                  "--train.log_interval", "1", "--data.token_budget", "512", "--train.timeout_s", "90", *layout,
                  *(["--colocate"] if colocated else [])],
                 timeout=240, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    ck = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    export = ck / "export"
    exported, text = json.loads((export / "config.json").read_text()), read_target_config(target)
    assert exported["hidden_size"] == text["hidden_size"] == 64
    assert exported["num_target_layers"] == text["num_hidden_layers"] == 4
    ids = exported["dflash_config"]["target_layer_ids"]
    assert ids == default_target_layer_ids(4, exported["num_hidden_layers"]) and all(0 <= i < 4 for i in ids)
    assert len(set(ids)) == len(ids)  # a shallow target gets distinct layers
    if sliding:
        assert (exported["layer_types"], exported["sliding_window"], exported["use_sliding_window"]) == ([S, F], 5, True)
        state = json.loads((ck / "trainer_state.json").read_text())
        assert state["arch"]["layer_types"] == [S, F] and state["arch"]["sliding_window"] == 5
        reloaded = DFlashDrafter.from_pretrained(export).arch
        assert (reloaded.layer_types, reloaded.sliding_window) == ([S, F], 5)

    result = tmp_path / "eval.json"
    rc = main(["eval", "--target", str(target), "--drafter", str(export), "--data", str(data), "--num-prompts", "2",
               "--max-new-tokens", "8", "--tree-budget", "8", "--json", str(result), "--device", "cpu"])
    assert rc == 0
    res = json.loads(result.read_text())
    assert res["lossless_checked"] and res["mismatches"] == [] and res["num_prompts"] == 2
    assert 2 <= res["generated_tokens"] <= 16  # at most --max-new-tokens per prompt
