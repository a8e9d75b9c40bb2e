"""Sequence-parallel drafter forward (DeepSpeed's Ulysses all-to-all): one long sequence over N ranks (issue #56).

A DFlash drafter's attention has two kinds of positions: the context (the target's hidden states, S positions,
projected by `fc` and turned into keys/values by each layer; no query of its own) and the anchor blocks (A blocks of
`bs` tokens: the queries, which also read each other's keys under the block mask). Everything but attention is per
position, so under sequence parallelism each of N ranks holds 1/N of the context positions and 1/N of the anchor
blocks, and runs fc, the norms, the projections, RoPE and the MLP on its share alone. For attention, DeepSpeed's
Ulysses all-to-all (`deepspeed.sequence.layer._SeqAllToAll`, the exchange under its `DistributedAttention`) turns
the sequence split into a head split: after it each rank holds every position of kv_heads/N key/value heads (and
their query heads), attends under the same block mask as one rank would (built from every anchor: [A*bs, S+A*bs]),
and a second all-to-all gives each rank its own positions back with every head. Context and block keys are
exchanged separately, so the gathered order is [all context; all blocks], the order of the one-rank forward, and
the mask is the one-rank mask. The result on each rank: its blocks' final hidden states, equal (fp32 round-off) to
the one-rank forward's rows; gradients summed over the group equal the one-rank gradients when each rank's loss is
its blocks' share of the global loss (`global_share`).

What each N does: N must divide the key/value heads (Qwen3-8B preset: 8 -> N 1, 2, 4, 8; Qwen3.6-27B preset: 4 ->
1, 2, 4; SmolLM2's drafter: 3 -> 1, 3); DeepSpeed's uneven-heads exchange (N > kv heads not allowed, N not dividing
them) is not used here: the caller is refused with the head counts. The context and the anchors are padded to a
multiple of N (`shard`): padded context positions lie past every anchor (never visible), padded anchors are 0 and
their blocks are dropped by the caller (invalid: no label).

Memory per rank at N (bf16, per layer): the context's projected states and keys/values S/N x (H + 2 kv D), the
exchanged keys/values S x 2 (kv/N) D; and on CPU (SDPA) the dense mask, A*bs x (S + A*bs): the boolean one, and
the additive copy in the dtype SDPA makes and keeps in every layer (memory/model.py), the same on every rank: the
term N does not split (flex on GPU builds a block mask instead). Qwen3-8B preset (H 4096, kv 8 x 128), S = 128K,
N = 8: 128K/8 x (4096 + 2048) x 2 B = 201 MB of per-position states and 128K x 2 x 128 x 2 B = 67 MB exchanged a
layer, against 1.61 GB and 537 MB on one rank (MB = 1e6 B, as docs/MEMORY.md). The trainer runs it on colocated
ranks (topology.sequence_parallel; runtime/engine.DrafterTrainModule), with the one-rank forward's activation
checkpointing, and on drafter ranks fed by target ranks, which send each rank of a group only its shard of the
context (runtime/target_worker.py, distributed/wire.payload_specs).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint

from dflash_ds.errors import DFlashError
from dflash_ds.models.drafter_arch import SLIDING


def _exchange(group, x: torch.Tensor, to_heads: bool, kv_heads: int) -> torch.Tensor:
    """[B, L/N, heads, D] -> [B, L, heads/N, D] (`to_heads`), or back; differentiable (the reverse in backward)."""
    from deepspeed.sequence.layer import _SeqAllToAll

    scatter, gather = (2, 1) if to_heads else (1, 2)
    return _SeqAllToAll.apply(group, x.contiguous(), scatter, gather, 0, None, None, None, True, kv_heads)


def check_heads(num_kv_heads: int, size: int) -> None:
    """The head split Ulysses needs: N divides the key/value heads (each rank one group of query heads)."""
    if size < 1 or num_kv_heads % size:
        raise DFlashError(f"sequence parallel size {size}: the drafter's {num_kv_heads} key/value heads must divide "
                          f"by it (valid sizes: {[n for n in range(1, num_kv_heads + 1) if num_kv_heads % n == 0]})")


def padded(n: int, size: int) -> int:
    """`n` rounded up to a multiple of `size`."""
    return math.ceil(n / size) * size


def shard(t: torch.Tensor, dim: int, size: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s contiguous 1/size of `t` along `dim`, zero-padded at the end to a multiple of `size`."""
    n = t.shape[dim]
    extra = padded(n, size) - n
    if extra:
        pad = [0, 0] * (t.dim() - 1 - dim) + [0, extra]
        t = F.pad(t, pad)
    return t.chunk(size, dim=dim)[rank]


