"""eval --engine vllm: the export served as vLLM's DFlash drafter is lossless, and vLLM's acceptance length
equals dflash-ds eval's tau_pooled on the same prompts (within 1%), for a full and an all-sliding layout
(the sliding one on a drafter whose heads, head width and MLP width are not the target's). Both share one
--plain-cache: the full case serves the target plain and keeps its outputs, the sliding case checks against
them without starting a plain server."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dflash_ds.cli import main


def with_layers(export: Path, out: Path, layer_types: list[str], window: int | None) -> Path:
    shutil.copytree(export, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["layer_types"] = layer_types
    if window:
        cfg.update(sliding_window=window, use_sliding_window=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


@pytest.fixture(scope="module")
def held_out(tmp_path_factory) -> Path:
    from dflash_ds.tiny.corpus import tiny_prompts

    path = tmp_path_factory.mktemp("served_eval") / "held_out.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in tiny_prompts(12, seed=11)))
    return path


@pytest.fixture(scope="module")
def plain_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("plain_cache")


@pytest.mark.parametrize("layout", ["full", "sliding"])
def test_served_acceptance_equals_eval_and_is_lossless(vllm_python, eos_target, served_drafter, own_heads_drafter,
                                                      held_out, plain_cache, tmp_path, layout, capsys):
    drafter = served_drafter if layout == "full" else \
        with_layers(own_heads_drafter, tmp_path / "swa", ["sliding_attention"] * 2, window=12)
    if layout == "sliding":
        cfg = json.loads((drafter / "config.json").read_text())
        shape = [cfg[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")]
        assert shape == [2, 1, 64, 192]  # the target's: 4, 2, 32, 256 (vLLM's CPU attention has no head_dim 16)
    report = tmp_path / "eval.json"
    cached_before = sorted(plain_cache.iterdir())
    # The servers' logs: where --vllm-log says (full), else beside --json (sliding: eval.vllm/)
    logs = tmp_path / "logs" if layout == "full" else tmp_path / "eval.vllm"
    assert main(["eval", "--engine", "vllm", "--target", str(eos_target), "--drafter", str(drafter), "--data",
                 str(held_out), "--num-prompts", "12", "--max-new-tokens", "64", "--json", str(report),
                 *(["--vllm-log", str(logs)] if layout == "full" else []), "--plain-cache", str(plain_cache)]) == 0
    r = json.loads(report.read_text())
    served = r["vllm"]
    assert served["mismatches"] == [] and r["mismatches"] == []  # lossless, in vLLM and in dflash-ds
    assert served["generated_tokens"] == r["generated_tokens"]
    assert served["drafts"] > 300 and served["accepted_tokens"] > 20  # speculation ran, drafts got accepted
    assert abs(served["drafts"] - r["decode_steps"]) <= 0.01 * r["decode_steps"]
    assert served["mean_acceptance_length"] == pytest.approx(r["tau_pooled"], rel=0.01)
    assert len(served["per_position_acceptance"]) == 7
    assert served["per_position_acceptance"][0] == pytest.approx(r["per_position_acceptance"][0], abs=0.01)
    table = capsys.readouterr().out
    assert "vllm (served)" in table and "dflash-ds eval" in table and "equal plain serving token for token" in table
    assert (logs / "vllm_dflash.log").exists()
    assert served["speculative_config"] == {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 7}
    [cached] = sorted(plain_cache.iterdir())  # one target, one prompt set, one setting: one file
    if layout == "full" or not cached_before:  # the full case; the sliding one run alone (-k sliding)
        assert cached_before == [] and not served["plain_reused"]
        assert (logs / "vllm_plain.log").exists()
    else:  # the sliding case after the full one: its plain reference, no plain server
        assert served["plain_reused"] and served["plain_reused_from"] == str(cached)
        assert not (logs / "vllm_plain.log").exists()
        assert f"plain reference reused from {cached}" in table


def test_a_mixed_layout_gets_one_clear_message_on_a_cpu(vllm_python, eos_target, served_drafter, held_out, tmp_path,
                                                         capsys):
    drafter = with_layers(served_drafter, tmp_path / "mixed", ["sliding_attention", "full_attention"], window=12)
    assert main(["eval", "--engine", "vllm", "--target", str(eos_target), "--drafter", str(drafter), "--data",
                 str(held_out)]) == 2
    err = capsys.readouterr().err
    assert "VLLM_USE_V2_MODEL_RUNNER=1" in err and "Triton" in err and len(err.strip().splitlines()) == 1
