"""Drafter forwards: block-sparse mask by perturbation, training == inference, cache, export round trip."""

import json

import pytest
import torch

from dflash_ds.models.drafter import DFlashDrafter, DrafterArch, DrafterCache, default_target_layer_ids

H, NT = 32, 3  # hidden width, number of target layers read


def make_drafter(seed=0, layers=2, bs=4) -> DFlashDrafter:
    arch = DrafterArch(hidden_size=H, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, vocab_size=50, rms_norm_eps=1e-6,
                       max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                       block_size=bs, num_target_layers=8, mask_token_id=49, target_layer_ids=[1, 3, 5])
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
    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(8, 3) == [1, 3, 5]


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


def test_train_forward_equals_inference_forward():
    d = make_drafter()
    ctx, emb, anchors = inputs()
    with torch.no_grad():
        train = d.forward_train(ctx, emb, anchors)
        for b in range(2):
            for j in range(3):
                a = int(anchors[b, j])
                infer = d.forward_infer(ctx[b:b + 1, :a], emb[b:b + 1, j], start=a)
                assert torch.allclose(infer[0], train[b, j], atol=1e-5), (b, j)


def test_cached_inference_equals_uncached():
    d = make_drafter()
    ctx, emb, _ = inputs(b=1)
    with torch.no_grad():
        cache = DrafterCache(d.arch.num_hidden_layers)
        prev = 0
        for start in (3, 5, 9):
            cached = d.forward_infer(ctx[:, prev:start], emb[:, 0], start=start, cache=cache)
            full = d.forward_infer(ctx[:, :start], emb[:, 0], start=start)
            assert torch.allclose(cached, full, atol=1e-5)
            prev = start


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


def test_activation_checkpointing_same_output_and_gradients():
    """Recomputing each layer in backward changes memory, not the numbers."""
    results = []
    for recompute in (False, True):
        d = make_drafter(seed=3).train()
        d.activation_checkpointing = recompute
        ctx, emb, anchors = inputs()
        ctx.requires_grad_(True)
        out = d.forward_train(ctx, emb, anchors)
        (out.square().sum()).backward()
        results.append((out.detach(), ctx.grad.clone(), {n: p.grad.clone() for n, p in d.named_parameters()}))
    (o1, c1, g1), (o2, c2, g2) = results
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
