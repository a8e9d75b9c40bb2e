"""Single-device model code: the drafter and the frozen target. No process groups here."""
