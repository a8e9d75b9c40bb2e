"""`dflash-ds plan --seq-len L`: one long sequence per micro-batch, priced per rank (memory/long_context.py).

Colocated is already checked at L by `plan/colocated.py` (its drafter terms at L, plus the target forward's
rise above the step); this adds the disaggregated side, a drafter rank (ZeRO over the split's drafter ranks,
or over all GPUs but one when no rates give a split) and a target rank, and the longest L each holds.
"""

from __future__ import annotations

import argparse
from typing import Any

from dflash_ds.config import DataConfig, DrafterConfig, LossConfig
from dflash_ds.memory import long_context as lc
from dflash_ds.memory import sequence_parallel as lsp
from dflash_ds.memory import shapes

GB = 1e9


def long_context(args: argparse.Namespace, shape_cfg: dict[str, Any], hidden: int, vocab: int, layers_read: int,
                 out: dict[str, Any]) -> dict[str, Any]:
    """Per-rank bytes at --seq-len for each layout, the longest L that fits each, and warnings."""
    L = args.seq_len
    if L < DrafterConfig.block_size + 1:
        from dflash_ds.errors import DFlashError

        raise DFlashError(f"--seq-len {L}: a sequence needs more than the block size ({DrafterConfig.block_size})")
    missing = [k for k in shapes.SHAPE_FIELDS if k not in shape_cfg]
    if missing:
        return {"seq_len": L, "rows": [], "warnings": [f"not priced: the target config has no {missing[0]!r}"]}
    loss = LossConfig()
    run = lc.LongRun(layers_read=layers_read, drafter_layers=args.drafter_layers, num_anchors=loss.num_anchors,
                     max_anchors=loss.max_anchors_per_batch,
                     chunk_blocks=loss.chunk_blocks, block_size=DrafterConfig.block_size,
                     kl=not args.no_last_hidden, zero_stage=args.zero_stage)
    # the drafter's heads and MLP scaled to H, as colocated.drafter_memory does; lc reads the full width of this
    cfg = {**shape_cfg, "vocab_size": vocab}
    d = shapes.drafter_shape(cfg, hidden, args.drafter_layers, run.block_size)
    cfg = {**cfg, "hidden_size": d.hidden, "intermediate_size": d.intermediate, "num_attention_heads": d.heads,
           "num_key_value_heads": d.kv_heads, "head_dim": d.head_dim}
    kind = getattr(args, "kind", "dflash")
    limit = (args.gpu_memory_gb - args.headroom_gb) * GB
    split = (out.get("split") or {}).get("best") or {}
    drafters = split.get("drafter_ranks") or max(1, args.gpus - 1)
    weights = out["colocated"]["memory"]["target_bytes"]
    tp = (out.get("target_parallel") or {}).get("k", 1) or 1
    rows, warnings = [], []
    for role, ranks in (("colocated", args.gpus), ("drafter", drafters), ("target", 1)):
        if role != "drafter" and weights is None:
            rows.append({"role": role, "ranks": ranks, "bytes": None, "terms": {}, "longest": None, "fits": None})
            continue
        w = (weights or 0.0) / (tp if role == "target" else 1)
        terms = lc.rank_terms(cfg, L, run, role, ranks, w, kind)
        total = sum(terms.values())
        longest = lc.longest_fit(cfg, run, role, ranks, w, limit, kind=kind)
        rows.append({"role": role, "ranks": ranks, "bytes": total, "terms": terms, "longest": longest,
                     "fits": total <= limit})
        sp_note = ""
        if role in ("drafter", "colocated"):  # what sequence parallelism over these ranks would hold (by the model)
            colocated = w if role == "colocated" else None
            sp_longest = {n: lsp.longest_fit(cfg, run, n, ranks, limit, kind, target_weight_bytes=colocated)
                          for n in lsp.sp_sizes(lc.drafter_at(cfg, run, kind).kv_heads, ranks)}
            needed = next((n for n, most in sp_longest.items() if most >= L), None)
            rows[-1].update(sp_longest=sp_longest, sp_needed=needed)
            sp_note = ("" if needed is None or needed == 1 else
                       f"; by the model, sequence parallelism of {needed} over these ranks would hold it"
                       + (f": --colocate --topology.sequence_parallel {needed}" if role == "colocated" else
                          f": --topology.sequence_parallel {needed} (each drafter rank is sent its 1/{needed} of "
                          "every sequence)"))
        if total > limit:
            warnings.append(f"{_name(role, ranks)} does NOT hold {L:,} tokens: {total / GB:,.2f} GB > "
                            f"{args.gpu_memory_gb:g} - {args.headroom_gb:g} GB headroom; it holds "
                            + (f"up to {longest:,}" if longest else "no sequence at all") + sp_note)
    fit = {r["role"]: r["fits"] for r in rows}
    target_row = rows[-1]
    if fit.get("colocated") is False and fit.get("target") is False:
        warnings.append(f"no layout trains {L:,}-token sequences on {args.gpu_memory_gb:g} GB GPUs: a colocated GPU "
                        f"holds up to {rows[0]['longest']:,} tokens and a target rank holds up to "
                        f"{target_row['longest']:,} tokens (a target runs each sequence's forward whole: sequence "
                        "parallelism splits the drafter side only); shorten data.max_length, or hold fewer weights per "
                        "target rank (--target-parallel k)")
    elif fit.get("colocated") is False and fit.get("drafter") is False:
        warnings.append(f"no layout trains {L:,}-token sequences on {args.gpu_memory_gb:g} GB GPUs without sequence "
                        "parallelism (the drafter row's SP sizes: topology.sequence_parallel, each drafter rank sent its shard "
                        "of every sequence); else shorten data.max_length, or lower the drafter's memory "
                        "(more drafter ranks, ZeRO-3)")
    return {"seq_len": L, "anchors_per_row": lc.step_at(L, run).anchors_per_row, "limit_bytes": limit,
            "rows": rows, "warnings": warnings}


