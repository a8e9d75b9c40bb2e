"""Drafter forwards: block-sparse mask by perturbation, training == inference, cache, export round trip.

Mixed layouts (full + sliding-window layers) run through the same train == infer and cache checks;
the sliding mask is checked against a hand-built case.
"""

import json

import pytest
import torch

from dflash_ds.errors import DFlashError
from dflash_ds.models.drafter import DFlashDrafter, DrafterArch, DrafterCache, default_target_layer_ids

H, NT = 32, 3  # hidden width, number of target layers read
S, F = "sliding_attention", "full_attention"
# (layer types, window): all full; mixed with a window below the block size (the window cuts inside the
# block) and one above it (it cuts only the context).
LAYOUTS = [(None, None), ([S, F, S], 3), ([F, S, S], 6)]


def make_drafter(seed=0, layers=2, bs=4, layer_types=None, window=None) -> DFlashDrafter:
    layers = len(layer_types) if layer_types else layers
    arch = DrafterArch(hidden_size=H, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, vocab_size=50, rms_norm_eps=1e-6,
                       max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                       block_size=bs, num_target_layers=8, mask_token_id=49, target_layer_ids=[1, 3, 5],
                       layer_types=layer_types, sliding_window=window)
    torch.manual_seed(seed)
    d = DFlashDrafter(arch)
    d.init_weights(seed, std=0.2)  # large std so a perturbation shows up clearly
    return d.eval()


def inputs(b=2, s=12, a=3, bs=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randn(b, s, NT * H, generator=g)
    emb = torch.randn(b, a, bs, H, generator=g)
    anchors = torch.tensor([[2, 5, 8], [1, 4, 7]])[:b, :a]
    return ctx, emb, anchors


def test_default_target_layer_ids_rule():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]  # SpecForge's Qwen3.6-27B ids
    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(8, 3) == [1, 3, 5]
    # Shallow targets: the public rule would repeat ids ([1, 1], [1, 1, 1]); the span widens instead.
    assert default_target_layer_ids(4, 2) == [1, 2]
    assert default_target_layer_ids(4, 3) == [1, 2, 3]
    assert default_target_layer_ids(4, 4) == [0, 1, 2, 3]
    assert default_target_layer_ids(6, 5) == [1, 2, 3, 4, 5]
    for n_t in range(1, 80):
        for n in range(2, min(n_t, 12) + 1):
            ids = default_target_layer_ids(n_t, n)
            assert len(set(ids)) == n and ids == sorted(ids) and 0 <= ids[0] and ids[-1] < n_t, (n_t, n, ids)
            if n_t >= n + 3:  # the public rule where it gives distinct ids: unchanged
                assert ids == [round(1 + i * (n_t - 4) / (n - 1)) for i in range(n)], (n_t, n)
    with pytest.raises(DFlashError, match="model.target_layer_ids"):
        default_target_layer_ids(4, 5)


def test_mask_by_perturbation():
    d = make_drafter()
    ctx, emb, anchors = inputs()
    with torch.no_grad():
        base = d.forward_train(ctx, emb, anchors)
        for b in range(2):
            for j in range(3):
                a = int(anchors[b, j])
                # context at positions >= anchor: block unchanged
                c2 = ctx.clone()
                c2[b, a:] += torch.randn_like(c2[b, a:])
                out = d.forward_train(c2, emb, anchors)
                assert torch.allclose(out[b, j], base[b, j], atol=1e-6)
                # context at a position < anchor: block changes
                c3 = ctx.clone()
                c3[b, a - 1] += 1.0
                out = d.forward_train(c3, emb, anchors)
                assert not torch.allclose(out[b, j], base[b, j], atol=1e-4)
                # any token of another block: block unchanged
                for other in range(3):
                    if other == j:
                        continue
                    e2 = emb.clone()
                    e2[b, other] += torch.randn_like(e2[b, other])
                    out = d.forward_train(ctx, e2, anchors)
                    assert torch.allclose(out[b, j], base[b, j], atol=1e-6)
                # a token of its own block (even a later one): changes (bidirectional inside the block)
                e3 = emb.clone()
                e3[b, j, -1] += 1.0
                out = d.forward_train(ctx, e3, anchors)
                assert not torch.allclose(out[b, j, 0], base[b, j, 0], atol=1e-4)


