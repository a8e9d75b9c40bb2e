"""The draft layer's elementwise ops (RMSNorm, RoPE, SwiGLU), compiled on CUDA (components/fusion.py, train.fuse).

Eager, each is several full-size kernels forward and more backward: RMSNorm's cast, square, mean, scale, cast
back and weight; RoPE's negation, concatenation, two products and a sum; SwiGLU's silu and product. At the
Qwen3-8B preset's micro-step (2,048 blocks x 16 = 32,768 query rows, 5 layers, H 4,096, MLP 12,288, bf16) one
[32,768 x 4,096] activation is 0.27 GB in bf16, 0.54 GB in fp32: an eager RMSNorm moves ~5 GB forward and about
twice that backward, where one compiled kernel reads and writes ~0.5 GB forward and ~1 GB backward. Over the two
layer norms, the q / k norms, RoPE of q and k, and SwiGLU's [32,768 x 12,288], with checkpointing's recompute,
that is ~300 GB a micro-step eager (~75 ms at ~4 TB/s; the profile's "elementwise ~20%" of 0.888 s is ~180 ms
with the loss's passes) against ~30 GB compiled.

Each runs on rows (a fused function's first dimension is its one symbolic size): the callers flatten the leading
dimensions, views of contiguous tensors, and view the result back. Numerics: the eager forms below are the
reference (Qwen3's: RMSNorm in fp32, cast before the weight); compiled, inductor keeps intermediates in fp32
where eager bf16 rounds each product (RoPE, SwiGLU): differences within bf16's rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash_ds.components.fusion import fused


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3's RMSNorm over the last dimension of x [..., D]."""
    return _rms_norm_rows(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)


@fused
def _rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [B, L, heads, D] at cos / sin [B, L, D] (rotate-half, as Qwen3)."""
    b, length, heads, d = x.shape
    return _rope_rows(x.reshape(b * length, heads, d), cos.reshape(b * length, d),
                      sin.reshape(b * length, d)).view(x.shape)


@fused
def _rope_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of two [..., I] tensors."""
    return _swiglu_rows(gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1])).view(gate.shape)


@fused
def _swiglu_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up
