"""Nothing a test starts outlives it, even when the test process itself is SIGKILLed (a CI time limit).

A vLLM server, through VLLMServer's own launch path with a stand-in for vLLM's Python (it answers /health and
starts an "engine" child, as vLLM's API server does), and a launcher started by proc_utils.process_group (its
"ranks" in sessions of their own, as torchrun starts them). The real vLLM server is checked the same way in
tests/test_serving/test_regenerate_vllm.py (test_a_server_lost_part_way_...).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from proc_utils import alive

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent

STAND_IN = textwrap.dedent("""\
    import http.server, subprocess, sys
    port = int(sys.argv[sys.argv.index("--port") + 1])
    engine = subprocess.Popen([sys.executable, "-u", "-c", "import time; time.sleep(600)", "engine-of", *sys.argv[1:]])

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
    """)


def processes_naming(marker: str) -> list[int]:
    """Live pids whose command line holds `marker` (but a holder's: its code names the marker too)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and alive(int(entry)):
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if marker in cmd and int(entry) != os.getpid() and not cmd.startswith(f"{sys.executable}\0-c\0"):
                found.append(int(entry))
    return found


def wait_gone(marker: str, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := processes_naming(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def wait_ready(proc: subprocess.Popen) -> bool:
    """Read the holder's output up to its 'ready' line (False if it ended first)."""
    for line in proc.stdout:
        if line.startswith("ready"):
            return True
    return False


def holder(code: str, **kw) -> subprocess.Popen:
    """A child Python (as pytest would be) running `code`; it prints 'ready' once what it started is up."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{TESTS}"}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True,
                            env=env, **kw)


def test_a_vllm_server_dies_with_the_process_that_started_it(tmp_path):
    """SIGKILL to the starter: the server and its engine child are gone within the keeper's grace; before that,
    stop() ends the group as it did, and a starter still alive keeps its server."""
    python = tmp_path / "python"
    python.write_text(f"#!{sys.executable}\n" + STAND_IN)
    python.chmod(0o755)
    model = tmp_path / "model-orphan-check"
    code = f"""
        import sys, time
        from dflash_ds.serving.vllm_server import VLLMServer
        servers = [VLLMServer({str(model)!r}, python={str(python)!r}, log_path={str(tmp_path / 's.log')!r})
                   for _ in range(2)]
        for s in servers:
            s.start()
        servers[1].stop()
        print("ready", servers[0].url, flush=True)
        time.sleep(600)
        """
    proc = holder(code)
    try:
        assert wait_ready(proc)
        running = processes_naming(str(model))
        # One server kept (keeper, stand-in server, its engine), the stopped one gone.
        assert len(running) == 3, running
        time.sleep(1)  # the keeper looks at its parent every 0.2 s: a live one keeps the server up
        assert processes_naming(str(model)) == running
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        t0 = time.monotonic()
        assert wait_gone(str(model), timeout=15) == []
        print(f"server and engine gone {time.monotonic() - t0:.1f}s after their starter was SIGKILLed")
    finally:
        proc.kill()
        for pid in processes_naming(str(model)):
            os.kill(pid, signal.SIGKILL)
    assert "is gone: ending the server" in (tmp_path / "s.log").read_text()


def test_a_launchers_tree_dies_with_the_test_process(tmp_path):
    """proc_utils.process_group in a child Python SIGKILLed while its launcher runs: the launcher and a
    grandchild in a session of its own (torchrun starts each rank so) are gone too."""
    mark = f"rank-of-{os.getpid()}-{tmp_path.name}"
    code = f"""
        import subprocess, sys, time
        from proc_utils import process_group
        rank = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-u', '-c', "
                "'import time; time.sleep(600)', {mark!r}], start_new_session=True); time.sleep(600)")
        with process_group([sys.executable, "-u", "-c", rank, {mark!r}]):
            time.sleep(1)
            print("ready", flush=True)
            time.sleep(600)
        """
    proc = holder(code)
    try:
        assert wait_ready(proc)
        assert len(processes_naming(mark)) == 2
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert wait_gone(mark, timeout=15) == []
    finally:
        proc.kill()
        for pid in processes_naming(mark):
            os.kill(pid, signal.SIGKILL)
