"""Run by test_topology under torchrun or the deepspeed launcher: role groups from the launcher's env,
one all_reduce per role, one batch from the target (the last rank) to every drafter; writes rank<N>.json."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from dflash_ds.distributed.bridge import recv_batch, send_batch, wait_all
from dflash_ds.distributed.launch_env import read_launch_env
from dflash_ds.distributed.layout import make_layout
from dflash_ds.distributed.topology import init_role_groups, shutdown


def main(out_dir: str) -> None:
    """Role groups from the launcher env, then one bridge batch per drafter."""
    launch = read_launch_env()
    agent_store_before = os.environ.get("TORCHELASTIC_USE_AGENT_STORE")
    layout = make_layout(launch.world_size, 1)
    ctx = init_role_groups(layout, launch.rank, launch.master_addr, launch.master_port, "gloo",
                           timeout_s=60, local_rank=launch.local_rank)
    total = torch.tensor([float(launch.rank)])
    dist.all_reduce(total)
    result = {
        "role": ctx.role, "role_rank": ctx.role_rank, "dist_world": dist.get_world_size(),
        "dist_rank": dist.get_rank(), "role_sum_of_global_ranks": total.item(),
        "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")},
        "agent_store_before": agent_store_before,
        "agent_store_after": os.environ.get("TORCHELASTIC_USE_AGENT_STORE"),
    }
    if ctx.is_target:
        for d in layout.drafter_ranks:  # x differs per drafter, rank 0's included
            works = send_batch(ctx.bridge, d, {"x": torch.arange(6).view(2, 3) * (d + 1)},
                               {"sent_by": float(launch.rank)}, batch_id=d)
            wait_all(works, d, 60)
    else:
        batch = recv_batch(ctx.bridge, src=layout.target_ranks[0], timeout_s=60)
        result["batch_id"] = batch.batch_id
        result["x"] = batch.tensors["x"].tolist()
        result["meta"] = batch.meta
    Path(out_dir, f"rank{launch.rank}.json").write_text(json.dumps(result))
    shutdown(ctx)


if __name__ == "__main__":
    main(sys.argv[-1])  # the deepspeed launcher puts --local_rank=N first
