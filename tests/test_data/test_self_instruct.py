"""self-instruct's filters, near-duplicate removal and topic-word split, by hand; the generation itself runs
against a real vLLM server of the real target in tests/test_recipe_real_drafter.py."""

from __future__ import annotations

import pytest

from dflash_ds.data.dedupe import NearDuplicates, shingles, split_by_topic_words, words
from dflash_ds.data.self_instruct import clean, examples_for, request_ids


def test_shingles_and_jaccard_by_hand():
    sea, ocean = "Write a short poem about the sea.", "Write a short poem about the ocean."
    assert len(shingles(sea)) == 5 and len(shingles(sea) & shingles(ocean)) == 4
    assert shingles("Hi there") == frozenset([("hi", "there")])
    dups = NearDuplicates(0.5)
    assert dups.add(sea)
    assert dups.overlap(ocean) == pytest.approx(4 / 6)
    assert not dups.add(ocean)  # 0.67 >= 0.5: one prompt
    leaves = "Write a short poem about autumn leaves."
    assert dups.overlap(leaves) == pytest.approx(3 / 7)  # 3 shared of 7 in the union
    assert dups.add(leaves) and len(dups) == 2
    assert dups.overlap("Completely unrelated words here.") == 0.0
    strict = NearDuplicates(0.4)
    strict.add(sea)
    assert not strict.add(leaves)
    with pytest.raises(ValueError, match="threshold"):
        NearDuplicates(0.0)


@pytest.mark.parametrize("raw, kept, why", [
    (" What is the difference between a siren and a fire alarm?", "What is the difference between a siren and a "
     "fire alarm?", ""),
    ("Explain gravity to a child.\n6. next item", "Explain gravity to a child.", ""),
    ("6. Explain gravity simply.", None, "numbered"),
    ("Wow!", None, "short"),
    ("Tell me about the history of", None, "unfinished"),
    (" ".join(["word"] * 61) + ".", None, "long"),
])
def test_clean(raw, kept, why):
    assert clean(raw) == (kept, why)


def test_examples_are_seeded_and_mix_seeds_with_written():
    seeds = [f"seed prompt {i}." for i in range(10)]
    written = [f"written prompt {i}." for i in range(5)]
    a = examples_for(7, 0, "fact", seeds, written)
    assert a == examples_for(7, 0, "fact", seeds, written)
    assert a != examples_for(8, 0, "fact", seeds, written)
    assert sum(x in seeds for x in a) == 2 and sum(x in written for x in a) == 2
    assert all(x in seeds for x in examples_for(7, 0, "fact", seeds, []))  # no written yet: all four are seeds
    assert len(examples_for(7, 0, "fact", seeds, written[:1])) == 4


def test_request_is_a_numbered_list_left_open(real_target):
    from dflash_ds.data.chat import load_tokenizer

    tok = load_tokenizer(str(real_target))
    ids = request_ids(tok, ["One request?", "Two requests."])
    text = tok.decode(ids)
    assert text == "Requests that people sent to an AI assistant:\n1. One request?\n2. Two requests.\n3."


def test_split_by_topic_words_holds_no_topic_word_in_training():
    texts = ([f"How do I care for a {w} plant at home?" for w in ("cactus", "fern", "orchid")] * 2
             + [f"Explain the history of {w} in simple terms." for w in ("jazz", "chess", "paper", "bread")] * 2
             + ["Tell me one fact about penguins.", "Tell me two facts about whales."])
    train, held, held_words = split_by_topic_words(texts, held_out=4, seed=3, common_share=0.5)
    assert len(held) == 4 and held_words
    assert not set(train) & set(held)
    for i in held:
        assert set(words(texts[i])) & set(held_words)
    for i in train:
        assert not set(words(texts[i])) & set(held_words), texts[i]
    # every text is in train, held out, or dropped because it shares a held-out word
    dropped = set(range(len(texts))) - set(train) - set(held)
    assert all(set(words(texts[i])) & set(held_words) for i in dropped)
    assert split_by_topic_words(texts, 4, seed=3, common_share=0.5) == (train, held, held_words)


@pytest.mark.parametrize("take", [None, 5, 0])
def test_finish_takes_the_grids_first_training_prompts(tmp_path, take):
    """train.jsonl: the grid's first `take` training prompts (all when None: --grid-train) and the kept generated
    ones the topic split trains on; the grid's held-out set whole; data_stats.json counts what was written."""
    import json
    from collections import Counter
    from types import SimpleNamespace

    from dflash_ds.data.prompt_grid import natural_prompts, split_prompts
    from dflash_ds.data.self_instruct import finish

    grid_train, grid_held = split_prompts(natural_prompts(0), 0)
    texts = ([f"How do I care for a {w} plant at home?" for w in ("cactus", "fern", "orchid")] * 2
             + [f"Explain the history of {w} in simple terms." for w in ("jazz", "chess", "paper", "bread")] * 2)
    kept = [{"messages": [{"role": "user", "content": t}], "kind": "explain"} for t in texts]
    gen = SimpleNamespace(grid_train=grid_train, grid_held=grid_held, kept=kept, rejected=Counter())
    stats = finish(gen, tmp_path, held_out=2, seed=0, asked=len(kept), grid_train=take)
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    want_grid = grid_train if take is None else grid_train[:take]
    generated = stats["generated_train"]["prompts"]
    assert len(rows) == stats["train"]["prompts"] == len(want_grid) + generated and generated > 0
    assert sorted(json.dumps(r) for r in rows if r not in kept) == sorted(json.dumps(r) for r in want_grid)
    assert len((tmp_path / "held_out_grid.jsonl").read_text().splitlines()) == len(grid_held) > 0
