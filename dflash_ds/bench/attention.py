"""`dflash-ds bench attention`: the drafter's training step under each block-sparse mask backend.

The drafter attends from A anchor blocks of `block_size` tokens to [context, own block] under a
block-sparse mask (docs/DESIGN.md §3). On CPU the mask is a dense boolean tensor fed to SDPA; on GPU a
flex_attention BlockMask skips the masked tiles. This measures, for one synthetic batch of the
chosen shape, forward + backward time of the drafter, tokens/s (sequence tokens per second), peak
device memory and the largest output difference of each backend against the dense one.
Single process, no DeepSpeed: it isolates the kernel choice from the rest of the step.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from typing import Any

from dflash_ds.errors import DFlashError

# name -> drafter shape (width, MLP, heads, kv heads, head dim, layers, target layers read, vocab)
PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(hidden=128, intermediate=384, heads=4, kv_heads=2, head_dim=32, layers=2, read=3),
    "qwen3-8b": dict(hidden=4096, intermediate=12288, heads=32, kv_heads=8, head_dim=128, layers=5, read=5),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `dflash-ds bench attention`."""
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                        help="drafter shape: tiny (CPU) or qwen3-8b (a DFlash drafter for an 8B target)")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda when available)")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default=None,
                        help="compute dtype (default: bf16 on GPU, fp32 on CPU)")
    parser.add_argument("--backends", default=None,
                        help="comma-separated mask backends among dense,flex (default: dense on CPU, dense,flex on GPU; "
                             "flex on CPU has no backward)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: 256 CPU, 4096 GPU)")
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per batch")
    parser.add_argument("--num-anchors", type=int, default=None, help="anchor blocks per sequence (default: seq-len/8)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block")
    parser.add_argument("--steps", type=int, default=5, help="timed forward+backward steps per backend")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation happens here)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the batch")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _arch(preset: dict[str, int], block_size: int):
    from dflash_ds.models.drafter import DrafterArch

    n_target = 36
    read = preset["read"]
    return DrafterArch(
        hidden_size=preset["hidden"], intermediate_size=preset["intermediate"], num_hidden_layers=preset["layers"],
        num_attention_heads=preset["heads"], num_key_value_heads=preset["kv_heads"], head_dim=preset["head_dim"],
        vocab_size=1024, rms_norm_eps=1e-6, max_position_embeddings=65536,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, block_size=block_size,
        num_target_layers=n_target, mask_token_id=1023, target_layer_ids=list(range(1, 1 + read)))


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Time each backend on one synthetic batch; returns the JSON result."""
    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise DFlashError("bench attention: --device cuda but torch sees no CUDA GPU")
    on_gpu = device.startswith("cuda")
    dtype_name = args.dtype or ("bf16" if on_gpu else "fp32")
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    backends = (args.backends or ("dense,flex" if on_gpu else "dense")).split(",")
    for b in backends:
        if b not in ("dense", "flex"):
            raise DFlashError(f"bench attention: --backends: unknown backend {b!r} (dense, flex)")
    if "flex" in backends and not on_gpu:
        raise DFlashError("bench attention: flex_attention has no backward on CPU; use --backends dense")
    seq = args.seq_len or (4096 if on_gpu else 256)
    bs = args.block_size
    anchors_n = args.num_anchors or max(1, seq // 8)
    for name in ("batch_size", "block_size", "steps"):
        if getattr(args, name) < 1:
            raise DFlashError(f"bench attention: --{name.replace('_', '-')} must be >= 1")
    if seq <= bs:
        raise DFlashError(f"bench attention: --seq-len {seq} must exceed --block-size {bs}")

    from dflash_ds.models.drafter import DFlashDrafter

    preset = PRESETS[args.preset]
    arch = _arch(preset, bs)
    torch.manual_seed(args.seed)
    drafter = DFlashDrafter.seeded(arch, args.seed)
    drafter = drafter.to(device=device, dtype=dtype)
    g = torch.Generator().manual_seed(args.seed)
    b = args.batch_size
    ctx = torch.randn(b, seq, preset["read"] * preset["hidden"], generator=g).to(device, dtype)
    emb = torch.randn(b, anchors_n, bs, preset["hidden"], generator=g).to(device, dtype)
    anchors = torch.sort(torch.randint(0, seq - bs, (b, anchors_n), generator=g), dim=1).values.to(device)

    def sync():
        if on_gpu:
            torch.cuda.synchronize()

    rows, reference = [], None
    for backend in backends:
        drafter.mask_backend = backend
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
        times = []
        out = None
        for i in range(args.warmup + args.steps):
            drafter.zero_grad(set_to_none=True)
            sync()
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = drafter.forward_train(ctx, emb, anchors)
            out.float().square().mean().backward()
            sync()
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        step_s = sorted(times)[len(times) // 2]
        out = out.detach().float()
        if reference is None:
            reference = out
        rows.append({
            "backend": backend,
            "step_ms": round(step_s * 1e3, 3),
            "tokens_per_s": round(b * seq / step_s, 1),
            "peak_mem_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1) if on_gpu else None,
            "max_abs_diff_vs_first": float((out - reference).abs().max()),
        })
    return {
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "dtype": dtype_name, "preset": args.preset, "seq_len": seq, "batch_size": b,
        "num_anchors": anchors_n, "block_size": bs, "steps": args.steps, "torch": torch.__version__,
        "rows": rows,
    }


def run(args: argparse.Namespace) -> int:
    """Entry point of `dflash-ds bench attention`."""
    res = measure(args)
    if args.json:
        print(json.dumps(res))
        return 0
    print(f"bench attention: {res['preset']} drafter, {res['device']}, {res['dtype']}, batch {res['batch_size']} x "
          f"{res['seq_len']} tokens, {res['num_anchors']} anchors x {res['block_size']}, median of {res['steps']} steps")
    print(f"{'backend':>8} {'step ms':>10} {'tokens/s':>12} {'peak MiB':>10} {'max|diff|':>10}")
    for r in res["rows"]:
        mem = "-" if r["peak_mem_mib"] is None else f"{r['peak_mem_mib']:.0f}"
        print(f"{r['backend']:>8} {r['step_ms']:>10.2f} {r['tokens_per_s']:>12.0f} {mem:>10} "
              f"{r['max_abs_diff_vs_first']:>10.2e}")
    return 0
