"""A run folder's records hold one lineage: each batch the latest checkpoint's weights trained, once.

A run that ends without a checkpoint of its last steps (a cut link, a lost host, a killed rank) has recorded
steps S..S+k past its latest checkpoint S; `--resume auto` trains them again from S. Appended, the files would
show those batches twice (the same batch id and loss: seen in records/drafter{0,1}.jsonl after a link cut)
where the weights hold each once. So as a drafter starts at step S it keeps only the lines of the steps the
checkpoint holds:

- records/drafter{d}.jsonl: a line per micro-batch of `step` (0-based), kept while step < S;
- records/walks{d}.jsonl and records/uniform{d}.jsonl: lines keyed by the step they completed, kept up to S
  (what WalkHistory and UniformHistory read back).

Drafter d cuts its own files; the leader also cuts those of drafter indices the run no longer has (a resume on
fewer drafters, whose batches the others now train). A fresh run (S = 0) keeps nothing. metrics.jsonl is cut
the same way by the leader's monitor (runtime/monitor.py).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

# file stem -> whether a line of step `step` belongs to a lineage resumed at `start`
_KEEP = {
    "drafter": lambda step, start: step < start,  # the step a line trained, 0-based: S is the first redone
    "walks": lambda step, start: step <= start,  # the step a walk completed
    "uniform": lambda step, start: step <= start,  # the step that closed a record window
}


def keep_lineage(records: Path, start_step: int, drafters: list[int]) -> None:
    """Cut the record files of `drafters` in folder `records` to the lines of a run resumed at `start_step`."""
    for d in drafters:
        for stem, keep in _KEEP.items():
            _cut(records / f"{stem}{d}.jsonl", lambda step, keep=keep: keep(step, start_step))


def absent_drafters(records: Path, num_drafters: int) -> list[int]:
    """Drafter indices with record files in `records` that a run of `num_drafters` drafters does not have."""
    found = {int(m.group(2)) for p in records.glob("*.jsonl")
             if (m := re.fullmatch(r"(drafter|walks|uniform)(\d+)\.jsonl", p.name))}
    return sorted(d for d in found if d >= num_drafters)


def _cut(path: Path, keep) -> None:
    """Rewrite `path` with only the lines whose step `keep` accepts (atomically: a crash leaves the old file)."""
    if not path.exists():
        return
    lines = path.read_text().splitlines()
    kept = []
    for line in lines:
        try:
            if keep(int(json.loads(line)["step"])):
                kept.append(line)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue  # a blank line, or a torn last line of a process killed mid-write
    if len(kept) == len(lines):
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
