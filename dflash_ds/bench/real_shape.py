"""`dflash-ds bench real-shape`: colocated training at a published target's shape on one device, from no file.

The target is built with random weights straight on the device (transformers' `from_config` under the device
context: no download, no 16 GB file on disk, no Hub kernels); the drafter (5 layers, block 16 by default) trains
beside it in the trainer's own DeepSpeed engine (one rank, ZeRO-2, bf16 on CUDA), sharing the target's embedding
and LM head as a colocated rank does. Each step is a random-token batch of the token budget: the target forward
with its capture (`runtime/sources.capture_batch`), the drafter's micro-step (`runtime/step.forward` + backward)
and the optimizer step, each timed on its own (device synchronised around it). Reported: tokens/s of the whole
step and of each part, MFU of each part (model FLOPs / 989 TFLOP/s: the target's matmuls and causal attention,
the drafter's as `bench memory` counts them, no recompute), and peak / reserved memory against `plan`'s colocated
prediction (the target's weights + the drafter's training memory).

At Qwen3-8B's shape (the default): the target is 8.19 B parameters, 16.4 GB in bf16, about 13.9 GFLOP a token
forward at 2,048 tokens (228 TFLOP a 16,384-token batch); the drafter 1.05 B parameters, 16.8 GB of ZeRO-2 states
on one rank. `--preset qwen3.6-27b` builds a dense stand-in: Qwen3 layers at Qwen3.6-27B's widths and depth (64
layers, H 5120, V 248,320; 54 GB in bf16); its 48 Gated DeltaNet layers are full-attention layers here, so the
target's time is indicative only, while the drafter side (H 5120, V 248,320) is exact.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from dflash_ds.bench import micro_step
from dflash_ds.errors import DFlashError
from dflash_ds.memory import model as mm
from dflash_ds.memory.shapes import drafter_shape, step_shape
from dflash_ds.models.kinds import kind_names
from dflash_ds.models.presets import PRESETS


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `dflash-ds bench real-shape`."""
    p.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-8b",
                   help="target shape (models/presets.py); qwen3.6-27b is a dense stand-in (see the module doc)")
    p.add_argument("--kind", choices=kind_names(), default="dflash", help="drafter kind")
    p.add_argument("--num-layers", type=int, default=5, help="drafter decoder layers")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block, the anchor included")
    p.add_argument("--token-budget", type=int, default=16384, help="tokens per batch (one batch a step)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (token-budget // seq-len rows)")
    p.add_argument("--num-anchors", type=int, default=0, help="anchor blocks per sequence (0 = loss.num_anchors)")
    p.add_argument("--steps", type=int, default=3, help="timed steps (the median is reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (flex_attention compiles here)")
    p.add_argument("--activation-checkpointing", choices=["on", "off", "auto"], default="auto",
                   help="recompute each draft layer in backward (auto: as training decides, "
                        "runtime/checkpointing.py: off where the GPU's free memory holds the step without it)")
    p.add_argument("--device", default="auto", help="cuda, cpu or auto (cuda when available)")
    p.add_argument("--width", type=int, default=0,
                   help="shrink: hidden size of target and drafter (heads and MLP scaled; 0 = the preset's). For a "
                        "CPU check of the command; the figures mean something only at the real shape")
    p.add_argument("--target-layers", type=int, default=0, help="shrink: target decoder layers (0 = the preset's)")
    p.add_argument("--vocab", type=int, default=0, help="shrink: vocabulary size (0 = the preset's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the batches")
    p.add_argument("--json", default="", metavar="FILE", help="also write the result as JSON to FILE")


