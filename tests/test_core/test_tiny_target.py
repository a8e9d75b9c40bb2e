"""The tiny target loads offline through the Auto* classes, generates, and is byte-deterministic."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_ds.errors import DFlashError
from dflash_ds.tiny.target import make_tiny_target


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_loads_and_generates(tiny_target: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_target)
    model = AutoModelForCausalLM.from_pretrained(tiny_target)
    cfg = model.config
    assert cfg.model_type == "qwen3" and cfg.num_hidden_layers == 4 and cfg.hidden_size == 128
    assert cfg.tie_word_embeddings is False
    assert cfg.vocab_size == len(tok) == 512
    assert model.dtype == torch.float32
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.mask_token == "<|mask|>" and cfg.eos_token_id == tok.eos_token_id
    ids = tok.apply_chat_template([{"role": "user", "content": "Hello there"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 8) or out[0, -1].item() == tok.eos_token_id
    # Greedy generation is a pure function of the weights: same call, same tokens.
    assert torch.equal(out, model.generate(ids, max_new_tokens=8, do_sample=False))


def test_chat_template_round_trip(tiny_target: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_target)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "It is 4."}]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
                    "<|im_start|>assistant\nIt is 4.<|im_end|>\n")
    prompt = tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n") and text.startswith(prompt)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3


def test_deterministic_bytes(tiny_target: Path, tmp_path: Path) -> None:
    again = make_tiny_target(tmp_path / "again")
    assert _digests(again) == _digests(tiny_target)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(_digests(again))


def test_refuses_non_empty_dir(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(DFlashError, match="not empty"):
        make_tiny_target(tmp_path, layers=1)


def test_quality_tasks_are_functions_of_the_prompt(tiny_target: Path) -> None:
    from dflash_ds.tiny.quality import NUM_WORDS, WORDS, quality_conversations, quality_prompts

    tok = AutoTokenizer.from_pretrained(tiny_target)
    # One token per word, leading space included: an answer's positions line up with the prompt's words.
    assert all(len(tok.tokenize(" " + w)) == 1 for w in WORDS) and len(set(WORDS)) == len(WORDS)
    rows = quality_conversations(30, seed=3)
    assert rows == quality_conversations(30, seed=3) and rows != quality_conversations(30, seed=4)
    assert [r["messages"][:1] for r in rows] == [r["messages"] for r in quality_prompts(30, seed=3)]
    for row in rows:
        task, words = row["messages"][0]["content"].split(":")
        words, answer = words.split(), row["messages"][1]["content"].split()
        assert answer[0] == "=" and len(set(words)) == len(words) == NUM_WORDS == 16
        swapped = [w for i in range(0, NUM_WORDS, 2) for w in (words[i + 1], words[i])]
        want = {"copy": words, "twice": words + words, "swap": swapped}
        assert answer[1:] == want[task]


def test_quality_target_is_deterministic(tmp_path: Path) -> None:
    from dflash_ds.tiny.quality import make_quality_target

    # A few steps suffice for the bytes; the trained target itself is tested in tests/test_eval/test_quality_target.py.
    a = make_quality_target(tmp_path / "a", steps=3, batch=4)
    b = make_quality_target(tmp_path / "b", steps=3, batch=4)
    c = make_quality_target(tmp_path / "c", steps=3, batch=4, seed=1)
    assert _digests(a) == _digests(b)
    assert _digests(a)["model.safetensors"] != _digests(c)["model.safetensors"]
    assert _digests(a)["tokenizer.json"] == _digests(c)["tokenizer.json"]
    assert AutoModelForCausalLM.from_pretrained(a).config.model_type == "qwen3"


def test_make_tiny_target_quality_flag(tmp_path: Path, capsys) -> None:
    from dflash_ds.cli import main

    assert main(["make-tiny-target", "--out", str(tmp_path / "q"), "--quality", "--steps", "2", "--layers", "2"]) == 0
    out = capsys.readouterr().out
    assert "tiny target (quality): 2 layers, hidden 128, vocab 512" in out and "quality target step 1" in out
    assert main(["make-tiny-target", "--out", str(tmp_path / "x"), "--steps", "2"]) == 2
    assert "--steps applies to --quality only" in capsys.readouterr().err
    assert main(["make-tiny-target", "--out", str(tmp_path / "y"), "--quality", "--heads", "2"]) == 2
    assert "--heads does not apply to --quality" in capsys.readouterr().err
