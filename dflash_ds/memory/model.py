"""The predicted peak memory of one drafter micro-step, and the static bytes of a drafter rank.

Counted from the code (models/drafter.py, components/objective.py, components/loss.py): every
tensor autograd saves, or the step holds, is named below with its size in bytes. Notation, for
one micro-batch of B sequences of S tokens with A anchor blocks each (the most any row drew;
padding blocks are computed too):

    T = B*A*bs     block tokens            C = B*S     context tokens
    P = B*A*(bs-1) label positions         b = bytes of the compute dtype (4 fp32, 2 bf16)
    H hidden, I intermediate, nh / nkv heads of head_dim d, V vocabulary, L drafter layers

A kind beyond DFlash (`DrafterShape.kind`) adds the plain numbers of its spec's `MemoryTerms` (models/kinds.py),
counted, and explained, by the `memory_terms` of its module (`KindSpec.memory`): parameters per layer (in the
layer's count) and outside the layers (in Psi, their gradients a backward term of their own), H-wide values saved
per block token in each layer (added to a_tok), and its loss's buffers: copies of an LM-head chunk's [c, K, V]
entries beside the head's (a logit bias and its product, say), values per label position (kept rows or
embeddings for backward) and fixed bytes (an fp32 gradient accumulator), a loss term of their own.

The micro-step's peak is `held + max(forward, loss, backward)`:

- held: what forward leaves for backward: RoPE tables, the projected context, the dense mask's
  float copy in every layer (CPU SDPA saves it; flex_attention has none, only its BlockMask's small tile
  tables: `flex_block_mask_bytes`), and each layer's saved
  activations or, with activation checkpointing, only each layer's input (and the boolean mask); with only the
  first k layers recomputed (StepShape.checkpoint_layers), those their inputs and the others their activations;
- forward (its end): the block embeddings, the final norm, the boolean mask (no checkpointing);
- loss (inside the chunked LM head + loss): the block embeddings, the final norm's saved tensors
  and output, the [N, K, H] head input and its stored gradient, one chunk's [c, K, V] tensors;
- backward (inside draft layer l's backward, the worst l): layers after l have released what
  they saved, their parameter gradients exist, layer l is recomputed (checkpointing), and its
  gradients are in flight.

Per block token and layer autograd saves (read off the graph's saved tensors: RMSNorm keeps its
fp32 input, its normalised value and its output, the next linear's input; RoPE keeps only cos /
sin, which need no gradient; SDPA / flex keep q, the [ctx, block] K and V, the output (also
o_proj's input) and the logsumexp; SwiGLU its gate, silu, up and their product):

    a_tok = 2*H*(4 + 2b)        two RMSNorms
          + nh*d*(4 + 3b)       q: fp32 pre-norm, normalised, after RoPE; the attention output
          + nkv*d*(4 + 3b)      k: fp32 pre-norm, normalised; the block's rows of K and V
          + 4b*I + 4*nh         SwiGLU; fp32 logsumexp
    c_tok = nkv*d*(4 + 3b)      per context token and layer: its keys (same chain), its K/V rows

less 4*H per block token in layer 0 (its first RMSNorm keeps no fp32 input: the embeddings need
no gradient). With the layer ops compiled (StepShape.fused, train.fuse; models/layer_ops.py) every
"fp32 pre-norm" 4 above is 0 and SwiGLU keeps 3b*I (its silu is recomputed): `per_token_activations`. Checked against the saved-tensor graph (to 0.1%) and the exact allocation trace
(torch.profiler, profile_memory: every phase's peak to 1-3%) on CPU at widths 256 and 512 in
fp32 and 256 in bf16, with and without checkpointing, and with KL. The constants below were calibrated once from
those traces; the rest is counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflash_ds.models.kinds import MemoryTerms, kind_spec

GB = 1e9

# Bytes per (label position x vocabulary entry) of one LM-head chunk at its peak. CPU: the exact
# allocation trace (torch.profiler, profile_memory) of `chunked_dflash_loss` + backward at chunks
# 32, 64 and 128 (V = 16,384) gave 8.0 (fp32: logits + log-softmax's logsumexp temporary), 10.0
# (bf16: + the bf16 logits) and 20.0 with KL, independent of the chunk to 0.1. CUDA, counted from
# the kernels (not yet measured): the local backward holds the fp32 log-probs, their gradient and
# the logits' gradient, 12; with KL, docs/DESIGN.md §7's unchunked measurement, 32.5 (a safe upper bound).
CPU_LM_HEAD_BYTES = {4: 8.0, 2: 10.0}
CPU_LM_HEAD_KL_BYTES = 20.0
CUDA_LM_HEAD_BYTES = 12.0
CUDA_LM_HEAD_KL_BYTES = 32.5
# Gradients in flight inside one draft layer's backward beyond what the layer still holds, per
# block token, in units of b bytes: MLP_GRAD_I x I (SwiGLU's gradients, net of its product, which
# down_proj's backward has released) + GRAD_H x H (the residual stream's gradient and the block's
# q/k/v gradients). Calibrated once from the exact allocation trace (torch.profiler,
# profile_memory) of CPU fp32 steps at widths 256 and 512 with checkpointing and chunk 4 (token
# budget 2048, V = 16,384), where this phase is the peak: 46 and 88 MiB in flight; the MLP's own
# count (grad of the product + of silu and up, minus the released product) is 1 x I.
MLP_GRAD_I = 1.0
GRAD_H = 2.5
PHASES = ("forward", "loss", "backward")
# The H200's dense bf16 peak (docs/DESIGN.md §7), the denominator of MFU.
H200_BF16_FLOPS = 989e12


@dataclass(frozen=True)
class DrafterShape:
    """The drafter's shape (same width as the target) and the frozen vocabulary it reads."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    num_layers: int
    num_read: int  # target layers concatenated into the context features
    block_size: int
    tied: bool = False  # target embedding and LM head are one matrix
    kind: str = "dflash"  # model.kind (models/kinds.py)
    options: Any = None  # the kind's options (DrafterArch.options); None = their defaults


