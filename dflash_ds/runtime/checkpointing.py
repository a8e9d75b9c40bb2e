"""Activation checkpointing for this drafter rank: the config's choice, else the fewest recomputed layers that fit.

Recomputing a draft layer in backward costs a fourth more of its FLOPs: on one H200 at Qwen3-8B's shape a
micro-step took 0.888 s recomputing all 5 and 0.751 s none (docs/BENCHMARKS.md), for 9.5 against 37.3 GB of step
memory. `model.activation_checkpointing: null` (the default) therefore turns it off on a GPU whose free memory
holds the step without it, by bench memory's formula (`memory/model.py`, which over-predicts that step by
~6.5% on the H200), and otherwise recomputes the fewest layers k (the first k: `model.checkpoint_layers`) with
which it fits, all L where none does: each layer kept costs its activations (6.7-7.0 GB at Qwen3-8B's default
step, 9.1-9.4 GB at Qwen3.6-27B's) and saves its recompute (4.7% / 4.5% of the micro-step's model FLOPs each).
At the default config (16,384 tokens, 2,048 anchors, ZeRO-2 over one drafter rank):

- Qwen3-8B, disaggregated drafter rank: micro-step 39.71 + model states 16.78 + frozen embedding and head 2.49 +
  receive buffers 5.37 = 64.4 GB: off on an 80 GB GPU (0.85 x ~79 GB free = 67 GB) and on an H200;
- Qwen3-8B colocated (the target's 16.4 GB, its embedding and head already allocated): 57.2 GB against 0.85 x
  ~62 GB free on 80 GB: 1 layer of 5 recomputed (50.5 GB); off on an H200 (~123 GB free);
- Qwen3.6-27B (H 5,120, V 248,320): 95.5 GB disaggregated: 4 of 5 at 80 GB (58.1 GB; 3 would need 67.5 against
  67.2), off on an H200; colocated beside its 54 GB target, 84.3 GB against 0.85 x ~85 GB free on an H200:
  2 of 5 (65.7 GB).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

# Of the free memory at engine build, the share the drafter may plan to use: the rest covers what the formula does
# not count (DeepSpeed's fp32 gradient accumulation buffers, NCCL's, the allocator's slack, a colocated target's
# forward activations; measured together 2.9 GB over `plan` at Qwen3-8B's colocated shape).
USABLE_SHARE = 0.85


class Checkpointing(NamedTuple):
    """What a drafter rank recomputes: `on`, the first `layers` draft layers (None: all), and why."""

    on: bool
    layers: int | None
    why: str


def fewest_recomputed(needs: list[float], usable: float) -> int:
    """The rule: with needs[k] the bytes of the step recomputing its first k layers (k = 0..L), the fewest k whose
    need fits `usable`, or L when none does."""
    return next((k for k, need in enumerate(needs) if need <= usable), len(needs) - 1)


def step_bytes(cfg: Any, arch: Any, *, colocated: bool, num_drafters: int, recomputed: int = 0) -> float:
    """What the rank still has to allocate when the step recomputes its first `recomputed` layers (bench memory's
    formula; 0: every layer's activations kept)."""
    from dflash_ds.memory import model as mm

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
                        dtype_bytes=2, checkpointing=recomputed > 0, checkpoint_layers=recomputed,
                        dense_mask=cfg.model.attention_backend == "dense", cuda=True)
    static = mm.static_terms(shape, budget, cfg.train.zero_stage, num_drafters, kl=step.kl,
                             **({"payloads_alive": 1, "pooled": False} if colocated else {}))
    if colocated:  # the target's own embedding and head, already allocated with it
        static.pop("frozen_embed_head")
    return mm.micro_step_peak(shape, step, param_grads=False) + sum(static.values())


def step_bytes_without_checkpointing(cfg: Any, arch: Any, *, colocated: bool, num_drafters: int) -> float:
    """What the rank still has to allocate when the step keeps every layer's activations."""
    return step_bytes(cfg, arch, colocated=colocated, num_drafters=num_drafters)


def choose_checkpointing(cfg: Any, arch: Any, device: torch.device, *, colocated: bool = False,
                         num_drafters: int = 1, free_bytes: int | None = None) -> Checkpointing:
    """What this rank recomputes; `free_bytes` defaults to the device's free memory now. A configured
    model.activation_checkpointing wins (true: model.checkpoint_layers, else all); under null, on a GPU: off when
    the step fits without it, else model.checkpoint_layers when set, else the fewest layers that fit (all when none
    does)."""
    asked, layers = cfg.model.activation_checkpointing, cfg.model.checkpoint_layers
    total = arch.num_hidden_layers
    if asked is not None:
        return Checkpointing(bool(asked), layers if asked else None,
                             f"model.activation_checkpointing = {str(asked).lower()}"
                             + (f", model.checkpoint_layers = {layers} of {total}" if asked and layers else ""))
    if device.type != "cuda":
        return Checkpointing(False, None, "off on CPU (model.activation_checkpointing: null)")
    if free_bytes is None:
        free_bytes = torch.cuda.mem_get_info(device)[0]
    usable = USABLE_SHARE * free_bytes
    where = f"{USABLE_SHARE:.0%} of the {free_bytes / 1e9:.1f} GB free (model.activation_checkpointing: null)"

    needs = [step_bytes(cfg, arch, colocated=colocated, num_drafters=num_drafters, recomputed=k)
             for k in range(total + 1)]
    k = fewest_recomputed(needs, usable)
    if k == 0:
        return Checkpointing(False, None, f"off: the step without it needs {needs[0] / 1e9:.1f} GB by bench memory's "
                                          f"formula, within {where}")
    if layers is not None:
        return Checkpointing(True, layers, f"on, model.checkpoint_layers = {layers} of {total}: the step without it "
                                           f"needs {needs[0] / 1e9:.1f} GB, over {where}")
    return Checkpointing(True, k, f"on for {k} of {total} layers: the step needs {needs[k] / 1e9:.1f} GB by bench "
                                  f"memory's formula recomputing {k} ({needs[0] / 1e9:.1f} GB recomputing none), "
                                  f"{'within' if needs[k] <= usable else 'over'} {where}")
