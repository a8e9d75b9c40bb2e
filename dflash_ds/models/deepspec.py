"""`dflash-ds convert-deepspec`: a DeepSpec-layout DSpark checkpoint as a dflash-ds export, for eval, fine-tuning
(--drafter) and serving. DSpark's own command (DeepSpec trains only DSpark), beside its modules dspark.py and
dspark_arch.py; cli.py names it.

What is assumed about that layout, read from vLLM 0.32's loading code (no released checkpoint is reachable from
here): tensor names as `Qwen3DSparkForCausalLM.load_weights` takes them (`layers.N...`, `fc`, `hidden_norm`,
`norm`, `markov_head.markov_w{1,2}`, `confidence_head.proj`, without the `model.` prefix vLLM adds; a prefixed
name is accepted too), and beside them optional `embed_tokens` / `lm_head` (the target's: vLLM shares the
target's when they are absent), `mask_embedding` (an unused placeholder), `t2d` (training only) and `d2t` (a
reduced draft vocabulary: refused). Config keys as `config/speculative.py` reads them: architectures
`Qwen3DSparkModel` (or `DSparkDraftModel` with model_type qwen3), block_size at the top level (else
`dspark_block_size`, else dflash_config's), the mask id in dflash_config.mask_token_id (else `mask_token_id`,
`dspark_noise_token_id`), target layers in dflash_config.target_layer_ids (else `dspark_target_layer_ids`,
`target_layer_ids`); `sample_from_anchor` absent means true (`spec_decode/dspark/speculator.py`). The export keeps
that layout (models/dspark_arch.py: block_size N is N drafts, the backbone run as DeepSpec's).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dflash_ds.errors import DFlashError

DROPPED = ("embed_tokens.", "lm_head.", "mask_embedding", "t2d")  # the target's own, or unused at inference


def deepspec_config(cfg: dict, num_target_layers: int | None, where: str) -> dict:
    """DeepSpec's config.json as the export's (dflash_config, block_size, num_target_layers, architectures)."""
    arch = cfg.get("architectures") or []
    if "Qwen3DSparkModel" not in arch and not ("DSparkDraftModel" in arch and cfg.get("model_type") == "qwen3"):
        raise DFlashError(f"{where}: architectures {arch} is not a Qwen3 DSpark drafter (Qwen3DSparkModel)")
    dcfg = dict(cfg.get("dflash_config") or {})
    pick = lambda *vals: next((v for v in vals if v is not None), None)  # noqa: E731 - vLLM's precedence
    block = pick(cfg.get("block_size"), cfg.get("dspark_block_size"), dcfg.get("block_size"))
    mask = pick(dcfg.get("mask_token_id"), cfg.get("mask_token_id"), cfg.get("dspark_noise_token_id"))
    layers = pick(dcfg.get("target_layer_ids"), cfg.get("dspark_target_layer_ids"), cfg.get("target_layer_ids"))
    depth = pick(cfg.get("num_target_layers"), num_target_layers)
    for name, value in (("block_size", block), ("mask token id", mask), ("target layer ids", layers),
                        ("num_target_layers (pass --target)", depth)):
        if value is None:
            raise DFlashError(f"{where}: no {name}")
    out = {**cfg, "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "block_size": int(block),
           "num_target_layers": int(depth), "sample_from_anchor": cfg.get("sample_from_anchor", True)}
    out["dflash_config"] = {**dcfg, "mask_token_id": int(mask), "target_layer_ids": list(layers),
                            "block_size": int(block)}
    return out


def convert_deepspec(src: str | Path, out: str | Path, target: str | Path | None = None) -> Path:
    """Read a DeepSpec-layout checkpoint folder and write it as an export folder; returns `out`."""
    from safetensors.torch import load_file

    from dflash_ds.models.drafter import DFlashDrafter, DrafterArch

    src, out = Path(src), Path(out)
    where = str(src / "config.json")
    try:
        cfg = json.loads((src / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise DFlashError(f"{where}: cannot read ({exc})") from None
    depth = None
    if target is not None:
        from dflash_ds.models.target import read_target_config

        depth = int(read_target_config(target)["num_hidden_layers"])
    arch = DrafterArch.from_json_dict(deepspec_config(cfg, depth, where), where)
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise DFlashError(f"{src}: no *.safetensors")
    state = {}
    for f in files:
        for name, tensor in load_file(str(f)).items():
            name = name.removeprefix("model.")
            if name == "d2t" or name.endswith(".d2t"):
                raise DFlashError(f"{f}: a reduced draft vocabulary (d2t) is not supported here")
            if not name.startswith(DROPPED):
                state[name] = tensor
    model = DFlashDrafter.empty(arch)  # every parameter is loaded below (checked)
    expected = {k for k in model.state_dict() if not k.startswith("rotary_emb.")}
    if expected != state.keys():
        raise DFlashError(f"{src}: tensor names do not match a {arch.kind} drafter of its config (missing "
                          f"{sorted(expected - state.keys())[:3]}, unexpected {sorted(state.keys() - expected)[:3]})")
    model.load_state_dict(state, strict=False)
    return model.to(next(iter(state.values())).dtype).save_pretrained(out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Register the convert-deepspec flags."""
    p.add_argument("src", help="DeepSpec-layout checkpoint folder (config.json + *.safetensors)")
    p.add_argument("--out", required=True, help="export folder to write (config.json + model.safetensors)")
    p.add_argument("--target", default=None, help="the target's HF folder: its depth when the config has no "
                                                  "num_target_layers")


def run(args: argparse.Namespace) -> int:
    """CLI entry: convert and say what was written."""
    out = convert_deepspec(args.src, args.out, args.target)
    from dflash_ds.serving.vllm_server import serve_command

    print(f"convert-deepspec: {args.src} -> {out} (anchor-as-first layout kept; embed_tokens / lm_head / "
          "mask_embedding / t2d dropped: the target's are used)")
    print(f"serve: {serve_command(args.target or 'TARGET', out)}")
    return 0
