"""Peak memory of this process: CUDA allocator peak on GPU, peak resident set size on CPU.

On CPU the kernel keeps the high-water mark of the resident set (VmHWM in /proc/self/status);
writing "5" to /proc/self/clear_refs resets it to the current resident size, so a window's
peak can be read without a separate process.
"""

from __future__ import annotations

from pathlib import Path

import torch

GIB = 1024 ** 3


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def resident_bytes() -> int:
    """Current resident set size of this process (0 where /proc is not available)."""
    kib = _status_kib("VmRSS")
    return (kib or 0) * 1024


def peak_memory_bytes(device: torch.device) -> int:
    """Peak since the last `reset_peak_memory`: CUDA max_memory_allocated, or peak RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    kib = _status_kib("VmHWM")
    return (kib or 0) * 1024


def reset_peak_memory(device: torch.device) -> bool:
    """Start a new peak window; False where the CPU high-water mark cannot be reset (then it is lifetime)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def reserved_memory_bytes(device: torch.device) -> int | None:
    """Peak memory the CUDA caching allocator held since the last reset (allocated plus its cached slack and
    fragmentation); None on CPU."""
    return int(torch.cuda.max_memory_reserved(device)) if device.type == "cuda" else None


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far (flex_attention's and train.fuse's: bounded
    numbers, see models/block_mask.py and components/fusion.py; a count that grows every window means
    recompiles)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
