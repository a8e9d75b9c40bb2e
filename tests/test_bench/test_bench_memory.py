"""`dflash-ds bench memory`: the measured micro-step peak meets the formula, and the formula's terms add up by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dflash_ds.memory import model as mm

REPO = Path(__file__).resolve().parents[2]
# A vision-language-style wrapper (the LM under text_config), small enough for a CPU test.
TINY_CONFIG = {"model_type": "tiny_vl", "tie_word_embeddings": False,
               "text_config": {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 12,
                               "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 32,
                               "vocab_size": 32768, "rope_theta": 10000.0}}
TINY_STEP = ["--widths", "128,256", "--num-layers", "2", "--token-budget", "2048", "--seq-len", "1024",
             "--num-anchors", "128", "--max-anchors", "192", "--chunk-blocks", "16", "--steps", "1", "--warmup", "1"]


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "dflash_ds", "bench", "memory", *argv], capture_output=True,
                          text=True, env=env, timeout=240, check=False)


@pytest.fixture()
def tiny_target(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    return tmp_path


def test_bench_memory_measures_and_predicts_each_width(tiny_target: Path, tmp_path: Path) -> None:
    out = tmp_path / "res" / "memory.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "dflash_ds", "bench", "memory", "--target", str(tiny_target), *TINY_STEP,
           "--json", str(out)]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as run:
        while not out.exists() and run.poll() is None:  # the first version: written as width 128 ended
            time.sleep(0.02)
        first = json.loads(out.read_text())
        stdout, stderr = run.communicate(timeout=240)
    assert run.returncode == 0, stderr[-3000:]
    # a run cut short after its first width would have left that width's rows (written whole, then replaced)
    assert first["partial"] is True and [r["width"] for r in first["rows"]] == [128], first["rows"]
    assert "measured GB" in stdout and "= total" in stdout
    res = json.loads(out.read_text())
    assert res["partial"] is False and not Path(f"{out}.tmp").exists()
    assert (res["device"], res["dtype"], res["mask"], res["activation_checkpointing"]) == ("cpu", "fp32", "dense", False)
    assert res["batch"] == 2 and [r["width"] for r in res["rows"]] == [128, 256]
    for row in res["rows"]:
        # width 128: 4 heads of 32, kv heads in the target's 4:1 ratio, MLP scaled by 128/512
        assert row["heads"] == row["width"] // 32 and row["kv_heads"] == row["heads"] // 4
        assert row["intermediate"] == 3 * row["width"]
        assert row["anchors"] == 192 and row["anchors_per_row"] == 96
        assert row["measured_peak_bytes"] > 0 and row["predicted_peak_bytes"] > 0 and row["step_s"] > 0
        assert row["mfu"] is None  # CPU: no MFU
        # peak RSS with large allocations mmapped tracks live tensor bytes: within 1% here; 10% leaves room
        assert abs(row["error_pct"]) < 10, row
    full = res["full_width"]
    assert full["hidden"] == 512 and full["settings"]["mask"] == "flex"
    assert full["total_bytes"] == pytest.approx(full["micro_step_bytes"] + sum(full["static_terms"].values()))


def test_the_first_k_layers_recomputed_measure_as_predicted(tiny_target: Path) -> None:
    """--checkpoint-layers K (model.checkpoint_layers): the first K layers recomputed, the rest keeping their
    activations; the measured peak meets the formula as the full settings do, and lies between them. (A process
    of its own: the peak resident set of this one holds every earlier test's heap.)"""
    out = tiny_target / "k.json"
    res = run_cli("--target", str(tiny_target), *TINY_STEP, "--widths", "256", "--activation-checkpointing", "on",
                  "--checkpoint-layers", "1", "--json", str(out))
    assert res.returncode == 0, res.stderr[-2000:]
    assert " 1/2 " in res.stdout, res.stdout  # the table's checkpointing column: 1 layer of 2
    (row,) = json.loads(out.read_text())["rows"]
    assert row["activation_checkpointing"] and row["recomputed_layers"] == 1 and abs(row["error_pct"]) < 10, row
    from dflash_ds.memory.shapes import drafter_shape

    d = drafter_shape({**TINY_CONFIG, **TINY_CONFIG["text_config"]}, 256, 2, 16)
    s = mm.StepShape(batch=2, seq_len=1024, anchors_per_row=row["anchors_per_row"], chunk_blocks=16, dtype_bytes=4,
                     checkpointing=True, checkpoint_layers=1, dense_mask=True)
    assert row["predicted_peak_bytes"] == mm.micro_step_peak(d, s)
    ends = [mm.micro_step_peak(d, replace(s, checkpointing=c, checkpoint_layers=None)) for c in (True, False)]
    assert ends[0] < row["predicted_peak_bytes"] < ends[1]
    bad = run_cli("--target", str(tiny_target), *TINY_STEP, "--checkpoint-layers", "3")  # TINY_STEP: 2 layers
    assert bad.returncode == 2 and "--checkpoint-layers 3 must be 1..--num-layers (2)" in bad.stderr, bad.stderr


def test_lm_head_chunk_term_scales_with_chunk() -> None:
    d = mm.DrafterShape(4096, 12288, 32, 8, 128, 151936, 5, 5, 16)
    s = mm.StepShape(batch=8, seq_len=2048, anchors_per_row=256, chunk_blocks=64, dtype_bytes=2,
                     checkpointing=True, dense_mask=False, cuda=True)
    half = mm.StepShape(**{**s.__dict__, "chunk_blocks": 32})
    full_term = mm.micro_step_terms(d, s)["loss"]["lm_head_chunk"]
    assert full_term == 64 * 15 * 151936 * 12.0
    assert mm.micro_step_terms(d, half)["loss"]["lm_head_chunk"] == full_term / 2
    # flex: no dense mask; checkpointing: layer inputs (not activations) are held
    held = mm.micro_step_terms(d, s)["held"]
    assert held["attention_mask"] == 0 and held["layer_inputs"] == 4 * (8 * 256 * 16) * 4096 * 2


def test_static_terms_by_hand() -> None:
    d = mm.DrafterShape(4096, 12288, 32, 8, 128, 151936, 5, 5, 16)
    per_layer = (4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096  # q, k, v, o
                 + 2 * 128 + 3 * 4096 * 12288 + 2 * 4096)  # q/k norms, SwiGLU, two RMSNorms
    psi = 5 * per_layer + 5 * 4096 * 4096 + 2 * 4096  # + fc over 5 target layers, hidden_norm, norm
    assert per_layer == 192_946_432 and psi == 1_048_626_432 == mm.drafter_params(d)
    assert mm.zero_model_state_bytes(psi, 2, 1) == 16 * psi
    assert mm.zero_model_state_bytes(psi, 2, 4) == 2 * psi + 14 * psi / 4
    assert mm.zero_model_state_bytes(psi, 3, 4) == 4 * psi
    static = mm.static_terms(d, 16384, zero_stage=2, num_drafters=1)
    assert static["frozen_embed_head"] == 2 * 151936 * 4096 * 2
    # 6 leased + 2 pooled receive buffers; 671 MB is a power of two, its own size class (no slack)
    assert static["payload_buffers"] == 8 * 16384 * 5 * 4096 * 2
    d27 = mm.DrafterShape(**{**d.__dict__, "hidden": 5120})
    per27 = 16384 * 5 * 5120 * 2  # 838,860,800 -> size class 872,415,232 (2^29 + 5/8 of 2^29: 4% over)
    assert mm.static_terms(d27, 16384, 2, 1)["payload_buffers"] == 8 * 872_415_232 and 872_415_232 < 1.125 * per27
    colocated = mm.static_terms(d, 16384, 2, 1, payloads_alive=1, pooled=False)  # one exact captured batch
    assert colocated["payload_buffers"] == 16384 * 5 * 4096 * 2
    tied = mm.static_terms(mm.DrafterShape(**{**d.__dict__, "tied": True}), 16384, 2, 1)
    assert tied["frozen_embed_head"] == static["frozen_embed_head"] / 2


def test_params_formula_matches_the_drafter_module() -> None:
    """Psi counted by the formula equals the real module's parameter count (built on the meta device)."""
    from dflash_ds.models.presets import PRESETS
    from dflash_ds.memory.shapes import drafter_shape
    from dflash_ds.models.drafter import DFlashDrafter, DrafterArch, default_target_layer_ids

    for preset in PRESETS.values():
        d = drafter_shape(preset, preset["hidden_size"], 5, 16)
        arch = DrafterArch(hidden_size=d.hidden, intermediate_size=d.intermediate, num_hidden_layers=5,
                           num_attention_heads=d.heads, num_key_value_heads=d.kv_heads, head_dim=d.head_dim,
                           vocab_size=d.vocab, rms_norm_eps=1e-6, max_position_embeddings=4096,
                           rope_parameters={"rope_type": "default", "rope_theta": 1e6}, block_size=16,
                           num_target_layers=preset["num_hidden_layers"], mask_token_id=0,
                           target_layer_ids=default_target_layer_ids(preset["num_hidden_layers"], 5))
        with torch.device("meta"):
            drafter = DFlashDrafter(arch)
        assert sum(p.numel() for p in drafter.parameters()) == mm.drafter_params(d)


def test_dflash2_parts_in_psi_and_activations() -> None:
    """DFlash2 adds docs/MEMORY.md's hand counts to Psi, equal to the real DFlash2 module; DFlash is unchanged."""
    from dataclasses import replace

    from dflash_ds.memory.shapes import drafter_shape
    from dflash_ds.models.dflash2_arch import DFlash2Options
    from dflash_ds.models.drafter import DFlashDrafter, DrafterArch
    from dflash_ds.models.presets import PRESETS

    # per preset: convs 5 layers x 2 x (2*2*H + H*2*2*H/64), codebooks 2 x V x 64, hidden_projection H x 64
    hand = {"qwen3-8b": 10 * (2 * 2 * 4096 + 4096 * 256) + 2 * 151936 * 64 + 4096 * 64,
            "qwen3.6-27b": 10 * (2 * 2 * 5120 + 5120 * 320) + 2 * 248320 * 64 + 5120 * 64}
    assert hand == {"qwen3-8b": 30_359_552, "qwen3.6-27b": 48_701_440}  # the figures docs/MEMORY.md states
    step = mm.StepShape(batch=8, seq_len=2048, anchors_per_row=256, chunk_blocks=64, dtype_bytes=2,
                        checkpointing=True, dense_mask=False, cuda=True)
    for name, h, dflash_psi in (("qwen3-8b", 4096, 1_048_626_432), ("qwen3.6-27b", 5120, 1_835_072_000)):
        d = drafter_shape(PRESETS[name], h, 5, 16)
        d2 = replace(d, kind="dflash2")
        assert mm.drafter_params(d) == dflash_psi and mm.drafter_params(d2) - dflash_psi == hand[name]
        # saved activations: 4.125 H-wide bf16 values more per block token and layer (T = 32,768 here)
        a, a2 = mm.per_token_activations(d, 2)[0], mm.per_token_activations(d2, 2)[0]
        assert a2 - a == 8.25 * h
        t, t2 = mm.micro_step_terms(d, step, False), mm.micro_step_terms(d2, step, False)
        assert t2["backward"]["recomputed_layer"] - t["backward"]["recomputed_layer"] == 32768 * 8.25 * h
        assert t2["loss"]["selector_edges"] == 30720 * 8 * 64 * 2
    # `bench memory --kind dflash2` at Qwen3-8B: + ZeRO-2 D = 1 model states (16 B a parameter) + the recomputed
    # layer's 4.125 H bf16 per block token (docs/MEMORY.md: 37.20 GB against 35.60)
    import argparse

    from dflash_ds.bench import memory as bm

    parser = argparse.ArgumentParser()
    bm.add_arguments(parser)
    full = {k: bm.full_width_prediction(dict(PRESETS["qwen3-8b"]), parser.parse_args(["--kind", k]))
            for k in ("dflash", "dflash2")}
    added = full["dflash2"]["total_bytes"] - full["dflash"]["total_bytes"]
    assert added == pytest.approx(16 * 30_359_552 + 32768 * 8.25 * 4096)
    assert [round(full[k]["total_bytes"] / mm.GB, 2) for k in ("dflash", "dflash2")] == [35.6, 37.2]
    small = drafter_shape(PRESETS["qwen3-8b"], 256, 2, 16, kind="dflash2")  # the real module, on meta
    arch = DrafterArch(hidden_size=256, intermediate_size=small.intermediate, num_hidden_layers=2,
                       num_attention_heads=small.heads, num_key_value_heads=small.kv_heads, head_dim=small.head_dim,
                       vocab_size=small.vocab, rms_norm_eps=1e-6, max_position_embeddings=4096,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e6}, block_size=16,
                       num_target_layers=36, mask_token_id=0, target_layer_ids=[1, 34],
                       options=DFlash2Options())
    with torch.device("meta"):
        drafter = DFlashDrafter(arch)
    assert drafter.kind == "dflash2" and sum(p.numel() for p in drafter.parameters()) == mm.drafter_params(small)