@pytest.mark.parametrize("layer_types, window", LAYOUTS)
def test_train_forward_equals_inference_forward(layer_types, window):
    d = make_drafter(layer_types=layer_types, window=window)
    ctx, emb, anchors = inputs()
    with torch.no_grad():
        train = d.forward_train(ctx, emb, anchors)
        for b in range(2):
            for j in range(3):
                a = int(anchors[b, j])
                infer = d.forward_infer(ctx[b:b + 1, :a], emb[b:b + 1, j], start=a)
                assert torch.allclose(infer[0], train[b, j], atol=1e-5), (b, j)


@pytest.mark.parametrize("layer_types, window", LAYOUTS)
def test_cached_inference_equals_uncached(layer_types, window):
    d = make_drafter(layer_types=layer_types, window=window)
    ctx, emb, _ = inputs(b=1)
    with torch.no_grad():
        cache = DrafterCache(d.arch.num_hidden_layers)
        prev = 0
        for start in (3, 5, 9):
            cached = d.forward_infer(ctx[:, prev:start], emb[:, 0], start=start, cache=cache)
            full = d.forward_infer(ctx[:, :start], emb[:, 0], start=start)
            assert torch.allclose(cached, full, atol=1e-5)
            prev = start


def test_sliding_mask_hand_built():
    """Window 3, block 3, context 6, anchors 2 and 4: the query at position p sees positions p-2..p,
    context < anchor and its own block's earlier tokens only; full layers see all of both."""
    anchors = torch.tensor([[2, 4]])
    got = DFlashDrafter.block_mask(anchors, ctx_len=6, bs=3, sliding_window=3)[0, 0].int().tolist()
    #            context 0..5     | block 0 (pos 2,3,4) | block 1 (pos 4,5,6)
    expected = [[1, 1, 0, 0, 0, 0,  1, 0, 0,  0, 0, 0],   # block 0, pos 2: context 0,1 + itself
                [0, 1, 0, 0, 0, 0,  1, 1, 0,  0, 0, 0],   # pos 3: context 1, block 2..3
                [0, 0, 0, 0, 0, 0,  1, 1, 1,  0, 0, 0],   # pos 4: block 2..4 only
                [0, 0, 1, 1, 0, 0,  0, 0, 0,  1, 0, 0],   # block 1, pos 4: context 2,3 + itself
                [0, 0, 0, 1, 0, 0,  0, 0, 0,  1, 1, 0],   # pos 5: context 3, block 4..5
                [0, 0, 0, 0, 0, 0,  0, 0, 0,  1, 1, 1]]   # pos 6: block 4..6
    assert got == expected
    full = DFlashDrafter.block_mask(anchors, ctx_len=6, bs=3)[0, 0].int().tolist()
    assert full == [[1, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0]] * 3 + [[1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1]] * 3
    # The flex mask_mod (GPU training) gives the same matrix.
    from torch.nn.attention.flex_attention import create_mask

    mask_mod = DFlashDrafter.block_mask(anchors, 6, 3, use_flex=True, sliding_window=3).mask_mod
    assert create_mask(mask_mod, 1, None, 6, 12, device="cpu")[0, 0].int().tolist() == expected


def test_layer_types_rules():
    base = vars(make_drafter().arch)
    with pytest.raises(DFlashError, match="layer_types has 2 entries but the drafter has 3 layers"):
        DrafterArch(**{**base, "num_hidden_layers": 3, "layer_types": [S, F], "sliding_window": 4})
    with pytest.raises(DFlashError, match="sliding_window must be >= 1"):
        make_drafter(layer_types=[S, F])
    with pytest.raises(DFlashError, match="unknown layer types"):
        make_drafter(layer_types=["chunked_attention", F], window=4)
    assert make_drafter(layer_types=[F, F], window=8).arch.sliding_window is None  # no sliding layer


def test_sliding_export_reloads_with_layer_types(tmp_path):
    d = make_drafter(layer_types=[S, F, S], window=3)
    d.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["layer_types"] == [S, F, S] and cfg["sliding_window"] == 3 and cfg["use_sliding_window"] is True
    assert "is_causal" not in cfg or cfg["is_causal"] is None  # vLLM would take an explicit value over layer_types
    assert "causal" not in cfg["dflash_config"]
    back = DFlashDrafter.from_pretrained(tmp_path)
    assert back.arch.layer_types == [S, F, S] and back.arch.sliding_window == 3
    ctx, emb, anchors = inputs()
    with torch.no_grad():
        assert torch.equal(back.forward_train(ctx, emb, anchors), d.forward_train(ctx, emb, anchors))
    make_drafter().save_pretrained(tmp_path / "full")
    full = json.loads((tmp_path / "full/config.json").read_text())
    assert full["layer_types"] == [F, F] and full["sliding_window"] is None and full["use_sliding_window"] is False


