"""RoPE frequencies stay fp32 whatever the drafter is cast to (serving engines rotate with fp32 frequencies).

A bf16 `inv_freq` is 0.37% off: at position 2047 of a rope_theta 1e6, head_dim 128 drafter the phase of
the fastest pair is off by radians, so a model trained that way disagrees with what SGLang/vLLM serve.
"""

from __future__ import annotations

import pytest
import torch

from dflash_ds.models.drafter import DFlashDrafter, DrafterArch

H, HEAD_DIM = 128, 128


def make_drafter(seed: int = 0) -> DFlashDrafter:
    arch = DrafterArch(hidden_size=H, intermediate_size=128, num_hidden_layers=1, num_attention_heads=1,
                       num_key_value_heads=1, head_dim=HEAD_DIM, vocab_size=64, rms_norm_eps=1e-6,
                       max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                       block_size=4, num_target_layers=8, mask_token_id=63, target_layer_ids=[1, 5])
    d = DFlashDrafter(arch)
    d.init_weights(seed, std=0.2)  # peaky attention: the keys' positions matter
    return d


def fp32_freqs(d: DFlashDrafter) -> torch.Tensor:
    """The frequencies of a drafter never cast (fp32, as transformers computes them)."""
    return make_drafter().rotary_emb.inv_freq


@pytest.mark.parametrize("cast", [
    lambda m: m.to(torch.bfloat16),  # the trainer's and eval's cast
    lambda m: m.bfloat16(),  # DeepSpeed's bf16 engine
    lambda m: m.half(),
    lambda m: m.to("cpu", torch.bfloat16),
])
def test_casts_keep_rope_frequencies_fp32(cast) -> None:
    d = cast(make_drafter())
    assert next(d.parameters()).dtype in (torch.bfloat16, torch.float16)  # the weights did change dtype
    for name in ("inv_freq", "original_inv_freq"):
        buf = getattr(d.rotary_emb, name)
        assert buf.dtype == torch.float32, name
        assert torch.equal(buf, fp32_freqs(d)), name


def test_trainer_module_cast_keeps_rope_fp32() -> None:
    # The engine casts the wrapper that holds the drafter and the frozen head: the cast recurses into it.
    from dflash_ds.runtime.engine import DrafterTrainModule

    d = make_drafter()
    module = DrafterTrainModule(d, torch.nn.Embedding(64, H), torch.nn.Linear(H, 64, bias=False)).bfloat16()
    assert module.drafter.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(module.drafter.rotary_emb.inv_freq, fp32_freqs(d))


def bf16_rope_error(d_bf16: DFlashDrafter, reference: DFlashDrafter, ctx: torch.Tensor, emb: torch.Tensor,
                    anchors: torch.Tensor) -> float:
    with torch.no_grad():
        got = d_bf16.forward_train(ctx.bfloat16(), emb.bfloat16(), anchors).float()
        want = reference.forward_train(ctx, emb, anchors)
    return (got - want).abs().max().item() / want.abs().max().item()


def test_bf16_forward_is_closer_to_the_fp32_frequency_reference() -> None:
    torch.manual_seed(0)
    s = 2048
    ctx = torch.randn(1, s, 2 * H)
    emb = torch.randn(1, 2, 4, H)
    anchors = torch.tensor([[1500, 2040]])
    reference = make_drafter()
    with torch.no_grad():  # the reference runs the bf16-rounded weights in fp32 with fp32 frequencies
        for p in reference.parameters():
            p.copy_(p.bfloat16().float())
    fixed = make_drafter().to(torch.bfloat16)
    old = make_drafter().to(torch.bfloat16)
    for name in ("inv_freq", "original_inv_freq"):  # what a plain cast left before: bf16 frequencies
        old.rotary_emb._buffers[name] = old.rotary_emb._buffers[name].bfloat16()
    err_fixed = bf16_rope_error(fixed, reference, ctx, emb, anchors)
    err_old = bf16_rope_error(old, reference, ctx, emb, anchors)
    # Measured (max abs error / max abs output): fp32 frequencies 0.0073 (bf16 activations alone), bf16
    # frequencies 0.065: 9x further from the reference.
    assert err_fixed < err_old / 3, (err_fixed, err_old)
