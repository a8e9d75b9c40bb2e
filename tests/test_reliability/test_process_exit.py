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


CONSOLE_GONE = """
import sys
from dflash_ds.redact import redact_stdio
redact_stdio()
sys.stdin.readline()  # the parent has closed the reading end of this process's stdout by now
for _ in range(3):
    print("a line nobody reads", flush=True)
open(sys.argv[1], "w").write("went on")
raise SystemExit(75)
"""


def test_a_rank_whose_console_is_gone_goes_on(tmp_path):
    """A rank's prints once its console's reader has gone (an ssh session ended by a SIGTERM to every process of
    the launch) are dropped: the rank goes on to its checkpoint and its status, not BrokenPipeError."""
    marker = tmp_path / "marker"
    proc = subprocess.Popen([sys.executable, "-c", CONSOLE_GONE, str(marker)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    _, err = proc.communicate("\n", timeout=60)
    assert proc.returncode == 75 and marker.read_text() == "went on", err[-2000:]
