"""The drafter's training mask (docs/DESIGN.md §3) and the compiled flex_attention that runs it.

Block j (anchor a_j, positions a_j..a_j+bs-1) sees context positions < a_j and its own bs tokens,
never another block. Keys are laid out [context 0..S-1, block 0, block 1, ...]. CPU training uses a
dense boolean mask with SDPA; GPU training a flex_attention BlockMask and a compiled flex_attention.

Bounded compiles. Every micro-batch has its own shape: B rows (token-budget batching), the context
width S (its longest row, data/loader.py `collate`) and A anchors a row (the most any row drew,
components/loss.py `sample_anchors`); queries are Q = A*bs long, keys KV = S + Q. Compiled with
static shapes, each new (B, S, A) compiled a forward and a backward, and after dynamo's
recompile_limit (8) flex ran eagerly, materialising every score (an fp32 [B, heads, Q, KV] copy is
25.8 GB at the Qwen3-8B defaults). So:
- flex_attention is compiled with dynamic shapes (`dynamic=True`): B, Q and KV are symbols and one
  graph serves every size. Duck shaping is off while it compiles: it gives dims that happen to be
  equal at the first compile one symbol (in a trial A = 16 anchors met head_dim 16 and A was pinned
  to 16), so the first batch where they differ recompiles.
- dynamo specialises sizes 0 and 1, and inductor picks its decoding kernel for Q < 128 (a guard on
  Q). `flex_shapes` pads S to a multiple of FLEX_TILE (128) and A to at least 128 // bs + 1
  anchors: A >= 2, Q > 128 (two query tiles or more) and KV >= three key tiles in every batch. With
  S tile-aligned the block keys start on a tile boundary, so a query tile's own blocks lie in one
  key tile. B = 1 (a bucket's short last batch) is the one size left with a graph of its own.
- the mask_mod closure holds tensors (anchors, the padded width as a 0-d tensor) and per-run
  constants (bs, the window), never a per-batch Python int: a captured int is a guard.
A padded block (anchor 0) sees no context and only its own tokens; `DFlashDrafter.forward_train`
drops its output, so padding changes no result.

Bound (GRAPHS_PER_MASK): over a whole epoch, whatever the data, at most 2 graphs (B = 1, B >= 2) per
mask kind (full, sliding) and grad mode (training, no_grad) of a run's dtype: 2 when training the
default all-full-attention drafter, 2 x 2 x 2 = 8 at most: dynamo's default recompile_limit exactly, so
`run_flex` compiles with its own limit, FLEX_COMPILE.recompile_limit = 16 (twice the bound), scoped to the
flex call, and reaching it is an error (dynamo would otherwise run flex eagerly, silently). Each graph is a
40-70 s cold compile on a GPU: at 16, a run that breaks the bound fails within ~20 minutes, never eagerly.

The BlockMask is built from the block structure (`flex_block_mask`), not by evaluating mask_mod densely.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch._dynamo.config as dynamo_config
import torch.fx.experimental._config as fx_config
from torch._dynamo.exc import FailOnRecompileLimitHit

from dflash_ds.errors import DFlashError

try:  # block-sparse attention on GPU; CPU uses a dense boolean mask with SDPA
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
except ImportError:  # pragma: no cover - older torch
    flex_attention = None
    create_block_mask = None
    BlockMask = None

MASK_BACKENDS = ("auto", "dense", "flex")
FLEX_TILE = 128  # flex_attention's default BlockMask block size, for queries and keys
GRAPHS_PER_MASK = 2  # compiled graphs per (mask kind, grad mode): B = 1 and B >= 2 (module docstring)


@dataclass
class FlexCompile:
    """How flex_attention is compiled (the module-level `FLEX_COMPILE`).

    `on_cpu` compiles on CPU too (tests, with a counting `backend`: flex's backward does not run on
    CPU in torch 2.13); `dynamic=False, pad=False` is the per-shape static compile this module replaced
    (a test shows it passes the bound).
    """

    backend: Any = "inductor"  # a torch.compile backend: name or callable
    on_cpu: bool = False  # False: CPU runs flex eagerly (forward only)
    dynamic: bool = True  # one graph for every B, Q, KV
    pad: bool = True  # `flex_shapes` on the flex path of DFlashDrafter.forward_train
    recompile_limit: int = 16  # graphs of flex before a further one is an error (module docstring: bound 8)


FLEX_COMPILE = FlexCompile()
_compiled: tuple[tuple, Callable] | None = None


def flex_shapes(ctx_len: int, num_anchors: int, bs: int) -> tuple[int, int]:
    """(padded context width, padded anchor count) of a flex batch: S to a multiple of FLEX_TILE,
    A to at least FLEX_TILE // bs + 1 (Q > FLEX_TILE) and 2; see the module docstring."""
    s = -(-ctx_len // FLEX_TILE) * FLEX_TILE
    return s, max(num_anchors, FLEX_TILE // bs + 1, 2)


def run_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any, enable_gqa: bool) -> torch.Tensor:
    """flex_attention, compiled once per FLEX_COMPILE setting (eager flex materialises every score)."""
    global _compiled
    cfg = FLEX_COMPILE
    if not (q.is_cuda or cfg.on_cpu):
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)
    key = (cfg.backend, cfg.dynamic)
    if _compiled is None or _compiled[0] != key:
        # fullgraph: a graph break would run part of flex eagerly, and hitting the recompile limit is an error
        _compiled = (key, torch.compile(flex_attention, dynamic=cfg.dynamic, backend=cfg.backend, fullgraph=True))
    # Both read when dynamo (re)compiles, i.e. inside this call: the raised limit is scoped to flex's frame.
    # Without fail_on_recompile_limit_hit dynamo would run the call eagerly past the limit, silently.
    limits = dynamo_config.patch(recompile_limit=cfg.recompile_limit, fail_on_recompile_limit_hit=True)
    # Duck shaping is read when dynamo builds a graph's shape environment (module docstring).
    shapes = fx_config.patch(use_duck_shape=False) if cfg.dynamic else contextlib.nullcontext()
    try:
        with limits, shapes:
            return _compiled[1](q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)
    except FailOnRecompileLimitHit as exc:
        raise DFlashError(
            f"flex_attention reached FLEX_COMPILE.recompile_limit = {cfg.recompile_limit} compiled graphs (the "
            f"stated bound is {GRAPHS_PER_MASK} per mask kind and grad mode, 8 at most; models/block_mask.py): a "
            f"further graph would have run flex eagerly, materialising every attention score; rerun with "
            f"TORCH_LOGS=recompiles to see which guard failed") from exc


