"""What the launcher (torchrun, the deepspeed launcher) told this process, read from its environment."""

from __future__ import annotations

import os
from dataclasses import dataclass

from dflash_ds.errors import DFlashError


@dataclass
class LaunchEnv:
    """What the launcher (torchrun, the deepspeed launcher) told this process."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None
    master_addr: str
    master_port: int


def read_launch_env() -> LaunchEnv:
    """Read RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT as set by torchrun or the deepspeed launcher."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise DFlashError(
            f"{', '.join(missing)} not set: start the job with torchrun or the deepspeed launcher"
        )
    # torchrun sets LOCAL_WORLD_SIZE, the deepspeed launcher LOCAL_SIZE.
    lws = os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE"))
    return LaunchEnv(
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        local_world_size=int(lws) if lws else None,
        master_addr=os.environ["MASTER_ADDR"],
        master_port=int(os.environ["MASTER_PORT"]),
    )
