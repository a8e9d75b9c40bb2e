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
