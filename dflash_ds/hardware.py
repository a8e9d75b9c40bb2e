"""What this machine computes natively: where bf16 pays and where it is emulated.

Used by the trainer's `train.dtype fast` (runtime/job.py) and by the vLLM servers dflash-ds starts
(`--vllm-dtype fast`, serving/vllm_server.py).
"""

from __future__ import annotations


def native_bf16_cpu() -> bool:
    """Whether this CPU computes bf16 matmuls natively (AVX512-BF16 or AMX): bf16 then runs ~2x fp32's speed.
    Without (AVX2 only, e.g. an AMD EPYC VM here), torch emulates them: a [224, 576] x [576, 49,152] product, the
    SmolLM2 head's, took 1.40 s in bf16 against 0.22 s in fp32 on one core (2026-12-07); vLLM's CPU build served
    SmolLM2-135M at 12 new tokens/s in bf16 against 66 in float32 (60 answers at concurrency 16, 2026-12-07)."""
    import torch

    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:  # an older torch: no answer, no claim
        return False
