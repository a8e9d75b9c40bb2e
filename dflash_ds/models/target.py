"""The frozen target: local HF folder checks, loading, and capture of selected hidden states.

Only the outputs of the decoder layers in `target_layer_ids` and the final (normed)
hidden state are kept, through forward hooks: every layer's output and the vocabulary
logits are never materialised together.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash_ds.errors import DFlashError

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe", "qwen2", "llama")


def read_target_config(path: str | Path) -> dict[str, Any]:
    """config.json of a local target folder, checked to be a supported architecture."""
    path = Path(path)
    if not path.is_dir():
        raise DFlashError(f"target folder {path} does not exist")
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise DFlashError(f"target folder {path} has no config.json (expected a local HF model folder)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise DFlashError(f"{cfg_path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise DFlashError(f"{cfg_path}: model_type {model_type!r} is not supported "
                          f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)} — the Qwen3 and Llama families)")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if key not in cfg:
            raise DFlashError(f"{cfg_path}: missing field {key!r}")
    return cfg


def load_target(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> nn.Module:
    """Load the target causal LM with from_pretrained, frozen and in eval mode."""
    from transformers import AutoModelForCausalLM

    read_target_config(path)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
    model.to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def decoder_layers(target: nn.Module) -> nn.ModuleList:
    """The decoder layer list of a Qwen3/Llama-style causal LM."""
    return target.model.layers


def capture_hidden(target: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                   layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the target body once; return (concat of layer_ids outputs [B, S, n*H], final hidden [B, S, H]).

    Layer i's output is `hidden_states[i + 1]` of an HF forward; the final hidden is after the
    model's last norm, so `lm_head(final)` are the target's logits. The LM head itself is not run.
    """
    layers, last = capture_layers(target, input_ids, attention_mask, layer_ids)
    return torch.cat(layers, dim=-1), last


def capture_layers(target: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                   layer_ids: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """`capture_hidden` before the concatenation: the outputs of layer_ids (in that order) and the final hidden.

    The caller concatenates them where it wants the context, e.g. straight into a send buffer.
    """
    layers = decoder_layers(target)
    captured: dict[int, torch.Tensor] = {}
    hooks = []

    def keep(idx: int):
        def hook(_mod, _inp, out):
            captured[idx] = out[0] if isinstance(out, tuple) else out
        return hook

    for idx in sorted(set(layer_ids)):
        if not 0 <= idx < len(layers):
            raise DFlashError(f"target layer id {idx} is outside the target's {len(layers)} layers")
        hooks.append(layers[idx].register_forward_hook(keep(idx)))
    try:
        with torch.no_grad():
            out = target.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return [captured[i] for i in layer_ids], out.last_hidden_state


def _tensor_index(path: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file of a (possibly sharded) HF folder."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: path / v for k, v in weight_map.items()}
    single = path / "model.safetensors"
    if not single.is_file():
        raise DFlashError(f"target folder {path} has no model.safetensors(.index.json): only safetensors are loaded")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {k: single for k in f.keys()}


def load_target_head(path: str | Path, dtype: torch.dtype = torch.float32) -> tuple[nn.Embedding, nn.Linear]:
    """Only the target's token embedding and LM head (frozen), read from its safetensors.

    Drafter ranks need these two and nothing else of the target.
    """
    from safetensors import safe_open

    path = Path(path)
    cfg = read_target_config(path)
    index = _tensor_index(path)

    def read(name: str) -> torch.Tensor:
        with safe_open(str(index[name]), framework="pt") as f:
            return f.get_tensor(name).to(dtype)

    embed_name = next((k for k in ("model.embed_tokens.weight", "embed_tokens.weight") if k in index), None)
    if embed_name is None:
        raise DFlashError(f"target folder {path}: no embed_tokens weight in its safetensors")
    embed_w = read(embed_name)
    head_w = read("lm_head.weight") if "lm_head.weight" in index else None
    if head_w is None:
        if not cfg.get("tie_word_embeddings", False):
            raise DFlashError(f"target folder {path}: no lm_head.weight and tie_word_embeddings is false")
        head_w = embed_w
    embed = nn.Embedding(embed_w.shape[0], embed_w.shape[1], _weight=embed_w)
    head = nn.Linear(head_w.shape[1], head_w.shape[0], bias=False, device="meta")
    # A tied head shares the embedding's tensor (one V x H matrix in memory, not two).
    head.weight = embed.weight if head_w is embed_w else nn.Parameter(head_w)
    for p in (*embed.parameters(), *head.parameters()):
        p.requires_grad_(False)
    return embed, head
