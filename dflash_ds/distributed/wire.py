"""The target -> drafter wire contract: what a batch's payload holds, its header meta, the start message.

Both ends derive a batch's payload shapes from the shared batch stream alone (`payload_specs`),
so a drafter posts its receive before the target has computed the batch; the target writes the
batch straight into a pooled send buffer of exactly those shapes (`build_payload`). Encoding
(header, packing into one buffer) is `payload.py`'s, moving the messages `bridge.py`'s.

Bytes per token (Qwen3-8B, 5 layers read, bf16, KL on): 5 x 4096 x 2 (context) + 4096 x 2 (final
hidden) + 16 (int64 ids and loss mask) = 49,168; shipping the target's logits instead of its final
hidden state would add 151,936 x 2 = 303,872 bytes per token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dflash_ds.data.batching import BatchSpec, Cursor
from dflash_ds.distributed import bridge as bridge_mod
from dflash_ds.distributed.payload import describe_specs
from dflash_ds.errors import DFlashError

if TYPE_CHECKING:
    from dflash_ds.distributed.topology import RoleContext
    from dflash_ds.models.drafter_arch import DrafterArch

# The bridge carries input_ids and loss_mask as int64: 8 + 8 bytes per token.
ID_BYTES = 16
# The bridge tag of the start message (leader -> every target), apart from the batches' channels.
CONTROL_TAG = 7


def payload_specs(spec: BatchSpec, arch: DrafterArch, dtype: torch.dtype,
                  last_hidden: bool, shards: int = 1) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """The bridge payload of one batch, (name, dtype, shape) in wire order, from the shared batch stream alone.

    The target builds its batch to these specs and the drafter posts its receive with them before
    the batch exists (`bridge.Receiver`), so both must derive them here: right-padded int64 ids and
    mask (`data.loader.collate`), lengths, the selected layers concatenated, and the final hidden
    state when the loss has a KL term, in the run's dtype. Under sequence parallelism (`shards` N > 1) each rank
    of a group is sent the ids, mask and lengths whole and its 1/N of the context positions (the batch padded to
    a multiple of N: `context_part`; the final hidden too, when sent), so a rank's receive is the context's S/N: at
    the Qwen3-8B preset (5 layers read, bf16) a 128K-token sequence's context is 5.4 GB whole, 671 MB a rank at
    N = 8 (+ 2 MB of ids and mask).
    """
    hidden = arch.hidden_size
    return payload_specs_for(spec.num_seqs, spec.max_length, len(arch.target_layer_ids) * hidden,
                             hidden if last_hidden else 0, dtype, shards)


def payload_specs_for(rows: int, width: int, context_dim: int, last_dim: int,
                      dtype: torch.dtype, shards: int = 1) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """`payload_specs` from the shapes themselves (`bench comm` sends batches of this form); no final hidden if
    last_dim is 0."""
    local = shard_length(width, shards)
    specs = [("input_ids", torch.int64, (rows, width)), ("loss_mask", torch.int64, (rows, width)),
             ("lengths", torch.int64, (rows,)), ("context", dtype, (rows, local, context_dim))]
    if last_dim:  # the final hidden (KL, LK, target labels) is cut as the context is
        specs.append(("last_hidden", dtype, (rows, local, last_dim)))
    return specs


def bytes_per_token(feature_dim: int, last_dim: int, dtype) -> int:
    """Payload bytes per token: context and final hidden in `dtype`, plus int64 ids and loss mask."""
    return (feature_dim + last_dim) * torch.empty((), dtype=dtype).element_size() + ID_BYTES


def batch_meta(spec, after: Cursor, forward_s: float, batches_per_s: float, in_flight: int, target_rank: int) -> dict:
    """The header meta of one batch, as the drafter's metrics read it (a colocated rank builds the same).

    Keys are at most 16 ASCII bytes (see payload.py).
    """
    return {"bucket": spec.bucket, "epoch_after": after.epoch, "index_after": after.batch_index,
            "real_tokens": spec.real_tokens, "padded_tokens": spec.padded_tokens, "num_seqs": spec.num_seqs,
            "tgt_forward_s": forward_s, "tgt_batch_per_s": batches_per_s, "in_flight": in_flight,
            "target_rank": target_rank}


def shard_length(width: int, shards: int) -> int:
    """Positions of one shard of a `width`-token batch split `shards` ways (the batch padded to a multiple)."""
    return -(-width // shards)


def context_part(width: int, shards: int, part: int) -> tuple[int, int]:
    """(first, end) of the positions of a `width`-token batch that shard `part` of `shards` holds (the batch
    padded at the end to a multiple of `shards`, as distributed/sequence_parallel.shard; end - first may be less
    than the shard's size, or 0, where it reaches the padding)."""
    local = shard_length(width, shards)
    return min(width, part * local), min(width, (part + 1) * local)


def build_payload(sender: bridge_mod.AsyncSender, planned: list, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                  lengths: torch.Tensor, layers: list[torch.Tensor],
                  last_hidden: torch.Tensor | None, part: tuple[int, int] = (0, 1)) -> dict[str, torch.Tensor]:
    """A batch's bridge payload, written straight into a pooled send buffer (sent without a further copy).

    `planned` is `plan.payload_specs` of the batch, the shapes the drafter has already posted its
    receive for: a batch that differs is an error here, before anything is sent. The selected
    layers are concatenated into the buffer's `context`, which the concatenation needed anyway;
    `last_hidden` (for the KL term) is one extra copy of H values per token. `part` (i, N): the payload of
    shard i of N (sequence parallelism: `context_part` of the context, zero past the batch's end).
    """
    i, shards = part
    first, end = context_part(input_ids.shape[1], shards, i)
    if shards > 1:
        layers = [t[:, first:end] for t in layers]
        last_hidden = None if last_hidden is None else last_hidden[:, first:end]
    local = shard_length(input_ids.shape[1], shards)
    context_shape = (layers[0].shape[0], local, sum(t.shape[-1] for t in layers))
    specs = [("input_ids", input_ids.dtype, tuple(input_ids.shape)), ("loss_mask", loss_mask.dtype, tuple(loss_mask.shape)),
             ("lengths", lengths.dtype, tuple(lengths.shape)), ("context", layers[0].dtype, context_shape)]
    if last_hidden is not None:
        specs.append(("last_hidden", last_hidden.dtype, (*last_hidden.shape[:1], local, last_hidden.shape[-1])))
    if specs != planned:
        raise DFlashError(f"the target produced a batch of {describe_specs(specs)}, but the data plan says "
                          f"{describe_specs(planned)} (is the target's dtype the run's dtype?)")
    out = sender.empty(specs)
    out["input_ids"].copy_(input_ids, non_blocking=True)
    out["loss_mask"].copy_(loss_mask, non_blocking=True)  # from the loader's pinned tensors on CUDA
    out["lengths"].copy_(lengths, non_blocking=True)
    if end - first == local:
        torch.cat(layers, dim=-1, out=out["context"])
    else:  # the last shard(s) reach the padding
        torch.cat(layers, dim=-1, out=out["context"][:, :end - first])
        out["context"][:, end - first:].zero_()
    if last_hidden is not None:
        out["last_hidden"][:, :end - first].copy_(last_hidden, non_blocking=True)
        if end - first < local:
            out["last_hidden"][:, end - first:].zero_()
    return out


def send_start(ctx: RoleContext, start_step: int, cursor: Cursor, global_batch: int) -> None:
    """Tell every target where the run starts and its global batch (on the bridge's device: NCCL moves only
    CUDA tensors)."""
    start = torch.tensor([start_step, cursor.epoch, cursor.batch_index, global_batch], dtype=torch.long,
                         device=ctx.device)
    sends = [(t, bridge_mod.send_batch(ctx.bridge, t, {"start": start}, {}, batch_id=-1, tag=CONTROL_TAG))
             for t in ctx.layout.target_ranks]
    for t, works in sends:
        bridge_mod.wait_all(works, t, ctx.bridge_timeout_s, "sending the start point")


def receive_start(ctx: RoleContext, leader: int, timeout_s: float) -> tuple[int, Cursor, int]:
    """The resume point (start step, data cursor) and the global batch chosen by the leader once its engine is up."""
    _, tensors, _ = bridge_mod.recv_batch(ctx.bridge, leader, timeout_s=timeout_s, tag=CONTROL_TAG, device=ctx.device)
    start = tensors["start"].tolist()
    return int(start[0]), Cursor(int(start[1]), int(start[2])), int(start[3])
