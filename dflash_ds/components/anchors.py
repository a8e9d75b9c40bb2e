"""Anchor sampling and block labels (docs/DESIGN.md §3): which blocks a batch trains and what they predict.

Shapes: B rows, A anchors per row, block size bs; position k (1-based) of a block predicts x_{anchor+k}.
"""

from __future__ import annotations

import torch


def sample_anchors(loss_mask: torch.Tensor, lengths: torch.Tensor, block_size: int, num_anchors: int,
                   generator: torch.Generator, max_total: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded choice of up to `num_anchors` anchor positions per sequence, at most `max_total` in all.

    Candidates are response tokens (loss_mask == 1) at positions a >= 1 with a whole block after
    them (a + block_size <= length). Every position gets a random key (one draw for the batch, on
    its device) and a row keeps its `quota` candidates of lowest key: quota = its candidate count
    capped at `num_anchors` and then, if `max_total` > 0, shared under the cap by `water_fill`. So a
    capped row keeps a subset of its uncapped picks, and a cap that does not bind changes nothing.
    Returns anchors [B, A] (sorted, padding = 0) and valid [B, A], A = the largest quota.

    Host reads: one. Everything is tensor ops on the batch's device, vectorised over rows, except
    reading A (a `.item()`) to size the output. A shape-only A would need no read, but water-filling
    may hand one row the whole cap, so it must be min(num_anchors, S - block_size, max_total): at the
    Qwen3-8B defaults (8 rows of 2,048, 512 per row, cap 2,048, block 16) 8 x 512 = 4,096 blocks
    every batch where 2,048 are kept, twice the drafter's layers, LM head and loss (they run on
    every block, padded or not), and 7.75x on a bucket of 32 rows of 512 (32 x 496 for 2,048).
    Read, A is 256 there whenever every row has 256 candidates (2,048 blocks, none padded); its
    worst case is that same 4,096, only when one row holds 512 candidates and the rest few.

    `generator` should live on loss_mask's device; one elsewhere (the trainer's CPU generator)
    lends its seed to a fresh one there. The same seed gives the same anchors on the same kind of
    device (CPU and CUDA draw different streams).
    """
    b, s = loss_mask.shape
    dev = loss_mask.device
    pos = torch.arange(s, device=dev)
    cand = (loss_mask > 0) & (pos >= 1) & (pos + block_size <= lengths[:, None])
    quotas = cand.sum(1).clamp(max=num_anchors)
    if max_total > 0:
        quotas = water_fill(quotas, max_total)
    keys = torch.rand((b, s), generator=_generator_on(generator, dev), device=dev, dtype=torch.float64)
    order = keys.masked_fill(~cand, 2.0).argsort(dim=1, stable=True)  # candidates first, in random order
    keep = pos < quotas[:, None]  # the first `quota` of each row's order
    picked = torch.where(keep, order, s).sort(dim=1).values  # kept positions ascending, then s
    a = max(1, int(quotas.max().item()))  # the one host read: the output's width
    anchors = picked[:, :a]
    valid = anchors < s
    return anchors.masked_fill(~valid, 0), valid


def _generator_on(generator: torch.Generator, device: torch.device) -> torch.Generator:
    """`generator` if it draws on `device`, else a fresh generator there with its seed."""
    if generator.device == device:
        return generator
    return torch.Generator(device=device).manual_seed(generator.initial_seed())


def water_fill(counts: torch.Tensor, max_total: int) -> torch.Tensor:
    """Quotas [B] under a cap: the largest level q with sum(min(c, q)) <= max_total, the rest one each in row order.

    Every row keeps min(count, q) or one more; no row gives up anchors while a smaller row is cut,
    and the quotas sum to min(sum(counts), max_total). Tensor ops only (no host read): with the
    counts sorted, c_1 <= ... <= c_B and P_k = c_1 + ... + c_k, sum_i min(c_i, q) = min over k of
    (P_k + (B - k) q), so the level is the largest of floor((max_total - P_k) / (B - k)), k < B
    (at least max(counts) when the cap does not bind: then every quota is its count).
    """
    b = counts.numel()
    ascending = counts.sort().values
    below = ascending.cumsum(0) - ascending  # P_k, k = 0..B-1
    level = torch.div(max_total - below, torch.arange(b, 0, -1, device=counts.device), rounding_mode="floor").max()
    quotas = torch.minimum(counts, level)
    cut = counts > quotas
    spare = max_total - quotas.sum()  # fewer than the rows cut, or level + 1 would fit
    return quotas + (cut & (cut.cumsum(0) <= spare)).to(quotas.dtype)


def anchor_quotas(counts: list[int], max_total: int) -> list[int]:
    """`water_fill` of host counts, as a list (the memory model's A)."""
    if not counts:
        return []
    return water_fill(torch.tensor(counts, dtype=torch.long), max_total).tolist()


def block_inputs_and_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor, lengths: torch.Tensor,
                            anchors: torch.Tensor, valid: torch.Tensor, block_size: int,
                            mask_token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block tokens [B, A, bs] = [x_a, MASK...], labels [B, A, bs-1] = x_{a+1..a+bs-1}, label_valid."""
    b, s = input_ids.shape
    offs = torch.arange(1, block_size, device=input_ids.device)
    pos = anchors[:, :, None] + offs  # [B, A, K]
    in_seq = pos < lengths[:, None, None]
    pos_c = pos.clamp(max=s - 1)
    flat = pos_c.reshape(b, -1)
    labels = torch.gather(input_ids, 1, flat).view_as(pos)
    on = torch.gather(loss_mask, 1, flat).view_as(pos) > 0
    label_valid = in_seq & on & valid[:, :, None]
    blocks = torch.full((*anchors.shape, block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    blocks[:, :, 0] = torch.gather(input_ids, 1, anchors)
    return blocks, labels, label_valid
