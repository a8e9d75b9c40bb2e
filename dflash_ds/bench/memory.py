"""`dflash-ds bench memory`: peak memory and time of one drafter micro-step, measured and predicted.

One micro-step is what a drafter rank runs per batch: `drafter_objective` (anchors, every block
under the block-sparse mask, the chunked LM head + loss) and `loss.backward()`. It is measured at
a few small widths of a named target shape (`--widths`, heads scaled so head_dim stays, the MLP
by the same factor) with everything else full size: the vocabulary (a random frozen embedding and
LM head of all V rows at that width), the token budget, the anchors and the chunk. Each width's
peak (CPU: peak resident set; CUDA: max_memory_allocated), minus what was resident or allocated
before the step, is set beside the prediction of `memory/model.micro_step_peak`, a formula
counted from the code. The same formula then predicts the full width under the real GPU
settings (bf16, flex_attention, activation checkpointing), and the static per-rank terms (ZeRO
model states, frozen embedding and head, received payloads) complete a drafter rank's total.

Single process, no DeepSpeed: parameter gradients are plain `.grad` tensors here (counted in the
micro-step); the ZeRO term counts them in the total instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from dflash_ds.bench import memory_trace
from dflash_ds.bench.memory_report import print_result
from dflash_ds.bench.micro_step import micro_step_inputs, visible_keys, write_profile
from dflash_ds.components.fusion import FUSION, fuse_on, set_fuse_mode
from dflash_ds.errors import DFlashError, read_json_file
from dflash_ds.memory import model as mm
from dflash_ds.memory.shapes import SHAPE_FIELDS, drafter_shape, step_shape
from dflash_ds.models.kinds import kind_names
from dflash_ds.models.presets import PRESETS

BUDGET_GB = 60.0  # the per-drafter-rank target on an 80 GB GPU (docs/MEMORY.md)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `dflash-ds bench memory`."""
    from dflash_ds.config import LossConfig

    loss = LossConfig()
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-8b",
                        help="target shape: qwen3-8b (H 4096, 36 layers, 32/8 heads of 128, MLP 12288, V 151936) or "
                             "qwen3.6-27b (H 5120, 64 layers, 24/4 heads of 256, MLP 17408, V 248320): the published "
                             "text-config values as we read them")
    parser.add_argument("--target", default="",
                        help="a local HF target folder instead of --preset (its config.json, text_config when present)")
    parser.add_argument("--num-layers", type=int, default=5, help="drafter decoder layers (= target layers read)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block, the anchor included")
    parser.add_argument("--kind", default="dflash",
                        help=f"drafter kind(s) (model.kind), comma-separated: {', '.join(kind_names())}. Each width "
                             "measures each kind's own micro-step (its parts and loss terms at their defaults, each "
                             "term at its default weight; its memory terms: models/kinds.py) and the table gives its "
                             "step time against DFlash's; the full-width prediction is of the first kind")
    parser.add_argument("--token-budget", type=int, default=16384, help="tokens per micro-batch")
    parser.add_argument("--seq-len", type=int, default=2048,
                        help="tokens per sequence; the batch is token-budget // seq-len sequences, all response tokens")
    parser.add_argument("--num-anchors", type=int, default=loss.num_anchors, help="most anchor blocks per sequence")
    parser.add_argument("--max-anchors", type=int, default=loss.max_anchors_per_batch,
                        help="most anchor blocks per micro-batch (loss.max_anchors_per_batch; 0 = no cap)")
    parser.add_argument("--chunk-blocks", type=int, default=loss.chunk_blocks,
                        help="blocks per LM-head + loss chunk (loss.chunk_blocks)")
    parser.add_argument("--kl-weight", type=float, default=0.0,
                        help="soft-label KL weight; > 0 adds the target's last hidden state and its logits per chunk")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default=None,
                        help="measurement dtype (default: fp32 on CPU, bf16 on CUDA)")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda when available)")
    parser.add_argument("--activation-checkpointing", choices=["on", "off", "auto", "both"], default="auto",
                        help="recompute each draft layer in backward (auto: on with CUDA, off on CPU; training decides by "
                             "the free memory, runtime/checkpointing.py; "
                             "both: each row measured on, then off, on the same build)")
    parser.add_argument("--checkpoint-layers", type=int, default=None, metavar="K",
                        help="with checkpointing on: recompute only the first K draft layers (model.checkpoint_layers; "
                             "default: all); each layer kept costs its activations and saves a fourth of its FLOPs")
    parser.add_argument("--mask-backend", choices=["auto", "dense", "flex"], default="auto",
                        help="block-sparse mask: dense boolean + SDPA, flex_attention, auto (flex on CUDA, dense on CPU)")
    parser.add_argument("--fuse", choices=["auto", "on", "off", "both"], default="auto",
                        help="train.fuse: compile the loss's per-chunk passes, the layers' RMSNorm, RoPE and SwiGLU "
                             "and a kind's own elementwise parts (auto: on CUDA; both: each row measured compiled, "
                             "then eager, on the same build, each predicted with its own saved activations)")
    parser.add_argument("--widths", default="256,512",
                        help="comma-separated hidden sizes to measure at (heads, kv heads and MLP scaled; vocabulary, "
                             "token budget, anchors and chunk stay full size)")
    parser.add_argument("--full", action="store_true", help="also measure at the full width (for a GPU)")
    parser.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=2,
                        help="ZeRO stage of the predicted model-state term")
    parser.add_argument("--num-drafters", type=int, default=1, help="drafter ranks ZeRO partitions over (the D of 14Psi/D)")
    parser.add_argument("--steps", type=int, default=3, help="timed micro-steps per width (the median is reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed micro-steps first (flex_attention compiles here)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the batch")
    parser.add_argument("--json", default="", metavar="FILE", help="also write the result as JSON to FILE (rewritten as each width ends, "
                        "with \"partial\": true until the last: a run cut short keeps the rows it measured)")
    parser.add_argument("--profile", default="", metavar="FILE",
                        help="profile one more micro-step of the last width of each kind (torch.profiler): the top "
                             "kernels by device time (CPU time on CPU) to FILE (FILE.KIND for a second kind) and a "
                             "Chrome trace beside it")
    parser.add_argument("--memory-trace", default="", metavar="FILE",
                        help="CUDA: one more micro-step of each width and kind (its first setting) with the allocator's "
                             "history recorded: what is alive at its peak, by the dflash_ds line that allocated it, "
                             "appended to FILE (bench/memory_trace.py: to set against the model's terms)")


