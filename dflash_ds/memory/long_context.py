"""One long sequence per micro-batch: what a colocated rank, a drafter rank and a target rank hold at length L.

The drafter's micro-step is memory/model.py's at B = 1, S = L (its context terms grow with L: RoPE tables,
the projected context, the context K/V of the recomputed layer, the context's gradient in flight; its block
terms do not: T = A x bs with A = min(num_anchors, L - bs) under the anchor budget). What this module adds is
what one sequence of L tokens costs outside that step, counted from the code:

- the target's forward (models/target.capture_layers: inference_mode, use_cache=False, the attention of the
  target's `attn_implementation`, by default transformers' SDPA, whose CUDA kernels keep no L x L scores):
  the embeddings (transformers' decoder keeps `inputs_embeds` referenced for the whole forward, L H b), RoPE's
  cos and sin (2 L d b), the residual stream (a layer's input and its post-attention residual, 2 L H b), one
  decoder layer's working set, and the captured layers, which the hooks keep until the forward returns (n L H b
  while a layer after the last one read runs; the final hidden, L H b with KL, comes after the last layer, when
  its working set is gone). The layer's working set is the larger of the MLP's (its normed input, then
  silu(gate), up and their product: L (H + 3 I) b) and attention's (normed input, q and its rotated copy, k and
  its rotated copy, v, the output: L (H + 3 nh d + 3 nkv d) b). Measured on CPU at a tiny target, term by term,
  by `dflash-ds bench long-context` (docs/MEMORY.md);
- where the payload goes: a colocated rank concatenates the layers into a fresh tensor while they are still
  referenced (runtime/sources.fresh_payload: n L H b more at the forward's end); a target rank writes them
  into a pooled send buffer (`wire.build_payload`), one of TARGET_SEND_BUFFERS;
- the bridge: a drafter rank keeps 8 pooled receive buffers (memory/model.PAYLOADS_ALIVE + POOLED), each
  L (n + 1) H 2 bytes rounded to its pool size class, so the bridge grows with L like the context.

With flash-style attention nothing here is quadratic in L: the target's eager attention would add nh L^2 b a
layer (1.1 TB at Qwen3-8B, L = 128K), the drafter's dense CPU mask A bs (L + A bs) per layer (model.py).
Not counted: the target's KV cache (use_cache=False keeps none), the allocator's slack, CUDA context.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from dflash_ds.memory import model as mm
from dflash_ds.memory import shapes

# A target rank's AsyncSender (runtime/target_worker.py): 2 batches in flight + 1 being filled, pooled.
TARGET_SEND_BUFFERS = 3
LENGTHS = (8192, 16384, 32768, 65536, 131072)


@dataclass(frozen=True)
class LongRun:
    """The recipe settings one long sequence is priced at (config.py's defaults; bf16, flex, checkpointing)."""

    layers_read: int = 5  # target layers sent (n)
    drafter_layers: int = 5
    num_anchors: int = 512
    max_anchors: int = 2048
    chunk_blocks: int = 64
    block_size: int = 16
    kl: bool = True
    zero_stage: int = 2
    dtype_bytes: int = 2


def drafter_at(cfg: dict[str, Any], run: LongRun, kind: str = "dflash") -> mm.DrafterShape:
    """The full-width drafter of `cfg` (its heads, MLP and vocabulary), reading `run.layers_read` target layers."""
    d = shapes.drafter_shape(cfg, int(cfg["hidden_size"]), run.drafter_layers, run.block_size, kind)
    return replace(d, num_read=run.layers_read)


def step_at(seq_len: int, run: LongRun, batch: int = 1) -> mm.StepShape:
    """`batch` sequences of `seq_len` tokens, all response tokens, on a GPU: bf16, flex, all layers recomputed."""
    a = mm.anchors_per_row(batch, seq_len, run.block_size, run.num_anchors, run.max_anchors)
    return mm.StepShape(batch=batch, seq_len=seq_len, anchors_per_row=a, chunk_blocks=run.chunk_blocks, kl=run.kl,
                        dtype_bytes=run.dtype_bytes, checkpointing=True, dense_mask=False, cuda=True)


def payload_bytes(cfg: dict[str, Any], tokens: int, run: LongRun) -> int:
    """One batch's hidden states: n selected layers (+ the final hidden with KL) in the target's dtype (bf16 on a
    GPU; fp32 in the CPU check, bench/long_context.py)."""
    return tokens * (run.layers_read + (1 if run.kl else 0)) * int(cfg["hidden_size"]) * run.dtype_bytes


def target_forward_terms(d: mm.DrafterShape, tokens: int, run: LongRun) -> dict[str, int]:
    """The target forward's peak over `tokens` tokens (above its weights), before the payload is placed: the MLP
    (or attention) of a layer after the last layer read, the recipe's default ids (models/drafter_arch.py) leaving
    two such layers whenever the target has n + 3 layers or more.

    `d` is the full-width drafter, whose H, I and heads are the target's (memory/shapes.drafter_shape)."""
    h, i, b, n = d.hidden, d.intermediate, run.dtype_bytes, tokens
    mlp = n * (h + 3 * i) * b
    attention = n * (h + 3 * d.heads * d.head_dim + 3 * d.kv_heads * d.head_dim) * b
    return {"embeddings": n * h * b, "rope_tables": 2 * n * d.head_dim * b, "residual_stream": 2 * n * h * b,
            "layer_working_set": max(mlp, attention), "captured_layers": n * run.layers_read * h * b}


def forward_over_step(d: mm.DrafterShape, tokens: int, run: LongRun, step_peak: float) -> float:
    """A colocated rank: how far the target forward's peak rises above the drafter step's (captured batch +
    micro-step). The forward ends with the captured layers and their concatenation alive (fresh_payload)."""
    payload = tokens * (run.layers_read + (1 if run.kl else 0)) * d.hidden * run.dtype_bytes
    forward_end = payload + tokens * run.layers_read * d.hidden * run.dtype_bytes
    peak = max(sum(target_forward_terms(d, tokens, run).values()), forward_end)
    return max(0.0, peak - payload - step_peak)


def colocated_step_terms(cfg: dict[str, Any], seq_len: int, run: LongRun, step: mm.StepShape | None = None,
                         param_grads: bool = False, kind: str = "dflash") -> dict[str, float]:
    """A colocated rank's bytes above its weights and model states at one sequence of `seq_len` tokens: the
    captured batch, the drafter's micro-step on it (`step`; default `step_at`'s, on a GPU) and the target forward's
    rise above the two. Their sum is the peak of one whole step, target forward included."""
    d = drafter_at(cfg, run, kind)
    peak = mm.micro_step_peak(d, step or step_at(seq_len, run), param_grads=param_grads)
    return {"captured_batch": payload_bytes(cfg, seq_len, run), "micro_step_peak": peak,
            "target_forward_over_step": forward_over_step(d, seq_len, run, peak)}


def rank_terms(cfg: dict[str, Any], seq_len: int, run: LongRun, role: str, ranks: int,
               target_weight_bytes: float, kind: str = "dflash") -> dict[str, float]:
    """Named bytes of one rank at one sequence of `seq_len` tokens per micro-batch.

    role: "colocated" (target weights + drafter states + the worse of the target forward and the drafter step;
    ZeRO over `ranks` GPUs), "drafter" (a disaggregated drafter rank, ZeRO over `ranks` drafter ranks) or
    "target" (a disaggregated target rank: weights, its forward, its send buffers).
    """
    from dflash_ds.distributed.payload import BufferPool

    d = drafter_at(cfg, run, kind)
    payload = payload_bytes(cfg, seq_len, run)
    fwd = sum(target_forward_terms(d, seq_len, run).values())
    if role == "target":
        return {"target_weights": target_weight_bytes, "target_forward": fwd,
                "send_buffers": TARGET_SEND_BUFFERS * BufferPool.size_class(payload)}
    if role == "drafter":
        static = mm.static_terms(d, seq_len, run.zero_stage, ranks, kl=run.kl)
        return {**static, "micro_step_peak": mm.micro_step_peak(d, step_at(seq_len, run), param_grads=False)}
    states = mm.zero_model_state_bytes(mm.drafter_params(d), run.zero_stage, ranks)
    if role != "colocated":
        raise ValueError(f"role {role!r}: expected colocated, drafter or target")
    return {"target_weights": target_weight_bytes, f"model_states_zero{run.zero_stage}": states,
            **colocated_step_terms(cfg, seq_len, run, kind=kind)}


def longest_fit(cfg: dict[str, Any], run: LongRun, role: str, ranks: int, target_weight_bytes: float,
                limit_bytes: float, step: int = 1024, cap: int = 1 << 21, kind: str = "dflash") -> int:
    """The longest multiple of `step` tokens (<= cap) whose rank total fits `limit_bytes`; 0 when none does.
    Every term grows with L, so the search bisects."""
    return bisect_length(lambda n: sum(rank_terms(cfg, n, run, role, ranks, target_weight_bytes, kind).values())
                         <= limit_bytes, step, cap)


def bisect_length(fits, step: int = 1024, cap: int = 1 << 21) -> int:
    """The longest multiple of `step` (<= cap) for which `fits(length)` holds, `fits` falling once false (every
    term grows with L); 0 when none does."""
    lo, hi = 0, cap // step
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid * step):
            lo = mid
        else:
            hi = mid - 1
    return lo * step
