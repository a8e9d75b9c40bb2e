"""A dflash-ds DSpark export is served as DSpark: VLLMServer (what `eval --engine vllm` starts) passes method
"dspark" with block_size - 1 drafts; that config, on the unmodified export, goes through vLLM's own config path
and DSpark loader (`load_dspark_model`) in .venv-serve, and the model it builds drafts what dflash-ds drafts: the
same Markov bias, the same sequential tokens (dense and vLLM's top-k path), the same confidences.

What runs on this CPU (vllm_dspark_probe.py): vLLM's engine config in full but for its V1 model runner's refusal of
DSpark, lifted (vLLM serves DSpark on its V2 runner only: Triton kernels, a GPU), then vLLM's loader and model
class. What does not: a DSpark server and its speculator's Triton kernels; `eval --engine vllm` on a DSpark export
refuses this CPU with one line before any model loads, and asks a GPU for the V2 runner."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from dflash_ds.cli import main
from dflash_ds.models.drafter import DFlashDrafter
from dflash_ds.models.dspark_arch import DSparkOptions
from dflash_ds.models.from_target import drafter_arch_from_target
from dflash_ds.serving.vllm_server import VLLMServer

PROBE = Path(__file__).with_name("vllm_dspark_probe.py")
TOL = 1e-4  # fp32 both sides, logits of size ~10 (the bias is a sum over the rank in another order)


def test_vllm_loads_dspark_export_and_drafts_as_ours(vllm_python: str, tiny_target: Path, tmp_path: Path) -> None:
    block, rank = 5, 16
    arch = drafter_arch_from_target(tiny_target, num_layers=2, block_size=block,
                                    options=DSparkOptions(markov_rank=rank))
    drafter = DFlashDrafter(arch)
    drafter.init_weights(0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a Markov head and a confidence head far from their init: the bias decides drafts
        for p in (*drafter.markov_head.parameters(), *drafter.confidence_head.parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    drafter.eval()
    export = drafter.save_pretrained(tmp_path / "export")
    cfg = json.loads((export / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["markov_rank"] == rank
    assert cfg["sample_from_anchor"] is False and cfg["enable_confidence_head"] is True
    # What the server is started with: DSpark's method, the layout's draft length (vLLM's default is block_size).
    server = VLLMServer(tiny_target, drafter=export, python=vllm_python)
    spec = json.loads(server.cmd[server.cmd.index("--speculative-config") + 1])
    assert spec == {"method": "dspark", "model": str(export), "num_speculative_tokens": block - 1}
    inputs = {"speculative_config": spec, "hidden": torch.randn(3, block - 1, arch.hidden_size, generator=gen),
              "anchor_ids": torch.tensor([7, 300, 41]), "topk": 8}
    torch.save(inputs, tmp_path / "inputs.pt")
    proc = subprocess.run([vllm_python, str(PROBE), str(tiny_target), str(tmp_path / "inputs.pt"),
                           str(tmp_path / "out.pt")], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt")
    # vLLM's config path took it as DSpark in the fill-in layout: the anchor a bonus token, then B - 1 drafts.
    assert (got["method"], got["num_speculative_tokens"], got["architectures"]) == \
        ("dspark", block - 1, ["Qwen3DSparkModel"])
    assert got["sample_from_anchor"] is False and got["num_lookahead_tokens"] == block
    assert got["class"] == "Qwen3DSparkForCausalLM" and got["has_confidence_head"] and got["shares_target_head"]
    # vLLM's loader refused unexpected names, misshapen tensors and unfilled parameters (the probe got this far);
    # the DSpark parts are vLLM parameters of the names and shapes we export.
    heads = {k: v for k, v in got["params"].items() if ".markov_head." in k or ".confidence_head." in k}
    ours = {f"model.{k}": tuple(v.shape) for k, v in drafter.state_dict().items()
            if k.startswith(("markov_head.", "confidence_head."))}
    assert heads == ours and len(ours) == 4, (heads, ours)

    from safetensors.torch import load_file

    w = load_file(str(tiny_target / "model.safetensors"))
    head_w = w.get("lm_head.weight", w.get("model.embed_tokens.weight"))
    with torch.no_grad():
        draft = drafter.draft_tokens(inputs["hidden"], lambda x: x @ head_w.T, inputs["anchor_ids"])
    torch.testing.assert_close(draft.logits, got["dense_logits"], atol=TOL, rtol=TOL)
    assert torch.equal(draft.tokens, got["dense_tokens"])
    torch.testing.assert_close(draft.confidence, got["dense_confidence"], atol=1e-5, rtol=1e-5)
    # The bias decides: the chain is not the backbone's per-position argmax.
    assert not torch.equal(draft.tokens, (inputs["hidden"] @ head_w.T).argmax(-1))
    # vLLM's top-k path (dspark_draft_topk): the bias on the backbone's top-k only. Wherever the two chains have
    # drafted the same tokens so far (position 0 always: the anchor), its logits on the kept candidates are ours.
    same = torch.ones(3, 1, dtype=torch.bool)
    same = torch.cat([same, (got["topk_tokens"] == draft.tokens).long().cumprod(1)[:, :-1].bool()], dim=1)
    kept = torch.isfinite(got["topk_logits"]) & same[..., None]
    assert kept[:, 0].sum() == 3 * inputs["topk"]
    torch.testing.assert_close(got["topk_logits"][kept], draft.logits[kept], atol=TOL, rtol=TOL)


def test_eval_engine_vllm_serves_dspark_on_the_v2_runner(tiny_target: Path, tmp_path: Path, monkeypatch,
                                                         capsys) -> None:
    """On this CPU, one line before any model loads; on a GPU, the V2 runner (its DSpark speculator) is asked for."""
    from dflash_ds.eval import served

    arch = drafter_arch_from_target(tiny_target, num_layers=1, block_size=4, options=DSparkOptions(markov_rank=4))
    export = DFlashDrafter(arch).save_pretrained(tmp_path / "export")
    assert main(["eval", "--engine", "vllm", "--target", str(tiny_target), "--drafter", str(export), "--data",
                 str(tmp_path / "absent.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "a dspark drafter (Qwen3DSparkModel)" in err and "V2 model runner" in err and "--engine dflash" in err
    assert len(err.strip().splitlines()) == 1
    monkeypatch.setattr(served, "on_cpu", lambda: False)
    assert served.serving_env(export) == {"VLLM_USE_V2_MODEL_RUNNER": "1"}


def test_speculative_config_fields_merge_and_the_draft_length_is_bounded(vllm_python: str, tiny_target: Path,
                                                                          tmp_path: Path) -> None:
    """A --speculative-config among the extra arguments (`--vllm-arg`, either spelling) adds its fields to the
    export's, and a draft length past the block (vLLM would draft into untrained slots) is refused; no server.
    (vLLM's own config refuses enable_adaptive_verification on this CPU: V2 runner and full CUDA graphs only.)"""
    from dflash_ds.errors import DFlashError

    arch = drafter_arch_from_target(tiny_target, num_layers=1, block_size=4, options=DSparkOptions(markov_rank=4))
    export = DFlashDrafter(arch).save_pretrained(tmp_path / "export")
    server = VLLMServer(tiny_target, drafter=export, python=vllm_python, draft_sample="probabilistic",
                        extra_args=["--max-num-seqs", "2", '--speculative-config={"num_speculative_tokens": 2, '
                                    '"enable_adaptive_verification": true}'])
    assert server.cmd[-2:] == ["--max-num-seqs", "2"] and server.cmd.count("--speculative-config") == 1
    assert server.speculative_config == {"method": "dspark", "model": str(export), "num_speculative_tokens": 2,
                                         "draft_sample_method": "probabilistic", "enable_adaptive_verification": True}
    for extra in (['--speculative-config={"num_speculative_tokens": 4}'], ["--speculative-config", "[1]"]):
        with pytest.raises(DFlashError, match="drafts 1..3 tokens|not a JSON object"):
            VLLMServer(tiny_target, drafter=export, python=vllm_python, extra_args=extra)
    with pytest.raises(DFlashError, match="drafts 1..3 tokens a block"):
        VLLMServer(tiny_target, drafter=export, python=vllm_python, num_speculative_tokens=7)
    plain = VLLMServer(tiny_target, python=vllm_python, extra_args=["--speculative-config", '{"method": "ngram"}',
                                                                    "--max-num-seqs", "2"])
    # no drafter (eval's and bench speedup's plain reference): the drafter's fields are dropped, plain stays plain
    assert "--speculative-config" not in plain.cmd and plain.cmd[-2:] == ["--max-num-seqs", "2"]
    assert plain.speculative_config is None
