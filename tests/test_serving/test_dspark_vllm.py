"""A dflash-ds DSpark export, loaded by vLLM's own model class and loader (.venv-serve), drafts what dflash-ds
drafts: the same Markov bias, the same sequential tokens (dense and vLLM's top-k path), the same confidences.
vLLM serves DSpark on GPU only (its V2 runner needs Triton): its plain-torch model code is what is compared here
(vllm_dspark_probe.py says how the model is built on CPU)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import torch

from dflash_ds.models.drafter import DFlashDrafter
from dflash_ds.models.dspark_arch import DSparkOptions
from dflash_ds.models.from_target import drafter_arch_from_target

PROBE = Path(__file__).with_name("vllm_dspark_probe.py")
TOL = 1e-4  # fp32 both sides, logits of size ~10 (the bias is a sum over the rank in another order)


def test_vllm_loads_dspark_export_and_drafts_as_ours(vllm_python: str, tiny_target: Path, tmp_path: Path) -> None:
    block, rank = 5, 16
    arch = drafter_arch_from_target(tiny_target, num_layers=2, block_size=block,
                                    dspark=DSparkOptions(markov_rank=rank))
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
    inputs = {"num_speculative_tokens": block - 1, "hidden": torch.randn(3, block - 1, arch.hidden_size,
                                                                          generator=gen),
              "anchor_ids": torch.tensor([7, 300, 41]), "topk": 8}
    torch.save(inputs, tmp_path / "inputs.pt")
    proc = subprocess.run([vllm_python, str(PROBE), str(tiny_target), str(export), str(tmp_path / "inputs.pt"),
                           str(tmp_path / "out.pt")], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt")
    assert got["class"] == "Qwen3DSparkForCausalLM" and got["has_confidence_head"]
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
