"""Near-duplicate removal by word n-gram overlap, and a split held out by topic words.

A prompt's shingles are its lower-cased word 3-grams (a prompt of fewer than 3 words is one shingle of its
words). Two prompts are near duplicates when the Jaccard overlap of their shingle sets is at least the
threshold (default 0.5: "Write a short poem about the sea." and "Write a short poem about the ocean." share
4 of 6 shingles, 0.67, and are one prompt; two poems about different things share 3 of 7, 0.43, and are two).
`NearDuplicates` keeps an inverted index (shingle -> prompts), so checking a new prompt costs the postings of
its own shingles, not a pass over every kept prompt: ~20 s for 20 K prompts on one core of this machine,
the common template shingles ("write a short") dominating.

The held-out split is by topic words: content words (not stop words, not the task types' own template words,
which appear in a large share of the prompts) drawn seeded among those in a few prompts each; a held-out prompt
contains one of them and no training prompt contains any of them, so held-out tau measures prompts about
subjects the drafter never saw the target write about, not rephrasings.
"""

from __future__ import annotations

import random
import re
from collections import Counter

WORD = re.compile(r"[a-z0-9']+")
STOP = frozenset("""a an the and or but if then of to in on at by for with from about as into over after before
between through during without within is are was were be been being am do does did have has had can could will would
shall should may might must i you he she it we they me him her us them my your his its our their this that these
those what which who whom whose when where why how not no yes so than too very just also more most some any each
every all both few many much other such own same only one two three four five there here out up down off again
further once""".split())


def words(text: str) -> list[str]:
    """Lower-cased word tokens (letters, digits, apostrophes)."""
    return WORD.findall(text.lower())


def shingles(text: str, n: int = 3) -> frozenset[tuple[str, ...]]:
    """The set of word n-grams of a text (one n-gram of all its words when it has fewer than n)."""
    w = words(text)
    if len(w) < n:
        return frozenset([tuple(w)])
    return frozenset(tuple(w[i: i + n]) for i in range(len(w) - n + 1))


class NearDuplicates:
    """Prompts kept so far, and whether a new one overlaps any of them by at least `threshold` (Jaccard)."""

    def __init__(self, threshold: float = 0.5, n: int = 3) -> None:
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"dedupe threshold {threshold}: must be in (0, 1]")
        self.threshold, self.n = threshold, n
        self.sizes: list[int] = []
        self.index: dict[tuple[str, ...], list[int]] = {}

    def __len__(self) -> int:
        return len(self.sizes)

    def overlap(self, text: str) -> float:
        """The largest Jaccard overlap of `text` with a kept prompt (0 when none shares a shingle)."""
        mine = shingles(text, self.n)
        shared: Counter[int] = Counter()
        for s in mine:
            shared.update(self.index.get(s, ()))
        best = 0.0
        for other, common in shared.items():
            best = max(best, common / (len(mine) + self.sizes[other] - common))
        return best

    def add(self, text: str) -> bool:
        """Keep `text` unless it is a near duplicate of a kept prompt; whether it was kept."""
        if self.overlap(text) >= self.threshold:
            return False
        mine = shingles(text, self.n)
        ident = len(self.sizes)
        self.sizes.append(len(mine))
        for s in mine:
            self.index.setdefault(s, []).append(ident)
        return True


def content_words(text: str, common: frozenset[str]) -> set[str]:
    """The words of a text that can name its topic: not stop words, not `common` (template) words, >= 4 letters."""
    return {w for w in words(text) if len(w) >= 4 and w not in STOP and w not in common and not w.isdigit()}


def split_by_topic_words(texts: list[str], held_out: int, seed: int = 0, *, common_share: float = 0.02,
                         max_df: int = 40) -> tuple[list[int], list[int], list[str]]:
    """(train indices, held-out indices, held-out topic words).

    Words in more than `common_share` of the texts (and more than 5) are template words and never topics. Topic words are drawn
    seeded among the rest that appear in 2..`max_df` texts; each adds its texts to the held-out set until
    `held_out` texts. A text with any held-out word is in no training row (a held-out word's texts beyond the
    count are dropped: in neither set)."""
    df: Counter[str] = Counter()
    per_text = [set(words(t)) for t in texts]
    for w in per_text:
        df.update(w)
    common = frozenset(w for w, n in df.items() if n > max(common_share * len(texts), 5))  # 5: a floor for small sets
    topical = [content_words(t, common) for t in texts]
    any_topical = set().union(*topical)
    candidates = sorted(w for w, n in df.items() if 2 <= n <= max_df and w in any_topical)
    rng = random.Random(f"topic-split-{seed}")
    rng.shuffle(candidates)
    held: list[int] = []
    held_words: list[str] = []
    taken: set[int] = set()
    for word in candidates:
        if len(held) >= held_out:
            break
        mine = [i for i, t in enumerate(topical) if word in t and i not in taken]
        if not mine:
            continue
        held_words.append(word)
        for i in mine:
            taken.add(i)
            if len(held) < held_out:
                held.append(i)
    banned = set(held_words)
    train = [i for i, t in enumerate(topical) if i not in taken and not (t & banned)]
    return train, held, held_words
