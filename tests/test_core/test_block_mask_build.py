"""The drafter's flex BlockMask is built from the block structure: the same mask as torch's create_block_mask
(the same tiles visible, the same attention), and no B x Q x KV tensor on the way (a memory proxy: the largest
tensor any op makes while building it, counted with a TorchDispatchMode)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_ds.memory.model import flex_block_mask_bytes
from dflash_ds.models.block_mask import dense_block_mask, flex_block_mask, flex_mask_mod, flex_shapes
from dflash_ds.models.drafter import DFlashDrafter
from sync_count import SyncCount


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op returns inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def anchors_of(b: int, a: int, s: int, bs: int, seed: int) -> torch.Tensor:
    """Sorted anchors below s, the last row's tail padded with 0 (the padding anchors of a short row)."""
    g = torch.Generator().manual_seed(seed)
    anchors = torch.sort(torch.randint(1, s - bs, (b, a), generator=g), dim=1).values
    anchors[-1, a // 2:] = 0
    return anchors


@pytest.mark.parametrize("b, a, s, bs, window", [
    (3, 20, 512, 8, None), (3, 20, 512, 8, 12),  # padded: S tile-aligned, Q = 160 (a ragged query tile)
    (1, 9, 128, 16, 200), (2, 11, 300, 16, None),  # B = 1; S not aligned (the unpadded path)
])
def test_structural_mask_equals_create_block_mask(b, a, s, bs, window):
    anchors = anchors_of(b, a, s, bs, seed=a + s)
    width = torch.tensor(s)
    ours = flex_block_mask(anchors, s, bs, window)
    ref = create_block_mask(flex_mask_mod(anchors, width, bs, window), b, None, a * bs, s + a * bs, device="cpu")
    assert ours.shape == ref.shape and torch.equal(ours.to_dense(), ref.to_dense())  # the same tiles visible
    ours_full = _tiles(ours.full_kv_num_blocks, ours.full_kv_indices, ref.kv_indices.shape[-1])
    ref_full = _tiles(ref.full_kv_num_blocks, ref.full_kv_indices, ref.kv_indices.shape[-1])
    assert not (ours_full & ~ref_full).any()  # a tile we skip mask_mod in is fully visible
    if s % 128 == 0:
        assert torch.equal(ours_full, ref_full)  # tile-aligned (flex_shapes): exactly torch's full tiles
    # The attention itself, against SDPA over the dense boolean mask.
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, 2, n, 16, generator=g) for n in (a * bs, s + a * bs, s + a * bs))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex on CPU warns that it is unfused
        got = flex_attention(q, k, v, block_mask=ours)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_block_mask(anchors, s, bs, window))
    rows = (dense_block_mask(anchors, s, bs, window).any(-1))[..., None]  # queries that see something
    torch.testing.assert_close(got * rows, want * rows, atol=1e-5, rtol=1e-5)


def _tiles(counts: torch.Tensor, indices: torch.Tensor, n: int) -> torch.Tensor:
    """flex's (count, ordered indices) back to [B, H, nQ, nKV] booleans (the indices are a permutation)."""
    first = torch.arange(n) < counts[..., None]
    return torch.zeros(*indices.shape[:-1], n, dtype=torch.bool).scatter(-1, indices.long(), first)


def test_the_drafters_flex_mask_makes_no_dense_tensor():
    """At a padded training shape: the largest tensor while the drafter builds its flex mask, against
    B x Q x KV (what create_block_mask evaluates mask_mod over)."""
    b, bs = 4, 16
    s, a = flex_shapes(1000, 40, bs)  # 1024, 40: Q = 640, KV = 1664
    anchors = anchors_of(b, a, s, bs, seed=1)
    dense = b * a * bs * (s + a * bs)
    for window in (None, 256):
        with LargestTensor() as built:
            DFlashDrafter.block_mask(anchors, s, bs, use_flex=True, sliding_window=window)
        # B x Q x 13 key tiles: 33,280 of 4,259,840
        assert built.largest <= b * a * bs * -(-(s + a * bs) // 128) < dense // 100, (built.largest, dense)
    with SyncCount() as counted:  # and no host wait (the old path copied the width from the host)
        mask = DFlashDrafter.block_mask(anchors, s, bs, use_flex=True)
    assert not counted.calls, counted.calls
    # What remains is counted by bench memory's model: the tile tables, exactly.
    tables = [mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices, mask.q_num_blocks,
              mask.q_indices, mask.full_q_num_blocks, mask.full_q_indices]
    assert sum(t.numel() * t.element_size() for t in tables) == flex_block_mask_bytes(b, a * bs, s + a * bs)
    assert flex_block_mask_bytes(8, 4096, 6144) == 201_728  # Qwen3-8B defaults: B 8, A 256 x bs 16, S 2,048
    with LargestTensor() as eager:  # the old path, for scale
        create_block_mask(flex_mask_mod(anchors, torch.tensor(s), bs, None), b, None, a * bs, s + a * bs, device="cpu")
    assert eager.largest >= dense