@dataclass(frozen=True)
class StepShape:
    """One micro-batch and how the step runs."""

    batch: int
    seq_len: int
    anchors_per_row: int  # A: the most anchor blocks of any sequence (the padded width)
    chunk_blocks: int
    kl: bool = False
    dtype_bytes: int = 4
    checkpointing: bool = False
    checkpoint_layers: int | None = None  # with checkpointing: the first k layers recomputed (None: all)
    dense_mask: bool = True  # CPU SDPA with a boolean mask; False = flex_attention (no dense tensors)
    cuda: bool = False  # which LM-head constant applies
    # train.fuse: the layers' RMSNorm, RoPE and SwiGLU compiled (fewer saved tensors). bench memory's rows set it
    # as they ran; `plan`, the full-width prediction and the trainer's checkpointing choice keep the eager count,
    # an upper bound of a fused step, until a GPU has measured the fused one
    fused: bool = False


def recomputed_layers(d: DrafterShape, s: StepShape) -> int:
    """k: the draft layers the step recomputes in backward (the first k; 0 without checkpointing)."""
    if not s.checkpointing:
        return 0
    return d.num_layers if s.checkpoint_layers is None else max(0, min(d.num_layers, s.checkpoint_layers))


def lm_head_bytes_per_entry(s: StepShape) -> float:
    """Bytes per (label position x vocabulary entry) of the LM-head chunk (see the constants)."""
    if s.cuda:
        return CUDA_LM_HEAD_KL_BYTES if s.kl else CUDA_LM_HEAD_BYTES
    return CPU_LM_HEAD_KL_BYTES if s.kl else CPU_LM_HEAD_BYTES.get(s.dtype_bytes, 10.0)


def kind_terms(d: DrafterShape) -> MemoryTerms:
    """What the drafter's kind adds (its spec's memory terms at its options, or their defaults; none for dflash)."""
    spec = kind_spec(d.kind)
    if spec.memory is None:
        return MemoryTerms()
    return spec.memory(d.options if d.options is not None else spec.default_options(), d.hidden, d.vocab)


def layer_params(d: DrafterShape) -> int:
    """Parameters of one draft layer: q/k/v/o, q/k norms, SwiGLU, two RMSNorms (+ the kind's: MemoryTerms)."""
    h, q, kv = d.hidden, d.heads * d.head_dim, d.kv_heads * d.head_dim
    return h * q + 2 * h * kv + q * h + 2 * d.head_dim + 3 * h * d.intermediate + 2 * h + kind_terms(d).layer_params


