"""est_tau: the acceptance length greedy decoding would see, walked over the data (docs/DESIGN.md §3).

`tau` (components/loss.metrics_from_sums) is 1 + the mean argmax streak over anchors drawn uniformly
from the response. Decoding does not visit positions uniformly: after a rejection the next block
starts right after the position the drafter got wrong, where it tends to be wrong again, so a
uniform average overstates served acceptance (on the demo: tau 5.12, served 4.25 on its own text).

The convention is the trainer's and `eval/speculative.py`'s. A block anchored at position a holds
`[x_a, MASK x (B-1)]`, reads the target's features of positions < a, and its position k predicts
x_{a+k}. Verifying `[x_a, draft]`, the target accepts the longest prefix equal to its own greedy
choices plus its next token (the bonus): a step yields accepted + 1 tokens and the next block is
anchored at a + accepted + 1, the bonus token's position. A response (a maximal run of loss-mask
positions p..e) is decoded from its first token (the prefill's) to its last: blocks at p, then as
above while the anchor is before e; labels past e are not the response's, so a run stops there.

With teacher-forced context, the target's states of the true tokens, which is what greedy serving
sees when the data is the target's greedy output (`regenerate`), every block the walk can visit
is fixed before it runs: one no-grad forward with a block at every response position that has a
label after it (`walk_anchors`, `accepted_runs`) gives each block's accepted length, and the walk
is a pointer chase over them on the host (`decode_walk`). Per response, est_tau = tokens / steps;
`walk_sums` adds what a record needs: per-response means (their mean is eval's `tau`, the headline
`est_tau`), pooled tokens and steps (`est_tau_pooled`), and the uniform streak over the training's
own anchor candidates (1 + its mean is `tau` over every anchor instead of a sample). A training
record scales its few walked rows to the training `tau` of the last `train.est_tau_interval` steps by that
uniform streak (`calibrated_walk`).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from dflash_ds.components.anchors import block_inputs_and_labels
from dflash_ds.components.loss import leading_run

WALK_SUMS = ("tokens", "steps", "tau_sum", "responses", "streak", "blocks")


def walk_anchors(loss_mask: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every position a decode walk may anchor at: a response position with a response label after it.

    Returns anchors [R, A] (ascending, padding 0) and valid [R, A], A = the most such positions in a
    row. One host read (A), as in `sample_anchors`.
    """
    r, s = loss_mask.shape
    pos = torch.arange(s, device=loss_mask.device)
    on = loss_mask > 0
    nxt = torch.zeros_like(on)
    nxt[:, :-1] = on[:, 1:]
    cand = on & nxt & (pos + 1 < lengths[:, None])
    picked = torch.where(cand, pos, s).sort(dim=1).values
    a = max(1, int(cand.sum(1).max().item()))
    anchors = picked[:, :a]
    valid = anchors < s
    return anchors.masked_fill(~valid, 0), valid


def target_labels(input_ids: torch.Tensor, last_hidden: torch.Tensor, lm_head, chunk: int) -> torch.Tensor:
    """[R, S] ids whose position p >= 1 holds the target's greedy choice there, argmax lm_head(h_{p-1}).

    Position 0 keeps x_0 (no block predicts it). `chunk` positions go through the head at once.
    """
    r, s, h = last_hidden.shape
    flat = last_hidden[:, :-1].reshape(-1, h)
    picks = [lm_head(flat[lo:lo + chunk]).argmax(-1) for lo in range(0, flat.shape[0], chunk)]
    choice = torch.cat(picks).view(r, s - 1) if picks else input_ids.new_zeros(r, 0)
    return torch.cat([input_ids[:, :1], choice.to(input_ids.dtype)], dim=1)


