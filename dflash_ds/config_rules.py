"""The rules every run configuration is checked against (config.load_config runs `validate`).

Each field's rule is one line of `_RULES` (the text is what the user reads); model.kind's and those of each
kind's own fields come from the kinds' specs (models/kinds.py: `KindSpec.rules`); the rules that relate
fields (layer types and layer count, a validation split and its interval, the topology's modes) are
the functions below. Nothing here imports dflash_ds.config (no cycle).
"""

from __future__ import annotations

import re
import typing
from typing import Any

from dflash_ds.errors import DFlashError

Config = DrafterConfig = Any  # dflash_ds.config's classes; importing them would make an import cycle


# (dotted field, rule text, predicate). The rule text is what the user reads.
_RULES: list[tuple[str, str, typing.Callable[[Any], bool]]] = [
    ("model.num_layers", "must be >= 1", lambda v: v >= 1),
    ("model.block_size", "must be >= 2 (the anchor plus at least one predicted token)", lambda v: v >= 2),
    ("model.mask_token_id", "must be >= 0", lambda v: v is None or v >= 0),
    ("model.target_layer_ids", "must be a non-empty list of layer ids >= 0",
     lambda v: v is None or (len(v) > 0 and all(i >= 0 for i in v))),
    ("model.layer_types", "entries must be full_attention or sliding_attention",
     lambda v: not v or all(t in ("full_attention", "sliding_attention") for t in v)),
    ("model.sliding_window", "must be >= 1", lambda v: v is None or v >= 1),
    *((f"model.{name}", "must be >= 1 (or null: the target's)", lambda v: v is None or v >= 1)
      for name in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")),
    ("model.attention_backend", "must be auto, dense or flex", lambda v: v in ("auto", "dense", "flex")),
    ("model.init", "must be random or target", lambda v: v in ("random", "target")),
    ("model.checkpoint_layers", "must be >= 1 (or null: all, or the fewest that fit)", lambda v: v is None or v >= 1),
    ("loss.gamma", "must be > 0", lambda v: v > 0),
    ("loss.num_anchors", "must be >= 1", lambda v: v >= 1),
    ("loss.max_anchors_per_batch", "must be >= 0 (0 = no cap)", lambda v: v >= 0),
    ("loss.chunk_blocks", "must be >= 1", lambda v: v >= 1),
    ("loss.kl_weight", "must be in [0, 1]", lambda v: 0 <= v <= 1),
    ("loss.kl_temperature", "must be > 0", lambda v: v > 0),
    ("loss.streak_weight", "must be in [0, 1]", lambda v: 0 <= v <= 1),
    ("loss.labels", "must be data or target", lambda v: v in ("data", "target")),
    ("loss.lk", 'must be "" (off), log, hybrid or l1', lambda v: v in ("", "log", "hybrid", "l1")),
    ("loss.lk_weight", "must be in [0, 1]", lambda v: 0 <= v <= 1),
    ("loss.lk_kl_scale", "must be in [0, 1]", lambda v: 0 <= v <= 1),
    ("loss.lk_kl_decay", "must be >= 0", lambda v: v >= 0),
    ("loss.position_weighting", "must be decay or dpace", lambda v: v in ("decay", "dpace")),
    ("loss.dpace_alpha", "must be in [0, 1]", lambda v: 0 <= v <= 1),
    ("optim.lr", "must be > 0", lambda v: v > 0),
    ("optim.min_lr_ratio", "must be in [0, 1]", lambda v: 0 <= v <= 1),
    ("optim.warmup_steps", "must be >= 0", lambda v: v >= 0),
    ("optim.weight_decay", "must be >= 0", lambda v: v >= 0),
    ("optim.beta1", "must be in [0, 1)", lambda v: 0 <= v < 1),
    ("optim.beta2", "must be in [0, 1)", lambda v: 0 <= v < 1),
    ("optim.grad_clip", "must be >= 0", lambda v: v >= 0),
    ("noise.max_std", "must be >= 0", lambda v: v >= 0),
    ("noise.min_std", "must be >= 0", lambda v: v >= 0),
    ("noise.warmup_steps", "must be >= 0", lambda v: v >= 0),
    ("data.max_length", "must be >= 2", lambda v: v >= 2),
    ("data.token_budget", "must be >= 1", lambda v: v >= 1),
    ("data.num_buckets", "must be >= 1", lambda v: v >= 1),
    ("data.prefetch", "must be >= 1", lambda v: v >= 1),
    ("data.val_fraction", "must be in [0, 1)", lambda v: 0 <= v < 1),
    ("train.max_steps", "must be >= 1", lambda v: v >= 1),
    ("train.umask", 'must be an octal mask written as a string, 0o027 or "027" (a bare 027 is read as the number '
     "23: quote it or write 0o027)", lambda v: re.fullmatch(r"0[oO]?[0-7]{2,3}", v) is not None),
    ("train.log_interval", "must be >= 1", lambda v: v >= 1),
    ("train.save_interval", "must be >= 1", lambda v: v >= 1),
    ("train.keep_last", "must be >= 1", lambda v: v >= 1),
    ("train.global_batch", "must be >= 0 (0 = the checkpoint's, else one per drafter rank)", lambda v: v >= 0),
    ("train.launcher_grace_s", "must be > 0", lambda v: v > 0),
    ("train.zero_stage", "must be 0, 1, 2 or 3", lambda v: v in (0, 1, 2, 3)),
    ("train.dtype", "must be auto, fast, bf16 or fp32", lambda v: v in ("auto", "fast", "bf16", "fp32")),
    ("train.feature_cache_gb", "must be >= 0 (0 = off)", lambda v: v >= 0),
    ("train.target_attention", "must be auto, sdpa, eager, flash_attention_2, flash_attention_3 or flex_attention",
     lambda v: v in ("auto", "sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")),
    ("train.timeout_s", "must be > 0", lambda v: v > 0),
    ("train.stop_at", "must be >= 0", lambda v: v >= 0),
    ("train.startup_timeout_s", "must be > 0", lambda v: v > 0),
    ("train.bridge_timeout_s", "must be > 0", lambda v: v > 0),
    ("train.heartbeat_timeout_s", "must be > 0", lambda v: v > 0),
    ("train.max_bad_steps", "must be >= 1", lambda v: v >= 1),
    ("train.est_tau_rows", "must be >= 0 (0 = off)", lambda v: v >= 0),
    ("train.est_tau_interval", "must be >= 1", lambda v: v >= 1),
    ("train.est_tau_window", "must be >= 1", lambda v: v >= 1),
    ("train.eval_interval", "must be >= 0 (0 = never)", lambda v: v >= 0),
    ("train.eval_batches", "must be >= 0 (0 = the whole split)", lambda v: v >= 0),
    ("topology.num_target_ranks", "must be >= 1", lambda v: v >= 1),
    ("topology.targets_per_node", "must be >= 0", lambda v: v >= 0),
    ("topology.target_parallel", "must be >= 1", lambda v: v >= 1),
    ("topology.sequence_parallel", "must be >= 1", lambda v: v >= 1),
]


def umask_of(text: str) -> int:
    """train.umask as a number for os.umask ("0o027", "027" -> 0o027)."""
    return int(text.replace("o", "").replace("O", ""), 8)


def _get(cfg: Config, dotted: str) -> Any:
    obj: Any = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


# model.kind and each kind's own fields (model.* and loss.*) are checked after this field's rule (the kinds' specs
# hold theirs)
_KIND_RULES_AFTER = "model.attention_backend"


def _kind_rules() -> list[tuple[str, str, typing.Callable[[Any], bool]]]:
    """model.kind's rule (a registered kind: models/kinds.py), then every kind's rules of its fields."""
    from dflash_ds.models.kinds import kind_names, kind_specs  # here: importing the config loads no kind

    names = kind_names()
    text = f"must be {', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else f"must be {names[0]}"
    return [("model.kind", text, lambda v: v in names), *(rule for spec in kind_specs() for rule in spec.rules)]


def _all_rules() -> list[tuple[str, str, typing.Callable[[Any], bool]]]:
    at = next(i for i, (dotted, _, _) in enumerate(_RULES) if dotted == _KIND_RULES_AFTER) + 1
    return [*_RULES[:at], *_kind_rules(), *_RULES[at:]]


def validate(cfg: Config) -> Config:
    """Check every field's rule; raise DFlashError naming the first field that breaks one."""
    for dotted, rule, ok in _all_rules():
        value = _get(cfg, dotted)
        if not ok(value):
            raise DFlashError(f"config: {dotted} = {value!r} {rule}")
    _validate_layer_types(cfg.model)
    _validate_kind_fields(cfg)
    if cfg.noise.min_std > cfg.noise.max_std:
        raise DFlashError(
            f"config: noise.min_std = {cfg.noise.min_std} must be <= noise.max_std = {cfg.noise.max_std}")
    if cfg.data.max_length > cfg.data.token_budget:
        raise DFlashError(
            f"config: data.max_length = {cfg.data.max_length} must be <= data.token_budget = "
            f"{cfg.data.token_budget} (one longest sequence must fit a micro-batch)")
    _validate_validation(cfg)
    t = cfg.topology
    if t.colocate and t.targets_per_node:
        raise DFlashError(f"config: topology.colocate = true runs the target on every rank: topology.targets_per_node "
                          f"= {t.targets_per_node} cannot be combined with it")
    if t.colocate and t.target_parallel > 1:
        raise DFlashError(f"config: topology.target_parallel = {t.target_parallel} shards the target over target ranks; "
                          "colocated mode (topology.colocate = true) loads the whole target on every rank and cannot "
                          "shard it: use target ranks (--num-target-ranks) for a target larger than one GPU")
    if t.colocate_overlap and not t.colocate:
        raise DFlashError("config: topology.colocate_overlap = true needs topology.colocate = true (--colocate)")
    return cfg


def _validate_validation(cfg: Config) -> None:
    """One validation split at most, and an evaluation interval only with one."""
    d = cfg.data
    if d.val_fraction > 0 and d.val_path:
        raise DFlashError(f"config: data.val_fraction = {d.val_fraction} and data.val_path = {d.val_path!r}: "
                          f"choose one validation split")
    if cfg.train.eval_interval and not (d.val_fraction > 0 or d.val_path):
        raise DFlashError(f"config: train.eval_interval = {cfg.train.eval_interval} needs a validation split "
                          f"(data.val_fraction or data.val_path)")


def _validate_layer_types(m: DrafterConfig) -> None:
    """model.layer_types: one entry per draft layer; sliding layers need model.sliding_window. (And
    model.checkpoint_layers: at most the draft layers, never with checkpointing off.)"""
    if m.checkpoint_layers is not None and m.checkpoint_layers > m.num_layers:
        raise DFlashError(f"config: model.checkpoint_layers = {m.checkpoint_layers} must be <= model.num_layers = "
                          f"{m.num_layers} (the draft layers it recomputes)")
    if m.checkpoint_layers is not None and m.activation_checkpointing is False:
        raise DFlashError(f"config: model.checkpoint_layers = {m.checkpoint_layers} recomputes layers, but "
                          "model.activation_checkpointing = false: set it true (or null), or drop checkpoint_layers")
    if not m.layer_types:
        return
    if len(m.layer_types) != m.num_layers:
        raise DFlashError(f"config: model.layer_types has {len(m.layer_types)} entries but model.num_layers = "
                          f"{m.num_layers} (one per draft layer)")
    if "sliding_attention" in m.layer_types and m.sliding_window is None:
        raise DFlashError("config: model.layer_types has sliding_attention layers: set model.sliding_window")


def kind_fields() -> dict[str, tuple[str, ...]]:
    """The model.* fields of each kind beyond DFlash (its spec's model_fields, models/kinds.py)."""
    from dflash_ds.models.kinds import kind_specs

    return {spec.name: spec.model_fields for spec in kind_specs() if spec.model_fields}


def _validate_kind_fields(cfg: Config) -> None:
    """A field of another kind set away from its default (a field of kind k while model.kind is not k) -> one clear
    error (it would be ignored).

    With --drafter the folder fixes the kind (model.kind may stay at its default on a folder of another kind):
    runtime/job.check_kind_fields_match_drafter checks these fields against the folder instead."""
    if cfg.drafter:
        return
    defaults = type(cfg.model)()
    for kind, names in kind_fields().items():
        if cfg.model.kind == kind:
            continue
        for name in names:
            value = getattr(cfg.model, name)
            if value != getattr(defaults, name):
                raise DFlashError(f"config: model.{name} = {value!r} is a {kind} field but model.kind = "
                                  f"{cfg.model.kind!r} ignores it: set model.kind = {kind} or drop model.{name}")
