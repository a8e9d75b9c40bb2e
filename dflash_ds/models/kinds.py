"""The drafter kinds and the export architecture name each one writes (config.json `architectures`)."""

from __future__ import annotations

DFLASH, DFLASH2, DSPARK = "dflash", "dflash2", "dspark"
KINDS = (DFLASH, DFLASH2, DSPARK)
ARCHITECTURES = {DFLASH: "DFlashDraftModel", DFLASH2: "DFlash2DraftModel", DSPARK: "Qwen3DSparkModel"}
