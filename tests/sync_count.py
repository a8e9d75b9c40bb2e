"""Counting host <-> device synchronisations on the CPU (a GPU proxy), for tests.

`SyncCount` is a TorchFunctionMode: it names each call that makes the host wait for the GPU when its tensor
lives there (the CPU cannot tell devices apart, so every such call counts). `count_synchronize` patches the
explicit device barriers (torch.cuda / torch.accelerator / DeepSpeed's accelerator `synchronize`, CUDA stream
and event waits), which are not torch functions and so invisible to any mode; `SyncCount` counts them too.
"""

from __future__ import annotations

import collections
import contextlib
import sys
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

# Calls whose result is host data read from the tensor (or whose output shape depends on its values, so the
# host must wait for the device to size the output): each a blocking device -> host read on a GPU.
READS = {"item", "cpu", "tolist", "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "equal",
         "allclose", "is_nonzero", "__bool__", "__float__", "__int__", "__index__", "numpy"}
# Factories that copy host data onto the named device: blocking unless the source is pinned and the copy async.
FACTORIES = {"tensor", "as_tensor"}


def _barriers() -> list[tuple[object, str]]:
    """(owner, attribute) of every explicit device barrier reachable in this process."""
    owners: list[tuple[object, str]] = [(torch.cuda, "synchronize"), (torch.cuda.Stream, "synchronize"),
                                        (torch.cuda.Event, "synchronize")]
    if hasattr(torch, "accelerator"):
        owners.append((torch.accelerator, "synchronize"))
    if "deepspeed.accelerator" in sys.modules:  # DeepSpeed calls get_accelerator().synchronize() on its singleton
        owners.append((sys.modules["deepspeed.accelerator"].get_accelerator(), "synchronize"))
    return owners


@contextlib.contextmanager
def count_synchronize(calls: collections.Counter) -> Iterator[collections.Counter]:
    """Within the block, count each explicit device barrier under calls["synchronize"] (the real one still runs)."""
    saved = []
    for owner, attr in _barriers():
        real = getattr(owner, attr)
        own = vars(owner).get(attr)  # None for an instance whose class defines it

        def counted(*args, _real=real, **kwargs):
            calls["synchronize"] += 1
            return _real(*args, **kwargs)

        saved.append((owner, attr, own))
        setattr(owner, attr, counted)
    try:
        yield calls
    finally:
        for owner, attr, own in reversed(saved):
            if own is None:
                delattr(owner, attr)  # the class's method shows through again
            else:
                setattr(owner, attr, own)


class SyncCount(TorchFunctionMode):
    """Counts calls that synchronise with the device when their tensor is on a GPU, and explicit barriers."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter = collections.Counter()
        self._barriers = contextlib.ExitStack()

    def __enter__(self):
        self._barriers.enter_context(count_synchronize(self.calls))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._barriers.close()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in READS:
            self.calls[name] += 1
        elif name == "where" and len(args) + len(kwargs) == 1:  # torch.where(cond) is nonzero in disguise
            self.calls["where"] += 1
        elif name == "__getitem__" and len(args) > 1 and isinstance(args[1], torch.Tensor) \
                and args[1].dtype == torch.bool:
            self.calls["bool-index"] += 1
        elif name in FACTORIES and kwargs.get("device") is not None:
            self.calls[f"blocking {name}"] += 1
        elif name in ("to", "copy_") and not kwargs.get("non_blocking", False) and self._moves_host_data(args, kwargs):
            self.calls[f"blocking {name}"] += 1
        return func(*args, **kwargs)

    @staticmethod
    def _moves_host_data(args, kwargs) -> bool:
        # A `to` with an explicit device, or a `copy_` from another tensor: on a GPU run a host <-> device copy
        # (the CPU cannot tell the devices apart, so every such call without non_blocking counts).
        if not args or not isinstance(args[0], torch.Tensor):
            return False
        if len(args) > 1 and isinstance(args[1], torch.Tensor):  # copy_(src) / to(other_tensor)
            return True
        return any(isinstance(t, (str, torch.device)) for t in (*args[1:], kwargs.get("device")))