def shrunk_config(args: argparse.Namespace) -> dict[str, Any]:
    """The preset's text config, with --width / --target-layers / --vocab applied (heads keep head_dim)."""
    cfg = dict(PRESETS[args.preset])
    if args.width:  # scaled as bench memory scales its widths
        d = drafter_shape(cfg, args.width, 1, 2)
        cfg.update(hidden_size=d.hidden, intermediate_size=d.intermediate, num_attention_heads=d.heads,
                   num_key_value_heads=d.kv_heads)
    if args.target_layers:
        cfg["num_hidden_layers"] = args.target_layers
    if args.vocab:
        cfg["vocab_size"] = args.vocab
    return cfg


def build_target(cfg: dict[str, Any], device, dtype, seed: int):
    """A Qwen3 causal LM of `cfg`'s shape with random weights, made on `device` (nothing read from disk)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(**{k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                 "num_attention_heads", "num_key_value_heads", "head_dim",
                                                 "vocab_size", "tie_word_embeddings")},
                         rope_parameters={"rope_type": "default", "rope_theta": float(cfg["rope_theta"])},
                         max_position_embeddings=32768, attn_implementation="sdpa")
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def target_flops(cfg: dict[str, Any], body_params: int, batch: int, seq: int) -> float:
    """Model FLOPs of the target forward over batch x seq tokens: its matmuls (2 per body parameter and token,
    the embedding excluded and the LM head not run) and causal attention (QK^T and PV over seq(seq+1)/2 pairs)."""
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    attention = cfg["num_hidden_layers"] * batch * 4 * q * seq * (seq + 1) / 2
    return 2.0 * body_params * batch * seq + attention


def plan_prediction(cfg: dict[str, Any], args: argparse.Namespace, target_bytes: int, kl: bool) -> dict[str, Any]:
    """`plan`'s colocated memory for this GPU: the target's weights (as built) + the drafter's training memory."""
    from dflash_ds.plan.colocated import drafter_memory

    ns = argparse.Namespace(drafter_memory_gb=None, drafter_layers=args.num_layers, token_budget=args.token_budget,
                            no_last_hidden=not kl, zero_stage=2, kind=args.kind)
    drafter = drafter_memory(ns, cfg, cfg["hidden_size"], cfg["vocab_size"], args.num_layers, 1)
    return {"target_bytes": target_bytes, "drafter_bytes": drafter["bytes"], "drafter_terms": drafter["terms"],
            "total_bytes": target_bytes + drafter["bytes"]}


def _init_single_rank(cuda: bool) -> None:
    """A one-rank default process group on loopback (DeepSpeed needs one), unless one exists."""
    import socket

    import torch.distributed as dist

    if dist.is_initialized():
        return
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)


