"""The GPU check's summary: $OUT/summary.json (every step's status, seconds and figures) and $OUT/table.md (the
table docs/BENCHMARKS.md shows). Called by launch/gpu_check.sh; runs alone on a finished $OUT too:

    python launch/gpu_summary.py gpu_check_out --budget 470 --seconds 455
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path
from typing import Any


def _json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def figures(out: Path, steps: dict[str, dict[str, Any]]) -> None:
    """Attach each step's figures (from the JSON files it wrote) to its record."""
    bench = _json(out / "bench_memory.json")
    if bench and "bench_memory" in steps:
        steps["bench_memory"]["figures"] = {
            "peak_kind": bench.get("peak_kind"),
            "rows": [{k: r.get(k) for k in ("kind", "width", "activation_checkpointing", "fuse", "step_s", "tokens_per_s",
                                            "mfu", "hfu", "step_vs_dflash", "error_pct")}
                     | {"measured_peak_gb": r["measured_peak_bytes"] / 1e9,
                        "predicted_peak_gb": r["predicted_peak_bytes"] / 1e9,
                        "profile_top": (r.get("profile_top") or [])[:8]} for r in bench.get("rows", [])]}
    widths = _json(out / "bench_widths.json")
    if widths and "bench_widths" in steps:
        steps["bench_widths"]["figures"] = [{"width": r["width"], "measured_peak_gb": r["measured_peak_bytes"] / 1e9,
                                             "activation_checkpointing": r.get("activation_checkpointing"),
                                             "predicted_peak_gb": r["predicted_peak_bytes"] / 1e9,
                                             "error_pct": r["error_pct"]} for r in widths.get("rows", [])]
    real = _json(out / "real_shape.json")
    if real and "real_shape" in steps:
        steps["real_shape"]["figures"] = {k: real.get(k) for k in ("tok_per_s", "target_tok_per_s", "seconds", "mfu",
                                                                   "peak_bytes", "reserved_bytes", "anchors")}
        steps["real_shape"]["figures"]["plan_total_bytes"] = (real.get("plan") or {}).get("total_bytes")
    metrics = out / "colocated" / "full" / "metrics.jsonl"
    if metrics.is_file() and "colocated" in steps:
        last = json.loads(metrics.read_text().splitlines()[-1])
        steps["colocated"]["figures"] = {k: last.get(k) for k in ("tok_per_sec", "peak_mem_gb", "reserved_mem_gb",
                                                                    "compiled_graphs", "step_time_s", "loss")}
        log = out / "colocated.log"
        lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
        # each run's seconds (launch/gpu_colocated.sh), the resume's from an empty inductor cache and the run's own
        steps["colocated"]["figures"]["runs_s"] = {
            line.split("] ", 1)[1].rsplit(": ", 1)[0]: int(line.rsplit(": ", 1)[1].split()[0])
            for line in lines if line.startswith("[gpu_colocated] ") and line.endswith(" s")}
        steps["colocated"]["figures"]["compile_cache_loaded"] = any("compile cache: " in line for line in lines)
    tests = out / "gpu_tests.log"
    if tests.is_file() and "gpu_tests" in steps:
        tail = [line for line in tests.read_text().splitlines() if " passed" in line or " failed" in line]
        steps["gpu_tests"]["figures"] = {"result": tail[-1] if tail else None}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def table(summary: dict[str, Any]) -> str:
    """The markdown table of the run."""
    steps = {s["step"]: s for s in summary["steps"]}
    lines = [f"GPU check of {summary['date']} on {summary.get('gpu') or '?'}, torch {summary.get('torch') or '?'}: "
             f"{summary['seconds']} s in all (budget {summary['budget_s']} s), "
             f"{'green' if summary['green'] else 'NOT green'}; HF_HUB_OFFLINE={summary['hf_hub_offline']}, "
             f"USE_HUB_KERNELS {'unset' if summary['use_hub_kernels'] is None else summary['use_hub_kernels']}", "",
             "| step | exit | s | figures |", "|---|---:|---:|---|"]
    for name, s in steps.items():
        fig = ""
        f = s.get("figures")
        if name == "real_shape" and f:
            t = f["seconds"]
            fig = (f"{f['tok_per_s']:,.0f} tok/s (target {t['target']:.3f} s, drafter {t['drafter']:.3f} + "
                   f"optimizer {t['optimizer']:.3f} s); MFU target {_pct((f['mfu'] or {}).get('target'))}, drafter "
                   f"{_pct((f['mfu'] or {}).get('drafter'))}; peak {f['peak_bytes'] / 1e9:.2f} GB vs plan "
                   f"{(f['plan_total_bytes'] or 0) / 1e9:.2f} GB")
        elif name == "colocated" and f:
            tok = f["tok_per_sec"]
            fig = (f"{tok:,.0f}" if isinstance(tok, (int, float)) else f"{tok}") + (
                f" tok/s, peak {f['peak_mem_gb']} GB, reserved {f['reserved_mem_gb']} GB, {f['compiled_graphs']} graphs")
            runs = f.get("runs_s") or {}
            if runs:
                fig += "; " + ", ".join(f"{what} {sec} s" for what, sec in runs.items()) + (
                    " (compile cache loaded)" if f.get("compile_cache_loaded") else "")
        elif name == "gpu_tests" and f:
            fig = str(f["result"])
        elif name == "bench_widths" and f:
            fig = "; ".join(f"width {r['width']} ckpt {'on' if r.get('activation_checkpointing') else 'off'}: "
                            f"{r['measured_peak_gb']:.2f} GB vs {r['predicted_peak_gb']:.2f} ({r['error_pct']:+.1f}%)"
                            for r in f)
        status = s.get("skipped") or s.get("exit")
        lines.append(f"| {name} | {status} | {s.get('seconds', '-')} | {fig} |")
    bench = (steps.get("bench_memory") or {}).get("figures")
    if bench:
        lines += ["", "| kind | ckpt | fuse | step s | tokens/s | MFU | HFU | vs dflash | peak GB (pred.) |",
                  "|---|---|---|---:|---:|---:|---:|---:|---|"]
        for r in bench["rows"]:
            vs = "-" if r["step_vs_dflash"] is None else f"{r['step_vs_dflash']:.2f}x"
            lines.append(f"| {r['kind']} | {'on' if r['activation_checkpointing'] else 'off'} | {r.get('fuse') or '-'} | "
                         f"{r['step_s']:.3f} | "
                         f"{r['tokens_per_s']:,.0f} | {_pct(r['mfu'])} | {_pct(r['hfu'])} | {vs} | "
                         f"{r['measured_peak_gb']:.2f} ({r['predicted_peak_gb']:.2f}) |")
    return "\n".join(lines) + "\n"


def main() -> int:
    import os

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="the check's output folder ($OUT)")
    p.add_argument("--budget", type=int, default=0, help="the check's budget in seconds (BUDGET_S)")
    p.add_argument("--seconds", type=int, default=0, help="the check's run time in seconds")
    args = p.parse_args()
    out = Path(args.out)
    steps = {s["step"]: s for s in map(json.loads, (out / "steps.jsonl").read_text().splitlines())}
    figures(out, steps)
    bench = _json(out / "bench_memory.json") or _json(out / "real_shape.json") or {}
    summary = {"date": datetime.date.today().isoformat(), "gpu": bench.get("device"), "torch": bench.get("torch"),
               "seconds": args.seconds, "budget_s": args.budget,
               # a step skipped for want of CUDA has no exit status; one skipped for the budget has 124
               "green": all(s.get("exit", 0) == 0 for s in steps.values()),
               "hf_hub_offline": os.environ.get("HF_HUB_OFFLINE"), "use_hub_kernels": os.environ.get("USE_HUB_KERNELS"),
               "steps": list(steps.values())}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "table.md").write_text(table(summary))
    print(table(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
