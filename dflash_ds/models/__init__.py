"""Single-device model code: the drafter and the frozen target. No process groups here.

Nothing is imported here: the registry (kinds.py) and the kinds' arch modules it loads import no torch (the config
reads them), and `DFlashDrafter(arch)` (drafter.py) imports a kind's drafter module the first time it builds one
(`KindSpec.drafter_module`).
"""
