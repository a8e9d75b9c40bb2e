"""Warm-started recipes of `bench recipe`: `from: PATH` (with `{seed}`) starts each seed's run from another
run's export instead of a fresh drafter.

    - name: KIND_warm
      from: q/recipe/dflash/seed{seed}     # a bench run folder (its trained export) or an export folder
      set: {model.kind: KIND, loss.lk: l1, loss.lk_weight: 0.9}

KIND is a kind that can be warm-started (its spec's `warm_start`, models/kinds.py). The run folder gets
`warm_start/`: `init-drafter --from` of that export into the recipe's model.kind (models/warm_start.py: the
kind's added parts at identity / zero, so step 0 drafts as the source), and trains from
it with `--drafter`. The source's own training tokens are not the run's: the table's tokens column counts the
run's only, so compare a warm row with a from-scratch row trained for the sum.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash_ds.errors import DFlashError


def warm_source(recipe: dict[str, Any], seed: int) -> Path | None:
    """The export a recipe's run of `seed` starts from (None: a fresh drafter); an error naming what is missing."""
    template = recipe.get("from")
    if not template:
        return None
    path = Path(str(template).replace("{seed}", str(seed)))
    trained = path / "trained.json"
    if trained.is_file():  # a bench run folder: its trained export
        return path / json.loads(trained.read_text())["export"]
    if (path / "config.json").is_file():
        return path
    raise DFlashError(f"recipe {recipe['name']}: from {path} is neither a finished bench run (trained.json) nor an "
                      "export folder (config.json): run that bench first")


def warm_flags(recipe: dict[str, Any], seed: int, run_dir: Path) -> list[str]:
    """`--drafter RUN_DIR/warm_start` for a warm-started recipe (made once from its source), else nothing."""
    source = warm_source(recipe, seed)
    if source is None:
        return []
    out = run_dir / "warm_start"
    if not (out / "config.json").is_file():
        from dflash_ds.config import DrafterConfig
        from dflash_ds.models.kinds import DFLASH, kind_spec
        from dflash_ds.tools.init_drafter import warm_start_drafter

        kind = str(recipe["set"].get("model.kind", DFLASH))
        fields = {k.removeprefix("model."): v for k, v in recipe["set"].items() if k.startswith("model.")}
        options = kind_spec(kind).options_from_model(DrafterConfig(**{**fields, "kind": kind}))
        warm_start_drafter(source, out, kind, options, seed=seed, force=True)
    return ["--drafter", str(out)]