def test_bench_memory_cuda_without_gpu_is_an_error(tiny_target: Path, cli_here) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    proc = cli_here("bench", "memory", "--target", str(tiny_target), "--device", "cuda")
    assert proc.returncode == 2 and "no CUDA GPU" in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1  # one clear line, no traceback


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bench_memory_on_cuda_flex_bf16(tiny_target: Path, tmp_path: Path) -> None:
    out = tmp_path / "memory.json"
    proc = run_cli("--target", str(tiny_target), *TINY_STEP, "--widths", "128", "--device", "cuda",
                   "--json", str(out), "--memory-trace", str(tmp_path / "trace.txt"))  # one width: one flex compile
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert (res["dtype"], res["mask"], res["activation_checkpointing"]) == ("bf16", "flex", True)
    for row in res["rows"]:
        assert row["measured_peak_bytes"] > 0 and row["mfu"] is not None and row["mfu"] > 0
    # what is alive at the peak (bench/memory_trace.py): the step's own blocks, ours found by their line
    trace = res["rows"][0]["memory_trace"]
    assert trace["traced_peak_bytes"] >= trace["measured_peak_bytes"] > 0 and not trace["truncated"]
    assert 0 < sum(g["bytes"] for g in trace["groups"]) <= trace["traced_peak_bytes"]
    assert any(g["site"].startswith(("models/", "components/")) for g in trace["groups"]), trace["groups"]
    assert (tmp_path / "trace.txt").read_text().startswith("== dflash, width 128, checkpointing True")


