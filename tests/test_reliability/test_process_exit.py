"""exit_now (dflash_ds/process_exit.py): the status, the exit handlers and the last buffered output survive the
skipped teardown; the commands end through it."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import atexit, sys
from dflash_ds.process_exit import exit_now
atexit.register(lambda: open(sys.argv[1], "w").write("handler ran"))
sys.stdout.write("buffered, no newline")
sys.stderr.write("and on stderr")
exit_now(int(sys.argv[2]))
print("never")
"""


def test_exit_now_keeps_status_handlers_and_output(tmp_path):
    for status in (0, 3):
        marker = tmp_path / f"handler{status}"
        r = subprocess.run([sys.executable, "-c", SCRIPT, str(marker), str(status)], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == status and r.stdout == "buffered, no newline" and r.stderr == "and on stderr", r
        assert marker.read_text() == "handler ran"


def test_the_entry_points_end_through_it():
    import ast
    from pathlib import Path

    package = Path(__file__).resolve().parents[2] / "dflash_ds"
    for name in ("train.py", "cli.py", "__main__.py"):
        tree = ast.parse((package / name).read_text())
        main_blocks = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
        assert len(main_blocks) == 1 and ("exit_now(" in ast.unparse(main_blocks[0])
                                          or "entry()" in ast.unparse(main_blocks[0])), name
    assert 'dflash-ds = "dflash_ds.cli:entry"' in (package.parent / "pyproject.toml").read_text()
