"""`dflash-ds init-drafter`: derive a drafter from a target and save a random init in the export format."""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path
from typing import Any

from dflash_ds.config_parse import class_field_docs
from dflash_ds.errors import DFlashError
from dflash_ds.models.drafter import DFlashDrafter
from dflash_ds.models.from_target import SHAPE_OVERRIDES, drafter_arch_from_target, target_dtype
from dflash_ds.models.kinds import DFLASH, kind_names, kind_recipe, kind_spec, kind_specs, options_dict
from dflash_ds.models.warm_start import warm_start


def init_drafter(target_dir: str | Path, out_dir: str | Path, *, num_layers: int = 5, block_size: int = 16,
                 mask_token_id: int | None = None, seed: int = 0, force: bool = False,
                 layer_types: list[str] | None = None, sliding_window: int | None = None,
                 options: Any = None, layers_from_target: bool = False, **shape: Any) -> DFlashDrafter:
    """Build, seed-init and save a drafter for `target_dir` into `out_dir` (atomically), in the target's dtype.

    `layers_from_target`: the draft layers start as the target's last ones (models/target_layers_init.py).

    The export's dtype is what SGLang / vLLM run under --dtype auto, so a bf16 target's drafter
    says bfloat16 (a float32 config would be served as float16 by SGLang). `shape`: the heads, head
    width and MLP width when not the target's (models/from_target.SHAPE_OVERRIDES). `options`: a drafter of their
    kind (models/kinds.py: `KindSpec.options`, e.g. `kind_spec(name).default_options()`; None = DFlash).
    """
    arch = drafter_arch_from_target(target_dir, num_layers=num_layers, block_size=block_size,
                                    mask_token_id=mask_token_id, layer_types=layer_types,
                                    sliding_window=sliding_window, options=options,
                                    layers_from_target=layers_from_target, **shape)
    _check_out(Path(out_dir), force)
    model = DFlashDrafter.seeded(arch, seed)  # drawn in fp32, then cast: the same numbers whatever the dtype
    if layers_from_target:
        from dflash_ds.models.target_layers_init import copy_target_layers

        copy_target_layers(model, target_dir)
    return save_atomically(model.to(target_dtype(target_dir)), Path(out_dir))


def warm_start_drafter(source_dir: str | Path, out_dir: str | Path, kind: str,
                       options: Any = None, seed: int = 0,
                       force: bool = False) -> DFlashDrafter:
    """A `kind` drafter from the export in `source_dir` (models/warm_start.py), saved into `out_dir`."""
    _check_out(Path(out_dir), force)
    source = DFlashDrafter.from_pretrained(source_dir)
    return save_atomically(warm_start(source, kind, options, seed), Path(out_dir))


def _check_out(out: Path, force: bool) -> None:
    if out.exists() and any(out.iterdir()) and not force:
        raise DFlashError(f"output folder {out} is not empty (use --force to overwrite)")


