"""`dflash-ds bench fuse`: each function train.fuse compiles, eager against compiled, at a target's real widths.

One process, no model: each function of the drafter step's elementwise work (components/fusion.py) on random
inputs of a preset's shape, forward and backward (the loss core computes its gradient by hand, forward only),
eager (`train.fuse false`) and compiled (inductor: C++ kernels on CPU, Triton on CUDA). Per function: the
median of `--repeats` timed calls after one that compiles, its compile time, and the speed-up. The rows
(`--rows`, default 2,048) stand for a micro-step's 32,768 block tokens at one-sixteenth the size (CPU); on a
GPU pass `--rows 32768`. The loss core runs one chunk of `--chunk-blocks` blocks over the full vocabulary, with
hard labels (CE) and with the target's distribution (KL 0.5).
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path
from typing import Any, Callable

from dflash_ds.models.presets import PRESETS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `dflash-ds bench fuse`."""
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-8b",
                        help="target shape: its hidden size, heads, head_dim, MLP and vocabulary")
    parser.add_argument("--rows", type=int, default=2048,
                        help="token rows of the layer ops (a Qwen3-8B micro-step has 32,768 block tokens)")
    parser.add_argument("--chunk-blocks", type=int, default=16,
                        help="blocks of the loss core's chunk (loss.chunk_blocks; the trainer's default is 64)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block, the anchor included")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda when available)")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default=None,
                        help="input dtype (default: fp32 on CPU, bf16 on CUDA)")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per function and mode (median)")
    parser.add_argument("--only", default="", help="comma-separated case names to run (default: all)")
    parser.add_argument("--json", default="", metavar="FILE", help="also write the rows as JSON to FILE")


def cases(cfg: dict[str, Any], rows: int, chunk: int, bs: int, device, dtype) -> dict[str, Callable]:
    """name -> a function making (callable, its inputs) at this shape."""
    import torch

    from dflash_ds.components.loss import LossSpec, _chunk_loss_and_grad
    from dflash_ds.models import layer_ops
    from dflash_ds.models.kinds import kind_names, kind_spec

    h, heads, d = int(cfg["hidden_size"]), int(cfg["num_attention_heads"]), int(cfg.get("head_dim") or 128)
    mlp, vocab = int(cfg["intermediate_size"]), int(cfg["vocab_size"])

    def t(*shape, grad=True):
        x = torch.randn(*shape, device=device).to(dtype)
        return x.requires_grad_(grad)

    def loss(kl: bool):
        k = bs - 1
        spec = LossSpec(gamma=7.0, kl_weight=0.5 if kl else 0.0)
        logits, labels = t(chunk, k, vocab, grad=False) * 3, torch.randint(0, vocab, (chunk, k), device=device)
        target = t(chunk, k, vocab, grad=False) * 3 if kl else None
        valid = torch.ones(chunk, k, dtype=torch.bool, device=device)
        return lambda: _chunk_loss_and_grad(logits, labels, valid, spec, target, True, pad_to=chunk), []

    def layer(fn, *args):
        grads = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        return lambda: torch.autograd.grad(fn(*args).float().sum(), grads), grads

    out = {
        f"loss core CE [{chunk} x {bs - 1} x {vocab}]": lambda: loss(False),
        f"loss core KL 0.5 [{chunk} x {bs - 1} x {vocab}]": lambda: loss(True),
        f"RMSNorm [{rows} x {h}]": lambda: layer(layer_ops.rms_norm, t(rows, h), t(h), 1e-6),
        f"q RMSNorm [{rows} x {heads} x {d}]": lambda: layer(layer_ops.rms_norm, t(rows, heads, d), t(d), 1e-6),
        f"RoPE q [{rows} x {heads} x {d}]": lambda: layer(layer_ops.rope, t(1, rows, heads, d), t(1, rows, d, grad=False),
                                                         t(1, rows, d, grad=False)),
        f"SwiGLU [{rows} x {mlp}]": lambda: layer(layer_ops.swiglu, t(rows, mlp), t(rows, mlp)),
    }
    def kind_part(build: Callable, part: str):
        fn, args = build(t)[part]
        return layer(fn, *args)

    def meta(*shape, grad=True):
        return torch.empty(*shape, device="meta")

    for name in kind_names():  # a kind's own fused functions (KindSpec.fused_parts), built when run
        spec = kind_spec(name)
        if spec.fused_parts is not None:
            build = functools.partial(spec.fused_parts, spec.default_options(), h, rows, bs)
            for part in build(meta):  # the names, from tensors without storage
                out[f"{name} {part}"] = functools.partial(kind_part, build, part)
    return out


def time_case(make: Callable, repeats: int, sync: Callable) -> dict[str, float]:
    """{mode: median seconds} for eager and compiled, and the compiled first call's seconds."""
    from dflash_ds.components import fusion

    out: dict[str, float] = {}
    for mode in ("off", "on"):
        fusion.set_fuse_mode(mode)
        call, _ = make()
        t0 = time.perf_counter()
        call()
        sync()
        first = time.perf_counter() - t0
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            call()
            sync()
            times.append(time.perf_counter() - t0)
        out[mode] = sorted(times)[len(times) // 2]
        if mode == "on":
            out["first"] = first
    return out


def run(args: argparse.Namespace) -> int:
    """Entry point of `dflash-ds bench fuse`."""
    import torch

    from dflash_ds.bench.table import print_table
    from dflash_ds.components import fusion
    from dflash_ds.errors import DFlashError

    name = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise DFlashError("bench fuse: --device cuda but torch sees no CUDA GPU")
    device = torch.device(name)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    every = cases(dict(PRESETS[args.preset]), args.rows, args.chunk_blocks, args.block_size, device, dtype)
    wanted = [w.strip() for w in args.only.split(",") if w.strip()]
    unknown = [w for w in wanted if not any(n.startswith(w) for n in every)]
    if unknown:
        raise DFlashError(f"bench fuse: --only {unknown[0]!r} names no case: {', '.join(every)}")
    before, rows = fusion.FUSION.mode, []
    try:
        for case, make in every.items():
            if wanted and not any(case.startswith(w) for w in wanted):
                continue
            r = time_case(make, args.repeats, sync)
            rows.append({"case": case, "eager_s": r["off"], "fused_s": r["on"], "speedup": r["off"] / r["on"],
                         "compile_s": r["first"]})
            print(f"  {case}: eager {r['off'] * 1e3:.1f} ms, fused {r['on'] * 1e3:.1f} ms", flush=True)
    finally:
        fusion.set_fuse_mode(before)
    print_table(f"bench fuse: {args.preset}, {device.type} {str(dtype).split('.')[-1]}, {args.repeats} timed calls "
                f"each (median)", ["function (forward + backward)", "eager ms", "fused ms", "speed-up", "compile s"],
                [[r["case"], f"{r['eager_s'] * 1e3:.1f}", f"{r['fused_s'] * 1e3:.1f}", f"{r['speedup']:.2f}x",
                  f"{r['compile_s']:.1f}"] for r in rows],
                "fused: train.fuse's compiled function (components/fusion.py); the loss core computes its gradient "
                "by hand in its forward; compile s: the first compiled call")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"preset": args.preset, "device": device.type, "dtype": str(dtype),
                                               "torch": torch.__version__, "rows": rows}, indent=1) + "\n")
    return 0