def test_rope_scaling_written_for_non_default_rope(tmp_path):
    """transformers-4.x loaders read only rope_scaling; a 4.x-style config reads back the same RoPE."""
    from transformers import AutoConfig

    yarn = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 64}
    d = make_drafter()
    arch = DrafterArch(**{**vars(d.arch), "rope_parameters": dict(yarn)})
    cfg = arch.to_json_dict()
    assert cfg["rope_scaling"] == {"rope_type": "yarn", "type": "yarn", "factor": 4.0,
                                   "original_max_position_embeddings": 64}
    assert cfg["rope_theta"] == 1e6 and "rope_scaling" not in d.arch.to_json_dict()
    old_style = {k: v for k, v in cfg.items() if k != "rope_parameters"}
    assert DrafterArch.from_json_dict(old_style).rope_parameters == yarn
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert AutoConfig.from_pretrained(tmp_path).rope_parameters["rope_type"] == "yarn"


def test_save_load_save_byte_identical(tmp_path):
    from safetensors.torch import load_file

    d = make_drafter()
    d.save_pretrained(tmp_path / "a")
    d2 = DFlashDrafter.from_pretrained(tmp_path / "a")
    d2.save_pretrained(tmp_path / "b")
    ta, tb = load_file(str(tmp_path / "a/model.safetensors")), load_file(str(tmp_path / "b/model.safetensors"))
    assert ta.keys() == tb.keys()
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k])
    assert (tmp_path / "a/model.safetensors").read_bytes() == (tmp_path / "b/model.safetensors").read_bytes()
    assert json.loads((tmp_path / "a/config.json").read_text()) == json.loads((tmp_path / "b/config.json").read_text())


def test_from_pretrained_rejects_mismatched_tensors(tmp_path):
    from safetensors.torch import load_file, save_file

    from dflash_ds.errors import DFlashError

    d = make_drafter()
    d.save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    state["extra.weight"] = torch.zeros(1)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(DFlashError, match="unexpected"):
        DFlashDrafter.from_pretrained(tmp_path)


def test_activation_checkpointing_same_output_and_gradients(monkeypatch):
    """Recomputing layers in backward (all of them, or the first `checkpoint_layers`) changes memory, not the
    numbers; exactly the layers asked for are checkpointed."""
    import torch.utils.checkpoint as tuc

    calls, original = [], tuc.checkpoint
    monkeypatch.setattr(tuc, "checkpoint", lambda fn, layer, *a, **k: calls.append(layer) or original(fn, layer, *a, **k))
    results = []
    for recompute, layers in ((False, None), (True, None), (True, 1)):
        d = make_drafter(seed=3, layers=3).train()
        d.activation_checkpointing, d.checkpoint_layers = recompute, layers
        calls.clear()
        ctx, emb, anchors = inputs()
        ctx.requires_grad_(True)
        out = d.forward_train(ctx, emb, anchors)
        assert calls == list(d.layers)[: (3 if layers is None else layers) if recompute else 0]
        (out.square().sum()).backward()
        results.append((out.detach(), ctx.grad.clone(), {n: p.grad.clone() for n, p in d.named_parameters()}))
    (o1, c1, g1) = results[0]
    for o2, c2, g2 in results[1:]:
        assert torch.equal(o1, o2)
        assert torch.allclose(c1, c2, atol=1e-6)
        assert g1.keys() == g2.keys() and all(torch.allclose(g1[n], g2[n], atol=1e-6) for n in g1)


def test_export_in_the_weights_dtype(tmp_path):
    """A bf16 drafter exports bf16 tensors and says so (SGLang reads a float32 config as float16 under auto)."""
    from safetensors import safe_open

    d = make_drafter().to(torch.bfloat16)
    d.save_pretrained(tmp_path / "bf16")
    cfg = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert cfg["dtype"] == cfg["torch_dtype"] == "bfloat16"
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    back = DFlashDrafter.from_pretrained(tmp_path / "bf16")
    for (n, p), q in zip(d.state_dict().items(), back.state_dict().values()):
        assert torch.equal(p.float(), q.float()), n
    make_drafter().save_pretrained(tmp_path / "fp32")
    assert json.loads((tmp_path / "fp32" / "config.json").read_text())["dtype"] == "float32"
