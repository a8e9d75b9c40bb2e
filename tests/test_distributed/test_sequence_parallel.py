"""Sequence parallelism over gloo ranks (distributed/sequence_parallel.py, issue #56): N = 2 and 4 give the one-rank
forward's hidden states, loss and gradients on one sequence of 16,411 context positions (a length no N divides)
with 30 anchor blocks (no N divides either), a sliding-window layer among the full ones, at a tiny width, the
memory a rank keeps for backward falling as 1/N (measured: autograd's saved tensors), activation checkpointing
under SP giving the same; and the whole objective
(anchors drawn by the real sampler on every rank, blocks and labels sharded, KL to the target's law on) gives
components/objective.drafter_objective's loss and gradients, from a whole final hidden (colocated) and from one
sent cut by position (each rank's label rows fetched from the ranks that hold them)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from dist_utils import free_port_block, run_ranks

S_CTX, N_ANCHORS, BS, H, V = 16_411, 30, 4, 32, 64
NOISE = 0.05  # the objective's context noise: each rank draws its positions' (components/noise.py)
TOL = 2e-5  # fp32: the same sums in another order (attention over exchanged heads, gradients summed over ranks)


class SavedBytes:
    """The bytes autograd keeps for backward while active (each storage once): a rank's activation memory."""

    def __init__(self):
        self.storages: dict[int, int] = {}

    def __enter__(self):
        def pack(t):
            if t.device.type == "cpu" and t.untyped_storage().nbytes():
                self.storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        self.hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def _drafter():
    from dflash_ds.models.drafter import DFlashDrafter
    from dflash_ds.models.drafter_arch import DrafterArch

    arch = DrafterArch(hidden_size=H, intermediate_size=64, num_hidden_layers=3, num_attention_heads=8,
                       num_key_value_heads=4, head_dim=8, vocab_size=V, rms_norm_eps=1e-6,
                       max_position_embeddings=32_768, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                       block_size=BS, num_target_layers=8, mask_token_id=V - 1, target_layer_ids=[1, 5],
                       layer_types=["full_attention", "sliding_attention", "full_attention"], sliding_window=512)
    d = DFlashDrafter(arch)
    d.init_weights(0, std=0.1)
    return d.float().train()


def _batch():
    """Context features, block embeddings, anchors (sorted, spread over the sequence), labels, label validity."""
    g = torch.Generator().manual_seed(1)
    ctx = torch.randn(1, S_CTX, 2 * H, generator=g)
    emb = torch.randn(1, N_ANCHORS, BS, H, generator=g)
    anchors = torch.sort(torch.randperm(S_CTX - BS, generator=g)[:N_ANCHORS]).values[None]
    labels = torch.randint(0, V, (N_ANCHORS, BS - 1), generator=g)
    valid = torch.rand(N_ANCHORS, BS - 1, generator=g) > 0.2
    head = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g) * 0.3)
    return ctx, emb, anchors, labels, valid, head


def _objective_inputs():
    """Token ids, loss mask (the first 300 positions a prompt), lengths, the embedding, the target's final hidden,
    the loss settings (with KL to the target's law: the final hidden at every label position is read)."""
    from dflash_ds.config import LossConfig

    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, V - 1, (1, S_CTX), generator=g)
    mask = (torch.arange(S_CTX) >= 300).long()[None]
    embed = torch.nn.Embedding(V, H)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(V, H, generator=g))
    last = torch.randn(1, S_CTX, H, generator=g)
    return ids, mask, torch.tensor([S_CTX]), embed, last, LossConfig(num_anchors=N_ANCHORS, chunk_blocks=8,
                                                                      kl_weight=0.5)


def _loss(hidden, head, labels, valid):
    from dflash_ds.components.loss import chunked_dflash_loss

    n = hidden.shape[0] * hidden.shape[1]
    terms = chunked_dflash_loss(hidden[:, :, 1:].reshape(n, BS - 1, H), head, labels, valid, gamma=4.0, chunk_blocks=8)
    return terms.loss, terms.weight_sum


def _host(sums: dict) -> dict:
    return {k: v.detach().double().reshape(-1) for k, v in sums.items()}


def _grads(d) -> dict:
    return {k: p.grad.clone() for k, p in d.named_parameters() if p.grad is not None}


