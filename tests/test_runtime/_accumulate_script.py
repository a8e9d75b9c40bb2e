"""One process, world size 1: a dropped (non-finite) micro-batch under gradient accumulation.

Engine A accumulates 2 micro-batches, the first dropped (`step.accumulate(loss=None)`), the second
with loss L; engine B (same init) takes one step on L / 2. Both must end with the same weights:
the dropped micro-batch contributed exactly nothing and DeepSpeed stepped at the right boundary.
Also (colocated): an engine built beside the loaded target shares the target's embedding and head
tensors (no second copy) and trains to the same first-step weights as one built from the safetensors.
Prints one JSON line for the test.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
target, pg_file, config = sys.argv[1:4]
dist.init_process_group("gloo", init_method=f"file://{pg_file}", rank=0, world_size=1)

from dflash_ds.config import load_config  # noqa: E402
from dflash_ds.runtime.engine import build_drafter_engine, check_shared_head  # noqa: E402
from dflash_ds.runtime.job import resolve_arch  # noqa: E402
from dflash_ds.runtime.step import accumulate, forward  # noqa: E402

cfg = load_config(config, {"target": target, "optim": {"warmup_steps": 0}})  # lr 0 at step 0 otherwise
arch = resolve_arch(cfg)
cpu, f32 = torch.device("cpu"), torch.float32
gen = torch.Generator().manual_seed(0)


def loss(engine, tensors, batch_id):
    """The trainer's micro-batch loss (noise off)."""
    return forward(engine, tensors, cfg.loss, cfg.train.seed, batch_id, 0.0, f32)[0].loss


def batch():
    ids = torch.randint(0, arch.vocab_size, (2, 64), generator=gen)
    return {"input_ids": ids, "loss_mask": torch.ones_like(ids), "lengths": torch.tensor([64, 50]),
            "context": torch.randn(2, 64, len(arch.target_layer_ids) * arch.hidden_size, generator=gen)}


b0, b1, b2, b3 = batch(), batch(), batch(), batch()
a = build_drafter_engine(cfg, arch, f32, cpu, 2)
init = [p.detach().clone() for p in a.module.drafter.parameters()]
accumulate(a, None, 2, b0, cfg, f32, 0)  # dropped
accumulate(a, loss(a, b1, 1), 2, b1, cfg, f32, 1)
steps_after_first = a.global_steps
after_a = [p.detach().clone() for p in a.module.drafter.parameters()]
b = build_drafter_engine(cfg, arch, f32, cpu, 1)
same_init = max((p - q).abs().max().item() for p, q in zip(b.module.drafter.parameters(), init))
accumulate(b, loss(b, b1, 1) * 0.5, 1, b1, cfg, f32, 1)
diff = max((p - q).abs().max().item() for p, q in zip(b.module.drafter.parameters(), after_a))
b_after = [p.detach().clone() for p in b.module.drafter.parameters()]
moved = max((p - q).abs().max().item() for p, q in zip(after_a, init))
for x, g in ((b2, 2), (b3, 3)):  # the next step's boundary is where it should be
    accumulate(a, loss(a, x, g), 2, x, cfg, f32, g)
from dflash_ds.models.target import load_target, target_parts  # noqa: E402

tgt = load_target(target)
c = build_drafter_engine(cfg, arch, f32, cpu, 1, target=tgt)
parts = target_parts(tgt)
shared = (c.module.embed_weight.data_ptr() == parts.embed.weight.data_ptr()
          and (c.module.tied_head or c.module.head_weight.data_ptr() == parts.head.weight.data_ptr()))
assert check_shared_head(c, tgt) is None  # what the trainer checks after building a colocated engine
assert "holds its own copy" in check_shared_head(b, tgt)  # an engine whose head was read from the files
accumulate(c, loss(c, b1, 1) * 0.5, 1, b1, cfg, f32, 1)
colocated_diff = max((p - q).abs().max().item() for p, q in zip(c.module.drafter.parameters(), b_after))
print(json.dumps({"diff": diff, "moved": moved, "same_init": same_init, "steps_after_first": steps_after_first,
                  "steps_after_second": a.global_steps, "colocated_shares_head": shared,
                  "colocated_diff": colocated_diff}), flush=True)
dist.destroy_process_group()
