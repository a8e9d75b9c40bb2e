"""One process, world size 1 (gloo, DeepSpeed on CPU): the three callers of the drafter step agree.

On one batch captured from the tiny target with `sources.capture_batch`:
- the trainer's optimizer step (`step.optimizer_step`, fed by a one-batch source) and the bench's
  (`bench/stages.train_step` on `bench/stages.make_engine`'s engine) give the same loss and weights;
- `dflash-ds train-step`'s first step (`tools/train_step.drafter_step`: plain module, plain AdamW)
  has the loss of the trainer's forward (`step.forward`) on the same weights and batch.
Prints one JSON line for the test.
"""

import json
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
target_dir, pg_file, config = sys.argv[1:4]
dist.init_process_group("gloo", init_method=f"file://{pg_file}", rank=0, world_size=1)

from dflash_ds.bench import stages  # noqa: E402
from dflash_ds.config import load_config  # noqa: E402
from dflash_ds.data.loader import Batch  # noqa: E402
from dflash_ds.models.drafter import DFlashDrafter  # noqa: E402
from dflash_ds.models.target import load_target  # noqa: E402
from dflash_ds.runtime.engine import DrafterTrainModule, build_drafter_engine  # noqa: E402
from dflash_ds.runtime.job import resolve_arch  # noqa: E402
from dflash_ds.runtime.sources import SourcedBatch, capture_batch  # noqa: E402
from dflash_ds.runtime.step import forward, noise_at, optimizer_step  # noqa: E402
from dflash_ds.tools.train_step import drafter_step  # noqa: E402

# KL on (the final hidden is captured and used) and noise on at STEP (its generator is seeded too).
cfg = load_config(config, {"target": target_dir, "loss": {"kl_weight": 0.5},
                           "noise": {"max_std": 0.05, "warmup_steps": 2}})
arch, f32, cpu = resolve_arch(cfg), torch.float32, torch.device("cpu")
STEP = BATCH_ID = 3  # one drafter, one micro-batch per step: step s trains global batch s

gen = torch.Generator().manual_seed(0)
ids = torch.randint(0, arch.vocab_size, (2, 48), generator=gen)
lengths = torch.tensor([48, 40])
attention = (torch.arange(48)[None, :] < lengths[:, None]).long()
loss_mask = attention.clone()
loss_mask[:, :8] = 0  # the prompt
target = load_target(target_dir)
tensors = capture_batch(target, Batch(ids, loss_mask, attention, lengths, spec=None, cursor=None),
                        arch.target_layer_ids, keep_last=True, device=cpu)


class OneBatch:
    """A batch source holding one batch (the BatchSource interface)."""

    def get(self):
        return SourcedBatch(BATCH_ID, tensors, {"epoch_after": 0, "index_after": 1}, 0)

    def release(self, _tensors):
        pass

    def close(self):
        pass


trainer = build_drafter_engine(cfg, arch, f32, cpu)
with torch.no_grad():  # train-step's first step is step 0, noise off: the trainer's forward of batch 0
    forward0 = forward(trainer, tensors, cfg.loss, cfg.train.seed, 0, 0.0, f32)[0].loss.item()
one_drafter = SimpleNamespace(accumulation=1, num_drafters=1)
result = optimizer_step(trainer, OneBatch(), one_drafter, cfg, f32, STEP, 0, lambda: False)

bench = stages.make_engine(cfg, arch, f32, cpu)
bench_loss = stages.train_step(bench, cfg, tensors, BATCH_ID, STEP, f32)
weights_diff = max((p - q).abs().max().item()
                   for p, q in zip(trainer.module.drafter.parameters(), bench.module.drafter.parameters()))

drafter = DFlashDrafter(arch)
drafter.init_weights(cfg.train.seed)  # the engines' initial weights
module = DrafterTrainModule(drafter, target.get_input_embeddings(), target.get_output_embeddings())
opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
tool_loss = drafter_step(module, opt, tensors, cfg.loss, cfg.train.seed, 0, f32)[0].loss.item()

print(json.dumps({"trainer_loss": result.micro[0].loss, "bench_loss": bench_loss, "weights_diff": weights_diff,
                  "noise": noise_at(cfg, STEP), "skipped": result.micro[0].skipped, "grad_norm": result.grad_norm,
                  "has_last_hidden": "last_hidden" in tensors, "forward0": forward0, "tool_loss": tool_loss}),
      flush=True)
dist.destroy_process_group()
