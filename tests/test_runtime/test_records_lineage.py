"""runtime/records.py: a resumed run's record files keep only the steps its checkpoint holds (no process needed).

The end-to-end case (a link cut past a checkpoint, then `--resume auto`: each batch once) is
test_multihost_train.py::test_deepspeed_launcher_over_ssh_on_two_hosts.
"""

from __future__ import annotations

import json

from dflash_ds.runtime.records import absent_drafters, keep_lineage


def _write(path, steps, torn: bool = False) -> None:
    text = "".join(json.dumps({"step": s, "batch_id": 2 * s}) + "\n" for s in steps)
    path.write_text(text + ('{"step": 9, "bat' if torn else ""))


def _steps(path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_a_resume_at_step_s_keeps_the_lines_its_checkpoint_holds(tmp_path):
    """Checkpoint 6, records of steps 0-8 (a run cut after it): drafter lines of steps 0-5 stay (step 6 is the first
    one trained again), walks and windows keyed by the step they completed up to 6; a torn last line goes."""
    _write(tmp_path / "drafter0.jsonl", range(9), torn=True)
    _write(tmp_path / "walks0.jsonl", [1, 4, 7])
    _write(tmp_path / "uniform0.jsonl", [5, 6, 8])
    _write(tmp_path / "drafter1.jsonl", range(9))  # another drafter's: not drafter 0's to cut
    keep_lineage(tmp_path, 6, [0])
    assert _steps(tmp_path / "drafter0.jsonl") == [0, 1, 2, 3, 4, 5]
    assert _steps(tmp_path / "walks0.jsonl") == [1, 4]
    assert _steps(tmp_path / "uniform0.jsonl") == [5, 6]
    assert _steps(tmp_path / "drafter1.jsonl") == list(range(9))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter0.jsonl", "drafter1.jsonl", "uniform0.jsonl",
                                                          "walks0.jsonl"]  # no temporary file left


def test_a_fresh_run_keeps_nothing_and_missing_files_are_fine(tmp_path):
    _write(tmp_path / "drafter0.jsonl", range(3))
    keep_lineage(tmp_path, 0, [0, 1])
    assert (tmp_path / "drafter0.jsonl").read_text() == ""
    assert not (tmp_path / "walks1.jsonl").exists()


def test_the_drafters_a_smaller_run_lacks_are_found(tmp_path):
    """A resume on 1 drafter of a run that had 3: the leader cuts drafters 1 and 2's files, whose batches it trains."""
    for name in ("drafter0.jsonl", "drafter1.jsonl", "walks2.jsonl", "uniform1.jsonl", "metrics.jsonl",
                 "drafter1.jsonl.tmp"):
        (tmp_path / name).write_text("")
    assert absent_drafters(tmp_path, 1) == [1, 2]
    assert absent_drafters(tmp_path, 3) == []
