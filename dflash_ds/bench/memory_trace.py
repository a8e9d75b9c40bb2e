"""What is alive at the peak of one micro-step on a GPU, by the line that allocated it (`bench memory --memory-trace`).

The memory model (memory/model.py) predicts the peak term by term; on the H200 it over-predicted (+22% at full
width with checkpointing, +17-18% at widths 256/512) where on CPU it had matched the exact allocation trace to 1-3%.
A measured peak alone does not say which term is off. This records the CUDA caching allocator's history for one step
(`torch.cuda.memory._record_memory_history`, Python stacks), replays its allocations and frees to the moment the
allocated bytes peak, and groups the blocks alive then by the innermost frame in dflash_ds (file:line function),
marking those allocated while a checkpointed layer was recomputed, and those with no dflash_ds frame (autograd's
backward: gradients, run by the engine from C++) by the block's size, to set against the model's named terms.

Events (the snapshot's `device_traces`, one list per device): `alloc` and `free_completed` move the allocated bytes
(`free_requested` is a free waiting for its stream; segment events are the reserved pool's, not tensors').
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

PACKAGE = "/dflash_ds/"
CHECKPOINT = "torch/utils/checkpoint.py"


def _site(frames: list[dict[str, Any]]) -> str:
    """The block's allocation site: its innermost dflash_ds frame, '(recomputed)' inside a checkpoint's recompute."""
    mine = next((f for f in frames if PACKAGE in f.get("filename", "")), None)
    recomputed = any(CHECKPOINT in f.get("filename", "") for f in frames)
    if mine is None:
        return "(no dflash_ds frame: autograd's backward)"
    where = f"{mine['filename'].split(PACKAGE, 1)[1]}:{mine['line']} {mine.get('name', '')}"
    return where + (" (recomputed)" if recomputed else "")


def peak_blocks(events: list[dict[str, Any]]) -> tuple[int, list[dict[str, Any]]]:
    """(peak bytes above the start, the blocks alive at that moment) of one device's trace events, in order.

    A block freed in the trace but allocated before it began (an input, a parameter) is not counted either way."""
    live: dict[int, dict[str, Any]] = {}
    total = peak = peak_at = 0
    for i, e in enumerate(events):
        action = e.get("action")
        if action == "alloc":
            live[e["addr"]] = e
            total += e["size"]
            if total > peak:
                peak, peak_at = total, i + 1
        elif action == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]
    live = {}
    for e in events[:peak_at]:  # again, up to the peak: the blocks alive there
        if e.get("action") == "alloc":
            live[e["addr"]] = e
        elif e.get("action") == "free_completed":
            live.pop(e["addr"], None)
    return peak, list(live.values())


def group_blocks(blocks: list[dict[str, Any]], top: int = 30) -> list[dict[str, Any]]:
    """Blocks grouped by allocation site, largest first: bytes, count and the three commonest block sizes."""
    groups: dict[str, list[int]] = defaultdict(list)
    for b in blocks:
        groups[_site(b.get("frames") or [])].append(b["size"])
    rows = []
    for site, sizes in groups.items():
        common = sorted(set(sizes), key=lambda s: (-sizes.count(s) * s, s))[:3]
        rows.append({"site": site, "bytes": sum(sizes), "blocks": len(sizes),
                     "sizes": [{"bytes": s, "count": sizes.count(s)} for s in common]})
    rows.sort(key=lambda r: -r["bytes"])
    return rows[:top]


def trace_step(one_step: Callable[[], Any], device, max_entries: int = 400_000) -> dict[str, Any]:
    """Run `one_step` once with the allocator's history recorded (CUDA only): its peak and the groups alive there."""
    import torch

    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    torch.cuda.memory._record_memory_history(max_entries=max_entries, context="alloc", stacks="python")
    try:
        one_step()
        torch.cuda.synchronize(device)
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    events = snap["device_traces"][device.index if device.index is not None else torch.cuda.current_device()]
    peak, blocks = peak_blocks(events)
    return {"measured_peak_bytes": torch.cuda.max_memory_allocated(device) - base, "traced_peak_bytes": peak,
            "events": len(events), "truncated": len(events) >= max_entries, "groups": group_blocks(blocks)}


def append(path: str, title: str, trace: dict[str, Any]) -> None:
    """Append `trace`'s section to the file at `path`."""
    with open(path, "a") as f:
        f.write(format_trace(title, trace))


def format_trace(title: str, trace: dict[str, Any]) -> str:
    """A text section: the peak, then each group's GB, blocks and commonest sizes."""
    lines = [f"== {title}: traced peak {trace['traced_peak_bytes'] / 1e9:.3f} GB above the step's start "
             f"(max_memory_allocated: {trace['measured_peak_bytes'] / 1e9:.3f} GB; {trace['events']} events"
             f"{', TRUNCATED: raise max_entries' if trace['truncated'] else ''})",
             f"{'GB':>8} {'blocks':>7}  site (commonest block sizes, MB x count)"]
    for g in trace["groups"]:
        sizes = ", ".join(f"{s['bytes'] / 1e6:.1f} x {s['count']}" for s in g["sizes"])
        lines.append(f"{g['bytes'] / 1e9:8.3f} {g['blocks']:7d}  {g['site']} ({sizes})")
    return "\n".join(lines) + "\n"
