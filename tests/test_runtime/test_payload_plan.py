"""The payload a drafter plans its receive for (from the data plan alone) is exactly what a target sends."""

from __future__ import annotations

import pytest
import torch

from dflash_ds.data.batching import BatchSpec
from dflash_ds.data.loader import collate
from dflash_ds.distributed.bridge import AsyncSender
from dflash_ds.errors import DFlashError
from dflash_ds.models.from_target import drafter_arch_from_target
from dflash_ds.models.target import capture_layers, load_target
from dflash_ds.distributed.wire import payload_specs
from dflash_ds.distributed.wire import build_payload


@pytest.mark.parametrize("kl", [False, True])
def test_planned_specs_match_the_batch_a_target_builds(tiny_target, kl: bool) -> None:
    arch = drafter_arch_from_target(tiny_target, num_layers=2, block_size=8)
    rows = {"input_ids": [[5, 6, 7], [8, 9, 10, 11, 12]], "loss_mask": [[0, 1, 1], [0, 0, 1, 1, 1]], "length": [3, 5]}
    spec = BatchSpec(index=0, bucket=0, sample_ids=[4, 9], real_tokens=8, padded_tokens=10)
    ids, mask, attn, lengths = collate(rows, spec, pad_id=0)
    target = load_target(str(tiny_target), dtype=torch.float32, device=torch.device("cpu"))
    layers, last = capture_layers(target, ids, attn, arch.target_layer_ids)
    planned = payload_specs(spec, arch, torch.float32, kl)
    sender = AsyncSender(bridge=None)  # only its buffer pool is used here
    out = build_payload(sender, planned, ids, mask, lengths, layers, last if kl else None)
    assert [(k, t.dtype, tuple(t.shape)) for k, t in out.items()] == planned
    assert planned[3] == ("context", torch.float32, (2, 5, len(arch.target_layer_ids) * arch.hidden_size))
    assert torch.equal(out["context"], torch.cat(layers, dim=-1)) and torch.equal(out["input_ids"], ids)
    # A batch in another dtype than the plan's is refused before it is sent, naming both.
    with pytest.raises(DFlashError, match=r"context float32\[2, 5, \d+\].*data plan says.*context bfloat16"):
        build_payload(sender, payload_specs(spec, arch, torch.bfloat16, kl), ids, mask, lengths, layers,
                      last if kl else None)
