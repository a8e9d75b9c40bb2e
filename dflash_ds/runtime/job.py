"""What every rank of a job derives from the config alone: the drafter shape, the dtype, the last step.

`run_job` derives them once and hands them to the role it runs; each rank computes the same
values, so nothing but the resume point (sent by the leader) has to travel at start-up.
"""

from __future__ import annotations

import torch

from dflash_ds.config import Config, DrafterConfig
from dflash_ds.errors import DFlashError
from dflash_ds.hardware import native_bf16_cpu
from dflash_ds.models.drafter_arch import DrafterArch, read_drafter_arch
from dflash_ds.models.from_target import SHAPE_OVERRIDES, drafter_arch_from_target
from dflash_ds.models.kinds import kind_spec, kind_specs


def resolve_arch(cfg: Config) -> DrafterArch:
    """The drafter shape: from --drafter's config.json, else derived from the target and cfg.model."""
    if cfg.drafter:
        arch = read_drafter_arch(cfg.drafter)
        tgt = drafter_arch_from_target(cfg.target, num_layers=arch.num_hidden_layers, block_size=arch.block_size,
                                       mask_token_id=arch.mask_token_id, target_layer_ids=arch.target_layer_ids)
        check_arch_matches_target(arch, tgt, cfg.drafter, cfg.target)
        check_model_matches_drafter(cfg, arch)
        return arch
    return drafter_arch_from_target(cfg.target, num_layers=cfg.model.num_layers, block_size=cfg.model.block_size,
                                    mask_token_id=cfg.model.mask_token_id, target_layer_ids=cfg.model.target_layer_ids,
                                    layer_types=cfg.model.layer_types, sliding_window=cfg.model.sliding_window,
                                    options=kind_spec(cfg.model.kind).options_from_model(cfg.model),
                                    layers_from_target=cfg.model.init == "target",
                                    **{name: getattr(cfg.model, name) for name in SHAPE_OVERRIDES})


def check_arch_matches_target(arch: DrafterArch, tgt: DrafterArch, drafter_dir, target_dir) -> None:
    """A drafter whose width, vocab or target depth differs from the target's -> one clear error."""
    for name in ("num_target_layers", "hidden_size", "vocab_size"):
        a, b = getattr(arch, name), getattr(tgt, name)
        if a != b:
            raise DFlashError(f"drafter {drafter_dir} has {name} = {a} but target {target_dir} has {b}")


# model.* field -> the DrafterArch attribute that --drafter's config.json fixes
MODEL_FIELDS = {"num_layers": "num_hidden_layers", "block_size": "block_size", "mask_token_id": "mask_token_id",
                "target_layer_ids": "target_layer_ids", "layer_types": "layer_types", "sliding_window": "sliding_window",
                **{name: name for name in SHAPE_OVERRIDES}, "kind": "kind"}


def check_model_matches_drafter(cfg: Config, arch: DrafterArch) -> None:
    """A model.* shape field set (away from its default) to another value than --drafter's -> one clear error.

    --drafter's config.json fixes the shape; a config or flag that asks for another one would otherwise be
    ignored without a word (a 5-layer config training a 2-layer drafter)."""
    defaults = DrafterConfig()
    for name, attr in MODEL_FIELDS.items():
        asked, default, has = getattr(cfg.model, name), getattr(defaults, name), getattr(arch, attr)
        if asked not in (default, None, []) and asked != has:  # None / [] (layer_types): not asked
            raise DFlashError(f"model.{name} = {asked} but --drafter {cfg.drafter} has {attr} = {has}: the "
                              f"drafter's config.json fixes the shape; drop model.{name} or start from a drafter "
                              "of that shape (dflash-ds init-drafter)")
    check_kind_fields_match_drafter(cfg, arch, defaults)


def check_kind_fields_match_drafter(cfg: Config, arch: DrafterArch, defaults: DrafterConfig) -> None:
    """A model.* field of a kind (its spec's model_fields) set away from its default to another value than
    --drafter's -> one clear error.

    The folder fixes the kind too, so config_rules lets these through with --drafter (kind may stay at its
    default on a folder of another kind) and this is where a field of one kind on a folder of another is caught."""
    for spec in kind_specs():
        kind, opts = spec.name, (arch.options if arch.kind == spec.name else None)
        for name in spec.model_fields:
            asked = getattr(cfg.model, name)
            if asked == getattr(defaults, name):  # the default: not asked
                continue
            if opts is None:
                raise DFlashError(f"model.{name} = {asked} but --drafter {cfg.drafter} is a {arch.kind} drafter "
                                  f"(no {name}): drop model.{name} or start from a {kind} drafter "
                                  f"(dflash-ds init-drafter --kind {kind})")
            has = getattr(opts, name)
            if asked != has:
                raise DFlashError(f"model.{name} = {asked} but --drafter {cfg.drafter} has {name} = {has}: the "
                                  f"drafter's config.json fixes the shape; drop model.{name} or start from a "
                                  "drafter of that shape (dflash-ds init-drafter)")


def torch_dtype(cfg: Config, cuda: bool) -> torch.dtype:
    """Compute dtype: bf16 on GPU, fp32 on CPU unless the config says otherwise; `fast`: bf16 where the device
    computes it natively (a GPU, a CPU with AVX512-BF16 or AMX), fp32 elsewhere."""
    if cfg.train.dtype == "bf16" or (cfg.train.dtype == "auto" and cuda):
        return torch.bfloat16
    if cfg.train.dtype == "fast" and (cuda or native_bf16_cpu()):
        return torch.bfloat16
    return torch.float32


def dtype_warning(cfg: Config, cuda: bool) -> str | None:
    """A warning when the run asks for bf16 on a CPU that emulates it (several times slower than fp32), else None."""
    if cfg.train.dtype != "bf16" or cuda or native_bf16_cpu():
        return None
    return ("train.dtype bf16 on a CPU without native bf16 (no AVX512-BF16 or AMX): torch emulates its matmuls, "
            "~6x slower than fp32 here (dflash_ds/hardware.native_bf16_cpu); train.dtype fast picks bf16 only where it is "
            "native, fp32 elsewhere")


def last_step(cfg: Config) -> int:
    """Steps this invocation runs up to: train.stop_at if set (and earlier), else train.max_steps."""
    if cfg.train.stop_at and cfg.train.stop_at < cfg.train.max_steps:
        return cfg.train.stop_at
    return cfg.train.max_steps


def load_run_target(cfg: Config, dtype: torch.dtype, device: torch.device, rank: int) -> torch.nn.Module:
    """The frozen target on this rank's device (its shard of it with topology.target_parallel > 1), with the
    configured attention kernels; logs what runs."""
    from dflash_ds.models.target import describe_target, held_bytes, load_target

    k = cfg.topology.target_parallel
    target = load_target(cfg.target, dtype=dtype, device=device, attn_implementation=cfg.train.target_attention,
                         tp_size=k, hub_kernels=cfg.train.target_hub_kernels)
    shard = ""
    if k > 1:
        mine, whole = held_bytes(target)
        shard = f" (tensor-parallel shard of {k}: {mine / 1e9:.3f} of {whole / 1e9:.3f} GB, {mine / whole:.0%})"
    print(f"[dflash-ds] rank {rank}: {describe_target(target)}{shard}", flush=True)
    return target
