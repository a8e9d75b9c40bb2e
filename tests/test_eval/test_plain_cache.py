"""eval --plain-cache: the key follows everything the plain outputs depend on, a written file reads back, a
corrupt one is one warning and a miss, and a hit starts no plain server (vLLM faked; the real one in
tests/test_serving/test_eval_vllm.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from dflash_ds.eval import served
from dflash_ds.eval.plain_cache import cache_path, plain_key_fields, read_plain, write_plain

PROMPTS = [[1, 2, 3], [4, 5]]
OUTPUTS = [[7, 8, 9, 2], [6]]


@pytest.fixture
def target(tmp_path: Path) -> Path:
    folder = tmp_path / "target"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "qwen3"}')
    (folder / "model.safetensors").write_bytes(b"\0" * 64)
    return folder


def fields(target: Path, prompts=PROMPTS, **over) -> dict:
    kw = {"max_new_tokens": 64, "dtype": "float32", "max_model_len": None, "extra_args": [], "env": {},
          "python": "/venv/bin/python", "concurrency": 8, **over}
    return plain_key_fields(target, prompts, **kw)


def test_the_key_follows_prompts_settings_and_target_files(target, tmp_path):
    def key(**over) -> str:
        return cache_path(tmp_path / "cache", fields(target, **over)).name

    base = key()
    assert base == key() and base.startswith("plain-") and len(base) == len("plain-.json") + 64
    changed = [key(prompts=[[1, 2, 3], [4, 6]]), key(prompts=PROMPTS[:1]), key(max_new_tokens=65),
               key(dtype="bfloat16"), key(max_model_len=512), key(extra_args=["--tensor-parallel-size", "2"]),
               key(env={"VLLM_USE_V2_MODEL_RUNNER": "1"}), key(python="/other/bin/python"), key(concurrency=2)]
    assert len({base, *changed}) == 1 + len(changed)
    weights = target / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # same bytes, rewritten
    after_touch = key()
    weights.write_bytes(b"\0" * 65)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # same mtime as after the touch, one byte more
    assert len({base, after_touch, key()}) == 3
    (target / "tokenizer.json").write_text("{}")
    assert key() != after_touch


def test_a_written_file_reads_back_and_says_what_it_is(target, tmp_path):
    f = fields(target)
    path = cache_path(tmp_path / "new" / "cache", f)  # the folder is created
    assert read_plain(path, f) is None
    write_plain(path, f, OUTPUTS)
    assert read_plain(path, f) == OUTPUTS
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temporary file left
    stored = json.loads(path.read_text())
    assert stored["key_fields"]["max_new_tokens"] == 64 and stored["key_fields"]["prompts"]["count"] == 2
    assert [x["name"] for x in stored["key_fields"]["target"]["files"]] == ["config.json", "model.safetensors"]
    assert stored["key_fields"]["target"]["path"] == str(target.resolve())


@pytest.mark.parametrize("text", ['{"key_fields": {}, "outputs": [[1', '{"outputs": [[1], [2]]}', "\xff\xfe",
                                  "wrong outputs"])
def test_a_corrupt_file_is_one_warning_and_a_miss(target, tmp_path, capsys, text):
    f = fields(target)
    path = cache_path(tmp_path, f)
    if text == "wrong outputs":
        write_plain(path, f, OUTPUTS[:1])  # one output for two prompts
    else:
        path.write_bytes(text.encode("latin-1"))
    assert read_plain(path, f) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"warning: --plain-cache {path} is unreadable")
    write_plain(path, f, OUTPUTS)  # served plain again: overwritten
    assert read_plain(path, f) == OUTPUTS


def test_served_eval_writes_on_a_miss_and_starts_no_plain_server_on_a_hit(target, tmp_path, monkeypatch, capsys):
    started = []

    class FakeServer:
        def __init__(self, model, *, drafter=None, **_kw):
            self.url = "http://127.0.0.1:1"
            started.append("spec" if drafter else "plain")
            # what the real server reports it started with (served_eval reads it back)
            self.speculative_config = served.speculative_config(drafter) if drafter else None

        def __enter__(self):
            return self

        def __exit__(self, *_exc):
            pass

    counters = iter([{}, {served.DRAFTS: 4.0, served.ACCEPTED: 2.0}] * 2)
    monkeypatch.setattr(served, "VLLMServer", FakeServer)
    monkeypatch.setattr(served, "generate_all", lambda *a, **k: [list(o) for o in OUTPUTS])
    monkeypatch.setattr(served.OpenAIClient, "metrics", lambda self: next(counters))
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text('{"architectures": ["DFlashDraftModel"], "block_size": 4}')
    kw = {"max_new_tokens": 64, "dtype": "float32", "python": sys.executable,
          "plain_cache": tmp_path / "cache"}
    first = served.served_eval(target, drafter, PROMPTS, **kw)
    assert started == ["plain", "spec"] and not first["plain_reused"] and "plain_reused_from" not in first
    second = served.served_eval(target, drafter, PROMPTS, **kw)
    assert started == ["plain", "spec", "spec"] and second["plain_reused"]
    assert second["mismatches"] == [] and second["mean_acceptance_length"] == 1.5
    [cached] = (tmp_path / "cache").iterdir()
    assert second["plain_reused_from"] == str(cached)
    assert f"eval: plain reference reused from {cached}" in capsys.readouterr().out
