"""The target loads straight onto its device in the run dtype (no second copy), and the log says what runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_ds.errors import DFlashError
from dflash_ds.models.target import describe_target, load_target

# Peak private (anonymous) memory while loading, sampled every 5 ms in a child process after every import:
# the tensors are read from the safetensors straight into the model (bf16 on disk, bf16 in the run), so the
# peak stays near one copy. The file's own mapped pages are page cache, shared and reclaimable: not counted
# (total RSS counts them too and swings between 1.2x and 1.6x with how many of them are mapped at once).
MEASURE = r"""
import json, sys, threading, time, torch
from dflash_ds.models.target import load_target

def anon() -> int:  # private memory only: the safetensors' own pages (file-backed, shared) do not count
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon")

peak, done = [anon()], threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], anon())
        time.sleep(0.005)
before = anon()
thread = threading.Thread(target=sample, daemon=True)
thread.start()
model = load_target(sys.argv[1], dtype=torch.bfloat16, device="cpu")
touched = sum(float(p.float().sum()) for p in model.parameters())  # every page of every weight resident
done.set()
thread.join()
size = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"before": before, "peak": max(peak[0], anon()), "size": size, "touched": touched}))
"""


@pytest.fixture(scope="module")
def big_bf16_target(tmp_path_factory) -> Path:
    """A ~0.76 GB bf16 Qwen3 (379 M parameters) saved in the HF format; no tokenizer is needed to load it."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = tmp_path_factory.mktemp("big_target")
    cfg = Qwen3Config(vocab_size=512, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=128, tie_word_embeddings=False,
                      dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.save_pretrained(out)
    return out


def test_loading_makes_no_second_copy(big_bf16_target: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", MEASURE, str(big_bf16_target)], capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["size"] > 0.7e9
    # Measured: 0.18x the model's bytes of private memory (loading buffers; on CPU the weights are the
    # safetensors' own mapped pages). A staged host copy or a load-then-convert would add 1x or more.
    assert (r["peak"] - r["before"]) / r["size"] <= 0.5, r


def test_the_log_names_the_attention_implementation(tiny_target: Path) -> None:
    target = load_target(tiny_target, attn_implementation="eager")
    assert describe_target(target) == "target Qwen3ForCausalLM: float32 on cpu, attention eager"
    assert "attention sdpa" in describe_target(load_target(tiny_target))
    with pytest.raises(DFlashError, match="attention implementation 'flashy'"):
        load_target(tiny_target, attn_implementation="flashy")


def test_gated_deltanet_targets_say_whether_the_fast_kernels_run(tmp_path: Path) -> None:
    import importlib.util

    from dflash_ds.tiny.families import make_tiny_family

    target = load_target(make_tiny_family(tmp_path / "q35", "qwen3_5"))
    line = describe_target(target)
    if importlib.util.find_spec("fla") and importlib.util.find_spec("causal_conv1d"):
        assert "use the fast kernels" in line, line
    else:
        assert "slow pure-torch fallback" in line and "pip install" in line, line
    assert json.loads((tmp_path / "q35" / "config.json").read_text())["model_type"] == "qwen3_5"
