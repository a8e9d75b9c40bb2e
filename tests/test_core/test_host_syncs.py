"""Host-device synchronisations on the hot path, counted on the CPU with a TorchFunctionMode (a GPU proxy).

Each of these makes the host wait for the GPU when the tensor lives there: `.item()`, `.cpu()`, `.tolist()`,
`float()`/`int()`/`bool()` of a tensor, `torch.equal`, the value-shaped outputs (`nonzero`, one-argument
`torch.where`, `masked_select`, `unique`, boolean-mask indexing), a host -> device copy that is not
`non_blocking` (`.to`, `copy_`, `torch.tensor(..., device=...)`), and an explicit barrier (the accelerator's
`synchronize`, DeepSpeed's included). The counter is tests/sync_count.py.

Per drafter micro-step the trainer did 25 of them (objective 13, bookkeeping 12), then 11
(anchor sampling's per-row host loop alone 8), now 4, of which on a GPU 2 are real: anchor sampling's one
read of its output width (components/loss.sample_anchors: the largest per-row quota, which a shape-only
width would double the drafter's work to avoid) and the loss's `.item()` that the drafters' skip/stop
agreement needs. The other 2 move RoPE frequencies to the device they are already on.
"""

from __future__ import annotations

import functools

import torch

from dflash_ds.components.loss import sample_anchors
from dflash_ds.components.objective import TargetStates
from dflash_ds.config import LossConfig
from dflash_ds.distributed.bridge import AsyncSender
from dflash_ds.distributed.wire import build_payload, payload_specs
from dflash_ds.models.drafter import DFlashDrafter, DrafterArch
from dflash_ds.runtime.engine import DrafterTrainModule
from dflash_ds.runtime.step_metrics import MetricWindow
from sync_count import SyncCount

__all__ = ["ARCH", "SyncCount"]  # test_lk_dpace counts with both


ARCH = DrafterArch(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=32, vocab_size=100, rms_norm_eps=1e-6, max_position_embeddings=512,
                   rope_parameters={"rope_type": "default", "rope_theta": 1e4}, block_size=8, num_target_layers=4,
                   mask_token_id=99, target_layer_ids=[1, 2])


def micro_step():
    """The trainer's module on one batch (KL and noise on): forward + backward, and its bookkeeping."""
    torch.manual_seed(0)
    drafter = DFlashDrafter(ARCH)
    drafter.init_weights(0)
    module = DrafterTrainModule(drafter, torch.nn.Embedding(100, 64), torch.nn.Linear(64, 100, bias=False))
    ids = torch.randint(0, 99, (4, 96))
    loss_mask = torch.ones_like(ids)
    loss_mask[:, :10] = 0
    states = TargetStates(ids, loss_mask, torch.tensor([96, 90, 80, 70]), torch.randn(4, 96, 128),
                          torch.randn(4, 96, 64))
    window = MetricWindow(num_buckets=2, num_positions=7, num_drafters=1, drafter=0)
    meta = {"real_tokens": 10, "padded_tokens": 12, "num_seqs": 2, "tgt_batch_per_s": 1.0, "tgt_forward_s": 0.1,
            "bucket": 0}
    with SyncCount() as model_side:
        terms, sums = module(states, LossConfig(num_anchors=8, kl_weight=0.5), 1, 0.05, 2)
        terms.loss.backward()
    with SyncCount() as bookkeeping:
        loss = terms.loss.item()  # what the skip/stop agreement needs
        window.add_step(loss, sums, meta, 1, 1.0, 1e-3, 0.0)
    return model_side.calls, bookkeeping.calls, window


def test_a_micro_step_reads_the_device_at_most_a_stated_number_of_times() -> None:
    model_side, bookkeeping, _ = micro_step()
    assert bookkeeping == {"item": 1}, bookkeeping  # the metrics stay on the device until the window closes
    assert "bool-index" not in model_side and "__float__" not in model_side, model_side
    # sample_anchors: 1 read (its output width); RoPE's .to(x.device): 2. It was 10 with the host loop.
    assert model_side == {"item": 1, "blocking to": 2}, model_side


