"""Data stages: conversation formats, tokenization with the target chat template (prepare), regeneration, batching."""
