"""`dflash-ds bench long-context`: one long sequence per micro-batch on CPU, measured against memory/long_context.py.

At a tiny target shape (`dflash_ds.tiny.target`'s widths at 6 layers, a random fp32 Qwen3 from its config)
and each of a few sequence lengths, one sequence per micro-batch, two peaks are measured with `bench memory`'s
mechanism (large allocations mmapped, the heap trimmed, the resident set's high-water mark reset before each):

- the target's forward as `models/target.capture_layers` runs it, against `target_forward_terms`;
- a colocated rank's whole step, the target forward, `sources.fresh_payload` and the drafter's micro-step on that
  payload (objective + backward), against `colocated_step_terms` with the CPU step (fp32, dense mask, no
  checkpointing, plain parameter gradients).

Both are above what was resident before (the target's and the drafter's weights). SDPA's CPU kernel for a causal
mask with no padding is a flash-style one (blocked, no L x L scores), as the CUDA kernels are: what CPU measures
here is what the model counts for a GPU, in fp32 instead of bf16 and with the drafter's dense CPU mask.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `dflash-ds bench long-context`."""
    parser.add_argument("--lengths", default="2048,4096,8192,16384",
                        help="comma-separated sequence lengths, one sequence per micro-batch")
    parser.add_argument("--hidden", type=int, default=128, help="target hidden size (the tiny target's 128)")
    parser.add_argument("--intermediate", type=int, default=256, help="target MLP size (the tiny target's 256)")
    parser.add_argument("--heads", type=int, default=4, help="target attention heads")
    parser.add_argument("--kv-heads", type=int, default=2, help="target key/value heads")
    parser.add_argument("--head-dim", type=int, default=32, help="target head dimension")
    parser.add_argument("--target-layers", type=int, default=6,
                        help="target decoder layers (6: the default ids of 3 layers read, [1, 2, 3], leave two layers "
                             "after the last one read, as at a real target)")
    parser.add_argument("--vocab", type=int, default=512, help="vocabulary size")
    parser.add_argument("--layers-read", type=int, default=3,
                        help="target layers read = drafter layers (their default ids, models/drafter_arch.py)")
    parser.add_argument("--num-anchors", type=int, default=64, help="anchor blocks per sequence (loss.num_anchors)")
    parser.add_argument("--chunk-blocks", type=int, default=16, help="blocks per LM-head + loss chunk")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the batch")
    parser.add_argument("--json", default="", metavar="FILE", help="also write the result as JSON to FILE")


