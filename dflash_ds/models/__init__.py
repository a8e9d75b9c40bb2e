"""Single-device model code: the drafter and the frozen target. No process groups here."""

# Drafter kinds beyond DFlash register their class on import, so that `DFlashDrafter(arch)` (models/drafter.py)
# builds the kind an arch names wherever a drafter is built or loaded.
from dflash_ds.models import dflash2 as _dflash2  # noqa: E402,F401
from dflash_ds.models import dspark as _dspark  # noqa: E402,F401
