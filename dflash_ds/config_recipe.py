"""A drafter kind's own recipe: config fields its runs take unless the file or a flag sets them.

A kind's `model.kind` alone trains its recipe (`KindSpec.recipe`, in its module; e.g. DeepSpec's objective): the
recipe sits between the defaults and the run's file, so whatever the run sets wins, and `recipe: none` turns it
off. The kind is the run's model.kind, or with --drafter the folder's (its config.json architectures), whose shape
then stays the folder's (the recipe's model.* fields are not applied). `recipe_report` is the line rank 0 prints:
the recipe in force and each of its fields the run departs from (under --drafter, the folder's shape against the
recipe's model.* fields). Nothing here imports dflash_ds.config (no cycle).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from dflash_ds.errors import DFlashError

NONE, AUTO = "none", "auto"


def _kind_of(cfg: Any) -> str:
    """The run's drafter kind: --drafter's folder's when the run names one and leaves model.kind at its default."""
    if cfg.drafter and cfg.model.kind == type(cfg.model)().kind:
        try:
            arch = json.loads((Path(cfg.drafter) / "config.json").read_text()).get("architectures")
        except (OSError, ValueError):
            return cfg.model.kind  # resolve_arch names the folder's problem later
        from dflash_ds.models.kinds import kind_of_architecture

        return kind_of_architecture(arch) or cfg.model.kind
    return cfg.model.kind


def _nested(fields: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for dotted, value in fields.items():
        node = out
        *head, last = dotted.split(".")
        for part in head:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def recipe_fields(cfg: Any) -> tuple[str, dict[str, Any]]:
    """(name, dotted fields) of the recipe a run built from `cfg`'s file and flags takes (("none", {}) if none)."""
    from dflash_ds.models.kinds import kind_recipe

    kind = _kind_of(cfg)
    name, fields = kind_recipe(kind)
    if cfg.recipe not in (AUTO, NONE, name):
        raise DFlashError(f"config: recipe = {cfg.recipe!r} is not a recipe of drafter kind {kind!r}: use auto "
                          f"(its own: {name}) or none (the plain defaults)")
    if cfg.recipe == NONE or not fields:
        return NONE, {}
    if cfg.drafter:  # the folder fixes the shape
        fields = {k: v for k, v in fields.items() if not k.startswith("model.")}
    return name, fields


def with_recipe(build: Callable[[dict[str, Any]], Any]) -> Any:
    """`build(base)` makes the run's config from the defaults updated by `base` and then its file and flags; build it
    once to learn its kind, then again on the kind's recipe, and record the recipe's name in `recipe`."""
    cfg = build({})
    name, fields = recipe_fields(cfg)
    if fields:
        cfg = build(_nested(fields))
    cfg.recipe = name
    return cfg


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


ARCH_NAMES = {"num_layers": "num_hidden_layers"}  # a model.* field -> its DrafterArch attribute, where they differ


def _folder_value(arch: Any, field: str) -> Any:
    """The value of model.`field` in a drafter's shape (its DrafterArch, or its kind's options)."""
    name = ARCH_NAMES.get(field, field)
    return getattr(arch, name) if hasattr(arch, name) else getattr(arch.options, name, None)


def recipe_report(cfg: Any, kind: str, arch: Any = None) -> str:
    """The recipe in force for a run of drafter `kind` and each of its fields the run sets otherwise (one line).

    With --drafter the model.* fields are the folder's (`arch`, its DrafterArch): they are compared as the folder
    has them, so a drafter warm-started from a block-16 export says it trains at block 16 where its recipe says 8."""
    from dflash_ds.models.kinds import kind_recipe

    name, fields = kind_recipe(kind)
    if cfg.recipe == NONE:
        extra = f" (drafter kind {kind}'s own recipe, {name}, is off: recipe none)" if fields else ""
        return f"recipe: none, the defaults of dflash_ds/config.py{extra}"
    off = []
    for k, v in fields.items():
        if cfg.drafter and k.startswith("model."):
            have = None if arch is None else _folder_value(arch, k.split(".", 1)[1])
            if have is not None and have != v:
                off.append(f"{k} {have!r} (recipe {v!r}; the --drafter folder's)")
        elif _get(cfg, k) != v:
            off.append(f"{k} {_get(cfg, k)!r} (recipe {v!r})")
    line = f"recipe: {name} (drafter kind {kind}'s own, under the run's file and flags)"
    return line + (f"; WARNING: this run departs from it: {', '.join(off)}" if off else "; the run keeps all of it")