def accepted_runs(drafter, embed, lm_head, context: torch.Tensor, input_ids: torch.Tensor, label_ids: torch.Tensor,
                  loss_mask: torch.Tensor, lengths: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor,
                  chunk_blocks: int) -> torch.Tensor:
    """Per block, how many leading positions the drafter gets right: [R, A, 2] long, [..., 0] as it drafts
    (its argmax; DFlash2: its selector's walk; DSpark: its Markov chain), [..., 1] by the training `tau`'s rule
    (the argmax alone; the same for DFlash and DSpark).

    Blocks are `[x_a, MASK...]` from input_ids; position k's label is label_ids[a + k] (the data, or
    the target's choice: `target_labels`), counted while it is a response position inside the row.
    The LM head runs `chunk_blocks` blocks at a time; no logits are kept. Call under no_grad.
    """
    arch = drafter.arch
    bs = arch.block_size
    blocks, labels, label_valid = block_inputs_and_labels(input_ids, loss_mask, lengths, anchors, valid, bs,
                                                          arch.mask_token_id)
    if label_ids is not input_ids:
        labels = block_inputs_and_labels(label_ids, loss_mask, lengths, anchors, valid, bs, arch.mask_token_id)[1]
    hidden = drafter.forward_train(context, embed(blocks).to(context.dtype), anchors)
    r, a = anchors.shape
    flat = hidden[:, :, 1:].reshape(r * a, bs - 1, -1)
    # a sequential kind (models/drafter.py): DFlash2's selector walk, DSpark's Markov chain
    walk = drafter.draft_tokens if drafter.sequential else None
    anchor_ids = blocks[:, :, 0].reshape(r * a)
    # DFlash2's selector, DSpark's Markov head: read once, so the chunks make no module call (ZeRO-3: their count
    # differs across ranks)
    read = drafter.draft_tables()
    tables = {} if read is None else {"tables": read}

    flat_labels, flat_valid = labels.reshape(r * a, bs - 1), label_valid.reshape(r * a, bs - 1)

    def pick(lo: int) -> torch.Tensor:
        h = flat[lo:lo + chunk_blocks]
        if walk is None:  # DFlash drafts its argmax: one set of picks serves both
            hi = lo + h.shape[0]
            return leading_argmax(h, lm_head, flat_labels[lo:hi], flat_valid[lo:hi])[..., None]
        draft = walk(h, lm_head, anchor_ids[lo:lo + chunk_blocks], **tables)
        if draft.candidates is None:
            # DSpark: the training tau's argmax is teacher-forced on the gold previous token, which the chain
            # reads wherever it was right so far: the same leading run, one set of picks serves both
            return draft.tokens[..., None]
        # the argmax is the first of the head's top-K candidates: the LM head runs once
        return torch.stack([draft.tokens, draft.candidates[..., 0]], dim=-1)

    picks = torch.cat([pick(lo) for lo in range(0, r * a, chunk_blocks)])
    picks = picks.view(r, a, bs - 1, picks.shape[-1])
    runs = torch.stack([leading_run(picks[..., i] == labels, label_valid) for i in range(picks.shape[-1])], dim=-1)
    return runs.expand(r, a, 2)  # [..., 0] as drafted, [..., 1] by the argmax (a view for DFlash and DSpark)


