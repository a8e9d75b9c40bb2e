"""Compiled elementwise work on the drafter's hot path: the loss's per-chunk passes, the layers' ops, a kind's own.

Why (docs/BENCHMARKS.md, the H200 profile of a Qwen3-8B-preset micro-step, 0.888 s): about a fifth of the
device time was elementwise kernels, each its own full-size pass in eager torch. The loss alone makes seven or
more passes over every chunk's [c, K, V] logits (cast to fp32, top-8, logsumexp, subtract and exp, scale,
scatter, cast back): at chunk 64, K 15 and V 151,936 one fp32 pass moves 0.58 GB each way, and a micro-step of
2,048 blocks has 32 chunks, so ~7 GB a chunk and ~0.2 TB a micro-step at ~4 TB/s is ~55 ms of memory traffic
where the fused passes need two reads of the bf16 logits and one write of their gradient (~0.9 GB a chunk).
DFlash2's grouped convolutions were ten full-size passes a layer, forward and backward (1.35x DFlash's step).

The layers' RMSNorm, RoPE and SwiGLU are a few kernels each (models/layer_ops.py has the arithmetic).

`fused(fn)` wraps such a function: `FUSION.mode` "auto" runs it compiled (torch.compile, inductor: one
kernel per fusable group) on CUDA tensors and eagerly elsewhere, "on" compiles on CPU too (tests; CPU figures),
"off" runs eagerly everywhere. The trainer sets the mode from `train.fuse` (null, true, false).

Bounded compiles. A fused function is compiled with static shapes or with one symbolic size:
- static (`fused(dynamic=False)`): its callers pad every call to one shape. The loss core gets every chunk at the
  full `loss.chunk_blocks` (a last, shorter chunk padded with invalid positions: at most one chunk of extra
  elementwise work a micro-step, none of the head's GEMM). Static kernels compile fastest: the loss core with
  KL took ~150 s to compile with a symbolic chunk on CPU, ~7 s static.
- dynamic (the default): the first dimension of every tensor argument is marked dynamic from the first call
  and the function takes its tensors row-flattened (the layer ops of models/layer_ops.py, the convolution:
  batch x positions rows), so one graph serves every batch. Dynamo specialises a size of 1 (one graph more if
  a call has a single row).
So 1 graph per (function, static sizes, static arguments, grad mode); a static size that changes (an RMSNorm
over H, then over head_dim) compiles a static graph of its own (automatic dynamic shapes are off for fused
functions). A run of the Qwen3-8B preset compiles the loss core once (twice with evaluation), the RMSNorm 3
times (head_dim; H; H over layer 0's input, which needs no gradient), RoPE twice (query and key/value heads), SwiGLU once, DFlash2's convolution once forward and once backward
(models/grouped_conv.py); evaluation
without gradients doubles each. Duck shaping is off while compiling (as for flex_attention,
models/block_mask.py): two sizes equal at the first compile would share a symbol. Past
`FUSION.recompile_limit` graphs of one function dynamo would run it eagerly, silently: that is an error instead.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch._dynamo.config as dynamo_config
import torch.fx.experimental._config as fx_config
from torch._dynamo.exc import FailOnRecompileLimitHit

from dflash_ds.errors import DFlashError

FUSE_MODES = ("auto", "on", "off")


@dataclass
class Fusion:
    """How `fused` functions run (the module-level `FUSION`)."""

    mode: str = "auto"  # auto: compiled on CUDA tensors; on: compiled everywhere; off: eager everywhere
    backend: Any = "inductor"  # a torch.compile backend: name or callable (tests count graphs with one)
    # graphs of one function before a further one is an error: the RMSNorm's bound is 12 (3 static shapes x grad
    # modes x a decode step's single context row, which dynamo specialises; module docstring)
    recompile_limit: int = 16


FUSION = Fusion()


def _mode(value: str | bool | None) -> str:
    """A mode from itself or train.fuse's value (null: auto, true: on, false: off); bench memory's "both" is on."""
    return {None: "auto", True: "on", False: "off", "both": "on"}.get(value, value)


def set_fuse_mode(mode: str | bool | None) -> None:
    """Set `FUSION.mode`: a mode, or train.fuse's value."""
    if _mode(mode) not in FUSE_MODES or mode == "both":
        raise ValueError(f"fuse mode {mode!r}: must be one of {FUSE_MODES}")
    FUSION.mode = _mode(mode)


def fuse_on(mode: str | bool | None, cuda: bool) -> bool:
    """Whether a mode (or train.fuse's value) compiles on this device: what the memory model assumes of the step
    (memory/model.StepShape.fused)."""
    mode = _mode(mode)
    return mode == "on" or (mode == "auto" and cuda)


def compiles_for(t: torch.Tensor) -> bool:
    """Whether a fused function given this tensor runs compiled under the current `FUSION.mode`."""
    return fuse_on(FUSION.mode, t.is_cuda)


def fused(fn: Callable | None = None, *, dynamic: bool = True) -> Callable:
    """`fn`, run compiled where `FUSION` says (decided by its first tensor argument's device), else eagerly; as
    `@fused` or `@fused(dynamic=False)` (module docstring: static or one symbolic size).

    `fn` must trace as one graph (fullgraph): branch only on Python values (static arguments), never on a
    tensor's contents; with `dynamic` the first dimension of each tensor argument is its one varying size.
    Inside it, `torch.compiler.is_compiling()` tells the compiled run from the eager one.
    """
    if fn is None:
        return functools.partial(fused, dynamic=dynamic)
    compiled: list = []  # [(backend, compiled fn)]: built on first use, rebuilt if the backend changes

    @functools.wraps(fn)
    def run(*args, **kwargs):
        first = next(a for a in args if isinstance(a, torch.Tensor))
        if not compiles_for(first):
            return fn(*args, **kwargs)
        if not compiled or compiled[0][0] is not FUSION.backend:
            compiled[:] = [(FUSION.backend, torch.compile(fn, backend=FUSION.backend, fullgraph=True,
                                                          dynamic=None if dynamic else False))]
        if dynamic:
            for a in args:
                if isinstance(a, torch.Tensor) and a.dim():
                    torch._dynamo.maybe_mark_dynamic(a, 0)
        # automatic dynamic shapes off: a size that is not the marked one (a norm's width: H, then head_dim) gets
        # a static graph of its own, never a symbolic one that serves both more slowly
        limits = dynamo_config.patch(recompile_limit=FUSION.recompile_limit, fail_on_recompile_limit_hit=True,
                                     automatic_dynamic_shapes=False)
        try:
            with limits, fx_config.patch(use_duck_shape=False):
                return compiled[0][1](*args, **kwargs)
        except FailOnRecompileLimitHit as exc:
            raise DFlashError(
                f"{fn.__qualname__} reached FUSION.recompile_limit = {FUSION.recompile_limit} compiled graphs (its "
                f"bound: components/fusion.py): rerun with "
                f"TORCH_LOGS=recompiles to see which guard failed, or --train.fuse false to run it eagerly") from exc

    run.eager = fn
    return run