def drafter_params(d: DrafterShape) -> int:
    """Psi: trainable parameters (layers, fc over n*H, hidden_norm, final norm, the kind's parts outside the layers:
    MemoryTerms.head_params)."""
    return (d.num_layers * layer_params(d) + d.num_read * d.hidden * d.hidden + 2 * d.hidden
            + kind_terms(d).head_params)


def anchors_per_row(batch: int, seq_len: int, block_size: int, num_anchors: int, max_anchors: int) -> int:
    """A for sequences that are all response tokens: up to num_anchors each, water-filled under max_anchors."""
    from dflash_ds.components.loss import anchor_quotas

    picks = min(num_anchors, max(0, seq_len - block_size))  # a >= 1 and a + bs <= S
    counts = [picks] * batch
    if max_anchors > 0:
        counts = anchor_quotas(counts, max_anchors)
    return max(1, max(counts))


def _sizes(d: DrafterShape, s: StepShape) -> tuple[int, int, int, int, int]:
    rows = s.batch * s.anchors_per_row
    q_len = s.anchors_per_row * d.block_size
    return rows * d.block_size, rows * (d.block_size - 1), s.batch * s.seq_len, rows, q_len


def per_token_activations(d: DrafterShape, b: int, fused: bool = False) -> tuple[int, int]:
    """(a_tok, c_tok): bytes one draft layer saves per block token and per context token.

    `fused` (the layer ops compiled, models/layer_ops.py): a compiled RMSNorm keeps its input in the run dtype
    and a per-row scale instead of an fp32 copy (4 bytes less per normalised value), and SwiGLU recomputes its
    silu (b bytes less per MLP value); RoPE saves the same. Checked with saved-tensor hooks on CPU (inductor):
    one layer's saved bytes fell by exactly this count in fp32 and bf16 (1,572,864 B at width 256).
    """
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    f32 = 0 if fused else 4
    a_tok = 2 * d.hidden * (f32 + 2 * b) + (q + kv) * (f32 + 3 * b) + (3 if fused else 4) * b * d.intermediate \
        + 4 * d.heads
    saved_h = kind_terms(d).saved_h
    if saved_h:
        a_tok += round(saved_h * d.hidden * b)
    return a_tok, kv * (f32 + 3 * b)


def micro_step_terms(d: DrafterShape, s: StepShape, param_grads: bool = True) -> dict[str, dict[str, float]]:
    """Named byte counts of one micro-step, by phase: {"held": ..., "loss": ..., "backward": ...}.

    `param_grads=False` leaves the drafter's parameter gradients out of the backward phase (the
    ZeRO model-state term counts them in a real run).
    """
    b, h, L, k = s.dtype_bytes, d.hidden, d.num_layers, recomputed_layers(d, s)
    t, p, c, rows, q_len = _sizes(d, s)
    a_tok, c_tok = per_token_activations(d, b, s.fused)
    mask_entries = s.batch * q_len * (s.seq_len + q_len) if s.dense_mask else 0
    # layer 0's first RMSNorm keeps no fp32 input: the embeddings need no gradient (compiled, it keeps none anyway)
    no_grad_input = 0 if s.fused or k else t * h * 4
    held = {
        "rope_tables": 2 * (t + c) * d.head_dim * b,
        "context_projection": c * h * (4 + 2 * b),
        # dense: the float copy of the boolean mask that SDPA makes and saves in every layer kept; with
        # checkpointing, the boolean mask itself (a checkpoint input), a recomputed layer's copy only on recompute.
        "attention_mask": mask_entries * ((L - k) * b + (1 if k else 0)),
    }
    if not s.dense_mask:
        held["flex_block_mask"] = flex_block_mask_bytes(s.batch, q_len, s.seq_len + q_len)
    # The block embeddings live as long as the objective, or through backward as layer 0's checkpoint input.
    embeddings = {"block_embeddings": t * h * b}
    if k:  # the first k layers keep their inputs (layer 0's: the embeddings), the others their activations
        held.update(embeddings)
        held["layer_inputs"] = (k - 1) * t * h * b
    if k < L:
        held["layer_activations"] = (L - k) * t * a_tok - no_grad_input
        held["context_kv"] = (L - k) * c * c_tok
    chunk = min(s.chunk_blocks, rows) * (d.block_size - 1) * d.vocab
    loss = {
        **({} if k else embeddings),
        "final_norm": t * h * (4 + 2 * b),
        "head_input": p * h * b,
        "hidden_grad": p * h * b,
        "lm_head_chunk": chunk * lm_head_bytes_per_entry(s),
    }
    if s.kl:
        loss["target_hidden"] = p * h * b
    extra = kind_terms(d)
    if extra.has_loss_term:  # the kind's loss buffers (its memory_terms say which)
        loss[extra.loss_name] = (extra.loss_chunk_copies * chunk * b + extra.loss_fixed_bytes
                                 + p * extra.loss_position_values * b)
    # The end of forward, before the loss: without checkpointing the boolean mask is still alive.
    forward = {**({} if k else embeddings), "final_norm": loss["final_norm"],
               **({"attention_mask_bool": mask_entries} if mask_entries and not k else {})}
    backward = _backward_phase(d, s, param_grads, a_tok, c_tok, mask_entries)
    return {"held": held, "forward": forward, "loss": loss, "backward": backward}


