"""DFlash2's block-local grouped dynamic convolution, with its backward written out (models/dflash2.py uses it).

    out[i, c] = sum_{t < taps} (base[t, c] + delta[i, t, c // group]) * x[i - t, c]

a tap reaching back only inside i's block (reading zero before the block's first position). x [R, H] is one
sublayer's input or output, delta [R, taps, groups] its per-token coefficients, base [taps, H] a parameter.

Why by hand. Left to autograd, the eager form (products and sums of broadcast views, a zero-padded shifted copy
per tap) kept for backward the shifted copy and each product's inputs: a DFlash2 layer kept 8.125 H-wide values
per block token more than a DFlash layer (saved-tensor hooks, tests/test_core/test_fusion.py), 10.9 GB at the
Qwen3-8B preset's micro-step without checkpointing (32,768 block tokens x 5 layers x 4,096 x bf16: the H200
measured 48.16 GB against DFlash's 37.27, the same 10.9); and its backward was a pass per product, a reduction
per broadcast and a sum per gradient contribution (DFlash2's H200 step was 1.35x DFlash's). Here the function
keeps x and delta only (x is the norm's output that the kernel projection keeps anyway, or the sublayer's
output), 4.125 H more than DFlash (models/dflash2_arch.saved_h: 5.5 GB there), and its backward is

    grad_x[i, c]     = sum_t (base[t, c] + delta[i + t, t, g(c)]) * g[i + t, c]      (i + t in i's block)
    grad_delta[i, t] = sum_{c in group} g[i, c] * x[i - t, c]
    grad_base[t, c]  = sum_i g[i, c] * x[i - t, c]

one product g * x per tap shared by the last two. Forward and backward are each a `fused` row function
(compiled under train.fuse: a kernel or two each; eager: a full-size pass per product, no shifted copy: the
taps add into slices in place).
"""

from __future__ import annotations

import torch

from dflash_ds.components.fusion import fused


def grouped_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int) -> torch.Tensor:
    """x [..., L, H] with L a multiple of block_size (blocks contiguous); delta [..., L, taps, groups];
    base [taps, H]. Taps reading before a block's first position read zero."""
    h, (taps, groups) = x.shape[-1], delta.shape[-2:]
    # contiguous: DFlash2's deltas are a side of the kernel projection's output (a view at an offset, which a
    # compiled graph would guard on: one graph per side); taps x groups values a token, H / 32 at the defaults
    out = _GroupedConv.apply(x.reshape(-1, h), delta.reshape(-1, taps, groups).contiguous(), base, block_size)
    return out.view(x.shape)


class _GroupedConv(torch.autograd.Function):
    """`grouped_conv` on rows, keeping x and delta for its own backward (module docstring)."""

    @staticmethod
    def forward(ctx, x, delta, base, block_size):
        ctx.save_for_backward(x, delta, base)
        ctx.block_size = block_size
        # base is a side of the base kernel, a view at an offset (a compiled graph would guard on it: one graph per
        # side): the compiled functions get a copy, taps x H values
        return _conv_rows(x, delta, base.clone(), block_size)

    @staticmethod
    def backward(ctx, grad):
        x, delta, base = ctx.saved_tensors
        need_x, need_delta, need_base = ctx.needs_input_grad[:3]
        gx, gdelta, gbase = _conv_grad_rows(grad.contiguous(), x, delta, base.clone(), ctx.block_size, need_x,
                                            need_delta or need_base)
        return gx if need_x else None, gdelta if need_delta else None, gbase if need_base else None, None


def _views(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int):
    """x as [blocks, block, groups, group], delta as [blocks, block, taps, groups, 1], base as [taps, groups, group]."""
    h, (taps, groups) = x.shape[-1], delta.shape[-2:]
    return (x.view(-1, block_size, groups, h // groups), delta.view(-1, block_size, taps, groups, 1),
            base.view(taps, groups, h // groups))


@fused
def _conv_rows(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int) -> torch.Tensor:
    """The forward on rows: x [R, H], delta [R, taps, groups], R a multiple of block_size."""
    xb, d, bk = _views(x, delta, base, block_size)
    out = torch.addcmul(xb * bk[0], xb, d[:, :, 0])
    for t in range(1, min(bk.shape[0], block_size)):
        # position i (>= t in its block) reads i - t: a slice of the same block, added in place
        tail = out[:, t:]
        tail.addcmul_(xb[:, :-t], bk[t])
        tail.addcmul_(xb[:, :-t], d[:, t:, t])
    return out.view(x.shape)


@fused
def _conv_grad_rows(g: torch.Tensor, x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int,
                    need_x: bool, need_coef: bool) -> tuple[torch.Tensor | None, torch.Tensor | None,
                                                            torch.Tensor | None]:
    """(grad x [R, H], grad delta [R, taps, groups], grad base [taps, H]) of `_conv_rows` (module docstring); a
    gradient not asked for is None."""
    xb, d, bk = _views(x, delta, base, block_size)
    gblk = g.view(xb.shape)
    taps = bk.shape[0]
    gx = gd = gbase = None
    if need_x:
        gx = torch.addcmul(gblk * bk[0], gblk, d[:, :, 0])
        for t in range(1, min(taps, block_size)):
            head = gx[:, :-t]  # x at i - t feeds out at i
            head.addcmul_(gblk[:, t:], bk[t])
            head.addcmul_(gblk[:, t:], d[:, t:, t])
        gx = gx.view(x.shape)
    if need_coef:
        gd = torch.zeros(delta.shape, dtype=delta.dtype, device=delta.device).view(d.shape[:-1])
        gbase = torch.zeros(base.shape, dtype=base.dtype, device=base.device).view(bk.shape)
        for t in range(min(taps, block_size)):
            p = gblk[:, t:] * xb[:, :xb.shape[1] - t]  # g[i] * x[i - t]: shared by both gradients
            gd[:, t:, t] = p.sum(-1)
            gbase[t] = p.sum((0, 1))
        gd, gbase = gd.view(delta.shape), gbase.view(base.shape)
    return gx, gd, gbase
