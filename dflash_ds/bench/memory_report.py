"""`dflash-ds bench memory`'s printed report (bench/memory.py makes the result)."""

from __future__ import annotations

from typing import Any

from dflash_ds.memory import model as mm


def _gb(n: float) -> str:
    return f"{n / mm.GB:,.2f}"


def print_result(res: dict[str, Any]) -> None:
    """The table of `bench memory`'s result and its full-width prediction, term by term."""
    from dflash_ds.bench.table import print_table

    mfu = res["device"] != "cpu"
    def ckpt(r: dict[str, Any]) -> str:  # on (every layer), off, or k/L (the first k recomputed)
        k = r.get("recomputed_layers")
        on = "on" if k in (None, res["num_layers"]) else f"{k}/{res['num_layers']}"
        return on if r.get("activation_checkpointing") else "off"

    rows = [[r.get("kind", "dflash"), ckpt(r), r.get("fuse", "off"),
             str(r["width"]), f"{r['heads']}/{r['kv_heads']}x{r['head_dim']}",
             str(r["intermediate"]), f"{r['params'] / 1e6:,.1f}", str(r["anchors"]), _gb(r["measured_peak_bytes"]),
             _gb(r["predicted_peak_bytes"]), f"{r['error_pct']:+.1f}", r["predicted_phase"], f"{r['step_s']:.3f}",
             "-" if r.get("step_vs_dflash") is None else f"{r['step_vs_dflash']:.2f}x", f"{r['tokens_per_s']:,.0f}"]
            + ([f"{100 * r['mfu']:.1f}", f"{100 * r['hfu']:.1f}"] if mfu else []) for r in res["rows"]]
    print_table(
        f"bench memory: {res['target']}, {res['num_layers']}-layer drafter, {res['device']} {res['dtype']}, "
        f"mask {res['mask']}; "
        f"{res['batch']} x {res['seq_len']} tokens, anchors {res['num_anchors']}/seq capped at {res['max_anchors']}, "
        f"chunk {res['chunk_blocks']} blocks, KL {res['kl_weight']:g}",
        ["kind", "ckpt", "fuse", "width", "heads", "MLP", "params M", "anchors", "measured GB", "predicted GB", "error %", "peak phase",
         "step s", "vs dflash", "tokens/s"] + (["MFU %", "HFU %"] if mfu else []), rows,
        f"one micro-step (objective + backward); measured = {res['peak_kind']} minus before the step"
        + (", allocations >= 64 KiB mmapped; " if res["cpu_allocations_mmapped"] else "; ") +
        f"LM-head chunk at {res['lm_head_bytes_per_entry']:g} B per (position x vocab entry)"
        + (f"; MFU: the DFlash drafter's model FLOPs (fwd + 2x bwd of the layers, fc, the head's fwd + input "
           f"gradient) / {mm.H200_BF16_FLOPS / 1e12:.0f} TFLOP/s; HFU adds the checkpointed layers' recompute"
           if mfu else ""))
    f = res["full_width"]
    print(f"\npredicted per {f.get('kind', 'dflash')} drafter rank at full width H={f['hidden']} ({f['params'] / 1e9:.2f}B drafter params, "
          f"{f['anchors_per_row']} anchors/seq): bf16, flex_attention, checkpointing on, ZeRO-{f['settings']['zero_stage']} "
          f"over {f['settings']['num_drafters']} drafter rank(s); peak phase: {f['peak_phase']}")
    terms = [[k, _gb(v)] for k, v in f["micro_step_terms"].items()]
    terms += [["= micro-step", _gb(f["micro_step_bytes"])]] + [[k, _gb(v)] for k, v in f["static_terms"].items()]
    terms += [["= total", _gb(f["total_bytes"])]]
    print_table("", ["term", "GB"], terms,
                f"total {'<=' if f['within_budget'] else '>'} {f['budget_gb']:g} GB per drafter rank "
                f"(80 GB GPU: {80 - f['total_bytes'] / mm.GB:.1f} GB left)")
