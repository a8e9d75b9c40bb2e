"""The drafter shape derived from a target folder: width, heads, vocabulary, RoPE, layer ids, mask token.

Reads the target's config.json and tokenizer only (no weights).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dflash_ds.errors import DFlashError
from dflash_ds.models.drafter_arch import DrafterArch, default_target_layer_ids
from dflash_ds.models.target import read_target_config

# "<|MASK|>" is SGLang's default DFlash mask token (dflash_config.mask_token when unset).
MASK_TOKEN_NAMES = ("<|mask|>", "<|MASK|>", "<mask>", "[MASK]")


def pick_mask_token_id(target_dir: str | Path, vocab_size: int) -> int:
    """A token the target never emits: the tokenizer's mask token, a `<|mask|>`-like special, or a padded vocab row."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(target_dir), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - any tokenizer failure means we cannot choose
        raise DFlashError(f"target folder {target_dir}: cannot load its tokenizer ({exc}); "
                          f"pass --mask-token-id") from None
    if tok.mask_token_id is not None:
        return int(tok.mask_token_id)
    vocab = tok.get_vocab()
    for name in MASK_TOKEN_NAMES:
        if name in vocab:
            return int(vocab[name])
    if vocab_size > len(tok):  # embedding rows past the tokenizer are never produced by it
        return len(tok)
    raise DFlashError(f"target folder {target_dir}: its tokenizer has no mask token and no spare vocabulary row; "
                      f"pass --mask-token-id")


# The draft layers' own widths, each the target's unless set (config model.*, init-drafter flags).
SHAPE_OVERRIDES = ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")


def drafter_arch_from_target(target_dir: str | Path, *, num_layers: int = 5, block_size: int = 16,
                             mask_token_id: int | None = None, target_layer_ids: list[int] | None = None,
                             layer_types: list[str] | None = None,
                             sliding_window: int | None = None, options: Any = None,
                             layers_from_target: bool = False, **shape: Any) -> DrafterArch:
    """Width, heads, vocab and RoPE from the target; target_layer_ids by the default rule (docs/DESIGN.md §2).

    `options` (a kind's options, models/kinds.py, e.g. `DSparkOptions(...)`; None = a DFlash drafter) make it a
    drafter of that kind.
    `shape` may set any of SHAPE_OVERRIDES (None = the target's): the heads, head width and MLP width
    of the draft layers need not be the target's (z-lab's Qwen3.6-27B drafter: 32 / 8 heads of 128 on a
    target of 24 / 4 heads of 256). The hidden size is the target's: the drafter reads its hidden states
    and shares its embedding and LM head.

    Reads config.json and the tokenizer only (no weights), so it works on a config-only folder
    when mask_token_id is given. `layers_from_target` (the draft layers start as the target's last ones): the
    default ids end at the input of the first copied layer (`default_target_layer_ids(from_target=True)`).
    """
    cfg: dict[str, Any] = read_target_config(target_dir)
    if num_layers < 1:
        raise DFlashError(f"--num-layers {num_layers}: a drafter needs at least 1 layer")
    if block_size < 2:
        raise DFlashError(f"--block-size {block_size}: must be >= 2 (the anchor plus at least one predicted token)")
    n_target = int(cfg["num_hidden_layers"])
    vocab = int(cfg["vocab_size"])
    if mask_token_id is None:
        mask_token_id = pick_mask_token_id(target_dir, vocab)
    if not 0 <= mask_token_id < vocab:
        raise DFlashError(f"--mask-token-id {mask_token_id} is outside the target vocabulary [0, {vocab})")
    layer_ids = target_layer_ids or default_target_layer_ids(n_target, num_layers, from_target=layers_from_target)
    bad = [i for i in layer_ids if not 0 <= i < n_target]
    if bad:
        raise DFlashError(f"target layer ids {bad} are outside the target's {n_target} layers")
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope.setdefault("rope_type", rope.pop("type", "default"))
    # The drafter rotates its whole head_dim in one dimension (as SpecForge's Qwen3.6 drafter config):
    # a hybrid target's partial rotary factor and multimodal RoPE sections are not the drafter's.
    rope = {k: v for k, v in rope.items() if k != "partial_rotary_factor" and not k.startswith("mrope")}
    rope.setdefault("rope_theta", float(cfg.get("rope_theta", 10000.0)))
    unknown = sorted(set(shape) - set(SHAPE_OVERRIDES))
    if unknown:
        raise TypeError(f"drafter_arch_from_target: unknown shape fields {unknown}")
    target_heads = int(cfg["num_attention_heads"])
    dims = {"num_attention_heads": target_heads,
            "num_key_value_heads": int(cfg.get("num_key_value_heads") or target_heads),
            "head_dim": int(cfg.get("head_dim") or cfg["hidden_size"] // target_heads),
            "intermediate_size": int(cfg.get("intermediate_size") or 4 * cfg["hidden_size"])}
    for name, value in shape.items():
        if value is not None:
            if value < 1:
                raise DFlashError(f"model.{name} = {value}: must be >= 1")
            dims[name] = int(value)
    if dims["num_attention_heads"] % dims["num_key_value_heads"]:
        raise DFlashError(f"model.num_key_value_heads = {dims['num_key_value_heads']} does not divide "
                          f"model.num_attention_heads = {dims['num_attention_heads']} (grouped-query attention)")
    try:
        return DrafterArch(
            hidden_size=int(cfg["hidden_size"]), num_hidden_layers=num_layers, **dims, vocab_size=vocab,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)), rope_parameters=rope,
            block_size=block_size, num_target_layers=n_target, mask_token_id=int(mask_token_id),
            target_layer_ids=list(layer_ids), layer_types=layer_types, sliding_window=sliding_window,
            options=options,
        )
    except DFlashError as exc:  # the layer-type rules: name the config fields they come from
        raise DFlashError(f"model.{exc}") from None


def target_dtype(target_dir: str | Path) -> torch.dtype:
    """The dtype the target's config.json declares (dtype / torch_dtype); float32 when it says none."""
    cfg = read_target_config(target_dir)
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32
