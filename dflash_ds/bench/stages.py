"""The per-batch work every `bench pipeline` phase times: target forward + capture, one drafter step.

Used by the pipeline's capacity phases (a) and (b) (`bench/pipeline.py`), so that both time
exactly the work the trainer does per batch: each calls the trainer's own functions
(`runtime/sources.capture_batch`, `runtime/engine.build_drafter_engine`, `runtime/step.train_micro`).
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable

from dflash_ds.config import Config


def capture(target, batch, arch, device, keep_last: bool) -> dict:
    """Target forward + capture of one loaded batch (`data.loader.Batch`), as a target rank does it."""
    from dflash_ds.runtime.sources import capture_batch

    return capture_batch(target, batch, arch.target_layer_ids, keep_last, device)


def make_engine(cfg: Config, arch, dtype: Any, device) -> Any:
    """The drafter's DeepSpeed engine over the current default process group, as run_drafter builds it."""
    from dflash_ds.runtime.engine import build_drafter_engine

    return build_drafter_engine(cfg, arch, dtype, device)


def train_step(engine: Any, cfg: Config, tensors: dict, batch_id: int, step: int, dtype) -> float:
    """One drafter step exactly as run_drafter takes it (runtime/step.py, one micro-batch); returns the loss."""
    from dflash_ds.runtime.sources import SourcedBatch
    from dflash_ds.runtime.step import noise_at, step_grad_norm, train_micro

    result, _ = train_micro(engine, SourcedBatch(batch_id, tensors, {}, 0), 0, cfg, dtype, noise_at(cfg, step),
                            accumulation=1, stop_requested=False)
    step_grad_norm(engine, [result], 1)  # the trainer reads it after every step
    return result.loss


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def put(store, key: str, value: Any) -> None:
    store.set(key, json.dumps(value))


def timed(work: list[tuple[int, int, Callable[[], Any]]], warmup: int, device) -> list:
    """Run (step, real tokens, fn) items in order; [real tokens, seconds, [(tokens, seconds)]] from step `warmup` on."""
    tokens, seconds, items = 0, 0.0, []
    for step, n, fn in work:
        t0 = time.perf_counter()
        fn()
        sync(device)
        if step >= warmup:
            dt = time.perf_counter() - t0
            tokens, seconds = tokens + n, seconds + dt
            items.append((n, dt))
    return [tokens, seconds, items]
