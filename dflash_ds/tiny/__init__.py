"""Tiny seeded targets, their tokenizer and prompts: real HF folders for tests, benchmarks and the CPU demo."""
