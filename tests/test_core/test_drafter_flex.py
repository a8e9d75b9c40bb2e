"""The flex_attention BlockMask path (GPU training) against the dense boolean mask (CPU training).

On CPU flex_attention runs forward only (eager), which checks the mask_mod itself; the GPU test
(skipped without CUDA) checks the compiled kernel forward and backward, fp32 and bf16.
"""

import warnings

import pytest
import torch

from dflash_ds.errors import DFlashError
from dflash_ds.models.drafter import DFlashDrafter, DrafterArch

H, NT = 64, 3


S, F = "sliding_attention", "full_attention"


def make_drafter(bs: int, seed: int = 0, layer_types=None, window=None) -> DFlashDrafter:
    arch = DrafterArch(hidden_size=H, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=64, rms_norm_eps=1e-6,
                       max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                       block_size=bs, num_target_layers=8, mask_token_id=63, target_layer_ids=[1, 3, 5],
                       layer_types=layer_types, sliding_window=window)
    d = DFlashDrafter(arch)
    d.init_weights(seed, std=0.1)
    return d


def batch(b: int, s: int, a: int, bs: int, device: str = "cpu", seed: int = 1):
    """Random context/block inputs; anchors sorted, some 0 (padding anchors) and some near the end."""
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randn(b, s, NT * H, generator=g)
    emb = torch.randn(b, a, bs, H, generator=g)
    anchors = torch.sort(torch.randint(0, s - bs, (b, a), generator=g), dim=1).values
    anchors[0, 0] = 0
    return ctx.to(device), emb.to(device), anchors.to(device)


def run(d: DFlashDrafter, backend: str, ctx, emb, anchors) -> torch.Tensor:
    d.mask_backend = backend
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex on CPU warns that it is unfused
        return d.forward_train(ctx, emb, anchors)


@pytest.mark.parametrize("b,s,a,bs,layer_types,window", [
    (2, 12, 3, 4, None, None), (2, 150, 9, 16, None, None), (1, 200, 17, 8, None, None),
    (2, 40, 5, 8, [S, F], 5),  # window inside the block
    (1, 200, 17, 8, [S, S], 64),  # window over the context
])
def test_flex_mask_equals_dense_mask_on_cpu(b, s, a, bs, layer_types, window):
    d = make_drafter(bs, layer_types=layer_types, window=window).eval()
    ctx, emb, anchors = batch(b, s, a, bs)
    with torch.no_grad():
        dense = run(d, "dense", ctx, emb, anchors)
        flex = run(d, "flex", ctx, emb, anchors)
    assert dense.shape == (b, a, bs, H)
    torch.testing.assert_close(flex, dense, atol=2e-5, rtol=1e-4)


def test_unknown_mask_backend_is_an_error():
    d = make_drafter(4)
    ctx, emb, anchors = batch(1, 12, 2, 4)
    with pytest.raises(DFlashError, match="mask_backend"):
        run(d, "sparse", ctx, emb, anchors)


def forward_backward(d: DFlashDrafter, backend: str, ctx, emb, anchors, dtype):
    """Output and every gradient (parameters and context features), as fp32."""
    d.zero_grad(set_to_none=True)
    c = ctx.detach().to(dtype).clone().requires_grad_(True)
    out = run(d, backend, c, emb.to(dtype), anchors)
    out.float().square().mean().backward()
    return [out.detach().float()] + [p.grad.float() for p in d.parameters() if p.grad is not None] + [c.grad.float()]


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
@pytest.mark.parametrize("layer_types,window", [(None, None), ([S, F], 40)])
def test_compiled_flex_equals_dense_forward_and_backward_on_gpu_fp32(layer_types, window):
    d = make_drafter(16, layer_types=layer_types, window=window).cuda()
    ctx, emb, anchors = batch(2, 333, 20, 16, device="cuda")
    dense = forward_backward(d, "dense", ctx, emb, anchors, torch.float32)
    flex = forward_backward(d, "flex", ctx, emb, anchors, torch.float32)
    assert len(flex) == len(dense) > 10
    errs = [rel_err(f, r) for f, r in zip(flex, dense)]
    assert max(errs) < 1e-3, errs


@needs_cuda
def test_compiled_flex_in_bf16_on_gpu_is_as_close_to_fp32_as_dense_bf16():
    """bf16 kernels round differently, so both bf16 paths are judged against the fp32 result."""
    d = make_drafter(16).cuda()
    ctx, emb, anchors = batch(2, 333, 20, 16, device="cuda")
    ref = forward_backward(d, "dense", ctx, emb, anchors, torch.float32)
    d = d.to(torch.bfloat16)
    dense = forward_backward(d, "dense", ctx, emb, anchors, torch.bfloat16)
    flex = forward_backward(d, "flex", ctx, emb, anchors, torch.bfloat16)
    for k, (f, dn, r) in enumerate(zip(flex, dense, ref)):
        ef, ed = rel_err(f, r), rel_err(dn, r)
        assert ef <= 2 * ed + 2e-2, f"tensor {k}: flex bf16 error {ef:.3g} vs dense bf16 error {ed:.3g}"
