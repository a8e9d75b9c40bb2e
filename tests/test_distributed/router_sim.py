"""Reference router for the tests: which target computes which global batch for which drafter.

Pure logic, no process groups. The trainer routes with `dflash_ds.distributed.layout.Layout.route`;
test_router.py checks that it agrees with this one and simulates both on FIFO channels.

Drafters train in lockstep: micro-step s needs one micro-batch on each of the D
drafters, so global batch g = s * D + d goes to drafter d. (An optimizer step of a global batch
of G = A * D micro-batches is A consecutive micro-steps: `data/stream.BatchStream.micro_steps`.) The target that
computes it is t = g % T, which keeps the T targets within one batch of each
other over any prefix of the stream, whatever the ratio of T to D. This is
the rule of a global layout; a per-node layout routes within each node
instead (`Layout.route`, the same argument per node).

Deadlock freedom with blocking FIFO point-to-point channels: every target
sends its batches in increasing g and every drafter receives its batches in
increasing g, so on each (target, drafter) channel both ends walk the same
increasing sequence. The smallest unfinished g can always finish: its target
has delivered all its earlier batches and its drafter has received all its
earlier ones (and every step before it, so the lockstep all-reduce is not in
the way). test_router.py simulates this.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterator


@dataclass(frozen=True)
class Route:
    """One global batch: who computes it, who trains on it, and at which micro-step."""

    global_batch: int
    step: int
    target_idx: int
    drafter_idx: int


def route(global_batch: int, num_targets: int, num_drafters: int) -> Route:
    """The route of global batch g: drafter g % D at step g // D, computed by target g % T."""
    _check(num_targets, num_drafters)
    step, d = divmod(global_batch, num_drafters)
    return Route(global_batch, step, global_batch % num_targets, d)


def plan_for_target(target_idx: int, num_targets: int, num_drafters: int,
                    num_steps: int | None = None, start_step: int = 0) -> Iterator[Route]:
    """The batches target `target_idx` computes and sends, in the order it must send them (increasing g)."""
    _check(num_targets, num_drafters, target_idx=target_idx)
    first = start_step * num_drafters
    # The first g >= first with g % T == target_idx.
    g = first + (target_idx - first) % num_targets
    end = None if num_steps is None else (start_step + num_steps) * num_drafters
    while end is None or g < end:
        yield route(g, num_targets, num_drafters)
        g += num_targets


def plan_for_drafter(drafter_idx: int, num_targets: int, num_drafters: int,
                     num_steps: int | None = None, start_step: int = 0) -> Iterator[Route]:
    """The batches drafter `drafter_idx` receives, one per micro-step, in step order."""
    _check(num_targets, num_drafters, drafter_idx=drafter_idx)
    steps = itertools.count(start_step) if num_steps is None else range(start_step, start_step + num_steps)
    for s in steps:
        yield route(s * num_drafters + drafter_idx, num_targets, num_drafters)


def _check(num_targets: int, num_drafters: int, target_idx: int | None = None,
           drafter_idx: int | None = None) -> None:
    if num_targets < 1 or num_drafters < 1:
        raise ValueError(f"need at least one target and one drafter, got T={num_targets}, D={num_drafters}")
    if target_idx is not None and not 0 <= target_idx < num_targets:
        raise ValueError(f"target index {target_idx} outside 0..{num_targets - 1}")
    if drafter_idx is not None and not 0 <= drafter_idx < num_drafters:
        raise ValueError(f"drafter index {drafter_idx} outside 0..{num_drafters - 1}")


class QueueDepthMeter:
    """Running statistics of a queue depth, per peer rank.

    What is measured depends on the side that feeds it:

    - sender (target, `bridge.AsyncSender`): after posting a batch to drafter
      d, how many batches to d are posted but not yet delivered. 1 means the
      drafter keeps up; the sender's depth means the target will block next
      (drafter-bound).
    - receiver (drafter, `bridge.Receiver`): when the trainer asks for the
      next batch, how many of the batches it has posted receives for have
      already arrived from their target. 0 means the drafter is about to wait
      (target-bound); bounded by the receiver's depth.
    """

    def __init__(self) -> None:
        self._sum: dict[int, int] = {}
        self._count: dict[int, int] = {}
        self._max: dict[int, int] = {}
        self._last: dict[int, int] = {}

    def update(self, peer: int, depth: int) -> None:
        """Record one observation of the queue towards/from `peer`."""
        self._sum[peer] = self._sum.get(peer, 0) + depth
        self._count[peer] = self._count.get(peer, 0) + 1
        self._max[peer] = max(self._max.get(peer, depth), depth)
        self._last[peer] = depth

    def summary(self, prefix: str = "queue_depth") -> dict[str, float]:
        """Mean/max/last over all peers, and the mean per peer, since the last reset."""
        if not self._count:
            return {}
        total = sum(self._count.values())
        out = {
            f"{prefix}/mean": sum(self._sum.values()) / total,
            f"{prefix}/max": float(max(self._max.values())),
            f"{prefix}/last_min": float(min(self._last.values())),
        }
        for peer in sorted(self._count):
            out[f"{prefix}/peer{peer}"] = self._sum[peer] / self._count[peer]
        return out

    def reset(self) -> None:
        """Start a new logging window."""
        for d in (self._sum, self._count, self._max, self._last):
            d.clear()
