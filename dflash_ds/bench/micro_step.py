"""One drafter micro-step of any kind at a given shape, with random weights: what `bench memory` measures and
profiles, and what the tests profile at the real vocabulary (tests/test_core/test_head_gemm.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash_ds.memory import model as mm


def drafter_arch(cfg: dict[str, Any], shape: mm.DrafterShape, seq_len: int):
    """The DrafterArch of `shape` (its kind's default options) reading `cfg`'s target: default layer ids."""
    from dflash_ds.models.drafter import DrafterArch, default_target_layer_ids
    from dflash_ds.models.kinds import kind_spec

    n_target = int(cfg["num_hidden_layers"])
    return DrafterArch(
        hidden_size=shape.hidden, intermediate_size=shape.intermediate, num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
        vocab_size=shape.vocab, rms_norm_eps=1e-6, max_position_embeddings=max(4096, seq_len),
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg.get("rope_theta", 1e6))},
        block_size=shape.block_size, num_target_layers=n_target, mask_token_id=shape.vocab - 1,
        target_layer_ids=default_target_layer_ids(n_target, shape.num_layers),
        options=shape.options if shape.options is not None else kind_spec(shape.kind).default_options())


def visible_keys(batch: int, seq_len: int, block_size: int, num_anchors: int, max_anchors: int) -> tuple[float, int]:
    """(keys the block queries see, summed over queries; anchors per row) of full-length all-response rows with the
    anchors of seed 0: attention's share of the micro-step's FLOPs (memory/model.micro_step_flops)."""
    import torch

    from dflash_ds.components.anchors import sample_anchors

    anchors, _ = sample_anchors(torch.ones(batch, seq_len, dtype=torch.long), torch.full((batch,), seq_len),
                                block_size, num_anchors, torch.Generator().manual_seed(0), max_total=max_anchors)
    return float(((anchors + block_size) * block_size).sum()), int(anchors.shape[1])


def micro_step_inputs(cfg: dict[str, Any], shape: mm.DrafterShape, step: mm.StepShape, *, seed: int,
                      num_anchors: int, max_anchors: int, chunk_blocks: int, kl_weight: float, mask_backend: str,
                      device, dtype) -> tuple[Any, Any, Any]:
    """(train module, target states, loss config) of one micro-step of a `shape.kind` drafter with random weights.

    The module is what DeepSpeed wraps in training (drafter + frozen full-vocabulary embedding and head); the
    batch is `step.batch` full-length sequences of response tokens; the loss config is the kind's defaults with
    the anchors and chunk asked for (each kind's own loss term at its default weight: config_kinds.py).
    """
    import torch
    from torch import nn

    from dflash_ds.components.objective import TargetStates
    from dflash_ds.config import LossConfig
    from dflash_ds.models.drafter import DFlashDrafter
    from dflash_ds.runtime.engine import DrafterTrainModule

    arch = drafter_arch(cfg, shape, step.seq_len)
    torch.manual_seed(seed)
    drafter = DFlashDrafter.seeded(arch, seed, device).to(dtype)  # drawn on the device
    drafter.activation_checkpointing, drafter.checkpoint_layers = step.checkpointing, step.checkpoint_layers
    drafter.mask_backend = mask_backend
    gen = torch.Generator().manual_seed(seed)
    # the V x H matrices drawn on the device: 2 x 622 M normal samples at Qwen3-8B take seconds on one CPU core
    dgen = torch.Generator(device=device).manual_seed(seed)
    embed_w = (torch.randn(shape.vocab, shape.hidden, generator=dgen, device=device) * 0.02).to(dtype)
    embed = nn.Embedding(shape.vocab, shape.hidden, _weight=embed_w)
    head = nn.Linear(shape.hidden, shape.vocab, bias=False, device="meta")  # no throwaway V x H init
    if shape.tied:
        head.weight = embed.weight
    else:
        head.weight = nn.Parameter((torch.randn(shape.vocab, shape.hidden, generator=dgen, device=device) * 0.02
                                    ).to(dtype))
    module = DrafterTrainModule(drafter, embed, head)
    b, s = step.batch, step.seq_len
    states = TargetStates(
        input_ids=torch.randint(0, shape.vocab - 1, (b, s), generator=gen).to(device),
        loss_mask=torch.ones(b, s, dtype=torch.long, device=device), lengths=torch.full((b,), s, device=device),
        context=torch.randn(b, s, shape.num_read * shape.hidden, generator=gen).to(device, dtype),
        last_hidden=torch.randn(b, s, shape.hidden, generator=gen).to(device, dtype) if step.kl else None)
    loss_cfg = LossConfig(num_anchors=num_anchors, max_anchors_per_batch=max_anchors, chunk_blocks=chunk_blocks,
                          kl_weight=kl_weight)
    return module, states, loss_cfg


def write_profile(one_step, device, path: str, top: int = 25) -> list[dict[str, Any]]:
    """Run `one_step` once under torch.profiler; write the `top` kernels by device time (CPU: by CPU time) to
    `path` as a table, beside it a Chrome trace (`path`.trace.json); return them as rows."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts, record_shapes=True) as prof:
        one_step()
        if cuda:
            torch.cuda.synchronize(device)
    key = "device_time_total" if cuda else "cpu_time_total"
    # CUDA: the kernels themselves (device-side events), not the ops that launched them too: an op's device time
    # is its kernels', so listing both counts every kernel twice
    events = [e for e in prof.key_averages() if getattr(e, key, 0) > 0
              and (not cuda or getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)]
    total = sum(getattr(e, "self_" + key, 0) for e in events) or 1.0
    events.sort(key=lambda e: getattr(e, "self_" + key, 0), reverse=True)
    rows = [{"name": e.key[:120], "calls": e.count, "self_ms": getattr(e, "self_" + key, 0) / 1e3,
             "share": getattr(e, "self_" + key, 0) / total} for e in events[:top]]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    lines = [f"{'self ms':>10} {'share':>6} {'calls':>6}  name ({'device' if cuda else 'CPU'} time, one micro-step)"]
    lines += [f"{r['self_ms']:10.2f} {100 * r['share']:5.1f}% {r['calls']:6d}  {r['name']}" for r in rows]
    Path(path).write_text("\n".join(lines) + "\n")
    prof.export_chrome_trace(str(path) + ".trace.json")
    return rows
