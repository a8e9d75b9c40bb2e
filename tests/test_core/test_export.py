"""init-drafter output against the export format of docs/DESIGN.md §2, and its bad-input errors."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from dflash_ds.errors import DFlashError
from dflash_ds.tools.init_drafter import init_drafter
from dflash_ds.models.from_target import pick_mask_token_id
from dflash_ds.models.drafter import DFlashDrafter, default_target_layer_ids

CONFIG_FIELDS = {"block_size", "num_target_layers", "dflash_config", "architectures", "rope_theta", "hidden_size",
                 "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "vocab_size", "rms_norm_eps", "max_position_embeddings", "model_type", "tie_word_embeddings"}


def expected_tensor_names(n_layers):
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(n_layers):
        p = f"layers.{i}."
        names |= {p + f"self_attn.{x}_proj.weight" for x in "qkvo"}
        names |= {p + f"self_attn.{x}_norm.weight" for x in "qk"}
        names |= {p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
    return names


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "dflash_ds", *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd)


def test_init_drafter_export_format(tiny_target, tmp_path):
    r = cli("init-drafter", "--target", str(tiny_target), "--out", str(tmp_path / "d"), "--num-layers", "3",
            "--block-size", "8")
    assert r.returncode == 0, r.stderr
    cfg = json.loads((tmp_path / "d/config.json").read_text())
    tcfg = json.loads((tiny_target / "config.json").read_text())
    assert CONFIG_FIELDS <= cfg.keys()
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == 8 and cfg["num_hidden_layers"] == 3
    assert cfg["num_target_layers"] == tcfg["num_hidden_layers"]
    assert set(cfg["dflash_config"]) == {"mask_token_id", "target_layer_ids"}
    L = tcfg["num_hidden_layers"]
    assert cfg["dflash_config"]["target_layer_ids"] == default_target_layer_ids(L, 3) == [1, 2, 3]  # L = 4
    assert 0 <= cfg["dflash_config"]["mask_token_id"] < tcfg["vocab_size"]
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        assert cfg[key] == tcfg[key]
    assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"]
    tensors = load_file(str(tmp_path / "d/model.safetensors"))
    assert set(tensors) == expected_tensor_names(3)
    h = tcfg["hidden_size"]
    assert tensors["fc.weight"].shape == (h, 3 * h)
    assert "embed_tokens.weight" not in tensors and "lm_head.weight" not in tensors


def test_save_load_save_identical(tiny_target, tmp_path):
    init_drafter(tiny_target, tmp_path / "a", num_layers=2, block_size=4)
    d = DFlashDrafter.from_pretrained(tmp_path / "a")
    d.save_pretrained(tmp_path / "b")
    a, b = load_file(str(tmp_path / "a/model.safetensors")), load_file(str(tmp_path / "b/model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_init_is_seeded(tiny_target, tmp_path):
    init_drafter(tiny_target, tmp_path / "a", num_layers=2, seed=3)
    init_drafter(tiny_target, tmp_path / "b", num_layers=2, seed=3)
    assert (tmp_path / "a/model.safetensors").read_bytes() == (tmp_path / "b/model.safetensors").read_bytes()


@pytest.mark.parametrize("case", ["missing", "no_config", "arch", "block1", "mask"])
def test_bad_input_one_clear_error(tiny_target, tmp_path, case, cli_here):
    """One line on stderr, a non-zero exit, no output folder; "missing" through the installed command (nothing
    printed at import either), the others in this process."""
    target = tiny_target
    extra = []
    if case == "missing":
        target, msg = tmp_path / "nope", "does not exist"
    elif case == "no_config":
        target = tmp_path / "empty"
        target.mkdir()
        msg = "has no config.json"
    elif case == "arch":
        target = tmp_path / "unknown"
        target.mkdir()
        (target / "config.json").write_text(json.dumps({"model_type": "nope_lm", "n_layer": 2}))
        msg = "model_type 'nope_lm' has no causal-LM class"
    elif case == "block1":
        extra, msg = ["--block-size", "1"], "--block-size 1: must be >= 2"
    else:
        extra, msg = ["--mask-token-id", "100000"], "--mask-token-id 100000 is outside the target vocabulary"
    out = tmp_path / "out"
    r = (cli if case == "missing" else cli_here)("init-drafter", "--target", str(target), "--out", str(out), *extra)
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and msg in lines[0], r.stderr
    assert not out.exists()


def test_init_sliding_window_drafter(tiny_target, tmp_path):
    types = ["sliding_attention", "full_attention"]
    init_drafter(tiny_target, tmp_path / "d", num_layers=2, block_size=4, layer_types=types, sliding_window=16)
    cfg = json.loads((tmp_path / "d/config.json").read_text())
    assert (cfg["layer_types"], cfg["sliding_window"], cfg["use_sliding_window"]) == (types, 16, True)
    assert DFlashDrafter.from_pretrained(tmp_path / "d").arch.layer_types == types
    with pytest.raises(DFlashError, match="model.layer_types has 1 entries but the drafter has 2 layers"):
        init_drafter(tiny_target, tmp_path / "e", num_layers=2, layer_types=types[:1], sliding_window=16)


def test_bf16_target_gives_a_bfloat16_export(tiny_target, tmp_path):
    """SGLang / vLLM run a drafter under --dtype auto in its config's dtype: a bf16 target's init says bfloat16."""
    target = tmp_path / "bf16_target"
    target.mkdir()
    tcfg = json.loads((tiny_target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**tcfg, "dtype": "bfloat16"}))  # config only: no weights
    init_drafter(target, tmp_path / "d", num_layers=2, block_size=4, mask_token_id=3)
    cfg = json.loads((tmp_path / "d/config.json").read_text())
    assert cfg["dtype"] == cfg["torch_dtype"] == "bfloat16"
    assert {t.dtype for t in load_file(str(tmp_path / "d/model.safetensors")).values()} == {torch.bfloat16}
    init_drafter(tiny_target, tmp_path / "fp32", num_layers=2, block_size=4)
    assert json.loads((tmp_path / "fp32/config.json").read_text())["dtype"] == tcfg.get("dtype", "float32")


@pytest.mark.parametrize("name", ["<|MASK|>", "<|mask|>"])
def test_mask_token_found_by_name(tmp_path, monkeypatch, name):
    """A tokenizer without a declared mask token but with SGLang's default <|MASK|> (or <|mask|>) gives its id."""
    import transformers

    class Tok:
        mask_token_id = None

        def get_vocab(self):
            return {"a": 0, "b": 1, name: 2}

        def __len__(self):
            return 3

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: Tok())
    assert pick_mask_token_id(tmp_path, vocab_size=3) == 2


