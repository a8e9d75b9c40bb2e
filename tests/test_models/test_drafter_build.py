"""A drafter built to be filled (`DFlashDrafter.empty` / `seeded`: every trainer start, export load, checkpoint
export and init-drafter) skips torch's default init, and once filled is the drafter the plain build gives: each
kind, every parameter and buffer, the RoPE frequencies kept fp32 through a cast, a save loaded back."""

from __future__ import annotations

import pytest
import torch

from dflash_ds.models.drafter import DFlashDrafter
from dflash_ds.models.from_target import drafter_arch_from_target
from dflash_ds.models.kinds import kind_names, kind_spec


@pytest.fixture
def default_inits(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The devices of the tensors torch's default init of a linear layer draws into, as a build runs it."""
    seen: list[str] = []
    original = torch.nn.init.kaiming_uniform_

    def recording(tensor, *args, **kwargs):
        seen.append(tensor.device.type)
        return original(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.nn.init, "kaiming_uniform_", recording)
    return seen


@pytest.mark.parametrize("kind", kind_names())
def test_a_seeded_build_skips_the_default_init_and_equals_build_then_init(kind, tiny_target, default_inits, tmp_path):
    spec = kind_spec(kind)
    arch = drafter_arch_from_target(tiny_target, num_layers=2, block_size=4,
                                    options=None if spec.options is None else spec.default_options())
    reference = DFlashDrafter(arch)
    assert "cpu" in default_inits  # the plain build draws every linear's default init on the CPU
    reference.init_weights(5)
    default_inits.clear()

    seeded = DFlashDrafter.seeded(arch, 5)
    assert "cpu" not in default_inits  # built on the meta device: nothing drawn on the CPU
    assert type(seeded) is type(reference) and type(seeded).kind == kind
    # parameters and buffers (RoPE's are computed, not saved: not in the state dict)
    ours = {**seeded.state_dict(), **dict(seeded.named_buffers())}
    theirs = {**reference.state_dict(), **dict(reference.named_buffers())}
    assert ours.keys() == theirs.keys() and "rotary_emb.inv_freq" in ours
    for name, tensor in theirs.items():
        assert ours[name].device.type == "cpu" and torch.equal(ours[name], tensor), name
    assert all(p.requires_grad for p in seeded.parameters())
    assert seeded._rope_fp32.keys() == reference._rope_fp32.keys()
    for name, tensor in reference._rope_fp32.items():
        assert seeded._rope_fp32[name].device.type == "cpu" and torch.equal(seeded._rope_fp32[name], tensor)
    bf16 = seeded.to(torch.bfloat16)
    assert bf16.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(bf16.rotary_emb.inv_freq, reference.rotary_emb.inv_freq)

    default_inits.clear()
    loaded = DFlashDrafter.from_pretrained(reference.save_pretrained(tmp_path / "export"))
    assert "cpu" not in default_inits
    for name, tensor in theirs.items():
        assert torch.equal({**loaded.state_dict(), **dict(loaded.named_buffers())}[name], tensor), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (launch/gpu_check.sh)")
def test_seeded_on_the_gpu_draws_there(tiny_target):
    """The benches' build (bench/micro_step.py): parameters allocated and drawn on the GPU, RoPE kept fp32."""
    arch = drafter_arch_from_target(tiny_target, num_layers=2, block_size=4)
    drafter = DFlashDrafter.seeded(arch, 5, "cuda").to(torch.bfloat16)
    params = dict(drafter.named_parameters())
    assert all(p.device.type == "cuda" and p.dtype == torch.bfloat16 for p in params.values())
    fc = params["fc.weight"].float()
    assert torch.isfinite(fc).all() and abs(fc.std().item() - 0.02) < 0.002
    assert torch.equal(params["norm.weight"].float(), torch.ones_like(params["norm.weight"].float()))
    rope = drafter.rotary_emb.inv_freq
    assert rope.device.type == "cuda" and rope.dtype == torch.float32
    assert torch.equal(rope.cpu(), DFlashDrafter(arch).rotary_emb.inv_freq)
