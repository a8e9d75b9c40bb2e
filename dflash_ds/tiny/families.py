"""Tiny random targets of each supported family, for tests and demos without network access.

Each family is built from its own transformers config at toy width (a few layers, hidden 64) and saved with
`save_pretrained` (safetensors) beside the chat-template tokenizer of `tiny/tokenizer.py`, as the released
checkpoints are: Qwen3.5/3.6 (dense and MoE) as their vision-language wrapper, so the folder exercises the
same loading path (`AutoModelForCausalLM` maps the wrapper to its text-only causal LM) and the same
safetensors keys (`model.language_model.*`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash_ds.errors import DFlashError

# Common toy shape; families override what their architecture names differently.
_BASE: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=32, max_position_embeddings=512, initializer_range=0.02,
                             rms_norm_eps=1e-6, tie_word_embeddings=False)
_MOE = dict(moe_intermediate_size=32, num_experts_per_tok=2)
_TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                    num_position_embeddings=16)
# Qwen3.5 Gated DeltaNet heads at toy width; layer_types default to 3 linear + 1 full attention per 4 layers.
_DELTANET = dict(linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)

# family -> (config class, model class saved, text-config overrides, wrapper?)
FAMILIES: dict[str, tuple[str, str, dict[str, Any], bool]] = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}, False),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"head_dim": None}, False),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, False),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {**_MOE, "num_experts": 4}, False),
    "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", dict(_DELTANET), True),
    "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration",
                    {**_DELTANET, **_MOE, "num_experts": 4, "shared_expert_intermediate_size": 32}, True),
    # A window of 8 tokens, so that eval prompts run past it and the sliding cache really wraps.
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                {**_MOE, "num_local_experts": 4, "sliding_window": 8, "layer_types": None,
                 # gpt-oss's own YaRN, with the pre-YaRN length that matches the toy context (512 / 32)
                 "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False, "original_max_position_embeddings": 16,
                                     "rope_theta": 150000.0}}, False),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    {**_MOE, "n_routed_experts": 4, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
                     "first_k_dense_replace": 1, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
                     "qk_nope_head_dim": 16, "v_head_dim": 16, "head_dim": 8, "num_key_value_heads": 2}, False),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 {**_MOE, "n_routed_experts": 4, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
                  "first_k_dense_replace": 1}, False),
}


def family_config(family: str, vocab_size: int, special: dict[str, int | None], text_overrides: dict | None = None):
    """The transformers config of a tiny `family` model with this vocabulary, these special token ids and overrides."""
    import transformers

    if family not in FAMILIES:
        raise DFlashError(f"unknown target family {family!r} (known: {', '.join(FAMILIES)})")
    config_cls, _, overrides, wrapper = FAMILIES[family]
    text = {**_BASE, **overrides, **(text_overrides or {}), "vocab_size": vocab_size, **special}
    text = {k: v for k, v in text.items() if v is not None}  # None = let the family pick its default
    cls = getattr(transformers, config_cls)
    if wrapper:
        # Top-level tie flag too: the wrapper's own default would otherwise decide for the text model.
        return cls(text_config=text, vision_config=dict(_TINY_VISION), tie_word_embeddings=False)
    return cls(**text)


def make_tiny_family(out_dir: str | Path, family: str, vocab_size: int = 512, seed: int = 0,
                     force: bool = False, text_overrides: dict | None = None) -> Path:
    """Write a seeded random `family` model (fp32 safetensors) and the chat-template tokenizer; return the path.

    `text_overrides` change the text config's toy shape (e.g. {"num_key_value_heads": 2}: tensor parallelism
    over 2 ranks needs a head count it divides).
    """
    import torch
    import transformers

    from dflash_ds.tiny.target import prepare_out_dir, save_tiny
    from dflash_ds.tiny.tokenizer import build_tokenizer

    out = prepare_out_dir(out_dir, force)
    tokenizer = build_tokenizer(vocab_size)
    special = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    config = family_config(family, max(vocab_size, len(tokenizer)), special, text_overrides)
    torch.manual_seed(seed)
    return save_tiny(getattr(transformers, FAMILIES[family][1])(config), tokenizer, out)