def _check(args: argparse.Namespace) -> None:
    for name in ("num_layers", "token_budget", "seq_len", "steps"):
        if getattr(args, name) < 1:
            raise DFlashError(f"bench real-shape: --{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0 or args.num_anchors < 0 or min(args.width, args.target_layers, args.vocab) < 0:
        raise DFlashError("bench real-shape: --warmup, --num-anchors, --width, --target-layers and --vocab must be >= 0")
    if args.token_budget < args.seq_len or args.seq_len <= args.block_size:
        raise DFlashError(f"bench real-shape: need --block-size {args.block_size} < --seq-len {args.seq_len} <= "
                          f"--token-budget {args.token_budget}")


def run(args: argparse.Namespace) -> int:
    """Entry point of `dflash-ds bench real-shape`."""
    import torch

    from dflash_ds.config import Config
    from dflash_ds.runtime.engine import build_drafter_engine

    _check(args)
    name = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise DFlashError("bench real-shape: --device cuda but torch sees no CUDA GPU")
    device = torch.device(name)
    cuda = device.type == "cuda"
    if cuda:
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = shrunk_config(args)
    t0 = time.perf_counter()
    target = build_target(cfg, device, dtype, args.seed)
    build_s = time.perf_counter() - t0
    target_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
    embed_params = target.get_input_embeddings().weight.numel()
    head = target.get_output_embeddings()
    head_params = 0 if head is None or cfg["tie_word_embeddings"] else head.weight.numel()
    body_params = sum(p.numel() for p in target.parameters()) - embed_params - head_params

    run_cfg = Config()
    run_cfg.model = replace(run_cfg.model, kind=args.kind, num_layers=args.num_layers, block_size=args.block_size,
                            activation_checkpointing={"on": True, "off": False, "auto": None}[args.activation_checkpointing],
                            attention_backend="auto" if cuda else "dense")
    if args.num_anchors:
        run_cfg.loss = replace(run_cfg.loss, num_anchors=args.num_anchors)
    run_cfg.train = replace(run_cfg.train, zero_stage=2, max_steps=args.warmup + args.steps, seed=args.seed)
    shape = drafter_shape(cfg, cfg["hidden_size"], args.num_layers, args.block_size, args.kind)
    step_args = argparse.Namespace(token_budget=args.token_budget, seq_len=args.seq_len, block_size=args.block_size,
                                   num_anchors=run_cfg.loss.num_anchors, max_anchors=run_cfg.loss.max_anchors_per_batch,
                                   chunk_blocks=run_cfg.loss.chunk_blocks, kl_weight=run_cfg.loss.kl_weight)
    arch = micro_step.drafter_arch(cfg, shape, args.seq_len)
    _init_single_rank(cuda)
    try:
        engine = build_drafter_engine(run_cfg, arch, dtype, device, target=target)
        ckpt, recomputed = engine.module.drafter.activation_checkpointing, engine.module.drafter.checkpoint_layers
        step = step_shape(step_args, 2 if cuda else 4, ckpt, not cuda, cuda, recomputed)
        result = _measure(args, cfg, target, engine, run_cfg, dtype, device)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    b, s = args.token_budget // args.seq_len, args.seq_len
    t_flops = target_flops(cfg, body_params, b, s)
    visible, _ = micro_step.visible_keys(b, s, args.block_size, run_cfg.loss.num_anchors,
                                         run_cfg.loss.max_anchors_per_batch)
    d_flops = mm.micro_step_flops(shape, step, visible, recompute=False)
    times = result["seconds"]
    peak_flops = mm.H200_BF16_FLOPS
    result.update(
        preset=args.preset, stand_in=args.preset != "qwen3-8b", device=torch.cuda.get_device_name(device) if cuda
        else "cpu", torch=torch.__version__, dtype="bf16" if cuda else "fp32", shape=cfg, kind=args.kind,
        activation_checkpointing=ckpt, checkpoint_layers=recomputed,
        checkpointing_reason=engine.module.checkpointing_reason,
        target_params=sum(p.numel() for p in target.parameters()),
        target_build_s=build_s, drafter_params=mm.drafter_params(shape), tokens=b * s,
        target_tflop=t_flops / 1e12, drafter_tflop=d_flops / 1e12,
        tok_per_s=b * s / times["step"], target_tok_per_s=b * s / times["target"],
        drafter_tok_per_s=b * s / (times["drafter"] + times["optimizer"]),
        mfu={"target": t_flops / times["target"] / peak_flops, "drafter": d_flops / times["drafter"] / peak_flops,
             "step": (t_flops + d_flops) / times["step"] / peak_flops} if cuda else None,
        plan=plan_prediction(cfg, args, target_bytes, run_cfg.loss.needs_last_hidden))
    _print(result)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def _measure(args, cfg, target, engine, run_cfg, dtype, device) -> dict[str, Any]:
    """Warm-up and timed steps: (target, drafter micro-step, optimizer step) seconds each, medians; memory."""
    import torch

    from dflash_ds.data.loader import Batch
    from dflash_ds.runtime.memory import peak_memory_bytes, reset_peak_memory
    from dflash_ds.runtime.sources import capture_batch
    from dflash_ds.runtime.step import forward

    cuda = device.type == "cuda"
    b, s = args.token_budget // args.seq_len, args.seq_len
    gen = torch.Generator().manual_seed(args.seed)
    keep_last = run_cfg.loss.needs_last_hidden

    def sync() -> float:
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter()

    parts: dict[str, list[float]] = {"target": [], "drafter": [], "optimizer": [], "step": []}
    reset_peak_memory(device)
    anchors = 0
    for i in range(args.warmup + args.steps):
        ids = torch.randint(0, cfg["vocab_size"] - 1, (b, s), generator=gen)
        batch = Batch(ids, torch.ones_like(ids), torch.ones_like(ids), torch.full((b,), s), spec=None, cursor=None)
        t0 = sync()
        tensors = capture_batch(target, batch, engine.module.drafter.arch.target_layer_ids, keep_last, device)
        t1 = sync()
        terms, sums = forward(engine, tensors, run_cfg.loss, args.seed, i, 0.0, dtype)
        engine.backward(terms.loss)
        t2 = sync()
        engine.step()
        t3 = sync()
        anchors = int(sums["anchors"])
        if i >= args.warmup:
            for k, v in (("target", t1 - t0), ("drafter", t2 - t1), ("optimizer", t3 - t2), ("step", t3 - t0)):
                parts[k].append(v)
        del tensors, terms, sums
    med = {k: sorted(v)[len(v) // 2] for k, v in parts.items()}
    return {"seconds": med, "anchors": anchors, "peak_bytes": peak_memory_bytes(device),
            "reserved_bytes": torch.cuda.max_memory_reserved(device) if cuda else None}


def _print(r: dict[str, Any]) -> None:
    from dflash_ds.bench.table import print_table

    t, p = r["seconds"], r["plan"]
    mfu = r["mfu"] or {}

    def pct(k: str) -> str:
        return f"{100 * mfu[k]:.1f}" if k in mfu else "-"

    rows = [["target forward + capture", f"{t['target']:.3f}", f"{r['target_tok_per_s']:,.0f}",
             f"{r['target_tflop']:.1f}", pct("target")],
            ["drafter micro-step", f"{t['drafter']:.3f}", "", f"{r['drafter_tflop']:.1f}", pct("drafter")],
            ["drafter optimizer step", f"{t['optimizer']:.3f}", "", "", ""],
            ["whole step", f"{t['step']:.3f}", f"{r['tok_per_s']:,.0f}", f"{r['target_tflop'] + r['drafter_tflop']:.1f}",
             pct("step")]]
    sh = r["shape"]
    print_table(f"bench real-shape: {r['preset']}{' (dense stand-in)' if r['stand_in'] else ''} target "
                f"(H {sh['hidden_size']}, {sh['num_hidden_layers']} layers, V {sh['vocab_size']}, "
                f"{r['target_params'] / 1e9:.2f} B params, random, built in {r['target_build_s']:.1f} s) + "
                f"{r['kind']} drafter ({r['drafter_params'] / 1e9:.2f} B), colocated on {r['device']} {r['dtype']}, "
                f"checkpointing {'on' if r['activation_checkpointing'] else 'off'}; {r['tokens']:,} tokens a step, "
                f"{r['anchors']} anchors",
                ["part", "s (median)", "tokens/s", "TFLOP", "MFU %"], rows,
                "MFU: model FLOPs / 989 TFLOP/s (no recompute); the target's LM head is not run (its hidden states "
                "are what the drafter reads)")
    gb = mm.GB
    peak = r["peak_bytes"] / gb
    print(f"\nmemory: peak {peak:.2f} GB" + (f", reserved {r['reserved_bytes'] / gb:.2f} GB" if r["reserved_bytes"]
                                             else "") +
          f"; plan's prediction {p['total_bytes'] / gb:.2f} GB = target weights {p['target_bytes'] / gb:.2f} + drafter "
          f"{p['drafter_bytes'] / gb:.2f} ({100 * (p['total_bytes'] / r['peak_bytes'] - 1):+.1f}% vs measured peak)"
          + ("" if r["activation_checkpointing"] else "; plan counts the step with checkpointing, this one ran without"))