def test_the_counter_catches_every_kind_of_host_wait() -> None:
    """Each call below blocks the host on a GPU tensor; the counter names each one (the value-dependent shapes,
    the host-data factories onto a device, and the explicit barriers, DeepSpeed's accelerator included)."""
    from deepspeed.accelerator import get_accelerator

    x = torch.arange(6)
    cases = {
        "masked_select": lambda: torch.masked_select(x, x > 2),
        "unique": lambda: x.unique(),
        "where": lambda: torch.where(x > 2),
        "equal": lambda: torch.equal(x, x),
        "blocking tensor": lambda: torch.tensor([1, 2], device=x.device),
        "synchronize": lambda: get_accelerator().synchronize(),
    }
    for name, call in cases.items():
        with SyncCount() as counted:
            call()
        assert counted.calls == {name: 1}, (name, counted.calls)
    with SyncCount() as counted:  # their non-blocking forms are not counted
        torch.where(x > 2, x, 0), torch.tensor([1, 2]), x.masked_fill(x > 2, 0)
    assert not counted.calls, counted.calls
    assert "synchronize" not in vars(get_accelerator())  # the patch is undone on exit


def test_anchor_sampling_reads_the_device_once() -> None:
    """Candidates, quotas (water-filled under the cap), keys and the sort stay on the batch's device."""
    loss_mask = torch.ones(8, 300, dtype=torch.long)
    lengths = torch.tensor([300, 280, 200, 120, 60, 30, 20, 300])
    with SyncCount() as counted:
        anchors, valid = sample_anchors(loss_mask, lengths, 16, 64, torch.Generator().manual_seed(0), max_total=200)
    assert counted.calls == {"item": 1}, counted.calls
    assert int(valid.sum()) == 200 and anchors.shape[1] == int(valid.sum(1).max())


def test_the_window_still_sums_what_it_used_to() -> None:
    """The device-side sums equal a host-side sum of the same statistics (float64 both ways)."""
    _, _, window = micro_step()
    _, _, again = micro_step()
    window._read_device_sums()
    assert window.sums["valid_positions"] > 0 and sum(window.pos_valid) == window.sums["valid_positions"]
    again._read_device_sums()
    assert window.sums == again.sums and window.pos_correct == again.pos_correct


def test_the_target_side_copies_are_asynchronous(tiny_target) -> None:
    """A target rank's capture (the loader's pinned tensors to the device, the payload's host parts into the
    send buffer): no blocking host -> device copy of ours (transformers' own forward is not counted here)."""
    from dflash_ds.data.loader import Batch
    from dflash_ds.models.target import load_target
    from dflash_ds.runtime import sources

    target = load_target(tiny_target)
    ids = torch.randint(0, 200, (2, 16))
    batch = Batch(ids, torch.ones_like(ids), torch.ones_like(ids), torch.tensor([16, 16]), spec=None, cursor=None)
    arch = DrafterArch(**{**vars(ARCH), "hidden_size": 128, "target_layer_ids": [0, 1]})
    spec = type("Spec", (), {"num_seqs": 2, "max_length": 16})()
    sender = AsyncSender(bridge=None, depth=2)  # only its pooled send buffers (nothing is sent)
    place = functools.partial(build_payload, sender, payload_specs(spec, arch, torch.float32, True))
    real_capture = sources.capture_layers
    for placer in (sources.fresh_payload, place):  # a colocated rank's fresh tensors; a target rank's send buffer
        counted = SyncCount()
        try:  # the target's forward itself runs uncounted
            sources.capture_layers = lambda *a, **k: _outside(real_capture, *a, **k)
            with counted:
                sources.capture_batch(target, batch, [0, 1], keep_last=True, device=torch.device("cpu"), place=placer)
        finally:
            sources.capture_layers = real_capture
        assert not [k for k in counted.calls if k.startswith("blocking")], counted.calls


def _outside(fn, *args, **kwargs):
    with torch.overrides._pop_mode_temporarily():
        return fn(*args, **kwargs)