def gather_shards(part: torch.Tensor, width: int, group) -> torch.Tensor:
    """The group's shards of a [B, S_pad/N, ...] tensor (`shard` along dim 1) put back together: [B, width, ...]
    (the padding cut). Collective over `group`; no gradient."""
    parts = [torch.empty_like(part) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, part.contiguous(), group=group)
    return torch.cat(parts, dim=1)[:, :width]


def rows_at(part: torch.Tensor, positions: torch.Tensor, width: int, group) -> torch.Tensor:
    """The rows of a [B, S_pad/N, H] tensor sharded over `group` (`shard` along dim 1: this rank's `part`) at this
    rank's `positions` [B, ...] (< width): [B, ..., H]. Every rank's positions are known to all (the anchors are drawn
    alike on every rank), so each sends each peer the rows of its shard the peer reads, in the peer's order, by one
    uneven all-to-all: a rank moves its blocks' rows (A/N x (bs - 1) x H), never the whole sequence. No gradient.
    `positions` must have the same shape on every rank (the anchor blocks padded to a multiple of N)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    b, local, h = part.shape
    flat = positions.reshape(b, -1)
    every = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(every, flat.contiguous(), group=group)
    rows = torch.arange(b, device=flat.device)[:, None].expand_as(flat)
    owners = torch.stack(every) // local  # [N, B, P]: which rank's shard holds each rank's each position
    mine = owners == rank  # the peers' positions in this rank's shard, in each peer's order
    send = [part[rows[mine[peer]], every[peer][mine[peer]] - rank * local] for peer in range(size)]
    # the split sizes on the host, in one read: what each peer is sent, what each peer sends
    send_sizes, recv_sizes = torch.stack([mine.sum(dim=(1, 2)),
                                          torch.bincount(owners[rank].reshape(-1), minlength=size)]).tolist()
    got = part.new_empty(sum(recv_sizes), h)
    dist.all_to_all_single(got, torch.cat(send).contiguous(), recv_sizes, send_sizes, group=group)
    out = part.new_empty(b, flat.shape[1], h)
    start = 0
    for peer, n in enumerate(recv_sizes):  # the rows from each peer, back into this rank's order
        out[owners[rank] == peer] = got[start:start + n]
        start += n
    return out.reshape(*positions.shape, h)


def _layer(layer, x, cos, sin, ctx, ccos, csin, mask, group) -> torch.Tensor:
    """One draft layer on this rank's blocks, its attention over every position of the sequence (see module doc)."""
    attn = layer.self_attn
    b, length, _ = x.shape
    kv = attn.num_kv_heads
    q, k, v = attn.block_qkv(layer.input_layernorm(x), cos, sin)  # [B, heads, L/N, D]
    ck, cv = attn.context_kv(ctx, ccos, csin)  # [B, kv, S/N, D]
    q, k, v, ck, cv = (_exchange(group, t.transpose(1, 2), True, kv) for t in (q, k, v, ck, cv))  # [B, *, h/N, D]
    keys = torch.cat([ck, k], dim=1).transpose(1, 2)
    values = torch.cat([cv, v], dim=1).transpose(1, 2)
    out = attn.attend(q.transpose(1, 2), keys, values, mask)  # [B, heads/N, L, D]
    out = _exchange(group, out.transpose(1, 2), False, kv)  # [B, L/N, heads, D]
    x = x + attn.o_proj(out.reshape(b, length, -1))
    return x + layer.mlp(layer.post_attention_layernorm(x))