def flex_mask_mod(anchors: torch.Tensor, ctx_len: torch.Tensor, bs: int, window: int | None) -> Callable:
    """The mask_mod of `dense_block_mask`'s matrix; ctx_len is a 0-d tensor (the keys' context width)."""
    def mask_mod(bi, hi, q, kv):
        blk, off = q // bs, q % bs
        anchor = anchors[bi, blk]
        in_ctx = kv < ctx_len
        ok = (in_ctx & (kv < anchor)) | (~in_ctx & ((kv - ctx_len) // bs == blk))
        if window is not None:
            kv_off = kv - ctx_len - blk * bs  # offset inside the query's block (own block: 0..bs-1)
            ok = ok & torch.where(in_ctx, kv > anchor + off - window, (kv_off <= off) & (kv_off > off - window))
        return ok
    return mask_mod


def flex_block_mask(anchors: torch.Tensor, ctx_len: int, bs: int, window: int | None = None) -> Any:
    """The flex BlockMask of `dense_block_mask`'s matrix, built from the block structure (no dense tensor).

    torch's create_block_mask evaluates mask_mod at every (row, query, key): B x Q x KV booleans and its
    int64 intermediates, 0.2 GB of booleans per mask at the Qwen3-8B defaults (8 x 4,096 x 6,144) and
    several times that transient, per mask kind and micro-step. Here each query's visible keys are two
    intervals (context [lo, anchor), its own block's keys), so a key tile is visible to a query tile if
    some query's interval meets it, and needs no mask_mod if every query's covers it: B x Q x KV/128
    comparisons (1.6 M at the defaults). A tile that only the union of the two intervals covers is left
    partial (mask_mod still decides inside it): the same attention, one tile less skipped at most.
    """
    b, a = anchors.shape
    q_len, kv_len, dev = a * bs, ctx_len + a * bs, anchors.device
    q = torch.arange(q_len, device=dev)
    blk, off = q // bs, q % bs
    anchor = anchors.repeat_interleave(bs, 1)  # [B, Q]
    lo_ctx = torch.zeros_like(anchor) if window is None else (anchor + off - window + 1).clamp(min=0)
    own = ctx_len + blk * bs  # [Q] the first key of each query's block
    lo_own = own if window is None else own + (off - window + 1).clamp(min=0)
    hi_own = own + (bs if window is None else off + 1)
    intervals = [(lo_ctx, anchor), (lo_own.expand(b, -1), hi_own.expand(b, -1))]
    q_tiles, kv_tiles = -(-q_len // FLEX_TILE), -(-kv_len // FLEX_TILE)
    k0 = torch.arange(kv_tiles, device=dev) * FLEX_TILE
    k1 = (k0 + FLEX_TILE).clamp(max=kv_len)
    seen = covered = torch.zeros(b, q_len, kv_tiles, dtype=torch.bool, device=dev)
    for lo, hi in intervals:
        lo, hi = lo[..., None], hi[..., None]
        seen = seen | (torch.maximum(lo, k0) < torch.minimum(hi, k1))
        covered = covered | ((lo <= k0) & (hi >= k0 + FLEX_TILE))  # a ragged last key tile is never full
    pad = q_tiles * FLEX_TILE - q_len  # padded query rows see nothing, so a ragged last query tile is never full
    seen = torch.nn.functional.pad(seen, (0, 0, 0, pad)).view(b, q_tiles, FLEX_TILE, kv_tiles).any(2)
    full = torch.nn.functional.pad(covered, (0, 0, 0, pad)).view(b, q_tiles, FLEX_TILE, kv_tiles).all(2)
    # The width goes in as a tensor (a Python int captured by mask_mod would be a compile guard), made by a
    # fill on the device, not copied from the host.
    width = torch.full((), ctx_len, dtype=torch.long, device=dev)
    return BlockMask.from_kv_blocks(*_ordered(seen & ~full), *_ordered(full), BLOCK_SIZE=FLEX_TILE,
                                    mask_mod=flex_mask_mod(anchors, width, bs, window), seq_lengths=(q_len, kv_len))


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, nQ, nKV] booleans -> flex's (count [B, 1, nQ], indices [B, 1, nQ, nKV]: the set tiles first)."""
    tiles = tiles[:, None].to(torch.int32)
    order = torch.argsort(tiles, dim=-1, descending=True, stable=True)
    return tiles.sum(-1).to(torch.int32), order.to(torch.int32)


def dense_block_mask(anchors: torch.Tensor, ctx_len: int, bs: int, window: int | None = None) -> torch.Tensor:
    """Boolean [B, 1, A*bs, ctx_len + A*bs] for SDPA (True = attend)."""
    b, a = anchors.shape
    dev = anchors.device
    q_blk, q_off = torch.arange(a * bs, device=dev) // bs, torch.arange(a * bs, device=dev) % bs  # [Q]
    q_anchor = anchors.repeat_interleave(bs, 1)[:, :, None]  # [B, Q, 1]
    kv_ctx = torch.arange(ctx_len, device=dev)[None, None, :]
    ctx_ok = kv_ctx < q_anchor
    own = (q_blk[:, None] == q_blk[None, :])  # [Q, Q]
    if window is not None:
        ctx_ok = ctx_ok & (kv_ctx > q_anchor + q_off[None, :, None] - window)
        diff = q_off[:, None] - q_off[None, :]  # query offset - key offset, same block
        own = own & (diff >= 0) & (diff < window)
    return torch.cat([ctx_ok, own.expand(b, -1, -1)], dim=2).unsqueeze(1)
