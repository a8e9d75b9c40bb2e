"""Every `dflash-ds` command writes with CLI_UMASK (027) added to the caller's umask (dflash_ds/cli.py), as the ranks
write with train.umask: observed on the files and folders two commands write, run in this process, whose own umask
is back as it was afterwards."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from dflash_ds.cli import main


def report(tmp_path: Path) -> tuple[list[str], list[Path]]:
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 5.0 / s}) + "\n" for s in (1, 2)))
    plots = tmp_path / "plots"
    return ["report", "--run", str(tmp_path)], [plots, plots / "loss.png", plots / "summary.txt"]


def make_prompts(tmp_path: Path) -> tuple[list[str], list[Path]]:
    out = tmp_path / "prompts"
    return ["make-prompts", "--out", str(out)], [out, out / "train.jsonl", out / "held_out.jsonl"]


@pytest.mark.parametrize("command, caller, folder, file", [
    (report, 0o022, 0o750, 0o640),  # the usual shell's umask: others lose read
    (make_prompts, 0o002, 0o750, 0o640),  # a group-writable umask: the group loses write too
    # a mask closed to the group stays so (027 put in its place would open the files to it); others lose all
    (make_prompts, 0o070, 0o700, 0o600),
], ids=["report-022", "make-prompts-002", "make-prompts-070"])
def test_a_command_writes_with_027_added_to_the_callers_umask(tmp_path, command, caller, folder, file):
    argv, written = command(tmp_path)
    previous = os.umask(caller)
    try:
        assert main(argv) == 0
        after = os.umask(caller)
    finally:
        os.umask(previous)
    assert after == caller  # the command's mask is its own: this process gets the caller's back
    for path in written:
        assert stat.S_IMODE(path.stat().st_mode) == (folder if path.is_dir() else file), path
