"""One process, world size 1: real DeepSpeed engines built as the trainer builds them in bf16 (load_ds_config +
build_engine over the drafter module), ZeRO 1, 2 and 3, each 6 micro-steps (forward, backward, step) of
2 accumulated per update, as a drafter accumulates G / D micro-batches;
counts explicit device barriers (the accelerator's `synchronize`) in those steps. Once more at ZeRO-1 with
DeepSpeed's default throughput timer, to show the count sees it. Prints one JSON line for the test.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the counter

import collections  # noqa: E402

from sync_count import count_synchronize  # noqa: E402

from dflash_ds.components.objective import TargetStates  # noqa: E402
from dflash_ds.config import LossConfig, load_config  # noqa: E402
from dflash_ds.models.drafter import DFlashDrafter, DrafterArch  # noqa: E402
from dflash_ds.runtime.engine import DrafterTrainModule, build_engine, load_ds_config, resolve_ds_config  # noqa

ARCH = DrafterArch(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=32, vocab_size=100, rms_norm_eps=1e-6, max_position_embeddings=512,
                   rope_parameters={"rope_type": "default", "rope_theta": 1e4}, block_size=8, num_target_layers=4,
                   mask_token_id=99, target_layer_ids=[1, 2])
STEPS, ACCUMULATION = 6, 2  # DeepSpeed's timer synchronizes from its global step 2 on: micro-steps 4 and 5


def barriers(stage: int, default_timer: bool = False) -> int:
    """Explicit device barriers in STEPS trainer-shaped micro-steps of a ZeRO-`stage` engine."""
    cfg = load_config(None, {"train": {"zero_stage": stage, "max_steps": STEPS}})
    ds = load_ds_config(resolve_ds_config(cfg), cfg, bf16=True, accumulation=ACCUMULATION)  # a GPU run's dtype
    if default_timer:
        ds.pop("timers", None)
    torch.manual_seed(0)
    drafter = DFlashDrafter(ARCH)
    drafter.init_weights(0)
    module = DrafterTrainModule(drafter, torch.nn.Embedding(100, 64), torch.nn.Linear(64, 100, bias=False))
    module = module.to(torch.bfloat16)
    engine = build_engine(module, cfg, ds)
    ids = torch.randint(0, 99, (2, 64))
    states = TargetStates(ids, torch.ones_like(ids), torch.tensor([64, 50]),
                          torch.randn(2, 64, 128, dtype=torch.bfloat16), torch.randn(2, 64, 64, dtype=torch.bfloat16))
    calls = collections.Counter()
    with count_synchronize(calls):
        for step in range(STEPS):
            terms, _ = engine(states, LossConfig(num_anchors=8), step, 0.0, step)
            engine.backward(terms.loss)
            engine.step()
    return calls["synchronize"]


result = {f"zero{s}": barriers(s) for s in (1, 2, 3)}
result["zero1_default_timer"] = barriers(1, default_timer=True)
print(json.dumps(result))
