"""A dflash-ds DFlash2 export, loaded by vLLM's own model class and loader (.venv-serve), computes what dflash-ds
computes: the grouped convolutions, the candidate head (top-K, output_multiplier, soft cap), the selector's
edge scores, and the walk's drafts. vLLM serves DFlash2 on GPU only (Triton): its plain-torch paths are
what is compared here (vllm_dflash2_probe.py says how the model is built on CPU).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_ds.models.dflash2_arch import DFlash2Options
from dflash_ds.models.drafter import DFlashDrafter
from dflash_ds.models.from_target import drafter_arch_from_target

PROBE = Path(__file__).with_name("vllm_dflash2_probe.py")
TOL = 1e-5  # fp32 both sides; measured: convs within 2.4e-6 (values to 16, a reordered sum), scores bitwise equal
OPTS = DFlash2Options(conv_kernel_size=3, conv_group_size=16, selector_rank=8, selector_top_k=4,
                      output_multiplier=1.5, final_logit_softcapping=5.0)


def _random_dflash2(target: Path, block_size: int) -> DFlashDrafter:
    """A DFlash2 drafter whose convolutions and selector are far from their identity init."""
    arch = drafter_arch_from_target(target, num_layers=2, block_size=block_size)
    arch.options = OPTS
    drafter = DFlashDrafter(arch)
    drafter.init_weights(0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "_conv." in name or name.startswith("candidate_selector."):
                p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if "base_kernel" in name else 0.2))
    return drafter.eval()


def test_vllm_loads_dflash2_export_and_agrees(vllm_python: str, tiny_target: Path, tmp_path: Path) -> None:
    block = 4
    drafter = _random_dflash2(tiny_target, block)
    export = drafter.save_pretrained(tmp_path / "export")
    h = drafter.arch.hidden_size
    gen = torch.Generator().manual_seed(2)
    # Two requests of one block each (vLLM's rows: request-major, block_size query tokens per request).
    inputs = {"num_speculative_tokens": block - 1, "conv_x": torch.randn(2 * block, h, generator=gen),
              "conv_y": torch.randn(2 * block, h, generator=gen),
              "hidden": torch.randn(2, block - 1, h, generator=gen), "anchor_ids": torch.tensor([7, 300])}
    torch.save(inputs, tmp_path / "inputs.pt")
    proc = subprocess.run([vllm_python, str(PROBE), str(tiny_target), str(export), str(tmp_path / "inputs.pt"),
                           str(tmp_path / "out.pt")], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt")
    assert got["class"] == "DFlash2Qwen3ForCausalLM"

    # vLLM's loader refused unexpected names, misshapen tensors and parameters left unfilled (the probe got
    # this far). The DFlash2 parts are vLLM parameters of the same names and shapes as exported (the backbone
    # is stacked there, q/k/v into qkv_proj, as for DFlash).
    def dflash2_parts(names: dict) -> dict:
        return {k: v for k, v in names.items() if "_conv." in k or ".candidate_selector." in k}

    ours = {f"model.{k}": tuple(v.shape) for k, v in drafter.state_dict().items()}
    assert dflash2_parts(ours) == dflash2_parts(got["params"])
    assert len(dflash2_parts(ours)) == 2 * 2 * 2 + 3  # 2 layers x 2 convs x 2 tensors, 3 selector tensors

    with torch.no_grad():
        for i, layer in enumerate(drafter.layers):
            for side in ("attention_conv", "mlp_conv"):
                conv = getattr(layer, side)
                pre, delta = conv.prepare(inputs["conv_x"].view(2, block, h))
                post = conv.finish(inputs["conv_y"].view(2, block, h), delta)
                v_pre, v_post = got["convs"][f"{i}.{side}"]
                torch.testing.assert_close(pre.reshape(-1, h), v_pre, atol=TOL, rtol=TOL)
                torch.testing.assert_close(post.reshape(-1, h), v_post, atol=TOL, rtol=TOL)
        head = lambda x: x @ _target_head(tiny_target).T  # noqa: E731
        draft = drafter.draft_tokens(inputs["hidden"], head, inputs["anchor_ids"])
        tokens, ids = draft.tokens, draft.candidates
        _, scores = drafter.block_scores(inputs["hidden"], head, inputs["anchor_ids"])
    assert torch.equal(ids, got["candidate_ids"])
    torch.testing.assert_close(scores, got["scores"], atol=TOL, rtol=TOL)
    assert torch.equal(tokens, got["tokens"])
    # The selector changes the drafts here: the walk is not the per-position argmax of the unary scores.
    assert not torch.equal(tokens, ids[..., 0]) or pytest.fail("inputs too easy: walk == unary argmax")


def _target_head(target: Path) -> torch.Tensor:
    from safetensors.torch import load_file

    w = load_file(str(target / "model.safetensors"))
    return w.get("lm_head.weight", w.get("model.embed_tokens.weight"))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