def save_atomically(model: DFlashDrafter, out: Path) -> DFlashDrafter:
    """Write the export into a temporary folder beside `out`, then put it in place (never half-written)."""
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
    p.add_argument("--target", help="local HF folder of the target model (Qwen3 / Llama); not with --from")
    p.add_argument("--from", dest="source", default=None,
                   help="warm start: build --kind from this trained DFlash export (ours, or a released one in the "
                        "reference format), its backbone copied and the added parts at identity / zero, so that "
                        "step 0 drafts exactly as it (the shape flags are the export's; only --kind's own flags "
                        "apply). Train it with --drafter OUT")
    p.add_argument("--out", required=True, help="folder to write the drafter export (config.json, model.safetensors)")
    p.add_argument("--num-layers", type=int, default=5, help="draft decoder layers (default 5)")
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per block incl. the anchor (default: the kind's recipe's, "
                        + "".join(f"{s.name} {s.recipe['model.block_size']}; " for s in kind_specs()
                                  if "model.block_size" in s.recipe) + "else 16)")
    p.add_argument("--mask-token-id", type=int, default=None,
                   help="MASK token id (default: the tokenizer's mask token, <|mask|>, or a spare vocab row)")
    p.add_argument("--layer-types", default="",
                   help="comma-separated attention type per draft layer, full_attention or sliding_attention "
                        "(default: all full_attention)")
    p.add_argument("--sliding-window", type=int, default=None,
                   help="window of the sliding_attention layers in positions, the query included")
    p.add_argument("--num-attention-heads", type=int, default=None,
                   help="query heads per draft layer (default: the target's; z-lab's Qwen3.6-27B drafter: 32)")
    p.add_argument("--num-key-value-heads", type=int, default=None,
                   help="key/value heads per draft layer, dividing the query heads (default: the target's)")
    p.add_argument("--head-dim", type=int, default=None,
                   help="width of one attention head (default: the target's; z-lab's Qwen3.6-27B drafter: 128)")
    p.add_argument("--intermediate-size", type=int, default=None,
                   help="MLP width of each draft layer (default: the target's)")
    p.add_argument("--kind", choices=kind_names(), default=DFLASH,
                   help="; ".join(f"{spec.name} ({spec.summary})" for spec in kind_specs()))
    for spec in kind_specs():  # each kind's own fields, as flags
        if spec.options is None:
            continue
        kind, defaults, docs = spec.name, spec.options(), class_field_docs(spec.options)
        for name in spec.model_fields:
            value = getattr(defaults, name)
            text = " ".join(docs[name].split())
            kw = ({"type": lambda v: v.lower() in ("1", "true", "yes"), "metavar": "BOOL"}
                  if isinstance(value, bool) else {"type": type(value)})
            p.add_argument(f"--{name.replace('_', '-')}", default=value, **kw,
                           help=f"{kind}: {text[0].lower()}{text[1:].rstrip('.')} (default {value})")
    p.add_argument("--layers-from-target", action="store_true",
                   help="start draft layer i of n as the target's layer L-n+i (its attention, MLP and norms), fc "
                        "passing the last context layer through and the target's final norm, not at random: on "
                        "SmolLM2-135M est_tau 1.26 instead of 1.19 after 400 steps (docs/QUALITY.md); the draft "
                        "layers must have the target's widths")
    p.add_argument("--seed", type=int, default=0, help="init seed (default 0)")
    p.add_argument("--force", action="store_true", help="overwrite a non-empty --out folder")


def run(args: argparse.Namespace) -> int:
    if args.source:
        if args.target or args.layers_from_target:
            raise DFlashError("init-drafter: --from takes the shape and the weights from the export; drop --target "
                              "and --layers-from-target")
        options = kind_spec(args.kind).options_from_model(args)
        model = warm_start_drafter(args.source, args.out, args.kind, options, seed=args.seed, force=args.force)
    elif not args.target:
        raise DFlashError("init-drafter: give --target (a new drafter) or --from (a warm start from an export)")
    else:
        types = [t.strip() for t in args.layer_types.split(",") if t.strip()] or None
        block = args.block_size or kind_recipe(args.kind)[1].get("model.block_size", 16)  # as a run of the kind
        model = init_drafter(args.target, args.out, num_layers=args.num_layers, block_size=block,
                             mask_token_id=args.mask_token_id, seed=args.seed, force=args.force,
                             layer_types=types, sliding_window=args.sliding_window,
                             options=kind_spec(args.kind).options_from_model(args),
                             layers_from_target=args.layers_from_target,
                             **{name: getattr(args, name) for name in SHAPE_OVERRIDES})
    n = sum(p.numel() for p in model.parameters())
    a = model.arch
    print(f"drafter: {a.num_hidden_layers} layers, hidden {a.hidden_size}, heads {a.num_attention_heads} / "
          f"{a.num_key_value_heads} of {a.head_dim}, MLP {a.intermediate_size}, block {a.block_size}, "
          f"target layers {a.target_layer_ids}, mask token {a.mask_token_id}, {n / 1e6:.2f} M params -> {args.out}")
    if a.options is not None:
        print(f"{a.kind}: {options_dict(a.options)}")
    if a.has_sliding:
        print(f"layer types {a.layer_types}, sliding window {a.sliding_window}")
    from dflash_ds.serving.vllm_server import serve_command

    # derived from the export, as eval --engine vllm serves it (a trained export of the same shape serves alike)
    print(f"serve: {serve_command(args.target or 'TARGET', args.out)}")
    return 0