def _reference():
    """The one-rank forward: hidden states, loss, gradients by parameter name; the objective's loss and gradients."""
    from dflash_ds.components.objective import TargetStates, drafter_objective

    d = _drafter()
    ctx, emb, anchors, labels, valid, head = _batch()
    with SavedBytes() as saved:
        hidden = d.forward_train(ctx, emb, anchors, pad=False)
    loss, _ = _loss(hidden, head, labels, valid)
    loss.backward()
    forward = hidden.detach(), loss.detach(), _grads(d), saved.total
    d = _drafter()
    ids, mask, lengths, embed, last, loss_cfg = _objective_inputs()
    terms, sums = drafter_objective(d, embed, head, TargetStates(ids, mask, lengths, ctx, last), loss_cfg,
                                    anchor_gen=torch.Generator().manual_seed(7), noise_std=NOISE,
                                    noise_seed=8)
    terms.loss.backward()
    return forward, (terms.loss.detach(), _grads(d), _host(sums))


def _sp_run(group, out: Path, recompute: bool = False) -> None:
    """This rank's share of the batch through `group` (SP = its size): its blocks' hidden states, the group's loss
    and the gradients summed over the group, saved as out; `recompute`: every layer activation-checkpointed."""
    import torch.distributed as dist

    from dflash_ds.distributed.sequence_parallel import forward_train_sp, global_share, padded, shard

    size, rank = dist.get_world_size(group), dist.get_rank(group)
    d = _drafter()
    d.activation_checkpointing = recompute
    ctx, emb, anchors, labels, valid, head = _batch()
    padded_anchors = torch.nn.functional.pad(anchors, (0, padded(N_ANCHORS, size) - N_ANCHORS))
    labels, valid = shard(labels, 0, size, rank), shard(valid, 0, size, rank)  # padded blocks: no valid label
    # clones: a rank receives its shard alone (a view would keep the whole sequence's storage)
    ctx, emb = shard(ctx, 1, size, rank).clone(), shard(emb, 1, size, rank).clone()
    with SavedBytes() as saved:
        hidden = forward_train_sp(d, ctx, emb, padded_anchors, group)
    loss, weight = _loss(hidden, head, labels, valid)
    share = global_share(loss, weight, group)
    share.backward()
    grads = _grads(d)
    for g in grads.values():
        dist.all_reduce(g, group=group)
    total = share.detach().clone()
    dist.all_reduce(total, group=group)
    torch.save({"hidden": hidden.detach(), "loss": total, "grads": grads, "saved": saved.total}, out)


def _sp_objective_run(group, out: Path, sent: bool = False) -> None:
    """The whole objective under SP over `group`: the group's loss and its summed gradients, saved as out; `sent`:
    the rank holds only its shard of the context and of the final hidden, as a target rank sends them
    (disaggregated: the KL's rows come from the ranks that hold them)."""
    import torch.distributed as dist

    from dflash_ds.components.objective import TargetStates
    from dflash_ds.distributed.sequence_parallel import shard, sp_objective

    size, rank = dist.get_world_size(group), dist.get_rank(group)
    d = _drafter()
    ctx, *_, head = _batch()
    ids, mask, lengths, embed, last, loss_cfg = _objective_inputs()
    if sent:
        ctx, last = shard(ctx, 1, size, rank).clone(), shard(last, 1, size, rank).clone()
    terms, sums = sp_objective(d, embed, head, TargetStates(ids, mask, lengths, ctx, last), loss_cfg,
                               anchor_gen=torch.Generator().manual_seed(7), group=group, noise_std=NOISE,
                               noise_seed=8, context_sharded=sent)
    terms.loss.backward()
    grads = _grads(d)
    for g in grads.values():
        dist.all_reduce(g, group=group)
    total = terms.loss.detach().clone()
    dist.all_reduce(total, group=group)
    stats = {k: v.detach().clone() for k, v in sums.items()}
    for v in stats.values():
        dist.all_reduce(v, group=group)
    torch.save({"loss": total, "grads": grads, "sums": _host(stats)}, out)


