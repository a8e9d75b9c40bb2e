"""A drafter rank's bytes at one long sequence split over N ranks (distributed/sequence_parallel.py, issue #56).

By the model (the trainer runs SP on colocated ranks: topology.sequence_parallel). What N changes, counted from
`forward_train_sp` and `sp_objective` at the GPU shape `long_context.step_at` prices (bf16, flex, every layer
recomputed):

- per position, 1/N: the bridge's receive buffers (each rank receives its L/N positions), the RoPE tables, the
  projected context, the context keys/values of the recomputed layer, the context's gradient; per block, 1/N:
  the block tokens' activations and the chunked loss (each rank its A/N anchor blocks): memory/model.py's
  micro-step at S = ceil(L/N), A = ceil(A_total/N);
- not split: the flex block mask, which every rank builds over every anchor and the whole sequence, and the
  batch's token ids and loss mask, held whole on every rank for the anchor sampler (2 x 8 bytes a position);
- added: the all-to-all's gathered tensors in the recomputed layer, every position's keys and values of kv/N
  heads and every block token's queries and output of nh/N heads, and as much again in their gradients in the
  layer's backward: 2 x ((L + T) x 2 kv/N + 2 T x nh/N) x d x b, T = A_total x bs.

With KL (or LK, target labels: `run.kl`) a rank also receives the final hidden's 1/N and its micro-step has the
KL's terms at its local shape (`sp_objective` reads the rows of its own label positions).
Qwen3-8B preset at 128K, 8 drafter ranks, ZeRO-2, kl off: a drafter rank holds 60.5 GB at SP 1 (43.0 of it the
bridge's 8 receive buffers), 34.2 at SP 2, 20.5 at SP 4, 14.4 at SP 8 (docs/MEMORY.md, "Sequence parallelism")."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from dflash_ds.memory import long_context as lc
from dflash_ds.memory import model as mm

ID_BYTES = 16  # a position's token id and loss-mask entry, int64 each, held whole on every SP rank


def sp_sizes(kv_heads: int, most: int) -> list[int]:
    """The SP sizes a drafter of `kv_heads` key/value heads allows over `most` drafter ranks: N divides the heads
    (the all-to-all's head split) and the ranks (the trainer's groups tile them)."""
    return [n for n in range(1, min(kv_heads, most) + 1) if kv_heads % n == 0 and most % n == 0]


def drafter_rank_terms(cfg: dict[str, Any], seq_len: int, run: lc.LongRun, sp: int, ranks: int,
                       kind: str = "dflash") -> dict[str, float]:
    """Named bytes of one drafter rank (ZeRO over `ranks` drafter ranks) at one sequence of `seq_len` tokens split
    over `sp` of them. At sp = 1, `long_context.rank_terms`' drafter terms exactly. With `run.kl` the receive buffers
    carry the final hidden's shard too, and the micro-step the KL's terms at its local shape; the exchange that fetches
    a rank's label rows (`sequence_parallel.rows_at`, ~2 x its label positions x H bytes) runs before the forward,
    off the peak."""
    from dflash_ds.distributed.sequence_parallel import check_heads

    d = lc.drafter_at(cfg, run, kind)
    check_heads(d.kv_heads, sp)
    full = lc.step_at(seq_len, run)
    static = mm.static_terms(d, math.ceil(seq_len / sp), run.zero_stage, ranks, kl=run.kl)
    return {**static, **sp_step_terms(d, full, sp)}


def sp_step_terms(d: mm.DrafterShape, full: mm.StepShape, sp: int, param_grads: bool = False) -> dict[str, float]:
    """Named bytes of one SP rank's micro-step on its 1/`sp` of the batch `full` (one sequence: batch 1): the
    micro-step at S = ceil(S/N), A = ceil(A/N) (memory/model.py), and what N does not split or adds: the mask over
    every anchor and the whole sequence (flex's tile tables; CPU's dense boolean mask and SDPA's float copy of it in
    every layer kept), the all-to-all's gathered tensors and their gradients, the token ids held whole."""
    local = replace(full, seq_len=math.ceil(full.seq_len / sp), anchors_per_row=math.ceil(full.anchors_per_row / sp))
    peak = mm.micro_step_peak(d, local, param_grads)
    terms = {"micro_step_peak": peak}
    if sp == 1:
        return terms
    b, bs = full.dtype_bytes, d.block_size
    s_pad, t_all, t_loc = local.seq_len * sp, local.anchors_per_row * sp * bs, local.anchors_per_row * bs
    if full.dense_mask:  # the whole mask in place of the local one: kept (float) in each layer, the boolean in forward
        extra = full.batch * (t_all * (s_pad + t_all) - t_loc * (local.seq_len + t_loc))
        k = mm.recomputed_layers(d, local)
        t = mm.micro_step_terms(d, local, param_grads)
        phases = {ph: sum(t[ph].values()) for ph in mm.PHASES}
        phases["forward"] += 0 if k else extra
        held = sum(t["held"].values()) + extra * ((d.num_layers - k) * b + (1 if k else 0))
        terms["dense_mask_whole"] = held + max(phases.values()) - peak
    else:
        terms["block_mask_whole"] = (mm.flex_block_mask_bytes(full.batch, t_all, s_pad + t_all)
                                     - mm.flex_block_mask_bytes(full.batch, t_loc, local.seq_len + t_loc))
    gathered = ((s_pad + t_all) * 2 * d.kv_heads + 2 * t_all * d.heads) // sp * d.head_dim * b
    terms["sp_exchange"] = 2 * gathered
    terms["sequence_ids"] = ID_BYTES * full.batch * full.seq_len
    return terms


