"""One training job on one rank: validate, join the role groups, run the role, shut down."""

from __future__ import annotations

import os
import sys

from dflash_ds.config import Config
from dflash_ds.distributed.topology import Layout, init_role_groups, make_layout, read_launch_env, shutdown
from dflash_ds.errors import DFlashError


def job_layout(cfg: Config, world_size: int, local_world_size: int | None) -> Layout:
    """Drafters take the first ranks (global rank 0 leads: monitoring, W&B, checkpoints), targets the last.

    With topology.targets_per_node = k, the last k local ranks of every node are targets.
    """
    per_node = cfg.topology.targets_per_node or None
    base = make_layout(world_size, None if per_node else cfg.topology.num_target_ranks,
                       nproc_per_node=local_world_size, targets_per_node=per_node)
    targets = sorted(world_size - 1 - r for r in base.target_ranks)
    return Layout(world_size, targets, [r for r in range(world_size) if r not in set(targets)])


def validate_job(cfg: Config, world_size: int, local_world_size: int | None) -> Layout:
    """Every cheap check, before any process group or model: layout, target, data, DeepSpeed JSON."""
    from dflash_ds.models.target import read_target_config
    from dflash_ds.runtime.engine import resolve_ds_config

    layout = job_layout(cfg, world_size, local_world_size)
    if not cfg.target:
        raise DFlashError("no target: pass --target DIR (a local HF model folder)")
    read_target_config(cfg.target)
    if not cfg.data.path:
        raise DFlashError("no data: pass --data DIR (a dataset written by `dflash-ds prepare`)")
    if not os.path.isdir(cfg.data.path):
        raise DFlashError(f"data folder {cfg.data.path} does not exist (run `dflash-ds prepare` first)")
    resolve_ds_config(cfg)
    return layout


def run_job(cfg: Config) -> int:
    """This rank's whole life in the job."""
    env = read_launch_env()
    layout = validate_job(cfg, env.world_size, env.local_world_size)
    from dflash_ds.runtime.plan import open_data, resolve_arch

    arch = resolve_arch(cfg)  # before any group: a bad drafter/target pair fails fast on every rank
    import torch

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "gloo":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    ctx = init_role_groups(layout, env.rank, env.master_addr, env.master_port, backend=backend,
                           timeout_s=cfg.train.timeout_s, local_rank=env.local_rank)
    try:
        data = open_data(cfg, layout.num_drafters, arch.vocab_size)
        if ctx.is_target:
            from dflash_ds.runtime.target_worker import run_target

            run_target(ctx, cfg, data)
        else:
            from dflash_ds.runtime.drafter_worker import run_drafter

            run_drafter(ctx, cfg, data)
    finally:
        sys.stdout.flush()
    shutdown(ctx)
    return 0
