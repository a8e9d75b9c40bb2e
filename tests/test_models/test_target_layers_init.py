"""`init-drafter --layers-from-target`: the draft layers start as the target's last layers (models/
target_layers_init.py), read from the target's safetensors, on the tiny Qwen3 target (q/k norms copied too) and
the real Llama one (SmolLM2: its q/k norms stay at one)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file


def _target_tensors(target: Path) -> dict[str, torch.Tensor]:
    return {k.removeprefix("model."): v.float() for k, v in load_file(str(target / "model.safetensors")).items()}


@pytest.mark.parametrize("which", ["tiny", "real"])
def test_draft_layers_are_the_targets_last_layers(which, tiny_target, real_target, cli_here, tmp_path):
    from dflash_ds.models.drafter import DFlashDrafter
    from dflash_ds.models.target import read_target_config

    target = tiny_target if which == "tiny" else real_target
    r = cli_here("init-drafter", "--target", target, "--out", tmp_path / "d", "--num-layers", "2",
                 "--block-size", "8", "--layers-from-target", *(["--mask-token-id", "16"] if which == "real" else []))
    assert r.returncode == 0, r.stderr
    d = DFlashDrafter.from_pretrained(tmp_path / "d").float()
    t, total = _target_tensors(target), int(read_target_config(target)["num_hidden_layers"])
    got = {k: v.float() for k, v in d.state_dict().items()}
    copied = 0
    for i, src in enumerate((total - 2, total - 1)):
        for name, value in got.items():
            if name.startswith(f"layers.{i}."):
                theirs = t.get(name.replace(f"layers.{i}.", f"layers.{src}.", 1))
                if theirs is None:  # a norm the Llama target does not have: at one
                    assert name.endswith(("q_norm.weight", "k_norm.weight")) and which == "real", name
                    assert torch.equal(value, torch.ones_like(value)), name
                else:
                    assert torch.equal(value, theirs), name
                    copied += 1
    assert copied == 2 * (11 if which == "tiny" else 9), copied  # Qwen3's q/k norms too
    assert torch.equal(got["hidden_norm.weight"], t[f"layers.{total - 2}.input_layernorm.weight"])
    assert torch.equal(got["norm.weight"], t["norm.weight"])
    h = d.arch.hidden_size
    want_fc = torch.zeros_like(got["fc.weight"])
    want_fc[:, -h:] = torch.eye(h)
    assert torch.equal(got["fc.weight"], want_fc)  # the last context layer passed through
    assert d.arch.target_layer_ids[-1] == total - 3 or which == "tiny", d.arch.target_layer_ids


def test_a_drafter_of_other_widths_is_refused_naming_the_tensor(tiny_target, cli_here, tmp_path):
    r = cli_here("init-drafter", "--target", tiny_target, "--out", tmp_path / "d", "--num-layers", "1",
                 "--layers-from-target", "--intermediate-size", "24")
    assert r.returncode != 0 and not (tmp_path / "d").exists()
    assert "layers.0.mlp.gate_proj.weight is (24," in r.stderr and "need the target's widths" in r.stderr, r.stderr
    r = cli_here("init-drafter", "--from", tmp_path, "--out", tmp_path / "e", "--layers-from-target")
    assert r.returncode != 0 and "drop --target and --layers-from-target" in r.stderr, r.stderr


def test_model_init_target_gives_the_trainer_the_same_drafter(tiny_target, cli_here, tmp_path):
    """`model.init: target` (the trainer's fresh drafter, runtime/engine.load_drafter) starts where `init-drafter
    --layers-from-target` does; a value other than random or target is refused naming the field."""
    from pathlib import Path

    from dflash_ds.config import load_config
    from dflash_ds.errors import DFlashError
    from dflash_ds.models.drafter import DFlashDrafter
    from dflash_ds.runtime.engine import load_drafter
    from dflash_ds.runtime.job import resolve_arch

    tiny = Path(__file__).resolve().parents[2] / "configs/tiny.yaml"
    cfg = load_config(tiny, {"target": str(tiny_target), "model": {"init": "target"}})
    arch = resolve_arch(cfg)
    trained_from = {k: v.float() for k, v in load_drafter(cfg, arch).state_dict().items()}
    r = cli_here("init-drafter", "--target", tiny_target, "--out", tmp_path / "d", "--num-layers",
                 arch.num_hidden_layers, "--block-size", arch.block_size, "--mask-token-id", arch.mask_token_id,
                 "--seed", cfg.train.seed, "--layers-from-target")
    assert r.returncode == 0, r.stderr
    exported = {k: v.float() for k, v in DFlashDrafter.from_pretrained(tmp_path / "d").state_dict().items()}
    assert sorted(trained_from) == sorted(exported)
    assert all(torch.equal(trained_from[k], exported[k]) for k in exported)  # the tiny target is fp32
    random = load_config(tiny, {"target": str(tiny_target)})
    assert not torch.equal(load_drafter(random, arch).state_dict()["layers.0.mlp.up_proj.weight"].float(),
                           trained_from["layers.0.mlp.up_proj.weight"])
    with pytest.raises(DFlashError, match="model.init"):
        load_config(tiny, {"target": str(tiny_target), "model": {"init": "targets"}})


def test_default_layer_ids_end_at_the_first_copied_layers_input(real_target):
    """With the layers from the target and no ids given, the last context layer (the one `fc` passes through) is the
    input of the first copied layer, in init-drafter and the trainer alike: 4 draft layers on SmolLM2's 30 read
    [1, 9, 17, 25] (layer 25 feeds layer 26, the first copied), not the random init's [1, 10, 18, 27]."""
    from pathlib import Path

    from dflash_ds.config import load_config
    from dflash_ds.models.drafter_arch import default_target_layer_ids
    from dflash_ds.models.from_target import drafter_arch_from_target
    from dflash_ds.runtime.job import resolve_arch

    def ids(**kw):
        arch = drafter_arch_from_target(real_target, num_layers=4, block_size=8, mask_token_id=16, **kw)
        return arch.target_layer_ids

    assert ids(layers_from_target=True) == [1, 9, 17, 25] and ids() == [1, 10, 18, 27]
    assert ids(layers_from_target=True, target_layer_ids=[2, 4, 6, 8]) == [2, 4, 6, 8]  # given ids are kept
    tiny = Path(__file__).resolve().parents[2] / "configs/tiny.yaml"
    model = {"num_layers": 4, "block_size": 8, "mask_token_id": 16}
    cfg = load_config(tiny, {"target": str(real_target), "model": {**model, "init": "target"}})
    assert resolve_arch(cfg).target_layer_ids == [1, 9, 17, 25]
    random = load_config(tiny, {"target": str(real_target), "model": model})
    assert resolve_arch(random).target_layer_ids == [1, 10, 18, 27]
    # Qwen3-8B's 36 layers, 5 draft layers; one draft layer reads the input of the last; a shallow target keeps the rule
    assert default_target_layer_ids(36, 5, from_target=True) == [1, 8, 16, 23, 30]
    assert default_target_layer_ids(30, 1, from_target=True) == [28]
    assert default_target_layer_ids(4, 2, from_target=True) == default_target_layer_ids(4, 2) == [1, 2]
