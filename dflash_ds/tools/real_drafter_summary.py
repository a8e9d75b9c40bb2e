"""What `dflash-ds real-drafter` reached: the data, tau per held-out set and task type, the speedup, the time.

Read from the stages' own outputs (prompts/data_stats.json, answers/*.jsonl, run/metrics.jsonl, eval/*.json,
speedup/speedup.json); written as OUT/summary.json and OUT/summary.txt.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def answer_tokens(path: Path) -> int:
    """Generated answer tokens of a regenerate output (the ids of every assistant turn)."""
    return sum(len(ids) for row in _rows(path) for ids in (row.get("token_ids") or []) if ids)


def tau_by_kind(prompts: Path, result: dict) -> dict[str, float]:
    """Mean of the per-prompt tau by the prompt rows' `kind` (eval takes the file's first N rows, in order)."""
    kinds = [row.get("kind", "?") for row in _rows(prompts)]
    by: dict[str, list[float]] = defaultdict(list)
    for kind, tau in zip(kinds, result.get("tau_per_prompt", [])):
        if tau is not None:
            by[kind].append(tau)
    return {k: sum(v) / len(v) for k, v in sorted(by.items())}


def summarize(out: Path, export: Path, walls: dict[str, float | None]) -> dict:
    stats = json.loads((out / "prompts" / "data_stats.json").read_text())
    metrics = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = max((m.get("step", 0) for m in metrics), default=0)
    held = {}
    for name in ("held_out", "held_out_grid"):
        res = json.loads((out / "eval" / f"{name}.json").read_text())
        held[name] = {"tau": res["tau"], "tau_pooled": res["tau_pooled"], "prompts": len(res.get("tau_per_prompt", [])),
                      "p_position": res["per_position_acceptance"][:3], "by_kind": tau_by_kind(out / "prompts" /
                                                                                                  f"{name}.jsonl", res)}
    speed = json.loads((out / "speedup" / "speedup.json").read_text())
    rows = [{k: r.get(k) for k in ("engine", "concurrency", "draft_tokens", "tau", "step_ratio", "predicted_speedup")}
            | {"speedup": r["speedup"]["mean"], "speedup_min": r["speedup"]["min"], "speedup_max": r["speedup"]["max"],
               "plain_tok_s": r["plain_tok_s"]["mean"], "spec_tok_s": r["spec_tok_s"]["mean"]}
            for r in speed["rows"]]
    return {"export": str(export), "prompts": {"requests": stats["requests"], "kept": stats["kept"],
                                                "rejected": stats["rejected"], "train": stats["train"]["prompts"]},
            "answer_tokens": answer_tokens(out / "answers" / "train.jsonl"), "train_steps": steps,
            "held_out": held, "speedup": rows, "mismatches": len(speed.get("mismatches", [])),
            "wall_s": walls, "total_s": sum(w for w in walls.values() if w)}


def format_summary(s: dict) -> str:
    p = s["prompts"]
    lines = [f"real-drafter: {s['export']}",
             f"  data: {p['kept']:,} generated prompts kept of {p['requests']:,} asked, {p['train']:,} training "
             f"prompts, {s['answer_tokens']:,} answer tokens; {s['train_steps']:,} training steps"]
    for name, h in s["held_out"].items():
        kinds = ", ".join(f"{k} {v:.2f}" for k, v in h["by_kind"].items())
        lines.append(f"  tau {name} ({h['prompts']} prompts): {h['tau']:.3f} (pooled {h['tau_pooled']:.3f}; "
                     f"P(pos 1-3) {', '.join(f'{x:.2f}' for x in h['p_position'])}); by task type: {kinds}")
    for r in s["speedup"]:
        pred = "" if r["predicted_speedup"] is None else (f", predicted {r['predicted_speedup']:.2f}x from step ratio "
                                                          f"{r['step_ratio']:.2f}")
        k = "" if r.get("draft_tokens") is None else f", k {r['draft_tokens']}"
        lines.append(f"  speedup {r['engine']} at concurrency {r['concurrency']}{k}: {r['speedup']:.2f}x "
                     f"({r['speedup_min']:.2f}-{r['speedup_max']:.2f}; {r['plain_tok_s']:.1f} -> {r['spec_tok_s']:.1f} "
                     f"tok/s, tau {r['tau']:.2f}{pred})")
    lines.append(f"  outputs differing from plain decoding: {s['mismatches']}")
    walls = ", ".join(f"{k} {v / 60:.1f}" for k, v in s["wall_s"].items() if v is not None)
    lines.append(f"  minutes: {walls}; total {s['total_s'] / 60:.1f}")
    return "\n".join(lines) + "\n"


def write_summary(out: Path, summary: dict) -> None:
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "summary.txt").write_text(format_summary(summary))