def forward_train_sp(drafter, context_shard: torch.Tensor, block_shard: torch.Tensor, anchors: torch.Tensor,
                     group) -> torch.Tensor:
    """This rank's blocks' final hidden states [B, A/N, bs, H] under sequence parallelism over `group`.

    context_shard [B, S_pad/N, n*H]: this rank's contiguous share of the context features (`shard`, dim 1);
    block_shard [B, A_pad/N, bs, H]: the embeddings of its share of the anchor blocks (`shard`, dim 1);
    anchors [B, A_pad]: every anchor of the batch (padded with 0 to a multiple of N), the same on every rank.
    DFlash's drafter (its attention reads [context, blocks]); other kinds are refused.
    """
    arch = drafter.arch
    if arch.kind != "dflash":
        raise DFlashError(f"sequence parallelism: kind {arch.kind!r} is not supported (DFlash only so far)")
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    check_heads(arch.num_key_value_heads, size)
    b, s_local, _ = context_shard.shape
    _, a_local, bs, h = block_shard.shape
    if anchors.shape[1] != a_local * size:
        raise DFlashError(f"sequence parallelism: {anchors.shape[1]} anchors for {size} ranks of {a_local} blocks")
    ctx = drafter.project_context(context_shard)
    x = block_shard.reshape(b, a_local * bs, h)
    offs = torch.arange(bs, device=anchors.device)
    mine = anchors[:, rank * a_local:(rank + 1) * a_local]
    pos = (mine[:, :, None] + offs).reshape(b, a_local * bs)
    ctx_pos = torch.arange(rank * s_local, (rank + 1) * s_local, device=anchors.device).expand(b, s_local)
    cos, sin = drafter._cos_sin(x, pos)
    ccos, csin = drafter._cos_sin(x, ctx_pos)
    use_flex = drafter.mask_backend == "flex" or (drafter.mask_backend == "auto" and block_shard.is_cuda)
    masks = {kind: drafter.block_mask(anchors, s_local * size, bs, use_flex=use_flex,
                                      sliding_window=arch.sliding_window if kind == SLIDING else None)
             for kind in set(arch.layer_types)}
    # Activation checkpointing as the one-rank forward (models/drafter._run_layers): a recomputed layer keeps only its
    # input and runs its exchange again in backward, on every rank of the group in the same order.
    recompute = drafter.activation_checkpointing and torch.is_grad_enabled()
    n = len(drafter.layers) if drafter.checkpoint_layers is None else drafter.checkpoint_layers
    for i, (layer, kind) in enumerate(zip(drafter.layers, arch.layer_types)):
        if recompute and i < n:
            x = torch.utils.checkpoint.checkpoint(_layer, layer, x, cos, sin, ctx, ccos, csin, masks[kind], group,
                                                  use_reentrant=False)
        else:
            x = _layer(layer, x, cos, sin, ctx, ccos, csin, masks[kind], group)
    return drafter.norm(x).view(b, a_local, bs, h)


def global_share(loss: torch.Tensor, weight: torch.Tensor, group) -> torch.Tensor:
    """A rank's weighted-mean loss over its blocks -> its share of the group's weighted mean (sums to it over the
    ranks, and so do the gradients): loss x (this rank's weight / every rank's weight)."""
    total = weight.detach().clone()
    dist.all_reduce(total, group=group)
    return loss * (weight.detach() / total.clamp(min=1e-12))