def test_dspark_parts_in_psi_and_the_loss() -> None:
    """DSpark adds its Markov head (2 x V x 256) and confidence head (H + 256 + 1) to Psi, equal to the real module;
    the loss holds the bias buffers of a chunk, markov_w2's fp32 gradient and the Markov embeddings."""
    from dataclasses import replace

    from dflash_ds.memory.shapes import drafter_shape
    from dflash_ds.models.drafter import DFlashDrafter, DrafterArch
    from dflash_ds.models.dspark_arch import DSparkOptions, dspark_params
    from dflash_ds.models.presets import PRESETS

    hand = {"qwen3-8b": 2 * 151936 * 256 + 4096 + 256 + 1, "qwen3.6-27b": 2 * 248320 * 256 + 5120 + 256 + 1}
    assert hand == {"qwen3-8b": 77_795_585, "qwen3.6-27b": 127_145_217}  # the figures models/dspark_arch.py states
    step = mm.StepShape(batch=8, seq_len=2048, anchors_per_row=256, chunk_blocks=64, dtype_bytes=2,
                        checkpointing=True, dense_mask=False, cuda=True)
    for name, h in (("qwen3-8b", 4096), ("qwen3.6-27b", 5120)):
        d = drafter_shape(PRESETS[name], h, 5, 16)
        ds = replace(d, kind="dspark")
        assert mm.drafter_params(ds) - mm.drafter_params(d) == hand[name]
        assert dspark_params(h, d.vocab, DSparkOptions()) == hand[name]
        loss = mm.micro_step_terms(ds, step, False)["loss"]
        assert loss["markov_bias"] == 4 * d.vocab * 256 + 30720 * 256 * 2  # no chunk buffer: added in place
    small = drafter_shape(PRESETS["qwen3-8b"], 256, 2, 16, kind="dspark")
    arch = DrafterArch(hidden_size=256, intermediate_size=small.intermediate, num_hidden_layers=2,
                       num_attention_heads=small.heads, num_key_value_heads=small.kv_heads, head_dim=small.head_dim,
                       vocab_size=small.vocab, rms_norm_eps=1e-6, max_position_embeddings=4096,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e6}, block_size=16,
                       num_target_layers=36, mask_token_id=0, target_layer_ids=[1, 34], options=DSparkOptions())
    with torch.device("meta"):
        drafter = DFlashDrafter(arch)
    assert sum(p.numel() for p in drafter.parameters()) == mm.drafter_params(small)


