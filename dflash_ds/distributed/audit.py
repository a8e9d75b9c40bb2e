"""Device-placement audit of every tensor this code hands to torch.distributed (tests only).

Why: NCCL carries CUDA tensors only. A CPU tensor reduced on an NCCL-only group raises at the
first step on a GPU cluster, yet passes on a CPU machine, where every group is gloo. With
`DFLASH_DIST_AUDIT=DIR` set, each rank wraps torch.distributed's collectives and point-to-point
calls and the bridge group, and checks every tensor that dflash_ds code passes against the
device types the group would have a backend for in a GPU job (`backends.ROLE_BACKENDS` /
`BRIDGE_BACKENDS` for "nccl"). DeepSpeed's and torch's own calls are counted but trusted: they
place their tensors on the accelerator themselves. Each rank writes DIR/rank{R}.json at exit:
calls per group kind and every violation with its call site.

On a CPU machine a host tensor and a tensor on the rank's device are both CPU tensors, so for
the bridge (whose tensors are all allocated on the rank's device) the audit can only check
that a tensor is on the bridge's device; the role groups, whose GPU backend must carry host
tensors, are checked exactly.

The launching code installs it once the groups exist (`runtime/launch.run_job`:
`if audit.enabled(): ctx.bridge = audit.install(ctx.bridge, ctx.device)`).
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dflash_ds.distributed.backends import BRIDGE_BACKENDS, ROLE_BACKENDS, backend_devices

ENV = "DFLASH_DIST_AUDIT"
# The backend to emulate: "nccl" checks placement as a GPU job would need it.
ENV_AS = "DFLASH_DIST_AUDIT_AS"
COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "scatter", "gather", "send", "recv",
               "isend", "irecv")
_state: dict[str, Any] = {"calls": {}, "violations": [], "installed": False}


def enabled() -> bool:
    """Whether this process audits its distributed calls."""
    return bool(os.environ.get(ENV))


def _emulated() -> str:
    return os.environ.get(ENV_AS, "nccl")


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _tensors(item)]
    return []


def _caller() -> tuple[str, str]:
    """(module of the frame that called torch.distributed, file:line)."""
    frame = sys._getframe(3)
    return frame.f_globals.get("__name__", ""), f"{frame.f_code.co_filename}:{frame.f_lineno}"


def _check(kind: str, op: str, tensors: list[torch.Tensor], allowed: set[str], device: torch.device) -> None:
    module, where = _caller()
    ours = module.startswith("dflash_ds")
    key = f"{kind}/{'dflash_ds' if ours else 'trusted'}"
    _state["calls"][key] = _state["calls"].get(key, 0) + 1
    if not ours:
        return
    for t in tensors:
        # On GPU a tensor on the rank's device is on the accelerator; anything else is host memory.
        on_accel = t.device == device if kind == "bridge" else (t.device.type == "cuda")
        dev_type = "cuda" if on_accel else "cpu"
        if dev_type not in allowed or (kind == "bridge" and t.device != device):
            _state["violations"].append({"op": op, "group": kind, "tensor_device": str(t.device),
                                         "would_be": dev_type, "group_devices": sorted(allowed), "at": where,
                                         "shape": list(t.shape)})


def _wrap(name: str, allowed: set[str], device: torch.device):
    real = getattr(dist, name)

    @functools.wraps(real)
    def audited(*args, **kwargs):
        tensors = _tensors(args[:2]) + _tensors(kwargs.get("tensor")) + _tensors(kwargs.get("tensor_list"))
        _check("role", name, tensors, allowed, device)
        return real(*args, **kwargs)

    return audited


class _AuditedBridge:
    """The bridge group with send/recv checked; everything else passes through."""

    def __init__(self, bridge, device: torch.device, allowed: set[str]) -> None:
        self._bridge, self._device, self._allowed = bridge, device, allowed

    def send(self, tensors, dst, tag):
        _check("bridge", "send", _tensors(tensors), self._allowed, self._device)
        return self._bridge.send(tensors, dst, tag)

    def recv(self, tensors, src, tag):
        _check("bridge", "recv", _tensors(tensors), self._allowed, self._device)
        return self._bridge.recv(tensors, src, tag)

    def __getattr__(self, name):
        return getattr(self._bridge, name)


def install(bridge, device: torch.device):
    """Wrap torch.distributed's tensor calls (once per process) and return the audited bridge."""
    emulated = _emulated()
    role_allowed = backend_devices(ROLE_BACKENDS[emulated])
    if not _state["installed"]:
        for name in COLLECTIVES:
            if hasattr(dist, name):
                setattr(dist, name, _wrap(name, role_allowed, device))
        out = Path(os.environ[ENV])
        out.mkdir(parents=True, exist_ok=True)
        rank = os.environ.get("DFLASH_GLOBAL_RANK", os.environ.get("RANK", "0"))
        atexit.register(_write, out / f"rank{rank}.json", emulated)
        _state["installed"] = True
    if bridge is None:  # colocated: no bridge, the role group's calls are still audited
        return None
    return _AuditedBridge(bridge, device, backend_devices(BRIDGE_BACKENDS[emulated]))


def _write(path: Path, emulated: str) -> None:
    path.write_text(json.dumps({"emulated_backend": emulated, "calls": _state["calls"],
                                "violations": _state["violations"]}, indent=1) + "\n")
