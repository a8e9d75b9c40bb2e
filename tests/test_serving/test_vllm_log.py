"""Where a vLLM server's log goes (serving/vllm_server.py) and when it is removed. No vLLM needed: the server's
Python is this one, which has no vLLM, so a start fails within a second or two, as a real failed start does."""

from __future__ import annotations

import subprocess
import sys
import tempfile

import pytest

from dflash_ds.errors import DFlashError
from dflash_ds.serving.vllm_server import VLLMServer


@pytest.fixture
def here(tmp_path, monkeypatch):
    """A run folder as the current folder, and a system temporary folder of its own to find strays in."""
    systemp = tmp_path / "systemp"
    systemp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(systemp))
    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.chdir(run)
    return run, systemp


def stand_in(server: VLLMServer) -> None:
    """Make `server` look started: its log written, a process of its own in a session of its own."""
    server.log_path.parent.mkdir(parents=True, exist_ok=True)
    server.log_path.write_text("served")
    server.proc = subprocess.Popen(["sleep", "30"], start_new_session=True)


def test_a_failed_start_keeps_its_log_in_the_current_folder_and_names_it(here):
    run, systemp = here
    failing = VLLMServer(run, python=sys.executable, startup_timeout_s=60)
    assert failing.log_path.parent == run and not failing.log_path.exists()  # created by start(), not before
    with pytest.raises(DFlashError, match=str(failing.log_path)):
        failing.start()
    assert "No module named 'vllm'" in failing.log_path.read_text()
    assert list(systemp.iterdir()) == []  # nothing in the machine's shared temporary folder


@pytest.mark.parametrize("raised", [False, True], ids=["clean", "raised"])
def test_a_log_named_here_goes_after_a_clean_run_and_stays_after_a_failure(here, raised, capsys):
    """The caller's own log (log_path) stays either way."""
    run, systemp = here
    server = VLLMServer(run, python=sys.executable)
    callers = VLLMServer(run, python=sys.executable, log_path=run / "logs" / "mine.log")
    assert server.log_path.parent == run
    for s in (server, callers):
        stand_in(s)
        s.__exit__(RuntimeError if raised else None, None, None)  # leaving `with`, a request failed or not
        assert s.proc is None
    assert server.log_path.exists() == raised and callers.log_path.read_text() == "served"
    assert (f"log kept at {server.log_path}" in capsys.readouterr().out) == raised
    assert list(systemp.iterdir()) == []


def test_a_log_that_cannot_be_written_is_one_clear_error(here):
    run, _ = here
    (run / "a_file").write_text("")
    server = VLLMServer(run, python=sys.executable, log_path=run / "a_file" / "vllm.log")
    with pytest.raises(DFlashError, match=r"vLLM's log .*a_file/vllm.log: .*; choose a writable one"):
        server.start()
    assert server.proc is None


def test_cpu_preload_adds_the_serving_env_openmp_once(tmp_path):
    """vLLM's CPU build wants Intel OpenMP preloaded (its worker warns of a large loss under speculative decoding
    without it): the serving venv's lib/libiomp5.so is appended to LD_PRELOAD, once, after the user's own."""
    from dflash_ds.serving.vllm_server import cpu_preload

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib").mkdir()
    python = venv / "bin" / "python"
    assert cpu_preload(str(python), "/mine/libx.so").split(":")[:1] == ["/mine/libx.so"]
    assert "libiomp5" not in cpu_preload(str(python))  # a venv without it: nothing of ours
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    got = cpu_preload(str(python), "/mine/libx.so")
    assert got.split(":")[0] == "/mine/libx.so" and got.endswith(f"{venv}/lib/libiomp5.so")
    assert cpu_preload(str(python), "/elsewhere/libiomp5.so").count("libiomp5") == 1  # the user's copy wins


