"""The hidden-state bridge: header encoding (pure), exact transfers between real gloo ranks,
receive timeouts, and DeepSpeed training on the drafter group while the target stays out of it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from dflash_ds.distributed.bridge import (
    AsyncSender, Batch, BridgeTimeoutError, Receiver, recv_batch, send_batch, wait_all,
)
from dflash_ds.distributed.layout import make_layout
from dflash_ds.distributed.payload import (
    ALIGN, BridgeError, BufferPool, decode_header, encode_header, packed_empty, payload_buffer, payload_layout,
)
from dflash_ds.distributed.topology import init_role_groups, shutdown
from dist_utils import free_port_block, run_ranks
from router_sim import QueueDepthMeter, plan_for_drafter, plan_for_target


def make_batch(g: int) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """A seeded batch shaped like the real traffic; shapes, dtypes and even the tensor set vary with g."""
    gen = torch.Generator().manual_seed(1000 + g)
    n, length, hidden, k = 1 + g % 2, 5 + 3 * g, 4, 2
    tensors = {
        "input_ids": torch.randint(0, 32000, (n, length), generator=gen),
        "loss_mask": torch.randint(0, 2, (n, length), generator=gen),
        "attention_mask": torch.ones(n, length, dtype=torch.long),
        "context": torch.randn(n, length, k * hidden, generator=gen).to(torch.bfloat16),
        "last_hidden": torch.randn(n, length, hidden, generator=gen),
    }
    if g % 2:
        tensors["flags"] = torch.rand(n, generator=gen) > 0.5
    return tensors, {"target_forward_s": 0.25 * g, "tiny": 1e-300 * (g + 1)}


def test_header_round_trip() -> None:
    tensors, meta = make_batch(3)
    tensors["scalar"] = torch.tensor(2.5, dtype=torch.float16)
    batch_id, specs, got_meta = decode_header(encode_header(2**40 + 7, tensors, meta))
    assert batch_id == 2**40 + 7
    assert specs == [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    assert got_meta == meta  # float64 bit patterns survive exactly


def test_header_rejects_what_it_cannot_carry() -> None:
    with pytest.raises(ValueError, match="longer than 24 bytes"):
        encode_header(0, {"x" * 25: torch.zeros(1)}, {})
    with pytest.raises(ValueError, match="at most 4 dims"):
        encode_header(0, {"x": torch.zeros(1, 1, 1, 1, 1)}, {})
    with pytest.raises(ValueError, match="at most 8 tensors"):
        encode_header(0, {f"t{i}": torch.zeros(1) for i in range(9)}, {})
    with pytest.raises(BridgeError, match="bad bridge header"):
        decode_header(torch.zeros(128, dtype=torch.long))


def test_buffer_pool_views_reuse_and_release() -> None:
    pool = BufferPool(max_free=2)
    specs = [("input_ids", torch.int64, (2, 7)), ("mask", torch.bool, (2, 7)), ("context", torch.bfloat16, (2, 7, 6)),
             ("empty", torch.float32, (0, 3))]
    a = pool.tensors(specs)
    assert [(k, t.dtype, tuple(t.shape)) for k, t in a.items()] == specs
    assert all(t.is_contiguous() and t.data_ptr() % BufferPool.ALIGN == 0 for t in a.values())
    ptr = a["input_ids"].untyped_storage().data_ptr()
    assert {t.untyped_storage().data_ptr() for t in a.values()} == {ptr}  # one buffer per batch
    for k, t in a.items():  # views do not overlap: writing each leaves the others intact
        t.fill_(1 if t.dtype == torch.bool else 3)
    a["context"].fill_(-2.5)
    assert a["input_ids"].eq(3).all() and a["mask"].all() and a["context"].eq(-2.5).all()
    b = pool.tensors(specs)  # a not released: a new buffer
    assert b["input_ids"].untyped_storage().data_ptr() != ptr and pool.allocations == 2
    pool.release(a)
    c = pool.tensors([("x", torch.float32, (5,))])  # smaller: reuses a's buffer
    assert c["x"].untyped_storage().data_ptr() == ptr and (pool.allocations, pool.reuses) == (2, 1)
    pool.release({"foreign": torch.zeros(3)})  # not the pool's: ignored
    pool.release(b)
    pool.release(c)
    assert pool.tensors([("y", torch.uint8, (10**6,))])["y"].numel() == 10**6 and pool.allocations == 3


def test_payload_layout_places_every_tensor_aligned_in_header_order() -> None:
    specs = [("input_ids", torch.int64, (2, 10)), ("context", torch.bfloat16, (3, 7)), ("mask", torch.bool, (2, 10)),
             ("empty", torch.float32, (0, 4)), ("lengths", torch.int64, (2,))]
    lay = payload_layout(specs)
    assert lay.nbytes == [160, 42, 20, 0, 16]
    assert lay.offsets == [0, 192, 256, 320, 320] and lay.total == 384
    assert all(o % ALIGN == 0 for o in lay.offsets)
    assert payload_layout([]).total == 0


def test_a_batch_built_in_place_is_sent_without_a_copy() -> None:
    specs = [("input_ids", torch.int64, (2, 5)), ("context", torch.float32, (2, 5, 3))]
    lay = payload_layout(specs)
    built = packed_empty(specs)
    flat = payload_buffer(list(built.values()), lay)
    assert flat is not None and flat.numel() == lay.total
    assert flat.data_ptr() == built["input_ids"].data_ptr()  # the message is the batch's own memory
    # Separate tensors, a wrong order, or a non-contiguous view are not in place: they get staged.
    loose = {k: torch.zeros(shape, dtype=dt) for k, dt, shape in specs}
    assert payload_buffer(list(loose.values()), lay) is None
    assert payload_buffer([built["context"], built["input_ids"]], payload_layout(specs[::-1])) is None
    view = packed_empty([("x", torch.float32, (4, 4))])["x"]
    assert payload_buffer([view.t()], payload_layout([("x", torch.float32, (4, 4))])) is None


class OrderMatchedLoopback:
    """An in-process bridge group that matches receives to sends by order alone, per (src, dst), as NCCL does.

    Tags are ignored; a receive whose size differs from the matched send raises (on NCCL that is
    silent corruption or a hang). Sends complete at once; receives are matched when posted.
    """

    class _Done:
        def wait(self, timeout=None) -> bool:
            return True

        def is_completed(self) -> bool:
            return True

    def __init__(self, me: int) -> None:
        self.me, self.wire = me, {}

    def send(self, tensors, dst, tag):
        self.wire.setdefault((self.me, dst), []).append(tensors[0].clone())
        return self._Done()

    def recv(self, tensors, src, tag):
        queue = self.wire.get((src, self.me), [])
        if not queue:
            raise AssertionError(f"receive posted from rank {src} with nothing sent")
        sent = queue.pop(0)
        if sent.numel() * sent.element_size() != tensors[0].numel() * tensors[0].element_size():
            raise AssertionError(f"receive of {tensors[0].numel() * tensors[0].element_size()} bytes matched a send of "
                                 f"{sent.numel() * sent.element_size()}: posting orders differ")
        tensors[0].view(-1).view(torch.uint8).copy_(sent.view(-1).view(torch.uint8))
        return self._Done()


@pytest.mark.parametrize("planned", [False, True])
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_receiver_posts_in_the_senders_order(depth: int, planned: bool) -> None:
    """A prefetching receiver must not post batch i+1's header before batch i's payload (NCCL ignores tags).

    planned: the schedule gives each payload's specs, so header and payload receives go out together,
    `depth` batches ahead, before anything has arrived.
    """
    group = OrderMatchedLoopback(me=0)
    sender = AsyncSender(group, depth=2)
    for g in range(6):
        tensors, meta = make_batch(g)
        group.me = 0  # rank 0 sends to rank 1
        sender.send(1, tensors, meta, batch_id=g, tag=5)
    sender.flush()
    group.me = 1
    pool = BufferPool()
    specs = {g: [(k, t.dtype, tuple(t.shape)) for k, t in make_batch(g)[0].items()] for g in range(6)}
    schedule = [(g, 0, specs[g]) if planned else (g, 0) for g in range(6)]
    receiver = Receiver(group, schedule, depth=depth, tag=5, pool=pool)
    if planned:  # already posted: depth headers and payloads, in the sender's order
        assert len(group.wire[(0, 1)]) == 2 * (6 - depth)
    got = []
    for batch in receiver:
        receiver.poll()  # the loopback completes at once: payloads get posted `depth` ahead
        expect, meta = make_batch(batch.batch_id)
        assert batch.meta == meta
        assert list(batch.tensors) == list(expect)
        assert all(torch.equal(batch.tensors[k], v) and batch.tensors[k].dtype == v.dtype for k, v in expect.items())
        got.append(batch.batch_id)
        pool.release(batch.tensors)
    assert got == list(range(6))
    assert group.wire[(0, 1)] == []  # every message received
    assert not pool._leased  # every buffer released


def test_planned_receive_refuses_a_batch_of_other_shapes() -> None:
    group = OrderMatchedLoopback(me=0)
    sent = {"input_ids": torch.arange(6).view(2, 3), "context": torch.ones(2, 3, 4)}
    wait_all(send_batch(group, 1, sent, {}, batch_id=7), 1, 10)
    group.me = 1
    # Same bytes, other shapes (the message sizes match, as they could on a real link): the header says so.
    planned = [("input_ids", torch.int64, (3, 2)), ("context", torch.float32, (3, 2, 4))]
    with pytest.raises(BridgeError, match=r"batch 7 from rank 0 is input_ids int64\[2, 3\].*planned input_ids "
                                          r"int64\[3, 2\].*disagree on the batch's shapes"):
        next(Receiver(group, [(7, 0, planned)], tag=0))


def test_buffer_pool_picks_the_smallest_free_buffer_that_fits() -> None:
    pool = BufferPool(max_free=8)
    batches = [pool.tensors([("x", torch.float32, (n,))]) for n in (1000, 4000, 2000, 8000)]
    ptrs = [b["x"].data_ptr() for b in batches]
    for b in batches:
        pool.release(b)
    for n, expect in ((1500, ptrs[2]), (100, ptrs[0]), (3000, ptrs[1]), (5000, ptrs[3])):
        got = pool.tensors([("y", torch.float32, (n,))])["y"]
        assert got.data_ptr() == expect, n
    assert (pool.allocations, pool.reuses) == (4, 4)
    assert pool.tensors([("z", torch.float32, (10,))])["z"].data_ptr() not in ptrs  # all leased: a new one


@pytest.mark.parametrize("n", [1, 63, 64, 65, 1000, 4096, 10**6, 3 * 2**20 + 1])
def test_buffer_pool_size_class_slack_is_at_most_an_eighth(n: int) -> None:
    c = BufferPool.size_class(n)
    assert c >= n and c % BufferPool.ALIGN == 0
    assert c <= max(BufferPool.ALIGN, n + n / 8 + BufferPool.ALIGN)


# ---------------------------------------------------------------- 1 target, 2 drafters

T, D, STEPS = 1, 2, 2


def _exchange_worker(rank: int, port: int, out_dir: str) -> None:
    layout = make_layout(T + D, T)
    ctx = init_role_groups(layout, rank, "127.0.0.1", port, "gloo", timeout_s=60)
    meter = QueueDepthMeter()
    result: dict = {}
    if ctx.is_target:
        sender = AsyncSender(ctx.bridge, depth=2, timeout_s=60, meter=meter)
        for r in plan_for_target(ctx.role_rank, T, D, STEPS):
            tensors, meta = make_batch(r.global_batch)
            if r.global_batch % 2 == 0:  # as the target worker builds them: in a pooled send buffer, no copy
                built = sender.empty([(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()])
                for k, t in tensors.items():
                    built[k].copy_(t)
                tensors = built
            # Drafter 1 listens on channel 3: tags keep channels apart on one pair.
            sender.send(layout.drafter_ranks[r.drafter_idx], tensors, meta, r.global_batch, tag=r.drafter_idx * 3)
        sender.flush()
        result["in_flight_after_flush"] = sender.in_flight()
        result["send_pool"] = [sender.pool.allocations, sender.pool.reuses, len(sender.pool._leased)]
    else:
        plan = list(plan_for_drafter(ctx.role_rank, T, D, STEPS))
        if ctx.role_rank == 0:  # prefetching receiver: headers of later batches posted early
            schedule = [(r.global_batch, layout.target_ranks[r.target_idx]) for r in plan]
            receiver = Receiver(ctx.bridge, schedule, depth=2, timeout_s=60, meter=meter)
            batches = []
            for batch in receiver:
                receiver.poll()  # what a trainer does mid-step
                batches.append(batch)
        else:  # plain blocking receive into pooled buffers, released once copied (as the trainer does)
            pool, batches = BufferPool(), []
            for r in plan:
                got = recv_batch(ctx.bridge, layout.target_ranks[r.target_idx], 60, tag=3, pool=pool)
                batches.append(Batch(got.batch_id, {k: t.clone() for k, t in got.tensors.items()}, got.meta))
                pool.release(got.tensors)
        result["batch_ids"] = [b.batch_id for b in batches]
        result["exact"] = [
            list(b.tensors) == list(make_batch(b.batch_id)[0])
            and all(torch.equal(t, make_batch(b.batch_id)[0][k]) and t.dtype == make_batch(b.batch_id)[0][k].dtype
                    for k, t in b.tensors.items())
            for b in batches]
        result["meta_exact"] = [b.meta == make_batch(b.batch_id)[1] for b in batches]
    result["meter"] = meter.summary()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    shutdown(ctx)


def test_target_sends_exact_batches_to_two_drafters(tmp_path: Path) -> None:
    run_ranks(_exchange_worker, T + D, (free_port_block(), str(tmp_path)), tmp_path, timeout_s=90)
    res = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(T + D)}
    # Drafters first (ranks 0, 1), the target last (rank 2).
    assert res[2]["in_flight_after_flush"] == 0
    # 2 batches built in the pool + 2 staged; every buffer back in the pool once sent
    allocations, reuses, leased = res[2]["send_pool"]
    assert allocations + reuses == 4 and leased == 0
    assert set(res[2]["meter"]) >= {"queue_depth/peer0", "queue_depth/peer1"}
    assert 1 <= res[2]["meter"]["queue_depth/max"] <= 2
    for rank, ids in [(0, [0, 2]), (1, [1, 3])]:
        assert res[rank]["batch_ids"] == ids
        assert res[rank]["exact"] == [True, True]
        assert res[rank]["meta_exact"] == [True, True]
    assert 0 <= res[0]["meter"]["queue_depth/peer2"] <= 2


# ---------------------------------------------------------------- timeouts


def _timeout_worker(rank: int, port: int, out_dir: str) -> None:
    ctx = init_role_groups(make_layout(2, 1), rank, "127.0.0.1", port, "gloo", timeout_s=60)
    if not ctx.is_target:  # the target (rank 1) never sends
        t0 = time.monotonic()
        try:
            recv_batch(ctx.bridge, src=ctx.layout.target_ranks[0], timeout_s=2.0)
            outcome = {"raised": None}
        except BridgeTimeoutError as e:
            outcome = {"raised": type(e).__name__, "message": str(e), "is_timeout": isinstance(e, TimeoutError)}
        outcome["elapsed"] = time.monotonic() - t0
        Path(out_dir, "drafter.json").write_text(json.dumps(outcome))
        ctx.store.set("test/drafter_done", "1")
    else:  # alive and silent until the drafter gave up: a peer that has left closes the pair instead
        ctx.store.get("test/drafter_done")
    shutdown(ctx)


def test_receive_times_out_naming_the_peer(tmp_path: Path) -> None:
    run_ranks(_timeout_worker, 2, (free_port_block(), str(tmp_path)), tmp_path, timeout_s=60)
    out = json.loads((tmp_path / "drafter.json").read_text())
    assert out["raised"] == "BridgeTimeoutError" and out["is_timeout"]
    assert "rank 1" in out["message"] and "2s" in out["message"]
    assert 1.9 <= out["elapsed"] < 4.0


# ---------------------------------------------------------------- DeepSpeed on the drafter group


def _ds_config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": stage},
        # A torch optimizer instead of DeepSpeed's fused CPU Adam: no extra JIT build.
        "zero_allow_untested_optimizer": True,
        "checkpoint": {"tag_validation": "Ignore"},
    }


def _drafter_input(role_rank: int) -> torch.Tensor:
    return torch.randn(1, 8, generator=torch.Generator().manual_seed(10 + role_rank))


def _deepspeed_worker(rank: int, port: int, out_dir: str, stage: int) -> None:
    layout = make_layout(3, 1)
    ctx = init_role_groups(layout, rank, "127.0.0.1", port, "gloo", timeout_s=180)
    if ctx.is_target:
        # The target joins none of DeepSpeed's collectives; it only feeds the bridge.
        for d in layout.drafter_ranks:
            wait_all(send_batch(ctx.bridge, d, {"x": torch.full((3,), float(d))}, {}, batch_id=d), d, 180)
        shutdown(ctx)
        return
    import deepspeed

    from dflash_ds.runtime.engine import disable_cpu_shm_allreduce

    disable_cpu_shm_allreduce()  # as build_engine does: no leaked /dev/shm segment, no op build
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=_ds_config(stage))
    loss = engine(_drafter_input(ctx.role_rank)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    ckpt = Path(out_dir, "ckpt")
    engine.save_checkpoint(str(ckpt), tag="step1")
    load_path, _ = engine.load_checkpoint(str(ckpt), tag="step1")
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
        weight = engine.module.weight.detach().clone().tolist()
    batch = recv_batch(ctx.bridge, src=layout.target_ranks[0], timeout_s=180)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({
        "dp_world": engine.dp_world_size, "weight": weight, "load_path": load_path,
        "bridge_x": batch.tensors["x"].tolist(),
    }))
    shutdown(ctx)


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_trains_and_checkpoints_without_the_target(tmp_path: Path, stage: int) -> None:
    run_ranks(_deepspeed_worker, 3, (free_port_block(), str(tmp_path), stage), tmp_path, timeout_s=240)
    res = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)}  # the drafters
    # One data-parallel AdamW step on the mean of both drafters' gradients, by hand.
    torch.manual_seed(0)
    ref = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    sum(ref(_drafter_input(d)).pow(2).mean() for d in range(2)).div(2).backward()
    opt.step()
    for r in (0, 1):
        assert res[r]["dp_world"] == 2
        assert res[r]["load_path"] is not None
        assert res[r]["bridge_x"] == [float(r)] * 3
        torch.testing.assert_close(torch.tensor(res[r]["weight"]), ref.weight.detach(), rtol=1e-5, atol=1e-6)
    assert (tmp_path / "ckpt" / "step1").is_dir()
