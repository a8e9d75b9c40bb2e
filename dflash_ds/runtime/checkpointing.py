"""Activation checkpointing on or off for this drafter rank: the config's choice, else whatever the GPU holds.

Recomputing each draft layer in backward costs a fourth more layer FLOPs: on one H200 at Qwen3-8B's shape a
micro-step took 0.888 s with it and 0.751 s without (docs/BENCHMARKS.md), for 9.5 against 37.3 GB of step memory.
`model.activation_checkpointing: null` (the default) therefore turns it off on a GPU whose free memory holds the
step without it, by bench memory's formula (`bench/memory_model.py`, which over-predicts that step by ~6.5% on the
H200), and on otherwise. At the default config (16,384 tokens, 2,048 anchors, ZeRO-2 over one drafter rank):

- Qwen3-8B, disaggregated drafter rank: micro-step 39.71 + model states 16.78 + frozen embedding and head 2.49 +
  receive buffers 5.37 = 64.4 GB: off on an 80 GB GPU (0.85 x ~79 GB free = 67 GB) and on an H200;
- Qwen3-8B colocated (the target's 16.4 GB, its embedding and head already allocated): 57.2 GB against 0.85 x
  ~62 GB free on 80 GB: on; off on an H200 (~123 GB free);
- Qwen3.6-27B (H 5,120, V 248,320): 95.5 GB disaggregated: on at 80 GB, off on an H200; colocated beside its
  54 GB target, 84.3 GB against 0.85 x ~85 GB free on an H200: on.
"""

from __future__ import annotations

from typing import Any

import torch

# Of the free memory at engine build, the share the drafter may plan to use: the rest covers what the formula does
# not count (DeepSpeed's fp32 gradient accumulation buffers, NCCL's, the allocator's slack, a colocated target's
# forward activations; measured together 2.9 GB over `plan` at Qwen3-8B's colocated shape).
USABLE_SHARE = 0.85


def step_bytes_without_checkpointing(cfg: Any, arch: Any, *, colocated: bool, num_drafters: int) -> float:
    """What the rank still has to allocate when the step keeps every layer's activations (bench memory's formula)."""
    from dflash_ds.bench import memory_model as mm

    shape = mm.DrafterShape(
        hidden=arch.hidden_size, intermediate=arch.intermediate_size, heads=arch.num_attention_heads,
        kv_heads=arch.num_key_value_heads, head_dim=arch.head_dim, vocab=arch.vocab_size,
        num_layers=arch.num_hidden_layers, num_read=len(arch.target_layer_ids), block_size=arch.block_size,
        kind=arch.kind, options=arch.options)
    budget, length = cfg.data.token_budget, cfg.data.max_length
    batch, seq = max(1, budget // length), min(length, budget)
    step = mm.StepShape(batch=batch, seq_len=seq, chunk_blocks=cfg.loss.chunk_blocks, kl=cfg.loss.needs_last_hidden,
                        anchors_per_row=mm.anchors_per_row(batch, seq, arch.block_size, cfg.loss.num_anchors,
                                                           cfg.loss.max_anchors_per_batch),
                        dtype_bytes=2, checkpointing=False, dense_mask=cfg.model.attention_backend == "dense",
                        cuda=True)
    static = mm.static_terms(shape, budget, cfg.train.zero_stage, num_drafters, kl=step.kl,
                             **({"payloads_alive": 1, "pooled": False} if colocated else {}))
    if colocated:  # the target's own embedding and head, already allocated with it
        static.pop("frozen_embed_head")
    return mm.micro_step_peak(shape, step, param_grads=False) + sum(static.values())


def choose_checkpointing(cfg: Any, arch: Any, device: torch.device, *, colocated: bool = False,
                         num_drafters: int = 1, free_bytes: int | None = None) -> tuple[bool, str]:
    """(checkpointing on?, why) for this rank; `free_bytes` defaults to the device's free memory now."""
    asked = cfg.model.activation_checkpointing
    if asked is not None:
        return bool(asked), f"model.activation_checkpointing = {str(asked).lower()}"
    if device.type != "cuda":
        return False, "off on CPU (model.activation_checkpointing: null)"
    if free_bytes is None:
        free_bytes = torch.cuda.mem_get_info(device)[0]
    need = step_bytes_without_checkpointing(cfg, arch, colocated=colocated, num_drafters=num_drafters)
    usable = USABLE_SHARE * free_bytes
    verdict = "off" if need <= usable else "on"
    return verdict == "on", (f"{verdict}: the step without it needs {need / 1e9:.1f} GB by bench memory's formula, "
                             f"{'within' if verdict == 'off' else 'over'} {USABLE_SHARE:.0%} of the "
                             f"{free_bytes / 1e9:.1f} GB free (model.activation_checkpointing: null)")