@pytest.mark.parametrize("gpu, native, served", [(False, False, "float32"), (False, True, "auto"), (True, False, "auto")])
def test_fast_dtype_serves_float32_only_where_bf16_is_emulated(monkeypatch, here, gpu, native, served):
    """`--vllm-dtype fast` (the default of regenerate, self-instruct and the recipe's server): the model's own dtype
    where the machine computes it natively, float32 on a CPU without AVX512-BF16 / AMX (vLLM's CPU build served
    SmolLM2 5.5x faster there); an explicit dtype passes as given."""
    from dflash_ds import hardware
    from dflash_ds.serving import vllm_server

    run, _ = here
    monkeypatch.setattr(vllm_server, "on_cpu", lambda: not gpu)
    monkeypatch.setattr(hardware, "native_bf16_cpu", lambda: native)
    server = VLLMServer(run, python=sys.executable)
    assert server.cmd[server.cmd.index("--dtype") + 1] == served
    assert VLLMServer(run, python=sys.executable, dtype="bfloat16").cmd.count("bfloat16") == 1
    assert vllm_server.served_dtype("float16") == "float16"


@pytest.mark.parametrize("gpu", [False, True])
def test_threads_reach_the_cpu_server_only(monkeypatch, here, gpu, capsys):
    """vLLM's CPU worker drops torch to 1 thread unless OMP_NUM_THREADS is set: `threads` sets it for a CPU server
    (over the caller's own), nothing on a GPU; none given leaves the environment as it was. Data generation asks for
    every core this process may use (`generation_threads`; 153 new tokens/s against 43 with vLLM's 1, docs/USAGE.md),
    and regenerate --engine vllm passes --vllm-threads, or that default, to its server."""
    import os

    from dflash_ds.cli import main
    from dflash_ds.serving import vllm_server

    run, _ = here
    monkeypatch.setattr(vllm_server, "on_cpu", lambda: not gpu)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {5, 0, 2, 3, 1})  # the cores this process may use
    env = VLLMServer(run, python=sys.executable, threads=3).env
    assert env["OMP_NUM_THREADS"] == ("1" if gpu else "3")
    # each thread on its own core: vLLM's own binding put a 2-core machine's worker on core 0 alone
    assert env.get("VLLM_CPU_OMP_THREADS_BIND") == (None if gpu else "0,1,2")
    if not gpu:
        assert VLLMServer(run, python=sys.executable, threads=9).env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1,2,3,5"
        assert VLLMServer(run, python=sys.executable, threads=9).env["OMP_NUM_THREADS"] == "5"
    env = VLLMServer(run, python=sys.executable).env
    assert env["OMP_NUM_THREADS"] == "1" and "VLLM_CPU_OMP_THREADS_BIND" not in env
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "2-3")  # the caller's own binding is kept
    env = VLLMServer(run, python=sys.executable, threads=2).env
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "2-3" and env["OMP_NUM_THREADS"] == \
        ("1" if gpu else "2")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    assert vllm_server.generation_threads() == 5 and vllm_server.generation_threads(2) == 2
    if gpu:
        return
    seen = []

    class Started(Exception):
        pass

    def record(*_args, **kwargs):
        seen.append(kwargs["threads"])
        raise Started

    monkeypatch.setattr(vllm_server, "VLLMServer", record)
    data = run / "p.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    for extra, threads in (([], len(os.sched_getaffinity(0))), (["--vllm-threads", "7"], 7)):
        with pytest.raises(Started):
            main(["regenerate", "--engine", "vllm", "--target", str(run), "--data", str(data), "--out",
                  str(run / "o.jsonl"), *extra])
        assert seen[-1] == threads
    for bad in ("0", "-2", "two"):  # OMP_NUM_THREADS takes a count >= 1: argparse's error names the flag (exit 2)
        with pytest.raises(SystemExit) as exc:
            main(["regenerate", "--engine", "vllm", "--target", str(run), "--data", str(data), "--out",
                  str(run / "o.jsonl"), "--vllm-threads", bad])
        assert exc.value.code == 2 and not (run / "o.jsonl").exists()
    assert "--vllm-threads: '-2': a number of threads, >= 1" in capsys.readouterr().err