def _peak_run(group, out: Path) -> None:
    """A drafter rank's micro-step as the trainer runs it fed by a target rank (the objective on the context shard
    it was sent, noise off, forward + backward), its peak resident bytes above the start saved as out: `bench
    memory`'s mechanism (allocations of 64 KiB or more mmapped, set as the rank started; the heap trimmed; the
    high-water mark reset), the lowest of 2 runs (the first one's one-off allocations left out). `group` None
    with `sp1`: the one-rank objective (components/objective.drafter_objective)."""
    import torch.distributed as dist

    from dflash_ds.bench.memory import _release_heap
    from dflash_ds.components.objective import TargetStates, drafter_objective
    from dflash_ds.distributed.sequence_parallel import shard, sp_objective
    from dflash_ds.runtime.memory import peak_memory_bytes, reset_peak_memory, resident_bytes

    size = 1 if group == "sp1" else dist.get_world_size(group)
    d = _drafter()
    ctx, *_, head = _batch()
    ids, mask, lengths, embed, _last, loss_cfg = _objective_inputs()
    loss_cfg = dataclasses.replace(loss_cfg, kl_weight=0.0)  # as the memory model prices it (StepShape's kl off)
    del _last
    if size > 1:
        ctx = shard(ctx, 1, size, dist.get_rank(group)).clone()
    states = TargetStates(ids, mask, lengths, ctx, None)
    del _
    peaks, cpu = [], torch.device("cpu")
    for _ in range(2):
        d.zero_grad(set_to_none=True)
        _release_heap()
        base = resident_bytes()
        reset_peak_memory(cpu)
        gen = torch.Generator().manual_seed(7)
        if size == 1:
            terms, _sums = drafter_objective(d, embed, head, states, loss_cfg, anchor_gen=gen)
        else:
            terms, _sums = sp_objective(d, embed, head, states, loss_cfg, anchor_gen=gen, group=group,
                                        context_sharded=True)
        terms.loss.backward()
        del terms, _sums
        peaks.append(peak_memory_bytes(cpu) - base)
    torch.save(min(peaks), out)