def leading_argmax(hidden: torch.Tensor, lm_head, labels: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[N, K] argmax picks of `lm_head(hidden)` [N, K, H], position by position, only while a block's run is alive.

    A block's leading run ends at its first miss (or invalid label), so position k's logits are needed only for
    the blocks that hit every position before it: the others get -1 there, which `leading_run` never reads as a
    hit after a miss. Early in training most blocks stop at position 1, so the head (the walk's largest cost: N x
    (B - 1) x V) runs on about N x tau positions instead (bitwise the same runs; one host read per position)."""
    n, k = labels.shape
    picks = torch.full((n, k), -1, dtype=torch.long, device=hidden.device)
    alive = torch.arange(n, device=hidden.device)
    for pos in range(k):
        if alive.numel() == 0:
            break
        chosen = lm_head(hidden[alive, pos]).argmax(-1)
        picks[alive, pos] = chosen
        alive = alive[(chosen == labels[alive, pos]) & valid[alive, pos]]
    return picks


def decode_walk(runs: np.ndarray, loss_mask: np.ndarray, length: int) -> list[list[int]]:
    """Tokens per decode step (accepted + 1) of each response of one row, walked over `runs`.

    runs[a] is the accepted length of the block anchored at a (read only where the walk goes). A
    response of one token has no decode step and is left out, as eval leaves out a prompt without one.
    """
    walks, p = [], 0
    while p < length:
        if not loss_mask[p]:
            p += 1
            continue
        e = p
        while e + 1 < length and loss_mask[e + 1]:
            e += 1
        steps, a = [], p
        while a < e:
            accepted = min(int(runs[a]), e - a)  # a run never passes the response's end (labels stop there)
            steps.append(accepted + 1)
            a += accepted + 1
        if steps:
            walks.append(steps)
        p = e + 1
    return walks


def walk_sums(runs: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor, loss_mask: torch.Tensor,
              lengths: torch.Tensor, block_size: int, uniform_runs: torch.Tensor | None = None) -> dict[str, float]:
    """Host sums of a batch's walks (`WALK_SUMS`): tokens, steps, per-response tau and their count, and the
    uniform streak and block count over the training's anchor candidates (a >= 1, a + B <= length), of
    `uniform_runs` (the argmax's runs, as the training `tau` counts them; default: `runs`).

    One read of the batch's runs, anchors and masks (a record's worth, not a micro-step's).
    """
    uniform_h = (runs if uniform_runs is None else uniform_runs).cpu().numpy()
    runs_h, anchors_h, valid_h = runs.cpu().numpy(), anchors.cpu().numpy(), valid.cpu().numpy()
    mask_h, lengths_h = loss_mask.cpu().numpy(), lengths.cpu().numpy()
    out = dict.fromkeys(WALK_SUMS, 0.0)
    for row in range(runs_h.shape[0]):
        length = int(lengths_h[row])
        dense = np.zeros(mask_h.shape[1], dtype=np.int64)
        at, run = anchors_h[row][valid_h[row]], runs_h[row][valid_h[row]]
        dense[at] = run
        for steps in decode_walk(dense, mask_h[row], length):
            out["tokens"] += sum(steps)
            out["steps"] += len(steps)
            out["tau_sum"] += sum(steps) / len(steps)
            out["responses"] += 1
        uniform = (at >= 1) & (at + block_size <= length)
        out["streak"] += float(uniform_h[row][valid_h[row]][uniform].sum())
        out["blocks"] += float(uniform.sum())
    return out


def walk_metrics(sums: dict[str, float], prefix: str) -> dict[str, float]:
    """`{prefix}est_tau` (mean over responses), `{prefix}est_tau_pooled` (all steps together) and, with the
    uniform counts, `{prefix}tau`; keys without a response to count are left out."""
    out = {}
    if sums.get("responses", 0) > 0:
        out[f"{prefix}est_tau"] = sums["tau_sum"] / sums["responses"]
        out[f"{prefix}est_tau_pooled"] = sums["tokens"] / sums["steps"]
    if prefix and sums.get("blocks", 0) > 0:
        out[f"{prefix}tau"] = 1.0 + sums["streak"] / sums["blocks"]
    return out


def calibrated_walk(sums: dict[str, float], tau: float) -> dict[str, float]:
    """The training record's est_tau: the walked acceptance of the pooled walks, scaled to `tau` (uniform anchors
    over every row the drafter trained on in the last `train.est_tau_interval` steps, the drafter as it is now) by
    the walked rows' own uniform tau, in accepted drafts (tau - 1, what a block adds to its bonus token):

        est_tau = 1 + (tau - 1) x (walked - 1) / (uniform tau of the walked rows - 1)

    A few walked rows say little by themselves (one response's walk varies by ~40% of the mean, and the pool
    spans the drafter's last hundreds of steps), but the ratio is steady: hard rows are hard by both counts.
    Counted in accepted drafts, walks of a drafter that accepted nothing yet (both figures 1) weigh nothing in
    the ratio. `est_tau_walked` keeps the walks' own mean. Without uniform blocks, or with walked rows whose
    uniform tau is 1, the walks' figures are returned as they are. Never below 1."""
    out = walk_metrics(sums, "")
    if "est_tau" not in out or sums.get("blocks", 0) <= 0 or not math.isfinite(tau):
        return out
    drafts = sums["streak"] / sums["blocks"]  # uniform accepted drafts of the walked rows
    if drafts <= 0:
        return {**out, "est_tau_walked": out["est_tau"]}
    scale = (tau - 1.0) / drafts
    # never below 1: a step yields at least its bonus token
    return {"est_tau": max(1.0, 1.0 + (out["est_tau"] - 1.0) * scale),
            "est_tau_pooled": max(1.0, 1.0 + (out["est_tau_pooled"] - 1.0) * scale), "est_tau_walked": out["est_tau"]}
