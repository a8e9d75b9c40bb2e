"""The vocabulary head runs as one GEMM per chunk in every kind's micro-step (docs/DESIGN.md §9).

A 3-D strided input to the head (positions 1.. of each block) made matmul broadcast the V x H head into a batched
GEMM of per-block [K x H] products: 47% of an H200 micro-step at Qwen3-8B's shape. The same dispatch happens on
CPU, so a profiled CPU micro-step at the real vocabulary shows any batched GEMM with a vocabulary-sized operand.

The loss core overwrites an fp32 chunk's logits with their gradient in place; taking the gradient at a view of that
buffer made autograd rebuild it through an as_strided backward: a zero-fill and a copy of the whole [c*K, V] chunk
per chunk (~10% of the chunk's CPU time), so the same profile also counts full passes that only move zeros or copies.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from dflash_ds.bench import micro_step
from dflash_ds.memory import model as mm
from dflash_ds.memory.shapes import drafter_shape
from dflash_ds.models.presets import PRESETS

BATCHED = ("aten::bmm", "aten::baddbmm")


def batched_gemms_with(vocab: int, kind: str) -> tuple[list[tuple[str, list]], int, list[tuple[str, list]], int]:
    """(batched GEMMs that have an operand with the vocabulary dimension, GEMMs with it, fills and copies of
    a buffer of blocks' logits, top-k passes over the vocabulary) in one micro-step."""
    cfg = dict(PRESETS["qwen3-8b"])  # the real vocabulary (151,936); a narrow drafter keeps it quick
    shape = drafter_shape(cfg, 64, 2, 16, kind)
    step = mm.StepShape(batch=2, seq_len=128, anchors_per_row=6, chunk_blocks=4, kl=True, dtype_bytes=4,
                        checkpointing=False, dense_mask=True, cuda=False)
    module, states, loss_cfg = micro_step.micro_step_inputs(
        cfg, shape, step, seed=0, num_anchors=6, max_anchors=0, chunk_blocks=4, kl_weight=0.5, mask_backend="dense",
        device=torch.device("cpu"), dtype=torch.float32)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        terms, _ = module(states, loss_cfg, 0, 0.0, 0)
        terms.loss.backward()
    bad, gemms, moves, topks = [], 0, [], 0
    for e in prof.events():
        shapes = [s for s in (e.input_shapes or []) if isinstance(s, list)]
        if e.name in ("aten::fill_", "aten::zero_", "aten::copy_") and shapes and shapes[0] \
                and torch.Size(shapes[0]).numel() % (15 * vocab) == 0:  # whole blocks' logits (a parameter's is not)
            moves.append((e.name, shapes))
        if not any(vocab in s for s in shapes):
            continue
        topks += e.name == "aten::topk"
        if e.name in BATCHED:
            bad.append((e.name, shapes))
        elif e.name in ("aten::mm", "aten::addmm"):
            gemms += 1
    return bad, gemms, moves, topks


@pytest.mark.parametrize("kind", ["dflash", "dflash2", "dspark"])
def test_no_batched_gemm_over_the_vocabulary(kind):
    """Head forward, its input gradient, the target's logits (KL on) and DSpark's Markov bias: 2-D GEMMs only."""
    vocab = PRESETS["qwen3-8b"]["vocab_size"]
    bad, gemms, moves, topks = batched_gemms_with(vocab, kind)
    assert not bad, f"{kind}: batched GEMMs over the vocabulary (the head read once per block): {bad[:3]}"
    assert not moves, f"{kind}: fills or copies of logits-sized buffers (an as_strided backward?): {moves[:3]}"
    # one top-k a chunk: DFlash2's candidates (top 8) are also the metrics' top-8 (eager; compiled counts ranks)
    assert topks == 3, f"{kind}: {topks} top-k passes over the vocabulary in 3 chunks"
    assert gemms >= 3 * 3  # 3 chunks of 12 blocks / 4: drafter logits, their input gradient, the target's logits
