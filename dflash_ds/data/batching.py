"""Length-bucketed, token-budget batching with stride interleaving of buckets.

Recipe for one epoch (a pure function of lengths, budget, boundaries, seed, epoch):

1. Bucket every sequence by length: bucket b holds lengths in
   (boundaries[b-1], boundaries[b]].
2. Inside each bucket, shuffle (seeded by seed, epoch, bucket), then sort by
   length inside windows of `sort_window` sequences (None: the whole bucket;
   1: no sorting). Bucket boundaries alone leave ~25% padding on ShareGPT-like
   lengths; sorting before cutting is what gets padding efficiency to ~0.999.
3. Cut the sorted stream greedily into batches whose padded size
   (sequences x longest length in the batch) never exceeds the token budget.
4. Shuffle the batch order inside each bucket.
5. Interleave buckets by stride: batch i of a bucket with n_b batches sits at
   fractional position (i + 0.5) / n_b; the epoch follows those positions (ties
   go to the lower bucket id), so every bucket runs out at the same time: at
   most (n - n_b) / (2 n_b) + (K - 1) / 2 batches follow the last batch of
   bucket b (n batches, K buckets).
6. Cap runs of one bucket at `max_run` (3) consecutive batches, because long
   runs of one length regime cause loss whiplash. When the stride order already
   obeys the cap (the usual case) it is used unchanged. Otherwise a repair
   takes, at a capped run, the other bucket whose next position is earliest,
   and takes a bucket early when it holds more than cap x (all the rest), which
   keeps the remainder feasible. If one bucket holds more than max_run x (all
   other batches + 1), no order obeys max_run; the cap then becomes the
   smallest achievable one, ceil(n_max / (n - n_max + 1)) (see `run_limit`).
   Repairs pull some batches forward; over random bucket counts the tail after
   a bucket's last batch stayed under (n - n_b) / n_b + cap + K batches.

Data parallelism: global batch g of an epoch goes to consumer g % dp_size, and
every consumer steps in lockstep, so the last (n % dp_size) batches of an
epoch are dropped (see `BatchSampler.iterate`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from dflash_ds.errors import DFlashError


@dataclass(frozen=True)
class Cursor:
    """Position of the next global batch: resuming from it continues exactly."""

    epoch: int
    batch_index: int


@dataclass(frozen=True)
class BatchSpec:
    """One batch of an epoch: which samples, from which bucket, and its token counts."""

    index: int  # global position of the batch in its epoch
    bucket: int
    sample_ids: list[int]
    real_tokens: int
    padded_tokens: int  # num_seqs * longest length in the batch

    @property
    def num_seqs(self) -> int:
        """Number of sequences in the batch."""
        return len(self.sample_ids)

    @property
    def max_length(self) -> int:
        """Longest sequence in the batch (the padded width)."""
        return self.padded_tokens // len(self.sample_ids)

    @property
    def padding_efficiency(self) -> float:
        """Fraction of the padded tokens that are real tokens."""
        return self.real_tokens / self.padded_tokens


def bucket_boundaries(max_length: int, num_buckets: int = 6) -> list[int]:
    """Geometric upper bounds of the length buckets; the last one is max_length."""
    if max_length < 1 or num_buckets < 1:
        raise DFlashError(f"need max_length >= 1 and num_buckets >= 1, got {max_length} and {num_buckets}")
    # Halving from max_length gives 128..4096 for the default (4096, 6); with many
    # buckets the lowest bound stops at 16 tokens so buckets stay non-empty.
    low = min(max_length, max(max_length / 2 ** (num_buckets - 1), 16.0))
    if num_buckets == 1:
        return [max_length]
    ratio = (max_length / low) ** (1.0 / (num_buckets - 1))
    bounds = [int(round(low * ratio**i)) for i in range(num_buckets - 1)] + [max_length]
    # Rounding can merge bounds when max_length is small: keep the distinct ones.
    return sorted(set(bounds))


def assign_buckets(lengths: np.ndarray, boundaries: Sequence[int]) -> np.ndarray:
    """Bucket id of every sequence: bucket b holds lengths in (boundaries[b-1], boundaries[b]]."""
    bounds = np.asarray(boundaries, dtype=np.int64)
    if bounds.ndim != 1 or len(bounds) == 0 or np.any(np.diff(bounds) <= 0) or bounds[0] < 1:
        raise DFlashError(f"bucket boundaries must be strictly increasing positive integers, got {list(boundaries)}")
    if len(lengths) and lengths.max() > bounds[-1]:
        raise DFlashError(
            f"a sequence of length {int(lengths.max())} exceeds the last bucket boundary {int(bounds[-1])}"
        )
    return np.searchsorted(bounds, lengths, side="left")


def pack_token_budget(lengths: Sequence[int], token_budget: int) -> list[tuple[int, int]]:
    """Greedy [start, end) cuts of a sequence stream so that n * longest <= token_budget."""
    cuts: list[tuple[int, int]] = []
    start, longest = 0, 0
    for k, length in enumerate(lengths):
        widest = max(longest, length)
        if (k - start + 1) * widest > token_budget:
            cuts.append((start, k))
            start, widest = k, length
        longest = widest
    if len(lengths) > start:
        cuts.append((start, len(lengths)))
    return cuts


def run_limit(counts: Sequence[int], max_run: int = 3) -> int:
    """Smallest achievable same-bucket run cap: max(max_run, ceil(n_max / (n - n_max + 1)))."""
    total, largest = sum(counts), max(counts, default=0)
    if largest == 0:
        return max_run
    # n_max batches need at least n_max / cap runs, separated by the n - n_max others.
    return max(max_run, math.ceil(largest / (total - largest + 1)))


def interleave_buckets(counts: Sequence[int], max_run: int = 3) -> list[int]:
    """Bucket id of each position of an epoch: stride interleaving with runs capped at run_limit."""
    if max_run < 1:
        raise DFlashError(f"max_run must be >= 1, got {max_run}")
    cap = run_limit(counts, max_run)
    remaining = list(counts)
    taken = [0] * len(counts)
    left = sum(counts)
    order: list[int] = []
    last, run = -1, 0
    while left:
        # A bucket holding more than cap x (all other batches) must go now, or the
        # others run out as separators (provably at most one such bucket, and it is
        # never the one that just hit the cap, as long as the start was feasible).
        forced = next((b for b, c in enumerate(remaining) if c > cap * (left - c)), None)
        if forced is not None:
            pick = forced
        else:
            # Follow the stride positions (i + 0.5) / n_b, skipping a bucket at its cap.
            best = None
            for b, c in enumerate(remaining):
                if c == 0 or (b == last and run >= cap):
                    continue
                position = (2 * taken[b] + 1) / (2 * counts[b])
                if best is None or position < best[0]:
                    best = (position, b)
            assert best is not None  # feasibility invariant: some bucket is always allowed
            pick = best[1]
        order.append(pick)
        remaining[pick] -= 1
        taken[pick] += 1
        left -= 1
        run = run + 1 if pick == last else 1
        last = pick
    return order


def longest_run(buckets: Sequence[int]) -> int:
    """Length of the longest run of equal consecutive values."""
    best = run = 0
    for k, b in enumerate(buckets):
        run = run + 1 if k and b == buckets[k - 1] else 1
        best = max(best, run)
    return best


def _check_lengths(lengths: np.ndarray | Sequence[int], token_budget: int) -> np.ndarray:
    arr = np.asarray(lengths, dtype=np.int64)
    if arr.ndim != 1:
        raise DFlashError(f"lengths must be a 1-D array, got shape {arr.shape}")
    if token_budget < 1:
        raise DFlashError(f"token budget must be >= 1, got {token_budget}")
    if len(arr) and arr.min() < 1:
        raise DFlashError(f"sample {int(arr.argmin())} is empty (length {int(arr.min())})")
    if len(arr) and arr.max() > token_budget:
        raise DFlashError(
            f"sample {int(arr.argmax())} has {int(arr.max())} tokens, more than the token budget {token_budget}; "
            "raise the budget or lower max_length"
        )
    return arr


def build_epoch(
    lengths: np.ndarray | Sequence[int],
    token_budget: int,
    boundaries: Sequence[int],
    seed: int,
    epoch: int,
    sort_window: int | None = None,
    max_run: int = 3,
) -> list[BatchSpec]:
    """All batches of one epoch, in order; a pure function of its arguments."""
    arr = _check_lengths(lengths, token_budget)
    if seed < 0 or epoch < 0:
        raise DFlashError(f"seed and epoch must be >= 0, got {seed} and {epoch}")
    if sort_window is not None and sort_window < 1:
        raise DFlashError(f"sort_window must be >= 1 or None, got {sort_window}")
    bucket_of = assign_buckets(arr, boundaries)
    # One independent stream per bucket, so a bucket's batches do not depend on
    # how many random draws the other buckets made.
    streams = np.random.SeedSequence([seed, epoch]).spawn(len(boundaries))
    per_bucket: list[list[tuple[list[int], int, int]]] = []
    for b, stream in enumerate(streams):
        rng = np.random.default_rng(stream)
        ids = rng.permutation(np.flatnonzero(bucket_of == b))
        lens = arr[ids]
        window = len(ids) if sort_window is None else sort_window
        if window > 1 and len(ids):
            # Stable sort on (window, length) keeps the shuffle among equal lengths.
            key = (np.arange(len(ids)) // window) * (int(lens.max()) + 1) + lens
            order = np.argsort(key, kind="stable")
            ids, lens = ids[order], lens[order]
        csum = np.concatenate([[0], np.cumsum(lens)])
        id_list, len_list = ids.tolist(), lens.tolist()
        batches = [
            (id_list[s:e], int(csum[e] - csum[s]), (e - s) * max(len_list[s:e]))
            for s, e in pack_token_budget(len_list, token_budget)
        ]
        per_bucket.append([batches[k] for k in rng.permutation(len(batches))])
    cursors = [0] * len(per_bucket)
    specs: list[BatchSpec] = []
    for index, b in enumerate(interleave_buckets([len(x) for x in per_bucket], max_run)):
        sample_ids, real, padded = per_bucket[b][cursors[b]]
        cursors[b] += 1
        specs.append(BatchSpec(index, b, sample_ids, real, padded))
    return specs


class BatchSampler:
    """Endless (or max_epochs-long) stream of one data-parallel consumer's batches."""

    def __init__(
        self,
        lengths: np.ndarray | Sequence[int],
        token_budget: int,
        boundaries: Sequence[int],
        seed: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        sort_window: int | None = None,
        max_run: int = 3,
        max_epochs: int | None = None,
    ) -> None:
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise DFlashError(f"need 0 <= dp_rank < dp_size, got dp_rank={dp_rank} dp_size={dp_size}")
        self.lengths = _check_lengths(lengths, token_budget)
        self.token_budget = token_budget
        self.boundaries = list(boundaries)
        self.seed = seed
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.sort_window = sort_window
        self.max_run = max_run
        self.max_epochs = max_epochs
        self._cached: tuple[int, list[BatchSpec]] | None = None
        self._check_steps(0)  # fail at construction, not mid-training

    def epoch_batches(self, epoch: int) -> list[BatchSpec]:
        """All global batches of an epoch (cached for the current epoch)."""
        if self._cached is None or self._cached[0] != epoch:
            specs = build_epoch(
                self.lengths, self.token_budget, self.boundaries, self.seed, epoch, self.sort_window, self.max_run
            )
            self._cached = (epoch, specs)
        return self._cached[1]

    @property
    def batches_per_epoch(self) -> int:
        """Steps per consumer in epoch 0; the same every epoch when sort_window is None."""
        return len(self.epoch_batches(0)) // self.dp_size

    def _check_steps(self, epoch: int) -> int:
        n = len(self.epoch_batches(epoch))
        if n < self.dp_size:
            raise DFlashError(
                f"epoch {epoch} has {n} batches, fewer than the {self.dp_size} data-parallel consumers; "
                "use more data or a smaller token budget"
            )
        return n

    def iterate(self, cursor: Cursor = Cursor(0, 0)) -> Iterator[tuple[Cursor, BatchSpec]]:
        """Yield (cursor after the step, batch) for this consumer, starting at `cursor`.

        From cursor (e, g), step s hands global batch g + s * dp_size + dp_rank to
        this consumer, for every full step left in the epoch; the leftover tail
        ((n - g) % dp_size batches) is dropped. The yielded cursor is the same on
        all consumers, so any of them can checkpoint it, and it may be resumed
        with another dp_size.
        """
        for after, specs in self.iterate_steps(cursor):
            yield after, specs[self.dp_rank]

    def iterate_steps(self, cursor: Cursor = Cursor(0, 0)) -> Iterator[tuple[Cursor, list[BatchSpec]]]:
        """Like `iterate`, but every consumer's batch of each step (index = dp rank), from one epoch build."""
        epoch, start = cursor.epoch, cursor.batch_index
        if epoch < 0 or start < 0:
            raise DFlashError(f"invalid cursor {cursor}")
        while self.max_epochs is None or epoch < self.max_epochs:
            specs = self.epoch_batches(epoch)
            n = self._check_steps(epoch)
            if start > n:
                raise DFlashError(f"cursor {Cursor(epoch, start)} is past the end of epoch {epoch} ({n} batches)")
            steps = (n - start) // self.dp_size
            for s in range(steps):
                g = start + s * self.dp_size
                done = s + 1 == steps
                after = Cursor(epoch + 1, 0) if done else Cursor(epoch, g + self.dp_size)
                yield after, specs[g: g + self.dp_size]
            epoch, start = epoch + 1, 0
