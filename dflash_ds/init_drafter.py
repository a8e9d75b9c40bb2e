"""`dflash-ds init-drafter`: derive a drafter from a target and save a random init in the export format."""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from dflash_ds.errors import DFlashError
from dflash_ds.models.drafter import DFlashDrafter, DrafterArch, default_target_layer_ids
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


def drafter_arch_from_target(target_dir: str | Path, *, num_layers: int = 5, block_size: int = 16,
                             mask_token_id: int | None = None, target_layer_ids: list[int] | None = None,
                             layer_types: list[str] | None = None,
                             sliding_window: int | None = None) -> DrafterArch:
    """Width, heads, vocab and RoPE from the target; target_layer_ids by the default rule (DESIGN §2).

    Reads config.json and the tokenizer only (no weights), so it works on a config-only folder
    when mask_token_id is given.
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
    layer_ids = target_layer_ids or default_target_layer_ids(n_target, num_layers)
    bad = [i for i in layer_ids if not 0 <= i < n_target]
    if bad:
        raise DFlashError(f"target layer ids {bad} are outside the target's {n_target} layers")
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope.setdefault("rope_type", rope.pop("type", "default"))
    # The drafter rotates its whole head_dim in one dimension (as SpecForge's Qwen3.6 drafter config):
    # a hybrid target's partial rotary factor and multimodal RoPE sections are not the drafter's.
    rope = {k: v for k, v in rope.items() if k != "partial_rotary_factor" and not k.startswith("mrope")}
    rope.setdefault("rope_theta", float(cfg.get("rope_theta", 10000.0)))
    heads = int(cfg["num_attention_heads"])
    try:
        return DrafterArch(
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg.get("intermediate_size", 4 * cfg["hidden_size"])),
            num_hidden_layers=num_layers, num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads", heads)),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads), vocab_size=vocab,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)), rope_parameters=rope,
            block_size=block_size, num_target_layers=n_target, mask_token_id=int(mask_token_id),
            target_layer_ids=list(layer_ids), layer_types=layer_types, sliding_window=sliding_window,
        )
    except DFlashError as exc:  # the layer-type rules: name the config fields they come from
        raise DFlashError(f"model.{exc}") from None


def target_dtype(target_dir: str | Path) -> torch.dtype:
    """The dtype the target's config.json declares (dtype / torch_dtype); float32 when it says none."""
    cfg = read_target_config(target_dir)
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


def init_drafter(target_dir: str | Path, out_dir: str | Path, *, num_layers: int = 5, block_size: int = 16,
                 mask_token_id: int | None = None, seed: int = 0, force: bool = False,
                 layer_types: list[str] | None = None, sliding_window: int | None = None) -> DFlashDrafter:
    """Build, seed-init and save a drafter for `target_dir` into `out_dir` (atomically), in the target's dtype.

    The export's dtype is what SGLang / vLLM run under --dtype auto, so a bf16 target's drafter
    says bfloat16 (a float32 config would be served as float16 by SGLang).
    """
    out = Path(out_dir)
    arch = drafter_arch_from_target(target_dir, num_layers=num_layers, block_size=block_size,
                                    mask_token_id=mask_token_id, layer_types=layer_types,
                                    sliding_window=sliding_window)
    if out.exists() and any(out.iterdir()) and not force:
        raise DFlashError(f"output folder {out} is not empty (use --force to overwrite)")
    model = DFlashDrafter(arch)
    model.init_weights(seed)  # drawn in fp32, then cast: the same numbers whatever the dtype
    model = model.to(target_dtype(target_dir))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return model


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="local HF folder of the target model (Qwen3 / Llama)")
    p.add_argument("--out", required=True, help="folder to write the drafter export (config.json, model.safetensors)")
    p.add_argument("--num-layers", type=int, default=5, help="draft decoder layers (default 5)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block incl. the anchor (default 16)")
    p.add_argument("--mask-token-id", type=int, default=None,
                   help="MASK token id (default: the tokenizer's mask token, <|mask|>, or a spare vocab row)")
    p.add_argument("--layer-types", default="",
                   help="comma-separated attention type per draft layer, full_attention or sliding_attention "
                        "(default: all full_attention)")
    p.add_argument("--sliding-window", type=int, default=None,
                   help="window of the sliding_attention layers in positions, the query included")
    p.add_argument("--seed", type=int, default=0, help="init seed (default 0)")
    p.add_argument("--force", action="store_true", help="overwrite a non-empty --out folder")


def run(args: argparse.Namespace) -> int:
    types = [t.strip() for t in args.layer_types.split(",") if t.strip()] or None
    model = init_drafter(args.target, args.out, num_layers=args.num_layers, block_size=args.block_size,
                         mask_token_id=args.mask_token_id, seed=args.seed, force=args.force,
                         layer_types=types, sliding_window=args.sliding_window)
    n = sum(p.numel() for p in model.parameters())
    a = model.arch
    print(f"drafter: {a.num_hidden_layers} layers, hidden {a.hidden_size}, block {a.block_size}, "
          f"target layers {a.target_layer_ids}, mask token {a.mask_token_id}, {n / 1e6:.2f} M params -> {args.out}")
    if a.has_sliding:
        print(f"layer types {a.layer_types}, sliding window {a.sliding_window}")
    return 0
