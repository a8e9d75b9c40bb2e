"""The serving engine in the loop: a vLLM server started from its own environment, and an OpenAI-compatible client."""