def test_each_kind_measures_its_own_step_and_mfu_counts_no_recompute(tiny_target: Path, cli_here) -> None:
    """--kind dflash,dflash2,dspark: one row per kind, each the kind's own module (its parameter count), its step
    against DFlash's; the FLOPs behind MFU leave the checkpointed recompute out (HFU keeps it). --fuse both: each
    kind compiled (train.fuse, inductor on CPU), then eager, each predicted with its own saved activations."""
    res = cli_here("bench", "memory", "--target", str(tiny_target), "--widths", "128", "--num-layers", "2",
                   "--token-budget", "1024", "--seq-len", "512", "--num-anchors", "16", "--chunk-blocks", "8",
                   "--steps", "1", "--warmup", "0", "--kind", "dflash,dflash2,dspark", "--fuse", "both", "--json",
                   str(tiny_target / "k.json"))
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads((tiny_target / "k.json").read_text())["rows"]
    assert [(r["kind"], r["fuse"]) for r in rows] == [(k, f) for k in ("dflash", "dflash2", "dspark")
                                                      for f in ("on", "off")]
    from dflash_ds.memory.shapes import drafter_shape

    text = {**TINY_CONFIG, **TINY_CONFIG["text_config"]}
    for r in rows:
        assert r["params"] == mm.drafter_params(drafter_shape(text, 128, 2, 16, r["kind"]))
    assert rows[0]["step_vs_dflash"] is None is rows[1]["step_vs_dflash"] and rows[2]["params"] > rows[0]["params"]
    for r in rows[2:]:  # against DFlash's row of the same fuse mode
        assert r["step_vs_dflash"] == pytest.approx(r["step_s"] / rows[r["fuse"] == "off"]["step_s"])
    for on, off in zip(rows[::2], rows[1::2]):  # no checkpointing on CPU: every layer's activations held
        (a, c), (a_f, c_f) = (mm.per_token_activations(drafter_shape(text, 128, 2, 16, on["kind"]), 4, fused)
                              for fused in (False, True))
        t = 2 * on["anchors_per_row"] * 16  # 2 sequences of 512 tokens
        layer_0 = t * 128 * 4  # eager's layer 0 keeps no fp32 input for its first norm; compiled neither
        assert off["predicted_peak_bytes"] - on["predicted_peak_bytes"] == \
            pytest.approx(2 * ((a - a_f) * t + (c - c_f) * 2 * 512) - layer_0)
    bad = cli_here("bench", "memory", "--kind", "dflash,eagle")
    assert bad.returncode != 0 and "--kind 'dflash,eagle'" in bad.stderr
    d = drafter_shape(text, 128, 2, 16)
    s = mm.StepShape(batch=2, seq_len=512, anchors_per_row=16, chunk_blocks=8, dtype_bytes=2, checkpointing=True,
                     dense_mask=False, cuda=True)
    t, c = 2 * 16 * 16, 2 * 512  # block tokens, context tokens
    layer_fwd = (t * 2 * (128 * 128 + 2 * 128 * 32 + 128 * 128 + 3 * 128 * 384) + c * 2 * 2 * 128 * 32
                 + 1000.0 * 4 * 128)
    model = 2 * layer_fwd * 3 + 2 * c * 2 * 128 * 128 * 2 + 2 * (2 * 16 * 15) * 128 * 32768 * 2
    assert mm.micro_step_flops(d, s, 1000.0, recompute=False) == pytest.approx(model)
    assert mm.micro_step_flops(d, s, 1000.0) == pytest.approx(model + 2 * layer_fwd)