def _peak(fn, device) -> tuple[int, Any]:
    """(peak resident bytes above the start, fn's result) of one call, after the heap is trimmed."""
    from dflash_ds.bench.memory import _release_heap
    from dflash_ds.runtime.memory import peak_memory_bytes, reset_peak_memory, resident_bytes

    _release_heap()
    base = resident_bytes()
    reset_peak_memory(device)
    out = fn()
    return peak_memory_bytes(device) - base, out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Each length's measured and predicted peaks: the target forward's and the colocated step's."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash_ds.bench.memory import _mmap_large_allocations
    from dflash_ds.bench.micro_step import micro_step_inputs
    from dflash_ds.components.objective import TargetStates
    from dflash_ds.memory import long_context as lc
    from dflash_ds.memory import model as mm
    from dflash_ds.models.drafter_arch import default_target_layer_ids
    from dflash_ds.models.target import capture_layers
    from dflash_ds.runtime.sources import fresh_payload

    torch.set_num_threads(args.threads)
    mmapped = _mmap_large_allocations()
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    cfg = {"hidden_size": args.hidden, "intermediate_size": args.intermediate,
           "num_hidden_layers": args.target_layers, "num_attention_heads": args.heads,
           "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim, "vocab_size": args.vocab}
    torch.manual_seed(args.seed)
    target = Qwen3ForCausalLM(Qwen3Config(**cfg, max_position_embeddings=max(lengths),
                                          tie_word_embeddings=False)).eval()
    run = lc.LongRun(layers_read=args.layers_read, drafter_layers=args.layers_read, num_anchors=args.num_anchors,
                     max_anchors=0, chunk_blocks=args.chunk_blocks, kl=True, dtype_bytes=4)
    layer_ids = default_target_layer_ids(args.target_layers, args.layers_read)
    d, cpu = lc.drafter_at(cfg, run), torch.device("cpu")
    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    for n in lengths:
        a = mm.anchors_per_row(1, n, run.block_size, run.num_anchors, run.max_anchors)
        step = mm.StepShape(batch=1, seq_len=n, anchors_per_row=a, chunk_blocks=run.chunk_blocks, kl=True,
                            dtype_bytes=4, checkpointing=False, dense_mask=True, cuda=False)
        module, _, loss_cfg = micro_step_inputs(cfg, d, step, seed=args.seed, num_anchors=args.num_anchors,
                                                max_anchors=0, chunk_blocks=args.chunk_blocks, kl_weight=0.5,
                                                mask_backend="dense", device=cpu, dtype=torch.float32)
        ids = torch.randint(0, args.vocab - 1, (1, n), generator=gen)
        mask = torch.ones(1, n, dtype=torch.long)

        def forward() -> None:
            layers, last = capture_layers(target, ids, mask, layer_ids)
            del layers, last

        def whole_step() -> None:  # runtime/sources.capture_batch, then the drafter's micro-step on its payload
            module.drafter.zero_grad(set_to_none=True)
            layers, last = capture_layers(target, ids, mask, layer_ids)
            p = fresh_payload(ids, mask, torch.tensor([n]), layers, last)
            del layers, last
            states = TargetStates(input_ids=p["input_ids"], loss_mask=p["loss_mask"], lengths=p["lengths"],
                                  context=p["context"], last_hidden=p["last_hidden"])
            terms, _ = module(states, loss_cfg, 0, 0.0, 0)
            terms.loss.backward()

        t0 = time.perf_counter()
        fwd = min(_peak(forward, cpu)[0] for _ in range(2))  # the first call's one-off allocations left out
        step_peak = min(_peak(whole_step, cpu)[0] for _ in range(2))
        fwd_terms = lc.target_forward_terms(d, n, run)
        col_terms = lc.colocated_step_terms(cfg, n, run, step=step, param_grads=True)
        rows.append({"seq_len": n, "anchors": a, "forward_measured": fwd, "forward_predicted": sum(fwd_terms.values()),
                     "forward_terms": fwd_terms, "step_measured": step_peak,
                     "step_predicted": sum(col_terms.values()), "step_terms": col_terms,
                     "seconds": time.perf_counter() - t0})
        del module
    return {"config": cfg, "layers_read": args.layers_read, "layer_ids": layer_ids, "num_anchors": args.num_anchors,
            "chunk_blocks": args.chunk_blocks, "threads": args.threads, "dtype": "fp32", "torch": torch.__version__,
            "cpu_allocations_mmapped": mmapped, "rows": rows}


def run(args: argparse.Namespace) -> int:
    """Entry point of `dflash-ds bench long-context`."""
    from dflash_ds.bench.table import print_table

    res = measure(args)
    mb = 1e6
    rows = [[f"{r['seq_len']:,}", str(r["anchors"]), f"{r['forward_measured'] / mb:.1f}",
             f"{r['forward_predicted'] / mb:.1f}", f"{r['forward_predicted'] / r['forward_measured']:.3f}",
             f"{r['step_measured'] / mb:.1f}", f"{r['step_predicted'] / mb:.1f}",
             f"{r['step_predicted'] / r['step_measured']:.3f}"] for r in res["rows"]]
    c = res["config"]
    print_table(f"bench long-context: target H {c['hidden_size']}, MLP {c['intermediate_size']}, "
                f"{c['num_attention_heads']}/{c['num_key_value_heads']} heads of {c['head_dim']}, "
                f"{c['num_hidden_layers']} layers, fp32 CPU; {res['layers_read']} layers read, one sequence",
                ["tokens", "anchors", "forward MB", "predicted", "ratio", "colocated step MB", "predicted", "ratio"],
                rows, "peak RSS above the start (VmHWM, allocations >= 64 KiB mmapped); predicted: "
                "memory/long_context.py's target_forward_terms and colocated_step_terms")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0
