"""DeepSpec's anchor-as-first DSpark layout: a checkpoint made to its names and shapes converts
(`dflash-ds convert-deepspec`), loads, drafts as DeepSpec's backbone does, and trains and serves as its layout says.

The checkpoint is built here from our own export: what that layout is assumed to be, and where it was read, is
in dflash_ds/models/deepspec.py's docstring (vLLM 0.32's `qwen3_dspark.py` load_weights,
`config/speculative.py`, `spec_decode/dspark/speculator.py` and the SAMPLE_FROM_ANCHOR branch of
`_prepare_dflash_inputs_kernel`: block_size N is N query tokens [anchor, MASK x (N-1)] at positions a..a+N-1,
query i predicting a+i+1). The variations of names tried: config keys at the top level (no dflash_config, no
num_target_layers, no sample_from_anchor), the mask id and target layers as DeepSpec writes them (mask_token_id,
target_layer_ids) and as vLLM also reads them (dspark_noise_token_id, dspark_target_layer_ids), and the extra tensors
embed_tokens / lm_head / mask_embedding / t2d beside the drafter's own.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_ds.errors import DFlashError
from dflash_ds.models.drafter import DFlashDrafter
from dflash_ds.models.dspark_arch import DSparkOptions
from dflash_ds.models.from_target import drafter_arch_from_target
from dflash_ds.models.deepspec import convert_deepspec

N = 4  # DeepSpec's block_size: drafts a block


def _deepspec_checkpoint(tiny_target: Path, folder: Path, keys: str = "vllm") -> DFlashDrafter:
    """A DSpark drafter written as DeepSpec's layout would hold it; returns the drafter. keys "vllm": the mask id and
    target layers under the names vLLM also reads (dspark_noise_token_id, dspark_target_layer_ids); "deepspec": the
    top-level mask_token_id / target_layer_ids DeepSpec itself writes."""
    arch = drafter_arch_from_target(tiny_target, num_layers=1, block_size=N + 1,
                                    options=DSparkOptions(markov_rank=4, sample_from_anchor=True))
    drafter = DFlashDrafter(arch)
    drafter.init_weights(0)
    ours = drafter.save_pretrained(folder / "ours")
    cfg = json.loads((ours / "config.json").read_text())
    assert cfg["block_size"] == N and cfg["sample_from_anchor"] is True  # the export keeps DeepSpec's meaning
    d = cfg.pop("dflash_config")
    for key in ("num_target_layers", "sample_from_anchor", "dspark_bonus_anchor"):
        cfg.pop(key)
    if keys == "vllm":
        cfg.update(dspark_noise_token_id=d["mask_token_id"], dspark_target_layer_ids=d["target_layer_ids"])
    else:
        cfg.update(mask_token_id=d["mask_token_id"], target_layer_ids=d["target_layer_ids"])
    src = folder / "deepspec"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(ours / "model.safetensors"))
    v, h = arch.vocab_size, arch.hidden_size
    tensors.update({"embed_tokens.weight": torch.zeros(v, h), "lm_head.weight": torch.zeros(v, h),
                    "mask_embedding": torch.zeros(h), "t2d": torch.ones(v, dtype=torch.bool)})
    save_file(tensors, str(src / "model-00001-of-00001.safetensors"))
    return drafter


def test_deepspec_checkpoint_converts_and_drafts_as_deepspec(tiny_target: Path, tmp_path: Path) -> None:
    from dflash_ds.serving.vllm_server import speculative_config

    original = _deepspec_checkpoint(tiny_target, tmp_path)
    out = convert_deepspec(tmp_path / "deepspec", tmp_path / "conv", target=tiny_target)
    conv = DFlashDrafter.from_pretrained(out)
    assert conv.kind == "dspark" and conv.arch.block_size == N + 1 and conv.arch.options.sample_from_anchor
    for name, tensor in original.state_dict().items():
        torch.testing.assert_close(conv.state_dict()[name], tensor, rtol=0, atol=0)
    assert speculative_config(out) == {"method": "dspark", "model": str(out), "num_speculative_tokens": N}

    # DeepSpec's backbone, written independently: the plain DFlash stack on the N query tokens [anchor, MASK x
    # (N-1)] at positions start..start+N-1; query i is the state draft slot i + 1 reads
    arch, gen = conv.arch, torch.Generator().manual_seed(1)
    backbone = DFlashDrafter(drafter_arch_from_target(tiny_target, num_layers=1, block_size=N))
    backbone.load_state_dict({k: v for k, v in conv.state_dict().items() if k in backbone.state_dict()})
    start, h = 6, arch.hidden_size
    ctx = torch.randn(1, start, len(arch.target_layer_ids) * h, generator=gen)
    block = torch.randn(1, N + 1, h, generator=gen)
    with torch.no_grad():
        ref = backbone.forward_infer(ctx, block[:, :N], start)
        got = conv.forward_infer(ctx, block, start)
        torch.testing.assert_close(got[:, 1:], ref)
        # training's path (every block of a batch under the block mask) agrees with inference's
        ctx_t = torch.cat([ctx, torch.randn(1, 10, ctx.shape[-1], generator=gen)], dim=1)
        train = conv.forward_train(ctx_t, block[:, None], torch.tensor([[start]]))
        torch.testing.assert_close(train[0, 0, 1:], got[0, 1:], atol=1e-5, rtol=1e-5)

    # eval drafts with it (lossless against greedy decoding); it fine-tunes on the recipe its folder's kind takes
    from dflash_ds.eval.speculative import greedy_generate, speculative_generate
    from dflash_ds.models.target import load_target

    target = load_target(str(tiny_target), dtype=torch.float32, device="cpu")
    prompt = [1, 5, 9, 13]
    spec = speculative_generate(target, prompt, drafter=conv.eval(), max_new_tokens=8)
    assert spec.tokens == greedy_generate(target, prompt, 8, set())[: len(spec.tokens)]
    assert all(1 <= n <= N + 1 for n in spec.accept_lengths)
    from dflash_ds.components.objective import TargetStates, drafter_objective
    from dflash_ds.config import load_config

    ids = torch.randint(0, arch.vocab_size, (1, 16), generator=gen)
    states = TargetStates(ids, torch.ones(1, 16, dtype=torch.long), torch.tensor([16]),
                          torch.randn(1, 16, ctx.shape[-1], generator=gen), torch.randn(1, 16, h, generator=gen))
    loss_cfg = load_config(None, ["--drafter", str(out), "--loss.num_anchors", "3"]).loss  # the folder's recipe
    assert (loss_cfg.lk, loss_cfg.gamma) == ("l1", 4.0)
    head = torch.nn.Linear(h, arch.vocab_size, bias=False)
    terms, _ = drafter_objective(conv.train(), torch.nn.Embedding(arch.vocab_size, h), head, states, loss_cfg,
                                 anchor_gen=torch.Generator().manual_seed(0))
    terms.loss.backward()
    assert torch.isfinite(terms.loss) and conv.layers[0].mlp.down_proj.weight.grad.abs().max() > 0


def test_deepspecs_own_key_names_convert_and_a_raw_folder_names_the_converter(tiny_target: Path,
                                                                                tmp_path: Path) -> None:
    """DeepSpec's own config keys (top-level mask_token_id, target_layer_ids) convert to the same export as vLLM's
    names; the raw folder, given where an export goes, fails naming `convert-deepspec`."""
    from dflash_ds.models.drafter import read_drafter_arch

    original = _deepspec_checkpoint(tiny_target, tmp_path, keys="deepspec")
    src = tmp_path / "deepspec"
    assert "dspark_noise_token_id" not in json.loads((src / "config.json").read_text())
    conv = DFlashDrafter.from_pretrained(convert_deepspec(src, tmp_path / "conv", target=tiny_target))
    assert (conv.arch.mask_token_id, conv.arch.target_layer_ids) == (original.arch.mask_token_id,
                                                                       original.arch.target_layer_ids)
    for name, tensor in original.state_dict().items():
        torch.testing.assert_close(conv.state_dict()[name], tensor, rtol=0, atol=0)
    with pytest.raises(DFlashError, match="missing field 'dflash_config'.*dflash-ds convert-deepspec SRC --out DIR"):
        read_drafter_arch(src)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "architectures": ["DSparkDraftModel"]}))
    with pytest.raises(DFlashError, match="convert-deepspec"):
        DFlashDrafter.from_pretrained(src)
    (src / "config.json").write_text(json.dumps({**cfg, "architectures": ["DFlashDraftModel"]}))
    with pytest.raises(DFlashError, match="missing field 'dflash_config' of a DFlash drafter config$"):
        read_drafter_arch(src)  # no hint where no kind's converter applies


def test_convert_refusals(tiny_target: Path, tmp_path: Path) -> None:
    _deepspec_checkpoint(tiny_target, tmp_path)
    src = tmp_path / "deepspec"
    with pytest.raises(DFlashError, match="no num_target_layers"):
        convert_deepspec(src, tmp_path / "x")  # the config has no depth and no --target was given
    tensors = load_file(str(src / "model-00001-of-00001.safetensors"))
    save_file({**tensors, "d2t": torch.zeros(3, dtype=torch.long)}, str(src / "model-00001-of-00001.safetensors"))
    with pytest.raises(DFlashError, match="reduced draft vocabulary"):
        convert_deepspec(src, tmp_path / "y", target=tiny_target)
