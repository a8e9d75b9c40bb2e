"""Shapes of published targets, as their text configs give them: what `bench memory`, `bench attention`
and `plan` size a real run with (memory depends on the shapes only; no weights are read)."""

from __future__ import annotations

from typing import Any

# Published text-config values as we read them (memory depends on the shapes only).
PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1e6,
                     tie_word_embeddings=False),
    "qwen3.6-27b": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
                        num_key_value_heads=4, head_dim=256, vocab_size=248320, rope_theta=1e7,
                        tie_word_embeddings=False),
}
