"""Helpers for the distributed trainer tests: a prepared tiny dataset and a bounded torchrun."""

from __future__ import annotations

import json
import os
import random
import re
import socket
import stat
import subprocess
import sys
from pathlib import Path

from proc_utils import run_bounded

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A free TCP port with 3 free ports above it (the trainer uses P+1..P+3)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 4 < 65535 and all(_is_free(port + i) for i in range(1, 4)):
            return port


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def write_conversations(path: Path, n: int, seed: int = 0) -> Path:
    """ShareGPT-style rows with answers made of the tiny corpus' simple sentences."""
    from dflash_ds.tiny.corpus import generate_corpus

    rng = random.Random(seed)
    lines = generate_corpus(400, seed=seed + 7)
    with path.open("w") as f:
        for i in range(n):
            answer = " ".join(rng.choice(lines) for _ in range(rng.randint(3, 12)))
            f.write(json.dumps({"id": f"c{i}", "conversations": [
                {"from": "human", "value": rng.choice(lines)}, {"from": "gpt", "value": answer}]}) + "\n")
    return path


def make_dataset(target: Path, out: Path, n: int = 64, max_length: int = 256, block_size: int = 8) -> Path:
    """Prepare `n` conversations for the tiny target."""
    from dflash_ds.data.prepare import prepare

    src = write_conversations(out.parent / f"{out.name}.jsonl", n)
    prepare(target, [src], out, max_length=max_length, block_size=block_size)
    return out


def env_for_children() -> dict[str, str]:
    """Environment for launched ranks: the repo on the path, CPU DeepSpeed, no W&B network."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    # The venv's tools first (its ninja, should anything JIT-build), then the rest of the PATH.
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.update({"DS_ACCELERATOR": "cpu", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1",
                "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"})
    return env


def torchrun(nproc: int, args: list[str], timeout: float = 420, extra: list[str] | None = None,
             cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node N -m dflash_ds.train ARGS` with a bound; a hang fails the test."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(free_port()), *(extra or []), "-m", "dflash_ds.train", *args]
    return run_bounded(cmd, timeout, env={**env_for_children(), **(env or {})}, cwd=cwd or REPO)


def exit_statuses(folder: Path) -> dict[int, dict]:
    """rank -> {"status", "time", "threads"} each rank wrote as it exited (DFLASH_EXIT_STATUS_DIR,
    runtime/faults.py). Asserts no rank left through the interpreter's teardown with its watchdog thread still
    running: it calls the store every second, and a thread inside a store call as the interpreter finalizes aborts
    the process (SIGABRT instead of its status, seen on CI). Threads waiting in Python or in a polled receive
    (sleeping between polls) leave without harm and are not checked."""
    got = {int(p.stem.removeprefix("rank")): json.loads(p.read_text()) for p in folder.glob("rank*.json")}
    running = {rank: s["threads"] for rank, s in got.items() if "dflash-watchdog" in s.get("threads", [])}
    assert not running, f"a watchdog still running at exit: {running}"
    return got


def torchrun_exit_codes(stderr: str) -> dict[int, int]:
    """rank -> exit code, from torchrun's failure report (it lists every rank that did not exit 0)."""
    found = re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", stderr)
    return {int(rank): int(code) for rank, code in found}


def read_jsonl(path: Path) -> list[dict]:
    """All records of a JSONL file."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wandb_history_keys(run_file: Path) -> set[str]:
    """Metric keys logged to an offline W&B run file (`run-*.wandb`: a leveldb-style log of protobufs)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    raw = run_file.read_bytes()
    assert raw[:4] == b":W&B", f"{run_file} is not a W&B run file"
    block, pos, records, partial = 32768, 7, [], b""
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # block trailer padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        data, pos = raw[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        if kind == 1:
            records.append(data)
        elif kind == 2:
            partial = data
        elif kind == 3:
            partial += data
        elif kind == 4:
            records.append(partial + data)
    keys: set[str] = set()
    for data in records:
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(data)
        if rec.WhichOneof("record_type") == "history":
            keys |= {item.key or "/".join(item.nested_key) for item in rec.history.item}
    return keys


def bench_torchrun(nproc: int, args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node N -m dflash_ds bench ARGS`, bounded: a hang fails the test."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(free_port()), "-m", "dflash_ds", "bench", *args]
    return run_bounded(cmd, timeout, env=env_for_children(), cwd=REPO)


def per_batch(out: Path) -> dict[int, dict]:
    """Global batch id -> its last record (a resumed run appends), over every drafter's record file."""
    got: dict[int, dict] = {}
    for f in sorted((out / "records").glob("drafter*.jsonl")):
        for rec in read_jsonl(f):
            got[rec["batch_id"]] = rec
    return got


def command_lines() -> dict[int, str]:
    """pid -> command line of every process now."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                raw = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            out[int(entry)] = raw.replace(b"\0", b" ").decode("utf8", "replace")
    return out


def files_changed_since(*roots: Path, since: float) -> list[Path]:
    """Regular files under `roots` changed since `since` (the run's), up to 64 MB each."""
    found = []
    for root in roots:
        for dirpath, _dirs, names in os.walk(root):
            for name in names:
                p = Path(dirpath) / name
                try:
                    st = p.lstat()
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode) and st.st_mtime >= since - 1 and st.st_size < 64 << 20:
                    found.append(p)
    return found
