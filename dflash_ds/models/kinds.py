"""The drafter kinds, the export architecture name each one writes (config.json `architectures`), and how vLLM
serves each (docs/DESIGN.md §8, §11, §12)."""

from __future__ import annotations

DFLASH, DFLASH2, DSPARK = "dflash", "dflash2", "dspark"
KINDS = (DFLASH, DFLASH2, DSPARK)
ARCHITECTURES = {DFLASH: "DFlashDraftModel", DFLASH2: "DFlash2DraftModel", DSPARK: "Qwen3DSparkModel"}
# vLLM 0.32's speculative `method` per kind: DFlash2 rides on "dflash" (vLLM picks its DFlash2 speculator by the
# architecture name), DSpark has a method of its own (under "dflash" it would be served by the bare backbone).
VLLM_METHODS = {DFLASH: "dflash", DFLASH2: "dflash", DSPARK: "dspark"}
# Kinds vLLM 0.32 serves only on its V2 model runner (their drafting is Triton kernels: a GPU).
VLLM_V2_ONLY = frozenset({DFLASH2, DSPARK})
# Kinds whose vLLM speculator takes a config without `sample_from_anchor` as anchor-as-first (DeepSpec's DSpark
# layout: block_size drafts a block); the others draft block_size - 1 after the anchor, the bonus token.
VLLM_ANCHOR_FIRST_BY_DEFAULT = frozenset({DSPARK})


def kind_of_architecture(architectures: list[str] | None) -> str | None:
    """The kind whose export architecture is listed (None when none is)."""
    return next((kind for kind, name in ARCHITECTURES.items() if name in (architectures or [])), None)


# Kinds with a recipe of their own (the module holding RECIPE_NAME and RECIPE: dotted config field -> value), applied
# under a run's file and flags by config.load_config; a kind not listed trains the plain defaults.
RECIPE_MODULES = {DSPARK: "dflash_ds.models.dspark_arch"}


def kind_recipe(kind: str) -> tuple[str, dict]:
    """(name, fields) of the kind's own recipe; ("none", {}) for a kind without one."""
    import importlib

    if kind not in RECIPE_MODULES:
        return "none", {}
    module = importlib.import_module(RECIPE_MODULES[kind])
    return module.RECIPE_NAME, dict(module.RECIPE)