# ---------------------------------------------------------------- shapes


def target_config(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """(name, text config) of --target or --preset."""
    if not args.target:
        return args.preset, dict(PRESETS[args.preset])
    cfg = read_json_file(Path(args.target) / "config.json", f"bench memory: --target {args.target} has no config.json")
    text = {**cfg, **cfg.get("text_config", {})}  # vision-language wrappers keep the LM under text_config
    text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
    missing = [k for k in SHAPE_FIELDS if k not in text]
    if missing:
        raise DFlashError(f"{Path(args.target) / 'config.json'}: missing field {missing[0]!r}")
    return str(args.target), text


def _write_json(path: str, result: dict[str, Any]) -> None:
    """--json's file, replaced whole (a run killed while writing leaves the previous version)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(f"{path}.tmp")
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        tmp.replace(path)


def _check_args(args: argparse.Namespace) -> list[int]:
    for name in ("num_layers", "token_budget", "seq_len", "num_anchors", "chunk_blocks", "steps", "num_drafters"):
        if getattr(args, name) < 1:
            raise DFlashError(f"bench memory: --{name.replace('_', '-')} must be >= 1")
    if args.block_size < 2:
        raise DFlashError("bench memory: --block-size must be >= 2")
    if args.max_anchors < 0 or args.warmup < 0:
        raise DFlashError("bench memory: --max-anchors and --warmup must be >= 0")
    if args.token_budget < args.seq_len:
        raise DFlashError(f"bench memory: --token-budget {args.token_budget} is less than one --seq-len {args.seq_len}")
    if args.checkpoint_layers is not None and not 1 <= args.checkpoint_layers <= args.num_layers:
        raise DFlashError(f"bench memory: --checkpoint-layers {args.checkpoint_layers} must be 1..--num-layers "
                          f"({args.num_layers})")
    if args.seq_len <= args.block_size:
        raise DFlashError(f"bench memory: --seq-len {args.seq_len} must exceed --block-size {args.block_size}")
    kinds = [k.strip() for k in args.kind.split(",") if k.strip()]
    if not kinds or any(k not in kind_names() for k in kinds):
        raise DFlashError(f"bench memory: --kind {args.kind!r}: give one or more of {', '.join(kind_names())}, "
                          "comma-separated")
    try:
        widths = [int(w) for w in args.widths.split(",") if w.strip()]
    except ValueError:
        raise DFlashError(f"bench memory: --widths {args.widths!r}: give hidden sizes like 256,512") from None
    if any(w < 1 for w in widths):
        raise DFlashError("bench memory: --widths must be positive")
    return widths


# ---------------------------------------------------------------- measurement


def _mmap_large_allocations() -> bool:
    """CPU: serve every allocation of 64 KiB or more by mmap, so a freed tensor leaves the resident set.

    glibc otherwise raises its mmap threshold (up to 32 MiB) as blocks are freed and serves tensors
    below it from the heap, whose freed holes stay resident: the peak RSS then carries heap slack
    the formula does not count (measured here: 4-18% of the step's peak). Setting the threshold
    also turns that adjustment off. Returns False where mallopt is not available.
    """
    import ctypes

    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def _release_heap() -> None:
    """Hand freed heap pages back to the OS so the CPU peak window starts from live memory only."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def measure_width(cfg: dict[str, Any], shape: mm.DrafterShape, steps: list[mm.StepShape], args: argparse.Namespace,
                  device, dtype, profile: str = "") -> list[dict[str, Any]]:
    """Build the drafter at this width with random weights and a full-vocabulary head; time and size its
    micro-step under each of `steps` (they differ in checkpointing only: one build serves them all), each under
    each of `args.fuse`'s modes (`fuse_modes`): a row per (step, mode), in that order.

    `profile`: a file for the top kernels of one more step of the first setting (`write_profile`).
    """
    import torch

    from dflash_ds.runtime.memory import peak_memory_bytes, reset_peak_memory, resident_bytes

    module, states, loss_cfg = micro_step_inputs(
        cfg, shape, steps[0], seed=args.seed, num_anchors=args.num_anchors, max_anchors=args.max_anchors,
        chunk_blocks=args.chunk_blocks, kl_weight=args.kl_weight, mask_backend=args.mask_backend, device=device,
        dtype=dtype)
    drafter = module.drafter
    cuda = device.type == "cuda"

    def one_step() -> int:
        drafter.zero_grad(set_to_none=True)  # the step allocates its parameter gradients, as in training
        terms, sums = module(states, loss_cfg, 0, 0.0, 0)  # anchor seed 0: the same blocks every step
        terms.loss.backward()
        return int(sums["anchors"])

    b, s = steps[0].batch, steps[0].seq_len
    visible, per_row = visible_keys(b, s, shape.block_size, args.num_anchors, args.max_anchors)
    rows, mode_before = [], FUSION.mode
    for n, (step, fuse) in enumerate((st, f) for st in steps for f in fuse_modes(args)):
        drafter.activation_checkpointing, drafter.checkpoint_layers = step.checkpointing, step.checkpoint_layers
        set_fuse_mode(fuse)
        peaks, times, anchors_used = [], [], 0
        for i in range(args.warmup + args.steps):
            if cuda:
                torch.cuda.synchronize(device)
                base = torch.cuda.memory_allocated(device)
            else:
                _release_heap()
                base = resident_bytes()
            reset_peak_memory(device)
            t0 = time.perf_counter()
            anchors_used = one_step()
            if cuda:
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
            if i >= args.warmup:
                times.append(dt)
                peaks.append(peak_memory_bytes(device) - base)
        top = write_profile(one_step, device, profile) if profile and n == 0 else None
        trace = memory_trace.trace_step(one_step, device) if args.memory_trace and n == 0 else None
        step_s = sorted(times)[len(times) // 2]
        model_flops = mm.micro_step_flops(shape, step, visible, recompute=False)
        hw_flops = mm.micro_step_flops(shape, step, visible)
        rows.append({"kind": shape.kind, "activation_checkpointing": step.checkpointing, "fuse": fuse,
                     "recomputed_layers": mm.recomputed_layers(shape, step),
                     "measured_peak_bytes": max(peaks), "step_s": step_s, "tokens_per_s": b * s / step_s,
                     "anchors": anchors_used, "anchors_per_row": per_row, "tflop": model_flops / 1e12,
                     "mfu": model_flops / step_s / mm.H200_BF16_FLOPS if cuda else None,
                     "hfu": hw_flops / step_s / mm.H200_BF16_FLOPS if cuda else None,
                     **({"profile_top": top} if top is not None else {}),
                     **({"memory_trace": trace} if trace is not None else {})})
    set_fuse_mode(mode_before)
    del module, drafter, states
    return rows


def fuse_modes(args: argparse.Namespace) -> list[str]:
    """The train.fuse modes each setting is measured under (--fuse; both: compiled, then eager)."""
    return ["on", "off"] if args.fuse == "both" else [args.fuse]


# ---------------------------------------------------------------- prediction at full width


def full_width_prediction(cfg: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Predicted bytes per drafter rank at the target's width: bf16, flex_attention, checkpointing, CUDA."""
    kind = getattr(args, "kind", "dflash").split(",")[0].strip()
    shape = drafter_shape(cfg, int(cfg["hidden_size"]), args.num_layers, args.block_size, kind)
    step = step_shape(args, dtype_bytes=2, checkpointing=True, dense=False, cuda=True)
    terms = mm.micro_step_terms(shape, step, param_grads=False)
    phase = max(mm.PHASES, key=lambda ph: sum(terms[ph].values()))
    micro = {k: v for k, v in {**terms["held"], **{f"{phase}:{k}": v for k, v in terms[phase].items()}}.items() if v}
    static = mm.static_terms(shape, args.token_budget, args.zero_stage, args.num_drafters, kl=step.kl)
    total = sum(micro.values()) + sum(static.values())
    return {"settings": {"dtype": "bf16", "mask": "flex", "activation_checkpointing": True,
                         "zero_stage": args.zero_stage, "num_drafters": args.num_drafters},
            "kind": kind, "hidden": shape.hidden, "params": mm.drafter_params(shape),
            "anchors_per_row": step.anchors_per_row,
            "peak_phase": phase, "micro_step_terms": micro, "micro_step_bytes": sum(micro.values()),
            "static_terms": static, "total_bytes": total, "budget_gb": BUDGET_GB,
            "within_budget": total <= BUDGET_GB * mm.GB}


# ---------------------------------------------------------------- entry point


def run(args: argparse.Namespace) -> int:
    """Entry point of `dflash-ds bench memory`."""
    import torch

    widths = _check_args(args)
    name, cfg = target_config(args)
    device_name = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device_name.startswith("cuda") and not torch.cuda.is_available():
        raise DFlashError("bench memory: --device cuda but torch sees no CUDA GPU")
    device = torch.device(device_name)
    cuda = device.type == "cuda"
    if args.memory_trace and not cuda:
        raise DFlashError("bench memory: --memory-trace records the CUDA allocator's history: it needs --device cuda")
    if args.mask_backend == "flex" and not cuda:
        raise DFlashError("bench memory: flex_attention has no backward on CPU; use --mask-backend dense")
    dtype_name = args.dtype or ("bf16" if cuda else "fp32")
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    mmap_all = _mmap_large_allocations() if not cuda else False
    ckpts = {"on": [True], "off": [False], "auto": [cuda], "both": [True, False]}[args.activation_checkpointing]
    ckpt = ckpts[0]
    dense = args.mask_backend == "dense" or (args.mask_backend == "auto" and not cuda)
    steps = [step_shape(args, 2 if dtype_name == "bf16" else 4, c, dense, cuda, args.checkpoint_layers) for c in ckpts]
    step = steps[0]
    full_h = int(cfg["hidden_size"])
    if args.full and full_h not in widths:
        widths.append(full_h)
    kinds = [k.strip() for k in args.kind.split(",") if k.strip()]
    if args.memory_trace:
        Path(args.memory_trace).parent.mkdir(parents=True, exist_ok=True)
        Path(args.memory_trace).write_text("")  # this run's sections only
    rows: list[dict[str, Any]] = []
    result = {"target": name, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
              "torch": torch.__version__, "dtype": dtype_name, "activation_checkpointing": ckpt,
              "mask": "dense" if dense else "flex", "num_layers": args.num_layers, "block_size": args.block_size,
              "token_budget": args.token_budget, "seq_len": args.seq_len, "batch": step.batch,
              "num_anchors": args.num_anchors, "max_anchors": args.max_anchors, "chunk_blocks": args.chunk_blocks,
              "kl_weight": args.kl_weight, "steps": args.steps,
              "peak_kind": "cuda max_memory_allocated" if cuda else "peak RSS (VmHWM)",
              "cpu_allocations_mmapped": mmap_all,
              "lm_head_bytes_per_entry": mm.lm_head_bytes_per_entry(step),
              "rows": rows, "full_width": full_width_prediction(cfg, args), "partial": True}
    for kind in kinds:
        for width in widths:
            shape = drafter_shape(cfg, width, args.num_layers, args.block_size, kind)
            profile = "" if not args.profile or width != widths[-1] else (
                args.profile if kind == kinds[0] else f"{args.profile}.{kind}")
            settings = [dataclasses.replace(st, fused=fuse_on(f, cuda)) for st in steps for f in fuse_modes(args)]
            for step_c, measured in zip(settings, measure_width(cfg, shape, steps, args, device, dtype, profile)):
                predicted = mm.micro_step_peak(shape, step_c)
                terms = mm.micro_step_terms(shape, step_c)
                base = next((r for r in rows if r["kind"] == "dflash" and r["width"] == width
                             and r["activation_checkpointing"] == step_c.checkpointing
                             and r["fuse"] == measured["fuse"]), None)
                if "memory_trace" in measured:
                    memory_trace.append(args.memory_trace, f"{kind}, width {width}, checkpointing "
                                        f"{step_c.checkpointing}, fuse {measured['fuse']}: predicted "
                                        f"{predicted / 1e9:.3f} GB", measured["memory_trace"])
                rows.append({"width": width, "heads": shape.heads, "kv_heads": shape.kv_heads,
                             "head_dim": shape.head_dim, "intermediate": shape.intermediate,
                             "params": mm.drafter_params(shape), **measured, "predicted_peak_bytes": predicted,
                             "error_pct": 100.0 * (predicted - measured["measured_peak_bytes"])
                             / measured["measured_peak_bytes"],
                             "step_vs_dflash": measured["step_s"] / base["step_s"] if base else None,
                             "predicted_phase": max(mm.PHASES, key=lambda ph: sum(terms[ph].values())),
                             "terms": terms})
            _write_json(args.json, result)  # each width as it ends: a run stopped by a deadline keeps its rows
    result["partial"] = False
    print_result(result)
    _write_json(args.json, result)
    return 0