def _rank(rank: int, port: int, out: str) -> None:
    """Four ranks: SP = 4 over all of them, then SP = 2 over the pairs (0, 1) and (2, 3)."""
    import deepspeed
    import torch.distributed as dist

    from dflash_ds.bench.memory import _mmap_large_allocations

    _mmap_large_allocations()  # this process only: a freed tensor leaves the resident set (`_peak_run`)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    deepspeed.init_distributed("gloo")  # DeepSpeed's comm layer over the group (the exchange calls it)
    try:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        _sp_run(None, Path(out) / f"sp4_{rank}.pt")
        _sp_run(pairs[rank // 2], Path(out) / f"sp2_{rank}.pt")
        _sp_run(pairs[rank // 2], Path(out) / f"sp2ckpt_{rank}.pt", recompute=True)
        _sp_objective_run(None, Path(out) / f"obj4_{rank}.pt")
        _sp_objective_run(None, Path(out) / f"obj4sent_{rank}.pt", sent=True)
        _sp_objective_run(pairs[rank // 2], Path(out) / f"obj2_{rank}.pt")
        _peak_run(None, Path(out) / f"peak4_{rank}.pt")
        _peak_run(pairs[rank // 2], Path(out) / f"peak2_{rank}.pt")
        if rank == 0:
            _peak_run("sp1", Path(out) / "peak1_0.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(600)
def test_sequence_parallel_equals_one_rank(tmp_path):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(1)
    (ref_hidden, ref_loss, ref_grads, ref_saved), (obj_loss, obj_grads, obj_sums) = _reference()
    run_ranks(_rank, 4, (free_port_block(1), str(tmp_path)), tmp_path, timeout_s=300)
    for size, ranks in ((4, [0, 1, 2, 3]), (2, [0, 1]), (2, [2, 3])):
        per = [torch.load(tmp_path / f"sp{size}_{r}.pt") for r in ranks]
        hidden = torch.cat([p["hidden"] for p in per], dim=1)[:, :N_ANCHORS]  # the ranks' blocks in order, unpadded
        assert (hidden - ref_hidden).abs().max().item() < TOL, size
        for p in per:  # every rank holds the same global loss and summed gradients
            _same(p, ref_loss, ref_grads, size)
        # The memory a rank keeps for backward falls as 1/N but for the dense masks (one a layer, the same on
        # every rank: CPU's SDPA path; see distributed/sequence_parallel.py). Measured 2026-12-06, without the masks:
        # 39.0 MB at one rank, 19.6 at SP 2, 9.9 at SP 4; the masks 23.8-25.4 MB (fp32, one a layer).
        saved = max(p["saved"] for p in per)
        assert saved - _mask_bytes(size) < (ref_saved - _mask_bytes(1)) * 1.1 / size, (size, saved, ref_saved)
        print(f"SP {size}: {saved / 1e6:.1f} MB kept for backward a rank, {_mask_bytes(size) / 1e6:.1f} MB of it masks "
              f"(one rank: {ref_saved / 1e6:.1f}, {_mask_bytes(1) / 1e6:.1f})")
        # the whole objective: the sampler's anchors, the labels sharded, each counted once; at SP 4 also from a
        # context sent already cut (its noise drawn for the rank's positions alone: components/noise.py)
        for name in [f"obj{size}_{r}" for r in ranks] + ([f"obj4sent_{r}" for r in ranks] if size == 4 else []):
            got = torch.load(tmp_path / f"{name}.pt")
            _same(got, obj_loss, obj_grads, name)
            assert got["sums"].keys() == obj_sums.keys()  # the statistics summed over the group: the one-rank ones
            for k, v in obj_sums.items():
                assert torch.allclose(got["sums"][k], v, rtol=1e-5, atol=1e-4), (name, k, got["sums"][k], v)
    # Activation checkpointing under SP (every layer recomputed, its exchange run again in backward): the same
    # hidden states, loss and gradients, and a rank keeps little but the layers' inputs for backward.
    for r in range(4):
        ckpt, plain = torch.load(tmp_path / f"sp2ckpt_{r}.pt"), torch.load(tmp_path / f"sp2_{r}.pt")
        assert torch.equal(ckpt["hidden"], plain["hidden"])
        _same(ckpt, ref_loss, ref_grads, "SP 2, recomputed")
        assert ckpt["saved"] < 0.3 * plain["saved"], (ckpt["saved"], plain["saved"])  # measured 9.8 against 43.4 MB
    # A rank's measured peak falls as N grows, and the memory model's (memory/sequence_parallel.sp_step_terms at this
    # CPU shape: fp32, the dense mask, no checkpointing, parameter gradients in the step) is within 10% of it at every
    # N (docs/MEMORY.md, "Measured per SP rank"; a long sequence's step peaks in a layer's backward, on its
    # context-side gradients: without that term SP 1 was 10.7% under).
    from dflash_ds.memory import model as mm
    from dflash_ds.memory.sequence_parallel import sp_step_terms

    shape = mm.DrafterShape(hidden=H, intermediate=64, heads=8, kv_heads=4, head_dim=8, vocab=V, num_layers=3,
                            num_read=2, block_size=BS)
    step = mm.StepShape(batch=1, seq_len=S_CTX, anchors_per_row=N_ANCHORS, chunk_blocks=8, dtype_bytes=4)
    peaks = {}
    for size, ranks in ((1, [0]), (2, range(4)), (4, range(4))):
        peaks[size] = max(torch.load(tmp_path / f"peak{size}_{r}.pt") for r in ranks)
        model = sum(sp_step_terms(shape, step, size, param_grads=True).values())
        print(f"SP {size}: a rank's step peaks at {peaks[size] / 1e6:.1f} MB, the model says {model / 1e6:.1f} "
              f"({model / peaks[size]:.3f})")
        assert abs(model / peaks[size] - 1) < 0.10, (size, model, peaks[size])
    assert peaks[4] < peaks[2] < peaks[1], peaks
    assert ref_grads["layers.0.self_attn.k_proj.weight"].abs().max() > 0  # the context path carries gradient
    assert obj_loss.item() > 0 and obj_grads["fc.weight"].abs().max() > 0


def _mask_bytes(size: int) -> int:
    """The masks' bytes autograd keeps at SP `size`: SDPA's fp32 copy of the boolean [A*bs, S + A*bs] mask in each of
    the 3 layers (memory/model.py's "attention_mask"), A and S padded to `size`."""
    from dflash_ds.distributed.sequence_parallel import padded

    queries = padded(N_ANCHORS, size) * BS
    return 3 * queries * (padded(S_CTX, size) + queries) * 4


def _same(got: dict, loss: torch.Tensor, grads: dict, what) -> None:
    assert abs(got["loss"].item() - loss.item()) < TOL, (what, got["loss"], loss)
    assert got["grads"].keys() == grads.keys(), what
    worst = {k: (got["grads"][k] - g).abs().max().item() / max(g.abs().max().item(), 1e-8) for k, g in grads.items()}
    assert max(worst.values()) < 1e-4, (what, worst)


def test_sizes_the_heads_do_not_divide_are_refused():
    from dflash_ds.errors import DFlashError
    from dflash_ds.distributed.sequence_parallel import check_heads

    check_heads(4, 2)
    with pytest.raises(DFlashError, match=r"3 key/value heads must divide by it \(valid sizes: \[1, 3\]\)"):
        check_heads(3, 2)
