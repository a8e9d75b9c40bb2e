"""Fixtures of the serving tests: the vLLM environment, a tiny target that ends some answers, conversations.

vLLM runs from its own environment (`make serve-env`: .venv-serve, or $DFLASH_VLLM_PYTHON). Where none
is installed these tests skip, except under `make test`, which sets DFLASH_REQUIRE_VLLM=1: there a
missing environment fails them.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def vllm_python() -> str:
    from dflash_ds.errors import DFlashError
    from dflash_ds.serving.vllm_server import vllm_python as find

    try:
        return find()
    except DFlashError as exc:
        if os.environ.get("DFLASH_REQUIRE_VLLM") == "1":
            pytest.fail(f"DFLASH_REQUIRE_VLLM=1 but {exc}")
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def eos_target(tiny_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny target, but its lm_head row of eos is 1.02 x the row of a token it often emits (id 427),
    so that greedy answers sometimes stop (finish "stop") and sometimes run to the token limit ("length")."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("serving") / "eos_target"
    shutil.copytree(tiny_target, out)
    weights = load_file(str(tiny_target / "model.safetensors"))
    eos = json.loads((tiny_target / "generation_config.json").read_text())["eos_token_id"]
    weights["lm_head.weight"][eos] = 1.02 * weights["lm_head.weight"][427]
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="session")
def conversations(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """32 conversations: single questions, one with a system turn, one multi-turn (two answers to regenerate)."""
    from dflash_ds.tiny.corpus import tiny_prompts

    rows = tiny_prompts(32, seed=3)
    rows[5]["messages"] += [{"role": "assistant", "content": "an old answer"},
                            {"role": "user", "content": "Tell me about the dog."}]
    rows[9]["messages"].insert(0, {"role": "system", "content": "Be brief."})
    path = tmp_path_factory.mktemp("serving") / "conversations.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="session")
def served_drafter(eos_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An export trained briefly (60 AdamW steps of the real objective) on the target's own greedy answers."""
    return train_served_drafter(eos_target, tmp_path_factory.mktemp("serving") / "drafter")


@pytest.fixture(scope="session")
def own_heads_drafter(eos_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """As served_drafter, with heads, head width and MLP width of its own (the target: 4 / 2 heads of 32, MLP
    256), as z-lab's Qwen3.6-27B drafter has 32 / 8 heads of 128 on a target of 24 / 4 heads of 256."""
    return train_served_drafter(eos_target, tmp_path_factory.mktemp("serving") / "own_heads",
                                num_attention_heads=2, num_key_value_heads=1, head_dim=64, intermediate_size=192)


def train_served_drafter(eos_target: Path, out: Path, **shape: int) -> Path:
    import torch
    from transformers import AutoTokenizer

    from dflash_ds.components.objective import TargetStates, drafter_objective
    from dflash_ds.config import LossConfig
    from dflash_ds.eval.speculative import eos_token_ids, greedy_generate
    from dflash_ds.models.target import capture_hidden, load_target
    from dflash_ds.tiny.corpus import tiny_prompts
    from dflash_ds.tools.init_drafter import init_drafter

    target = load_target(eos_target)
    drafter = init_drafter(eos_target, out, num_layers=2, block_size=8, seed=1, **shape)
    tok = AutoTokenizer.from_pretrained(str(eos_target))
    seqs = []
    for row in tiny_prompts(16, seed=5):
        ids = tok(tok.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=False),
                  add_special_tokens=False)["input_ids"]
        seqs.append((ids, greedy_generate(target, ids, 64, eos_token_ids(target))))
    length = max(len(a) + len(b) for a, b in seqs)
    ids = torch.zeros(len(seqs), length, dtype=torch.long)
    loss_mask = torch.zeros_like(ids)
    for i, (a, b) in enumerate(seqs):
        ids[i, : len(a) + len(b)] = torch.tensor(a + b)
        loss_mask[i, len(a): len(a) + len(b)] = 1
    context, last = capture_hidden(target, ids, None, drafter.arch.target_layer_ids)
    states = TargetStates(ids, loss_mask, torch.tensor([len(a) + len(b) for a, b in seqs]), context, last)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3, betas=(0.9, 0.95))
    drafter.train()
    for step in range(60):
        terms, _ = drafter_objective(drafter, target.get_input_embeddings(), target.get_output_embeddings(), states,
                                     LossConfig(num_anchors=16), anchor_gen=torch.Generator().manual_seed(step))
        opt.zero_grad()
        terms.loss.backward()
        opt.step()
    drafter.eval().save_pretrained(out)
    return out
