"""The real-scale recipes (configs/qwen3-8b.yaml, configs/qwen3.6-27b.yaml) against config-only targets of their shape.

Each recipe is loaded strictly, resolved into the drafter shape the trainer would build (the same
`resolve_arch` call), and the drafter is constructed on the meta device: no weights are allocated.
"""

import json
from pathlib import Path

import pytest
import torch

from dflash_ds.config import load_config
from dflash_ds.models.drafter import DFlashDrafter, default_target_layer_ids
from dflash_ds.runtime.job import resolve_arch

REPO = Path(__file__).resolve().parents[2]
S, F = "sliding_attention", "full_attention"

QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-6, "max_position_embeddings": 40960,
            "rope_theta": 1000000, "rope_scaling": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
# The vision-language wrapper as released: the decoder's shapes live under text_config.
QWEN36_27B = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
              "tie_word_embeddings": False, "dtype": "bfloat16",
              "text_config": {"model_type": "qwen3_5_text", "hidden_size": 5120, "intermediate_size": 17408,
                              "num_hidden_layers": 64, "num_attention_heads": 24, "num_key_value_heads": 4,
                              "head_dim": 256, "vocab_size": 248320, "rms_norm_eps": 1e-6,
                              "max_position_embeddings": 262144, "full_attention_interval": 4,
                              "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                                                  "partial_rotary_factor": 0.25, "mrope_interleaved": True,
                                                  "mrope_section": [11, 11, 10]}},
              "vision_config": {"model_type": "qwen3_5_vision", "hidden_size": 1152}}


# mask ids: each tokenizer's length, the spare embedding row init-drafter picks (and SpecForge's recipes use).
@pytest.mark.parametrize("recipe, target_cfg, mask_id, types, window, theta", [
    ("qwen3-8b.yaml", QWEN3_8B, 151669, [F] * 5, None, 1e6),
    ("qwen3.6-27b.yaml", QWEN36_27B, 248070, [S, S, S, S, F], 2048, 1e7),
])
def test_recipe_resolves_against_its_target_shape(tmp_path, recipe, target_cfg, mask_id, types, window, theta):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(target_cfg))  # config only: no weights, no tokenizer
    text = target_cfg.get("text_config", target_cfg)
    cfg = load_config(REPO / "configs" / recipe, {"target": str(target), "model": {"mask_token_id": mask_id}})
    assert cfg.loss.gamma == 7.0 and cfg.optim.lr == 6e-4 and cfg.loss.num_anchors == 512
    memory = (cfg.loss.max_anchors_per_batch, cfg.loss.chunk_blocks, cfg.model.activation_checkpointing)
    assert memory == (2048, 64, None)  # docs/MEMORY.md's settings; checkpointing by each rank's free memory
    assert cfg.data.max_length == 2048 and cfg.data.token_budget == 16384 and cfg.train.dtype == "bf16"

    arch = resolve_arch(cfg)
    n_t = text["num_hidden_layers"]
    assert arch.target_layer_ids == cfg.model.target_layer_ids == default_target_layer_ids(n_t, 5)
    assert arch.num_target_layers == n_t and arch.hidden_size == text["hidden_size"]
    assert arch.vocab_size == text["vocab_size"] and arch.head_dim == text["head_dim"]
    assert arch.layer_types == types and arch.sliding_window == window
    # Whole-head 1-D RoPE: the hybrid target's partial rotary factor and mrope sections are dropped.
    assert arch.rope_parameters == {"rope_type": "default", "rope_theta": theta}

    export = arch.to_json_dict()
    assert (export["layer_types"], export["sliding_window"], export["use_sliding_window"]) == (
        types, window, window is not None)
    assert export["dflash_config"] == {"mask_token_id": mask_id, "target_layer_ids": arch.target_layer_ids}
    assert "rope_scaling" not in export or export["rope_scaling"] is None

    with torch.device("meta"):  # the full-size drafter's shapes, no memory
        drafter = DFlashDrafter(arch)
    h = text["hidden_size"]
    assert drafter.fc.weight.shape == (h, 5 * h)
    assert drafter.layers[0].self_attn.q_proj.weight.shape == (text["num_attention_heads"] * text["head_dim"], h)
    assert drafter.layers[0].mlp.gate_proj.weight.shape == (text["intermediate_size"], h)


def test_dtype_fast_is_bf16_only_where_the_device_computes_it_natively(monkeypatch, capsys):
    """train.dtype fast (the SmolLM2 CPU recipe's): bf16 on a GPU and on a CPU with AVX512-BF16 / AMX, fp32 on a CPU
    that would emulate it (an AVX2-only AMD EPYC VM ran the recipe's 6-step quick start for 8+ minutes in bf16);
    bf16 asked for on such a CPU is run as asked, with a warning."""
    from dflash_ds.runtime import job

    recipe = load_config(REPO / "configs" / "real_smollm2.yaml", {"data": {"val_fraction": 0.1}})
    assert recipe.train.dtype == "fast"
    bf16 = load_config(None, ["--train.dtype", "bf16"])
    for native in (True, False):
        monkeypatch.setattr(job, "native_bf16_cpu", lambda: native)
        assert job.torch_dtype(recipe, cuda=True) == torch.bfloat16
        assert job.torch_dtype(recipe, cuda=False) == (torch.bfloat16 if native else torch.float32)
        assert job.torch_dtype(bf16, cuda=False) == torch.bfloat16
        assert (job.dtype_warning(bf16, cuda=False) is None) == native
        assert job.dtype_warning(recipe, cuda=False) is None and job.dtype_warning(bf16, cuda=True) is None
    assert "emulates its matmuls" in job.dtype_warning(bf16, cuda=False)
    with pytest.raises(Exception, match="must be auto, fast, bf16 or fp32"):
        load_config(None, ["--train.dtype", "bf8"])