def _name(role: str, ranks: int) -> str:
    return {"colocated": f"a colocated GPU (ZeRO over {ranks})", "drafter": f"a drafter rank (ZeRO over {ranks})",
            "target": "a target rank"}[role]


def long_context_lines(lc_out: dict[str, Any]) -> list[str]:
    """The report: each rank's terms at L and the longest L it holds."""
    L = lc_out["seq_len"]
    lines = [f"one sequence of {L:,} tokens per micro-batch ({lc_out.get('anchors_per_row', '?')} anchor blocks), per "
             f"rank against {lc_out.get('limit_bytes', 0) / GB:,.0f} GB (GPU less headroom):"]
    for r in lc_out["rows"]:
        if r["bytes"] is None:
            lines.append(f"  {_name(r['role'], r['ranks'])}: not checked (the target's weights are unknown)")
            continue
        verdict = "fits" if r["fits"] else "does NOT fit"
        lines.append(f"  {_name(r['role'], r['ranks']):<34} {r['bytes'] / GB:8.2f} GB: {verdict}; longest that fits "
                     f"{r['longest']:,} tokens")
        lines += [f"      {name:<28} {v / GB:8.2f}" for name, v in r["terms"].items()]
        if len(r.get("sp_longest") or {}) > 1:
            lines.append("      with sequence parallelism over these ranks (by the model; "
                         "topology.sequence_parallel): longest " + ", ".join(f"SP {n} {v:,}" for n, v in r["sp_longest"].items()))
    lines += [f"  warning: {w}" for w in lc_out["warnings"]]
    return lines


def holds(lc_out: dict[str, Any]) -> dict[str, int | None]:
    """Per mode, the smallest SP size whose ranks hold one sequence of --seq-len (1: no SP needed), None when none
    does, by the model: colocated, its row (each rank of a group runs the whole target forward, so SP rarely
    helps); disaggregated, the drafter row's and a target rank's (a target runs each sequence's forward whole).
    A row whose weights are unknown (fits None) is taken to hold."""
    rows = {r["role"]: r for r in lc_out["rows"]}

    def sp(row: dict[str, Any] | None) -> int | None:
        if row is None or row["fits"] is not False:
            return 1
        return row.get("sp_needed")

    dis = sp(rows.get("drafter")) if (rows.get("target") or {}).get("fits") is not False else None
    return {"colocated": sp(rows.get("colocated")), "disaggregated": dis}


def launch_flags(lc_out: dict[str, Any], mode: str) -> str | None:
    """The trainer flags that train sequences of --seq-len on `mode`'s layout, beside the layout's own flags; None
    when the model says that layout holds none. data.max_length is L; data.token_budget L when L is above the
    default (one sequence per micro-batch, as priced); with SP N, topology.sequence_parallel N."""
    L, sp = lc_out["seq_len"], holds(lc_out)[mode]
    if sp is None:
        return None
    flags = f"--data.max_length {L}" + (f" --data.token_budget {L}" if L > DataConfig.token_budget else "")
    return flags + (f" --topology.sequence_parallel {sp}" if sp > 1 else "")
