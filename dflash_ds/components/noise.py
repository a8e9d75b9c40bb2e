"""Gaussian noise on the context features (train.noise_std), drawn so that any slice of positions gets the values
the whole sequence would.

Positions are cut into fixed chunks of `NOISE_CHUNK`; chunk c of a batch is one `randn([B, NOISE_CHUNK, F])` from a
generator seeded by (seed, c). A rank that holds positions [start, start + S/N) of a sequence (sequence
parallelism: a shard computed here or received already cut) draws only the chunks it overlaps and gets exactly the
one-rank values: the same noise at every N, with no whole-context draw. What one draw costs: B x NOISE_CHUNK x F x
4 B in fp32, 21 MB at the Qwen3-8B preset (F = 5 x 4096, B 1), against 10.7 GB for one draw over a 128K-token
sequence (the noise was drawn whole, in fp32, before this module); the result is one copy of the context in its
own dtype, as `context + noise` was.
"""

from __future__ import annotations

import torch

# Positions per seeded draw: a draw covers whole chunks, so a batch or a shard draws up to NOISE_CHUNK - 1 positions
# a row it does not use at each end (a 200-token CPU batch at 256 draws 256); 512 draws at a 128K sequence.
NOISE_CHUNK = 256
_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads chunk indices over the seed space
_MASK = (1 << 63) - 1


def chunk_seed(seed: int, chunk: int) -> int:
    """The generator seed of chunk `chunk` under `seed` (a 63-bit value, distinct for distinct chunks)."""
    return (int(seed) * 1_000_003 + (chunk + 1) * _MIX) & _MASK


def noisy_context(context: torch.Tensor, std: float, seed: int, start: int = 0) -> torch.Tensor:
    """`context` [B, S_local, F] (positions start .. start + S_local of the sequence) plus N(0, std^2) noise, as a
    new tensor in the context's dtype; `std` 0 returns `context` itself."""
    if std <= 0:
        return context
    out = context.clone()
    b, length, width = context.shape
    stop = start + length
    gen = torch.Generator(device=context.device)
    for c in range(start // NOISE_CHUNK, -(-stop // NOISE_CHUNK)):
        lo, hi = max(start, c * NOISE_CHUNK), min(stop, (c + 1) * NOISE_CHUNK)
        gen.manual_seed(chunk_seed(seed, c))
        noise = torch.randn((b, NOISE_CHUNK, width), generator=gen, device=context.device, dtype=torch.float32)
        piece = noise[:, lo - c * NOISE_CHUNK:hi - c * NOISE_CHUNK]
        out[:, lo - start:hi - start] += (piece * std).to(context.dtype)
    return out
