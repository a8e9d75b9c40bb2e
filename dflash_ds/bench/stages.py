"""The per-batch work every `bench pipeline` phase times: target forward + capture, one drafter step.

Used by the pipeline's capacity phases (a) and (b) (`bench/pipeline.py`), so that both time
exactly the work the trainer does per batch.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable

from dflash_ds.config import Config


def capture(target, batch: dict, arch, device, keep_last: bool) -> dict:
    """Target forward + capture of one loaded batch, as a target rank does it."""
    import torch

    from dflash_ds.models.target import capture_hidden

    ids = batch["input_ids"].to(device)
    attn = (torch.arange(ids.shape[1])[None, :] < batch["lengths"][:, None]).long().to(device)
    context, last = capture_hidden(target, ids, attn, arch.target_layer_ids)
    out = {"input_ids": ids, "loss_mask": batch["loss_mask"].to(device), "lengths": batch["lengths"].to(device),
           "context": context.contiguous()}
    if keep_last:
        out["last_hidden"] = last.contiguous()
    return out


def make_engine(cfg: Config, dtype: Any) -> Any:
    """The drafter's DeepSpeed engine over the current default process group, as run_drafter builds it."""
    import torch

    from dflash_ds.models.drafter import DFlashDrafter
    from dflash_ds.models.target import load_target_head
    from dflash_ds.runtime.engine import DrafterTrainModule, build_engine, load_ds_config, resolve_ds_config
    from dflash_ds.runtime.job import resolve_arch

    if cfg.drafter:
        drafter = DFlashDrafter.from_pretrained(cfg.drafter)
    else:
        drafter = DFlashDrafter(resolve_arch(cfg))
        drafter.init_weights(cfg.train.seed)
    embed, head = load_target_head(cfg.target)
    module = DrafterTrainModule(drafter, embed, head)
    return build_engine(module, cfg, load_ds_config(resolve_ds_config(cfg), cfg, bf16=dtype == torch.bfloat16))


def train_step(engine: Any, cfg: Config, tensors: dict, batch_id: int, step: int, dtype) -> float:
    """One drafter step exactly as run_drafter takes it (anchors and noise seeded per batch); returns the loss."""
    from dflash_ds.components.objective import TargetStates
    from dflash_ds.components.schedules import noise_std_at
    from dflash_ds.runtime.step import ANCHOR_SALT, NOISE_SALT
    from dflash_ds.runtime.step import batch_seed

    states = TargetStates(tensors["input_ids"], tensors["loss_mask"], tensors["lengths"],
                          tensors["context"].to(dtype), tensors.get("last_hidden"))
    noise = noise_std_at(step, max_std=cfg.noise.max_std, min_std=cfg.noise.min_std,
                         warmup_steps=cfg.noise.warmup_steps, total_steps=cfg.train.max_steps)
    terms, _ = engine(states, cfg.loss, batch_seed(cfg.train.seed, batch_id, ANCHOR_SALT), noise,
                      batch_seed(cfg.train.seed, batch_id, NOISE_SALT))
    engine.backward(terms.loss)
    engine.step()
    engine.get_global_grad_norm()
    return terms.loss.item()


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
