"""Which torch.distributed backend each group of a job runs on, and the bridge group built on one.

A leaf: `topology` builds the groups from these tables and `audit` checks tensors against them,
so neither needs the other.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

# Backend of each role's default group, by the job's backend. NCCL carries CUDA tensors only
# (an all_reduce of a CPU tensor raises "No backend type associated with device type cpu"), and
# the trainer reduces small host tensors every step (stop/skip flags, metric sums), as does
# DeepSpeed's bookkeeping: on GPU the role groups carry both, host tensors over gloo.
ROLE_BACKENDS = {"gloo": "gloo", "nccl": "cpu:gloo,cuda:nccl"}
# The bridge moves only hidden states, always on the rank's device: NCCL alone on GPU.
BRIDGE_BACKENDS = {"gloo": "gloo", "nccl": "nccl"}


def role_backend(cuda: bool) -> str:
    """Backend string of a default group that carries CPU tensors, and CUDA tensors over NCCL when `cuda`."""
    return ROLE_BACKENDS["nccl" if cuda else "gloo"]


def backend_devices(spec: str) -> set[str]:
    """Device types a backend string has a backend for: "nccl" -> {cuda}; "gloo" -> {cpu, cuda}; "cpu:gloo,cuda:nccl" -> both."""
    if ":" not in spec:
        return {"cuda"} if spec == "nccl" else {"cpu", "cuda"}
    return {part.split(":", 1)[0].strip() for part in spec.split(",") if part.strip()}


def make_bridge(backend: str, store: dist.Store, rank: int, world: int,
                timeout: datetime.timedelta) -> dist.ProcessGroupGloo | dist.ProcessGroupNCCL:
    """A point-to-point group over all ranks on `backend`, never registered with torch.distributed.

    `timeout` is the bridge's own deadline (train.bridge_timeout_s); the group's is later by a margin
    (`bridge.group_timeout`), so the bridge's clear error fires before NCCL's watchdog aborts the rank."""
    from dflash_ds.distributed.bridge import group_timeout

    timeout = group_timeout(timeout.total_seconds())
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world, timeout)
    # Same options torch's own new_group() sets for NCCL (never run on a GPU yet: no GPU in CI).
    opts = dist.ProcessGroupNCCL.Options()
    opts.is_high_priority_stream = False
    opts._timeout = timeout
    opts.global_ranks_in_group = list(range(world))
    opts.group_name = "dflash_bridge"
    return dist.ProcessGroupNCCL(store, rank, world, opts)