def sp_objective(drafter, embed, lm_head, states, loss_cfg, *, anchor_gen: torch.Generator, group,
                 noise_std: float = 0.0, noise_seed: int = 0, context_sharded: bool = False):
    """DFlash's objective (components/objective.drafter_objective) of one batch under sequence parallelism:
    (LossTerms of this rank's blocks with `loss` = its share of the group's loss, their statistics).

    Every rank holds the batch's token ids, loss mask and lengths whole (S x 8 bytes each, 1 MB at 128K) and
    its shard of the context features: `states.context` is the whole context (a colocated rank computed it; the
    shard `shard(context, 1, N, rank)` is kept past the projection) or, with `context_sharded`, already this rank's
    shard (a target rank sent it: [B, S_pad/N, F]). The anchors are drawn by the same sampler from the same seed
    on every rank, and the context noise for this rank's positions alone (components/noise.py: the values the whole
    context's draw gives them), so both are the one-rank ones at every N; each rank runs its 1/N of the blocks and
    their labels, and its loss is
    its share of the global weighted mean (`global_share`): every label counted once, and so is every statistic
    (the sums over the group's ranks are the one-rank sums). The terms that read the target's distribution (KL, LK,
    target labels) take the target's final hidden at this rank's label positions: from `states.last_hidden` whole
    (colocated), or, with `context_sharded`, from the group's shards of it (sent cut as the context is), each rank
    sending each the rows it reads (`rows_at`).
    """
    from dflash_ds.components.anchors import block_inputs_and_labels, sample_anchors
    from dflash_ds.components.loss import acceptance_sums, chunked_dflash_loss, loss_knobs, metric_sums
    from dflash_ds.components.noise import noisy_context

    size, rank = dist.get_world_size(group), dist.get_rank(group)
    bs = drafter.arch.block_size
    anchors, valid = sample_anchors(states.loss_mask, states.lengths, bs, loss_cfg.num_anchors, anchor_gen,
                                    max_total=loss_cfg.max_anchors_per_batch)
    blocks, labels, label_valid = block_inputs_and_labels(states.input_ids, states.loss_mask, states.lengths,
                                                          anchors, valid, bs, drafter.arch.mask_token_id)
    width = states.input_ids.shape[1]
    local = padded(width, size) // size
    context = states.context
    if not context_sharded:
        context = shard(context, 1, size, rank).contiguous()  # a copy: the whole context is not kept for backward
    if context.shape[1] != local:
        raise DFlashError(f"sequence parallelism: rank {rank} of {size} holds {context.shape[1]} context positions, "
                          f"expected {local} (the {width}-token batch padded to {padded(width, size)}, split {size} "
                          f"ways)")
    real = max(0, min(local, width - rank * local))  # the shard's positions inside the batch (the rest is padding)
    if noise_std > 0 and real:
        noisy = noisy_context(context[:, :real], noise_std, noise_seed, start=rank * local)
        context = noisy if real == local else torch.cat([noisy, context[:, real:]], dim=1)
    all_anchors = F.pad(anchors, (0, padded(anchors.shape[1], size) - anchors.shape[1]))
    blocks, labels, label_valid, valid = (shard(t, 1, size, rank) for t in (blocks, labels, label_valid, valid))
    target_hidden = None
    if loss_cfg.needs_last_hidden and states.last_hidden is not None:
        # lm_head(final hidden at a+k-1) is the target's law for x_{a+k}, as in the one-rank objective
        pos = (shard(all_anchors, 1, size, rank)[:, :, None] + torch.arange(bs - 1, device=anchors.device)).clamp(
            max=width - 1)
        last = states.last_hidden
        if context_sharded:
            target_hidden = rows_at(last, pos, width, group)
        else:
            target_hidden = torch.gather(last, 1, pos.reshape(pos.shape[0], -1, 1).expand(-1, -1, last.shape[-1]))
        target_hidden = target_hidden.reshape(-1, bs - 1, last.shape[-1])
    with torch.no_grad():
        block_embeds = embed(blocks)
    hidden = forward_train_sp(drafter, context, block_embeds.to(context.dtype), all_anchors, group)
    n = hidden.shape[0] * hidden.shape[1]
    terms = chunked_dflash_loss(hidden[:, :, 1:].reshape(n, bs - 1, -1), lm_head, labels.reshape(n, bs - 1),
                                label_valid.reshape(n, bs - 1), target_hidden=target_hidden,
                                chunk_blocks=loss_cfg.chunk_blocks, **loss_knobs(loss_cfg))
    sums = {**metric_sums(terms), **acceptance_sums(terms), "anchors": valid.sum().float()}
    terms.loss = global_share(terms.loss, terms.weight_sum, group)
    return terms, sums


def check_supported(arch, size: int) -> None:
    """What the trainer checks before any group forms: a DFlash drafter whose key/value heads N divides."""
    if arch.kind != "dflash":
        raise DFlashError(f"topology.sequence_parallel {size}: the drafter kind {arch.kind!r} is not supported "
                          f"(DFlash only so far; issue 56)")
    check_heads(arch.num_key_value_heads, size)
