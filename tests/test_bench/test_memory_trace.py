"""`bench memory --memory-trace`: the replay of the CUDA allocator's history finds the peak and what is alive there
(bench/memory_trace.py), checked here on a hand-made trace in the snapshot's format; on CPU the flag is one error."""

from __future__ import annotations

import json
from pathlib import Path

from dflash_ds.bench.memory_trace import format_trace, group_blocks, peak_blocks

PKG = "/usr/lib/python3/site-packages/dflash_ds/"
LINEAR = {"filename": "/usr/lib/python3/site-packages/torch/nn/modules/linear.py", "line": 125, "name": "forward"}
MLP = {"filename": PKG + "models/drafter.py", "line": 113, "name": "forward"}
STEP = {"filename": PKG + "bench/memory.py", "line": 221, "name": "one_step"}
CKPT = {"filename": "/usr/lib/python3/site-packages/torch/utils/checkpoint.py", "line": 1100, "name": "recompute_fn"}


def alloc(addr: int, size: int, *frames: dict) -> dict:
    return {"action": "alloc", "addr": addr, "size": size, "stream": 0, "frames": list(frames)}


def free(addr: int, size: int, completed: bool = True) -> dict:
    return {"action": "free_completed" if completed else "free_requested", "addr": addr, "size": size, "stream": 0}


EVENTS = [
    alloc(1, 100, LINEAR, MLP, STEP),  # 100
    free(9, 4000),  # a block from before the trace: counted neither way
    alloc(2, 50, LINEAR, MLP, CKPT, STEP),  # 150
    free(1, 100, completed=False),  # requested, not yet back: still allocated
    {"action": "segment_alloc", "addr": 0, "size": 2 << 20, "stream": 0, "frames": []},  # the pool's, not a tensor
    alloc(3, 200),  # 350: autograd's backward (no Python frame of ours)
    alloc(4, 200),  # 550
    free(1, 100),  # 450
    alloc(5, 120, LINEAR, MLP, STEP),  # 570: the peak
    free(3, 200),  # 370
    alloc(6, 150),  # 520
]


def test_the_peak_and_what_is_alive_there_by_site():
    peak, blocks = peak_blocks(EVENTS)
    assert peak == 570 and sorted(b["addr"] for b in blocks) == [2, 3, 4, 5]
    groups = group_blocks(blocks)
    assert [(g["site"], g["bytes"], g["blocks"]) for g in groups] == [
        ("(no dflash_ds frame: autograd's backward)", 400, 2),
        ("models/drafter.py:113 forward", 120, 1),
        ("models/drafter.py:113 forward (recomputed)", 50, 1)]
    assert groups[0]["sizes"] == [{"bytes": 200, "count": 2}]
    text = format_trace("dflash, width 256", {"traced_peak_bytes": 570e6, "measured_peak_bytes": 560e6, "events": 11,
                                              "truncated": False, "groups": groups})
    assert text.splitlines()[0].startswith("== dflash, width 256: traced peak 0.570 GB")
    assert "   0.000       1  models/drafter.py:113 forward (recomputed) (0.0 x 1)" in text


def test_on_cpu_the_flag_is_one_clear_error(tmp_path: Path, cli_here) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024, "tie_word_embeddings": False}))
    proc = cli_here("bench", "memory", "--target", str(tmp_path), "--device", "cpu", "--memory-trace",
                    str(tmp_path / "trace.txt"))
    assert proc.returncode == 2 and "--memory-trace records the CUDA allocator's history" in proc.stderr, proc.stderr
    assert not (tmp_path / "trace.txt").exists()
