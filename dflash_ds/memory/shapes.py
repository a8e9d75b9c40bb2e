"""The memory model's shapes for a target's text config: a drafter at any width of it, and one micro-batch.

`bench memory` measures and predicts at these shapes, `plan` prices a colocated drafter at the full width.
"""

from __future__ import annotations

import argparse
from typing import Any

from dflash_ds.memory import model as mm

SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def drafter_shape(cfg: dict[str, Any], width: int, num_layers: int, block_size: int,
                  kind: str = "dflash") -> mm.DrafterShape:
    """The drafter for `cfg` at hidden size `width`: head_dim kept, heads and MLP scaled by width / H."""
    h, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or h // heads)
    f = width / h
    n_heads = max(1, round(heads * f))
    n_kv = max(1, round(n_heads * kv / heads))
    while n_heads % n_kv:  # grouped-query attention needs kv heads dividing heads
        n_kv -= 1
    return mm.DrafterShape(hidden=width, intermediate=max(1, round(int(cfg["intermediate_size"]) * f)),
                           heads=n_heads, kv_heads=n_kv, head_dim=head_dim, vocab=int(cfg["vocab_size"]),
                           num_layers=num_layers, num_read=num_layers, block_size=block_size,
                           tied=bool(cfg.get("tie_word_embeddings", False)), kind=kind)


def step_shape(args: argparse.Namespace, dtype_bytes: int, checkpointing: bool, dense: bool,
               cuda: bool, checkpoint_layers: int | None = None) -> mm.StepShape:
    """The micro-batch of the run: token-budget // seq-len full-length sequences (with checkpointing, the first
    `checkpoint_layers` layers recomputed; None: all)."""
    batch = args.token_budget // args.seq_len
    a = mm.anchors_per_row(batch, args.seq_len, args.block_size, args.num_anchors, args.max_anchors)
    return mm.StepShape(batch=batch, seq_len=args.seq_len, anchors_per_row=a, chunk_blocks=args.chunk_blocks,
                        kl=args.kl_weight > 0, dtype_bytes=dtype_bytes, checkpointing=checkpointing,
                        checkpoint_layers=checkpoint_layers if checkpointing else None, dense_mask=dense, cuda=cuda)