def test_heads_and_widths_of_its_own(tiny_target, tmp_path, cli_here):
    """Heads, head width and MLP width may differ from the target's (z-lab's Qwen3.6-27B drafter: 32 / 8 heads of
    128 on a target of 24 / 4 heads of 256); the config, the tensors and a reload say so."""
    r = cli_here("init-drafter", "--target", str(tiny_target), "--out", str(tmp_path / "d"), "--num-layers", "2",
                 "--block-size", "8", "--num-attention-heads", "8", "--num-key-value-heads", "2", "--head-dim", "16",
                 "--intermediate-size", "96")
    assert r.returncode == 0, r.stderr
    assert "heads 8 / 2 of 16, MLP 96" in r.stdout
    cfg = json.loads((tmp_path / "d/config.json").read_text())
    assert [cfg[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")] == \
        [8, 2, 16, 96]
    h = cfg["hidden_size"]  # the target's: the drafter reads its hidden states
    t = load_file(str(tmp_path / "d/model.safetensors"))
    assert t["layers.0.self_attn.q_proj.weight"].shape == (8 * 16, h)
    assert t["layers.0.self_attn.k_proj.weight"].shape == (2 * 16, h)
    assert t["layers.0.self_attn.o_proj.weight"].shape == (h, 8 * 16)
    assert t["layers.0.self_attn.q_norm.weight"].shape == (16,)
    assert t["layers.0.mlp.up_proj.weight"].shape == (96, h)
    assert DFlashDrafter.from_pretrained(tmp_path / "d").arch.head_dim == 16
    r = cli_here("init-drafter", "--target", str(tiny_target), "--out", str(tmp_path / "e"), "--num-layers", "2",
                 "--num-attention-heads", "6", "--num-key-value-heads", "4")
    assert r.returncode == 2 and "model.num_key_value_heads = 4 does not divide model.num_attention_heads = 6" \
        in r.stderr and not (tmp_path / "e").exists()


def test_heads_from_the_config_reach_the_trainer(tiny_target, tmp_path):
    from dflash_ds.config import load_config
    from dflash_ds.runtime.job import resolve_arch

    model = {"num_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16,
             "intermediate_size": 96}
    arch = resolve_arch(load_config(None, {"target": str(tiny_target), "model": model}))
    assert (arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim, arch.intermediate_size) == \
        (8, 2, 16, 96)
    tcfg = json.loads((tiny_target / "config.json").read_text())
    arch = resolve_arch(load_config(None, {"target": str(tiny_target), "model": {"num_layers": 2}}))
    assert (arch.num_attention_heads, arch.head_dim) == (tcfg["num_attention_heads"], tcfg["head_dim"])
    init_drafter(tiny_target, tmp_path / "d", num_layers=2, block_size=16)  # the target's heads
    with pytest.raises(DFlashError, match="model.head_dim = 16 but --drafter .* has head_dim = 32"):
        resolve_arch(load_config(None, {"target": str(tiny_target), "drafter": str(tmp_path / "d"),
                                        "model": {"head_dim": 16}}))
    with pytest.raises(DFlashError, match=r"model.intermediate_size = 0 must be >= 1 \(or null"):
        load_config(None, {"model": {"intermediate_size": 0}})
