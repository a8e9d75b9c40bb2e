"""The background prefetcher over a saved Arrow dataset (dflash_ds.data.loader)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import datasets
import pytest
import torch

from dflash_ds.data.batching import BatchSampler, BatchSpec, Cursor
from dflash_ds.data.loader import PrefetchLoader, load_lengths
from dflash_ds.errors import DFlashError

ROWS = {
    "input_ids": [[11, 12, 13], [21, 22], [31, 32, 33, 34, 35], [41], [51, 52, 53, 54]],
    "loss_mask": [[0, 1, 1], [1, 1], [0, 0, 1, 1, 1], [1], [0, 1, 0, 1]],
    "length": [3, 2, 5, 1, 4],
    "text": ["a", "b", "c", "d", "e"],  # an extra column the loader must ignore
}


@pytest.fixture()
def dataset(tmp_path: Path) -> datasets.Dataset:
    datasets.Dataset.from_dict(ROWS).save_to_disk(str(tmp_path / "ds"))
    return datasets.load_from_disk(str(tmp_path / "ds"))


def spec(index: int, ids: list[int]) -> BatchSpec:
    lengths = [ROWS["length"][i] for i in ids]
    return BatchSpec(index, 0, ids, sum(lengths), len(ids) * max(lengths))


def test_batches_are_right_padded_exactly(dataset: datasets.Dataset) -> None:
    plan = [(Cursor(0, 1), spec(0, [2, 0])), (Cursor(1, 0), spec(1, [3]))]
    with PrefetchLoader(dataset, plan, pad_id=-7, depth=1) as loader:
        first, second = list(loader)
    assert first.input_ids.dtype == torch.long and first.cursor == Cursor(0, 1) and first.spec == plan[0][1]
    assert first.input_ids.tolist() == [[31, 32, 33, 34, 35], [11, 12, 13, -7, -7]]
    assert first.loss_mask.tolist() == [[0, 0, 1, 1, 1], [0, 1, 1, 0, 0]]
    assert first.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert first.lengths.tolist() == [5, 3]
    assert second.input_ids.tolist() == [[41]] and second.cursor == Cursor(1, 0)


def test_loader_follows_the_sampler(dataset: datasets.Dataset) -> None:
    lengths = load_lengths(dataset)
    assert lengths.tolist() == ROWS["length"]
    sampler = BatchSampler(lengths, token_budget=8, boundaries=[2, 5], seed=3, max_epochs=2)
    expected = list(sampler.iterate())
    with PrefetchLoader(dataset, sampler.iterate()) as loader:
        got = list(loader)
    assert [(b.cursor, b.spec) for b in got] == expected
    for batch in got:
        assert batch.input_ids.shape == (batch.spec.num_seqs, batch.spec.max_length)
        assert int(batch.attention_mask.sum()) == batch.spec.real_tokens
        for row, sample in zip(batch.input_ids.tolist(), batch.spec.sample_ids):
            assert row[: ROWS["length"][sample]] == ROWS["input_ids"][sample]


def test_errors_in_the_thread_reach_the_consumer(dataset: datasets.Dataset) -> None:
    def plan() -> Iterator[tuple[Cursor, BatchSpec]]:
        yield Cursor(0, 1), spec(0, [0])
        raise ValueError("sampler broke")

    loader = PrefetchLoader(dataset, plan())
    assert next(loader).input_ids.tolist() == [[11, 12, 13]]
    with pytest.raises(ValueError, match="sampler broke"):
        next(loader)
    with pytest.raises(StopIteration):
        next(loader)
    loader.close()


def test_corrupt_rows_raise_a_clear_error(tmp_path: Path) -> None:
    bad = dict(ROWS, length=[3, 2, 5, 1, 3])  # sample 4 claims 3 tokens, has 4
    datasets.Dataset.from_dict(bad).save_to_disk(str(tmp_path / "bad"))
    with PrefetchLoader(datasets.load_from_disk(str(tmp_path / "bad")), [(Cursor(0, 1), spec(0, [4]))]) as loader:
        with pytest.raises(DFlashError, match="sample 4"):
            next(loader)


def test_missing_columns_are_rejected(tmp_path: Path) -> None:
    datasets.Dataset.from_dict({"input_ids": [[1]]}).save_to_disk(str(tmp_path / "x"))
    with pytest.raises(DFlashError, match="loss_mask"):
        PrefetchLoader(datasets.load_from_disk(str(tmp_path / "x")), [])


def test_close_stops_a_blocked_producer(dataset: datasets.Dataset) -> None:
    def endless() -> Iterator[tuple[Cursor, BatchSpec]]:
        k = 0
        while True:
            yield Cursor(0, k + 1), spec(k, [k % 5])
            k += 1

    loader = PrefetchLoader(dataset, endless(), depth=2)
    assert next(loader).spec.index == 0
    loader.close()  # the producer is blocked on the full queue: close must still end it
    assert not loader.alive
    with pytest.raises(StopIteration):
        next(loader)