def test_bench_real_shape_runs_colocated_and_counts_flops(tmp_path: Path) -> None:
    """bench real-shape at a shrunk shape on CPU: the random target built on the device, the drafter in the
    trainer's DeepSpeed engine; the step's parts add up and the target's FLOPs are its matmuls + causal attention."""
    out = tmp_path / "rs.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               DS_ACCELERATOR="cpu")
    proc = subprocess.run([sys.executable, "-m", "dflash_ds", "bench", "real-shape", "--device", "cpu", "--width",
                           "128", "--target-layers", "6", "--vocab", "512", "--token-budget", "1024", "--seq-len", "256",
                           "--num-anchors", "8", "--steps", "1", "--warmup", "1", "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "whole step" in proc.stdout and "plan's prediction" in proc.stdout
    r = json.loads(out.read_text())
    t = r["seconds"]
    assert t["step"] == pytest.approx(t["target"] + t["drafter"] + t["optimizer"], rel=1e-3, abs=1e-3)
    assert r["tok_per_s"] == pytest.approx(1024 / t["step"]) and r["anchors"] == 4 * 8 and r["mfu"] is None
    # 128 wide: 1 head of 128 (kv 1), MLP 384; 6 layers; body = layers + final norm (embedding and head excluded)
    layer = 128 * 128 + 2 * 128 * 128 + 128 * 128 + 2 * 128 + 3 * 128 * 384 + 2 * 128
    body = 6 * layer + 128
    assert r["target_params"] == body + 2 * 512 * 128
    want = 2 * body * 1024 + 6 * 4 * 4 * 128 * 256 * 257 / 2
    assert r["target_tflop"] * 1e12 == pytest.approx(want)
    assert r["plan"]["target_bytes"] == 4 * r["target_params"]


def test_checkpointing_follows_the_free_memory_unless_configured() -> None:
    """model.activation_checkpointing null: off on CPU; on a GPU off when the step without it (bench memory's formula
    at the run's config) fits 85% of the free memory, on otherwise; a configured value always wins."""
    from dataclasses import replace

    from dflash_ds.memory.shapes import drafter_shape
    from dflash_ds.bench.micro_step import drafter_arch
    from dflash_ds.config import Config
    from dflash_ds.models.presets import PRESETS
    from dflash_ds.runtime.checkpointing import choose_checkpointing, step_bytes, step_bytes_without_checkpointing

    cfg, preset = Config(), dict(PRESETS["qwen3-8b"])
    arch = drafter_arch(preset, drafter_shape(preset, 4096, 5, 16), 2048)
    need = step_bytes_without_checkpointing(cfg, arch, colocated=False, num_drafters=1)
    d = drafter_shape(preset, 4096, 5, 16)
    s = mm.StepShape(batch=8, seq_len=2048, anchors_per_row=256, chunk_blocks=64, dtype_bytes=2, checkpointing=False,
                     dense_mask=False, cuda=True)
    assert need == mm.micro_step_peak(d, s, param_grads=False) + sum(mm.static_terms(d, 16384, 2, 1).values())
    assert round(need / 1e9, 1) == 64.3  # the figure runtime/checkpointing.py states
    cuda = torch.device("cuda")
    assert choose_checkpointing(cfg, arch, torch.device("cpu"))[0] is False
    assert choose_checkpointing(cfg, arch, cuda, free_bytes=int(need / 0.85) + 1)[0] is False
    # short of that: the fewest layers recomputed (the first ones) that let the step fit
    by_k = [step_bytes(cfg, arch, colocated=False, num_drafters=1, recomputed=k) for k in range(6)]
    assert by_k[0] == need and all(a > b for a, b in zip(by_k, by_k[1:]))
    on, layers, why = choose_checkpointing(cfg, arch, cuda, free_bytes=int(need / 0.85) - 1)
    assert (on, layers) == (True, 1) and "on for 1 of 5 layers" in why and "within 85%" in why
    assert choose_checkpointing(cfg, arch, cuda, free_bytes=int(by_k[3] / 0.85) + 1)[:2] == (True, 3)
    assert choose_checkpointing(cfg, arch, cuda, free_bytes=int(by_k[3] / 0.85) - 1)[:2] == (True, 4)
    on, layers, why = choose_checkpointing(cfg, arch, cuda, free_bytes=int(by_k[5] / 0.85) - 1)  # none fits: all
    assert (on, layers) == (True, 5) and "over 85%" in why
    # each layer kept holds its activations and context K/V where a recomputed one holds its input (flex, bf16:
    # the peak is in the loss phase between the ends)
    t, c, (a_tok, c_tok) = 8 * 256 * 16, 16384, mm.per_token_activations(d, 2)
    assert by_k[2] - by_k[3] == pytest.approx(t * a_tok + c * c_tok - t * 4096 * 2)
    colocated = step_bytes_without_checkpointing(cfg, arch, colocated=True, num_drafters=1)
    assert need - colocated == pytest.approx(2 * 151936 * 4096 * 2 + 7 * 16384 * 5 * 4096 * 2)  # head, 7 buffers
    two = step_bytes_without_checkpointing(cfg, arch, colocated=False, num_drafters=2)
    assert need - two == pytest.approx(7 * mm.drafter_params(d))  # ZeRO-2 halves the 14 bytes per parameter
    forced = replace(cfg, model=replace(cfg.model, activation_checkpointing=False))
    assert choose_checkpointing(forced, arch, cuda, free_bytes=1) == (False, None, "model.activation_checkpointing = false")
    partial = replace(cfg, model=replace(cfg.model, activation_checkpointing=True, checkpoint_layers=2))
    assert choose_checkpointing(partial, arch, cuda, free_bytes=1) == (
        True, 2, "model.activation_checkpointing = true, model.checkpoint_layers = 2 of 5")
    auto2 = replace(cfg, model=replace(cfg.model, checkpoint_layers=2))
    assert choose_checkpointing(auto2, arch, cuda, free_bytes=1)[:2] == (True, 2)  # needed: the configured count
    assert choose_checkpointing(auto2, arch, cuda, free_bytes=int(need / 0.85) + 1)[:2] == (False, None)