def flex_block_mask_bytes(batch: int, q_len: int, kv_len: int, tile: int = 128) -> int:
    """The flex BlockMask of one mask kind (models/block_mask.flex_block_mask): int32 tile tables, held as a
    checkpoint input through the step. Per kind: kv and full-kv counts [B, nQ] and indices [B, nQ, nKV], and
    their transposes for the backward. Qwen3-8B defaults (B 8, Q 4,096, KV 6,144: 32 x 48 tiles): 201,728 B.
    Its build is transient and comes before the first layer, off the peak: B x Q x nKV booleans and int64
    interval bounds, ~20 B each, 31 MB there; torch's create_block_mask evaluated mask_mod over B x Q x KV
    (201 M entries: 0.2 GB of booleans and 1.6 GB per int64 intermediate), which this no longer does."""
    nq, nkv = -(-q_len // tile), -(-kv_len // tile)
    return 4 * (4 * batch * nq * nkv + 2 * batch * nq + 2 * batch * nkv)


def _backward_phase(d: DrafterShape, s: StepShape, param_grads: bool, a_tok: int, c_tok: int,
                    mask_entries: int) -> dict[str, float]:
    """The worst draft layer's backward: layers after l have given back what they saved, l..L-1 have grads."""
    b, h, L, k = s.dtype_bytes, d.hidden, d.num_layers, recomputed_layers(d, s)
    kv = d.kv_heads * d.head_dim
    t, _, c, _, _ = _sizes(d, s)
    grad_layer = layer_params(d) * b if param_grads else 0
    best: dict[str, float] = {}
    # every term is linear in l within the recomputed layers (l < k) and within the kept ones: the worst is an end
    for layer in sorted({0, k - 1, k, L - 1} & set(range(L))):
        later = L - 1 - layer  # layers whose backward is done
        later_kept = min(later, L - k)  # of them, layers that kept their activations (the last L - k)
        terms = {
            # + the gradient of the projected context, summed over the layers
            "grads_in_flight": t * b * (MLP_GRAD_I * d.intermediate + GRAD_H * h) + c * h * b,
            # this layer's own context-side gradients before they join that sum: its context keys' and values'
            # (2 kv), the keys' before RoPE (kv) and the projections' input gradient (H)
            "context_grads": c * b * (3 * kv + h),
            "param_grads": (later + 1) * grad_layer,
        }
        extra = kind_terms(d)
        if param_grads and extra.head_params:  # the kind's parts outside the layers: the loss's backward makes them
            terms[extra.grads_name] = extra.head_params * b

        if later - later_kept:  # recomputed layers after l: their inputs
            terms["layer_inputs_released"] = -(later - later_kept) * t * h * b
        if later_kept or not k:
            terms["layer_activations_released"] = -later_kept * (t * a_tok + c * c_tok + mask_entries * b)
        if layer < k:
            terms["recomputed_layer"] = t * a_tok + c * c_tok + mask_entries * b
        if not best or sum(terms.values()) > sum(best.values()):
            best = terms
    return best


def micro_step_peak(d: DrafterShape, s: StepShape, param_grads: bool = True) -> float:
    """Predicted peak bytes of one micro-step above what was allocated before it."""
    t = micro_step_terms(d, s, param_grads)
    return sum(t["held"].values()) + max(sum(t[ph].values()) for ph in PHASES)


def zero_model_state_bytes(psi: int, zero_stage: int, num_drafters: int) -> float:
    """bf16 params and grads with fp32 master weights and Adam moments: 2 + 2 + 12 bytes per parameter.

    ZeRO-1 partitions the 12, ZeRO-2 the 2 + 12, ZeRO-3 all 16 over the drafter ranks (the
    standard ZeRO arithmetic; `bench zero` measures these bytes per rank on CPU).
    """
    n = max(1, num_drafters)
    if zero_stage == 0:
        return 16.0 * psi
    if zero_stage == 1:
        return 4.0 * psi + 12.0 * psi / n
    if zero_stage == 2:
        return 2.0 * psi + 14.0 * psi / n
    if zero_stage == 3:
        return 16.0 * psi / n
    raise ValueError(f"ZeRO stage {zero_stage} is not 0, 1, 2 or 3")


# A drafter rank's received payloads (runtime/sources.BridgeSource): 2 receives posted ahead, 2 batches
# queued, 1 received batch waiting to be queued, 1 in the step = 6 leased buffers, plus up to 2 free ones
# the pool keeps for reuse; each a pool size class, up to 1/8 over the payload (payload.BufferPool).
PAYLOADS_ALIVE, PAYLOADS_POOLED = 6, 2


def static_terms(d: DrafterShape, token_budget: int, zero_stage: int, num_drafters: int, kl: bool = False,
                 payloads_alive: int = PAYLOADS_ALIVE + PAYLOADS_POOLED, pooled: bool = True) -> dict[str, float]:
    """Per drafter rank, besides the micro-step: model states, frozen embed/head, received payloads (bf16).

    `pooled`: the payloads are pool buffers, each rounded up to its size class (a colocated rank's
    captured batch is one exact tensor: payloads_alive=1, pooled=False).
    """
    from dflash_ds.distributed.payload import BufferPool

    psi = drafter_params(d)
    frozen = d.vocab * d.hidden * 2 * (1 if d.tied else 2)
    # A payload is the batch's selected target layers (and the last hidden for KL) in bf16; ids and
    # masks are negligible.
    per_payload = token_budget * (d.num_read + (1 if kl else 0)) * d.hidden * 2
    return {
        f"model_states_zero{zero_stage}": zero_model_state_bytes(psi, zero_stage, num_drafters),
        "frozen_embed_head": frozen,
        "payload_buffers": payloads_alive * (BufferPool.size_class(per_payload) if pooled else per_payload),
    }


def micro_step_flops(d: DrafterShape, s: StepShape, visible_keys: float, recompute: bool = True) -> float:
    """FLOPs of one micro-step: forward + backward (2x forward), + one more forward of the layers when
    checkpointing and `recompute` (hardware FLOPs); `recompute=False` counts model FLOPs only (MFU).

    `visible_keys`: the sum over block tokens of the keys each attends to (anchor + block size).
    Matmuls only: draft layers over block tokens, their K/V projections over context tokens, fc,
    attention over the visible keys, and the LM head (forward + input gradient: it is frozen).
    """
    h, t, p, c = d.hidden, *_sizes(d, s)[:3]
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    per_block_token = 2 * (h * q + 2 * h * kv + q * h + 3 * h * d.intermediate)
    layer_fwd = t * per_block_token + c * 2 * (2 * h * kv) + visible_keys * 4 * q
    layers = layer_fwd * (3 * d.num_layers + (recomputed_layers(d, s) if recompute else 0))
    fc = 2 * c * d.num_read * h * h * 2  # forward + weight gradient (the context needs none)
    head = 2 * p * h * d.vocab * 2
    return float(layers + fc + head + p * kind_terms(d).flops_per_position)
