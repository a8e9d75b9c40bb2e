"""The memory model: what a drafter rank holds, counted from the code; the trainer, `plan` and `bench` read it."""