def _sp_step_terms(cfg: dict[str, Any], seq_len: int, run: lc.LongRun, sp: int, kind: str) -> dict[str, float]:
    """The drafter micro-step of one SP rank and what SP adds to it (`drafter_rank_terms` without the static terms)."""
    terms = drafter_rank_terms(cfg, seq_len, run, sp, 1, kind)
    keep = ("micro_step_peak", "block_mask_whole", "sp_exchange", "sequence_ids")
    return {k: v for k, v in terms.items() if k in keep}


def colocated_rank_terms(cfg: dict[str, Any], seq_len: int, run: lc.LongRun, sp: int, ranks: int,
                         target_weight_bytes: float, kind: str = "dflash") -> dict[str, float]:
    """Named bytes of one colocated rank (ZeRO over `ranks`) under SP `sp`: what the trainer runs
    (topology.sequence_parallel). Every rank of a group runs the whole target forward on its group's sequence and
    keeps the whole captured batch through the step (the batch's tensors are released after it), plus its copy of
    its 1/N of the context; the drafter's step is an SP rank's (`drafter_rank_terms`). At sp = 1,
    `long_context.rank_terms`' colocated terms exactly."""
    if sp == 1:
        return lc.rank_terms(cfg, seq_len, run, "colocated", ranks, target_weight_bytes, kind)
    d = lc.drafter_at(cfg, run, kind)
    step = _sp_step_terms(cfg, seq_len, run, sp, kind)
    shard = math.ceil(seq_len / sp) * run.layers_read * int(cfg["hidden_size"]) * run.dtype_bytes
    held = sum(step.values()) + shard
    return {"target_weights": target_weight_bytes,
            f"model_states_zero{run.zero_stage}": mm.zero_model_state_bytes(mm.drafter_params(d), run.zero_stage,
                                                                             ranks),
            "captured_batch": lc.payload_bytes(cfg, seq_len, run), "context_shard": shard, **step,
            "target_forward_over_step": lc.forward_over_step(d, seq_len, run, held)}


def longest_fit(cfg: dict[str, Any], run: lc.LongRun, sp: int, ranks: int, limit_bytes: float,
                kind: str = "dflash", target_weight_bytes: float | None = None) -> int:
    """The longest multiple of 1,024 tokens a rank holds at SP `sp` within `limit_bytes` (0: none): a disaggregated
    drafter rank, or with `target_weight_bytes` a colocated rank."""
    if target_weight_bytes is None:
        return lc.bisect_length(lambda n: sum(drafter_rank_terms(cfg, n, run, sp, ranks, kind).values())
                                <= limit_bytes)
    return lc.bisect_length(lambda n: sum(colocated_rank_terms(cfg, n, run, sp, ranks, target_weight_bytes,
                                                                kind).values()) <= limit_bytes)
