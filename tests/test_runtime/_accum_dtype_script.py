"""One process, world size 1: 8 bf16 micro-batches accumulated by DeepSpeed in fp32 (the trainer's config) and in
bf16 (DeepSpeed's default), each against the exact mean of the same bf16 micro-gradients.

SGD with lr 1 and no clipping: the fp32 master weights move by exactly the accumulated gradient, so
`before - after` is what DeepSpeed accumulated. Prints one JSON line for the test.
"""

import copy
import json
import os
import sys

import torch
import torch.distributed as dist

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1)

import deepspeed  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param  # noqa: E402

from dflash_ds.config import load_config  # noqa: E402
from dflash_ds.runtime.engine import disable_cpu_shm_allreduce, load_ds_config, resolve_ds_config  # noqa: E402

MICRO, ZERO = 8, int(sys.argv[2])
cfg = load_config(None, {"train": {"zero_stage": ZERO}, "optim": {"grad_clip": 1e9}})
torch.manual_seed(0)
base = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1)).bfloat16()
batches = [torch.randn(64, 256).bfloat16() for _ in range(MICRO)]


def loss_of(model, x):
    return model(x).float().pow(2).mean()


# The exact mean of the bf16 micro-gradients (each scaled by 1/MICRO in bf16, as DeepSpeed scales the loss).
exact = [torch.zeros(p.shape, dtype=torch.float64) for p in base.parameters()]
for x in batches:
    m = copy.deepcopy(base)
    (loss_of(m, x) / MICRO).backward()
    for acc, p in zip(exact, m.parameters()):
        acc += p.grad.double()

disable_cpu_shm_allreduce()
result = {}
for name in ("fp32", "bf16"):
    ds = load_ds_config(resolve_ds_config(cfg), cfg, bf16=True, accumulation=MICRO)
    if name == "bf16":
        ds.pop("data_types")  # DeepSpeed's default: accumulate in the model dtype
    result[f"{name}_config"] = ds.get("data_types", {}).get("grad_accum_dtype", "model dtype")
    model = copy.deepcopy(base)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                      config=ds)
    before = [safe_get_full_fp32_param(p).double().clone() for p in engine.module.parameters()]
    for x in batches:
        engine.backward(loss_of(engine, x))
        engine.step()
    after = [safe_get_full_fp32_param(p).double() for p in engine.module.parameters()]
    err = max(((b - a) - e).abs().max().item() / e.abs().max().item() for b, a, e in zip(before, after, exact))
    result[name] = err
print(json.dumps(result))
