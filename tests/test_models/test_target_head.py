"""The drafter ranks' view of a target: embedding and LM head found by key suffix, one clear error otherwise."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from dflash_ds.errors import DFlashError
from dflash_ds.models.target import load_target_head, read_target_config, target_parts

V, H = 12, 4


def folder(tmp_path, tensors: dict[str, torch.Tensor], tied: bool = False, wrapper: bool = False):
    """A config-only target folder (Qwen3.5-style wrapper or plain Llama) with these safetensors."""
    text = {"hidden_size": H, "num_hidden_layers": 2, "num_attention_heads": 1, "vocab_size": V}
    cfg = ({"model_type": "qwen3_5", "tie_word_embeddings": tied, "text_config": {"model_type": "qwen3_5_text", **text}}
           if wrapper else {"model_type": "llama", "tie_word_embeddings": tied, **text})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_wrapper_keys_and_text_config_view(tmp_path):
    embed, head = rand(V, H), rand(V, H, seed=1)
    path = folder(tmp_path, {"model.language_model.embed_tokens.weight": embed, "lm_head.weight": head,
                             "model.visual.pos_embed.weight": rand(3, H)}, wrapper=True)
    cfg = read_target_config(path)
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]) == (H, 2, V)
    assert cfg["model_type"] == "qwen3_5_text" and cfg["tie_word_embeddings"] is False
    e, h = load_target_head(path)
    assert torch.equal(e.weight, embed) and torch.equal(h.weight, head)


def test_tied_head_is_the_embedding_and_mtp_copies_are_skipped(tmp_path):
    embed = rand(V, H)
    # DeepSeek-V3 checkpoints carry a second embedding for their multi-token-prediction layer.
    path = folder(tmp_path, {"model.embed_tokens.weight": embed,
                             "model.layers.61.embed_tokens.weight": rand(V, H, seed=2)}, tied=True)
    e, h = load_target_head(path)
    assert torch.equal(e.weight, embed) and h.weight is e.weight


@pytest.mark.parametrize("case", ["untied_no_head", "ambiguous", "no_embed", "shape"])
def test_bad_checkpoints_name_what_is_missing(tmp_path, case):
    tensors, msg = {
        "untied_no_head": ({"model.embed_tokens.weight": rand(V, H)},
                           "no \\*lm_head.weight .* tie_word_embeddings is false"),
        "ambiguous": ({"a.embed_tokens.weight": rand(V, H), "b.embed_tokens.weight": rand(V, H),
                       "lm_head.weight": rand(V, H)}, "ambiguous embed_tokens.weight: a.embed_tokens.weight, b.embed"),
        "no_embed": ({"lm_head.weight": rand(V, H)}, "no tensor named \\*embed_tokens.weight"),
        "shape": ({"model.embed_tokens.weight": rand(V, H + 1), "lm_head.weight": rand(V, H)},
                  r"model.embed_tokens.weight has shape \[12, 5\], expected \[12, 4\]"),
    }[case]
    with pytest.raises(DFlashError, match=msg):
        load_target_head(folder(tmp_path, tensors))


def test_no_causal_lm_class_is_one_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "clip", "hidden_size": H}))
    with pytest.raises(DFlashError, match="model_type 'clip' has no causal-LM class"):
        read_target_config(tmp_path)


def test_model_without_a_layer_list_is_one_clear_error(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                                         num_attention_heads=1, num_key_value_heads=1))
    assert len(target_parts(model).layers) == 2
    del model.model.layers  # a body whose decoder layers live nowhere the adapter can find them
    with pytest.raises(DFlashError, match="no decoder layer list of 2 layers found in LlamaModel"):
        target_parts(model)
