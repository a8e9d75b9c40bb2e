"""The compiled elementwise work of a drafter step (components/fusion.py, train.fuse) equals the eager one.

Inductor compiles on CPU too (`FUSION.mode = "on"`: C++ kernels where CUDA gets Triton ones), so these tests run
the same compiled graphs' numerics a GPU run gets, at small shapes: the chunked loss (value, gradient, statistics)
under the loss knobs' branches, DFlash2's grouped convolution forward and backward, and a whole DFlash2
micro-step with activation checkpointing. The compile bound (1 graph per static arguments and grad mode) and its
error are counted with a tracing backend (no code generation).
"""

from __future__ import annotations

import pytest
import torch

from dflash_ds.bench import micro_step
from dflash_ds.components import fusion
from dflash_ds.components.loss import chunked_dflash_loss
from dflash_ds.config import load_config
from dflash_ds.errors import DFlashError
from dflash_ds.memory import model as mm
from dflash_ds.memory.shapes import drafter_shape
from dflash_ds.models import layer_ops
from dflash_ds.models.dflash2 import grouped_conv
from dflash_ds.models.drafter import DFlashDrafter, _layer_step
from dflash_ds.models.presets import PRESETS
from dflash_ds.runtime.memory import compiled_graphs

V, K, H = 1003, 15, 48  # an odd vocabulary: no size a kernel could round to


class Counting:
    """A dynamo backend that counts graphs and runs each as traced."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


@pytest.fixture
def fuse(monkeypatch):
    """Set FUSION's fields for one test (its mode too: restored after it); dynamo's caches empty before and after."""
    monkeypatch.setattr(fusion.FUSION, "mode", fusion.FUSION.mode)

    def apply(**fields):
        for name, value in fields.items():
            monkeypatch.setattr(fusion.FUSION, name, value)
    torch._dynamo.reset()
    yield apply
    torch._dynamo.reset()


def loss_run(mode: str, blocks: int, chunk: int, seed: int = 0, **knobs):
    """(loss terms, d loss / d hidden) of `chunked_dflash_loss` over `blocks` random blocks, under `mode`."""
    fusion.FUSION.mode = mode
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g) * 0.3)
    hidden = torch.randn(blocks, K, H, generator=g).requires_grad_(True)
    target = torch.randn(blocks, K, H, generator=g)
    labels = torch.randint(0, V, (blocks, K), generator=g)
    labels[0, -3:] = -100  # positions without a label
    valid = (torch.rand(blocks, K, generator=g) > 0.2) & (labels >= 0)
    terms = chunked_dflash_loss(hidden, head, labels, valid, gamma=7.0, target_hidden=target, chunk_blocks=chunk,
                                **knobs)
    if torch.is_grad_enabled():
        terms.loss.backward()
    return terms, hidden.grad


KNOBS = [
    {},  # the default: CE on the data's labels
    {"kl_weight": 0.5, "lk": "hybrid", "streak_weight": 0.3},
    {"lk": "log", "labels": "target", "position_weighting": "dpace"},
    {"kl_weight": 1.0, "kl_temperature": 2.0, "lk": "l1"},
]


@pytest.mark.parametrize("knobs", KNOBS[:2], ids=["ce", "kl-lk-hybrid"])
def test_compiled_loss_equals_eager(fuse, knobs):
    """Inductor's loss (two chunk sizes: the last chunk is shorter) against eager: value, gradient, statistics."""
    fuse(backend="inductor")
    for blocks in (19, 23):  # chunks of 8, 8, 3 then 8, 8, 7 blocks (the last padded to 8): one graph
        eager, g_eager = loss_run("off", blocks, 8, seed=blocks, **knobs)
        comp, g_comp = loss_run("on", blocks, 8, seed=blocks, **knobs)
        assert torch.allclose(comp.loss, eager.loss, rtol=1e-5, atol=1e-6)
        assert torch.allclose(g_comp, g_eager, rtol=1e-4, atol=1e-7)
        for name in ("correct", "in_top4", "in_top8", "valid"):
            assert torch.equal(getattr(comp, name), getattr(eager, name)), name
        assert torch.allclose(comp.weight_sum, eager.weight_sum)
        if knobs:  # with the target's distribution
            assert torch.allclose(comp.alpha, eager.alpha, atol=1e-6)
            assert torch.allclose(comp.argmax_alpha, eager.argmax_alpha, atol=1e-6)
        else:
            assert comp.alpha is None and eager.alpha is None
    # the statistics compared above are not all-false: random heads put some labels in the top 8 of 1,003
    assert eager.in_top8.sum() > 0


def test_every_knob_traces_as_one_graph_within_the_bound(fuse):
    """Each branch of the loss traces whole (fullgraph: a break would be an error) into 1 graph per knobs and grad
    mode whatever the number of blocks (a short last chunk is padded to the chunk), and a graph past the limit is
    an error naming train.fuse."""
    counting = Counting()
    fuse(backend=counting)
    for knobs in KNOBS:
        torch._dynamo.reset()
        counting.graphs = 0
        for blocks in (5, 9, 13, 30):  # chunk 4: last chunks of 1, 1, 1 and 2 blocks beside full ones
            eager, g_eager = loss_run("off", blocks, 4, seed=blocks, **knobs)
            comp, g_comp = loss_run("on", blocks, 4, seed=blocks, **knobs)
            assert torch.allclose(comp.loss, eager.loss, rtol=1e-5) and torch.allclose(g_comp, g_eager, atol=1e-7)
            assert torch.equal(comp.in_top8, eager.in_top8)
        assert counting.graphs == 1, knobs
        with torch.no_grad():  # evaluation: the gradient-free variant, one graph more
            for blocks in (5, 30):
                loss_run("on", blocks, 4, **knobs)
        assert counting.graphs == 2, knobs
    torch._dynamo.reset()
    fuse(recompile_limit=1)
    loss_run("on", 8, 4)
    with torch.no_grad(), pytest.raises(DFlashError, match="train.fuse false"):
        loss_run("on", 8, 4)  # a second graph


def test_mode_decides_where_it_compiles(fuse):
    """auto compiles CUDA tensors only (none here: eager on CPU), on compiles CPU ones, off never."""
    counting = Counting()
    fuse(backend=counting)
    for mode, graphs in (("auto", 0), ("off", 0), ("on", 1)):
        loss_run(mode, 6, 8)
        assert counting.graphs == graphs, mode
    with pytest.raises(ValueError, match="auto"):
        fusion.set_fuse_mode("yes")
    with pytest.raises(DFlashError, match="train.fuse"):
        load_config(None, ["--train.fuse", "sometimes"])
    for text, mode in (("false", "off"), ("true", "on"), ("null", "auto")):  # the trainer's set_fuse_mode
        fusion.set_fuse_mode(load_config(None, [f"--train.fuse={text}"]).train.fuse)
        assert fusion.FUSION.mode == mode


def test_compiled_grouped_conv_and_dflash2_step_equal_eager(fuse):
    """DFlash2's convolution compiled by inductor: forward and all three gradients, then a whole DFlash2 micro-step
    with activation checkpointing (the GPU default: the layers' compiled ops run again in the recompute): its
    loss and every parameter's gradient, and the graphs it compiled."""
    fuse(backend="inductor")
    g = torch.Generator().manual_seed(0)
    base = torch.randn(3, 64, generator=g).requires_grad_(True)
    for lead, blocks in ((2, 4), (3, 5)):
        x = torch.randn(lead, blocks * 16, 64, generator=g).requires_grad_(True)
        delta = torch.randn(lead, blocks * 16, 3, 4, generator=g).requires_grad_(True)
        outs = {}
        for mode in ("off", "on"):
            fusion.FUSION.mode = mode
            y = grouped_conv(x, delta, base, 16)
            outs[mode] = (y, *torch.autograd.grad((y * y).sum(), (x, delta, base)))
        for a, b in zip(outs["on"], outs["off"]):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)

    cfg = dict(PRESETS["qwen3-8b"], vocab_size=2048)
    shape = drafter_shape(cfg, 64, 2, 16, "dflash2")
    step = mm.StepShape(batch=2, seq_len=128, anchors_per_row=6, chunk_blocks=4, kl=False, dtype_bytes=4,
                        checkpointing=True, dense_mask=True, cuda=False)
    results = {}
    torch._dynamo.reset()
    for mode in ("off", "on"):
        fusion.FUSION.mode = mode
        graphs = compiled_graphs()
        module, states, loss_cfg = micro_step.micro_step_inputs(
            cfg, shape, step, seed=0, num_anchors=6, max_anchors=0, chunk_blocks=4, kl_weight=0.0,
            mask_backend="dense", device=torch.device("cpu"), dtype=torch.float32)
        module.drafter.activation_checkpointing = True
        terms, _ = module(states, loss_cfg, 0, 0.0, 0)
        terms.loss.backward()
        results[mode] = (terms.loss.detach(), {n: p.grad for n, p in module.drafter.named_parameters()
                                               if p.grad is not None})
        # eager: none; compiled: the loss core, the convolution's forward and its backward, SwiGLU, RoPE (1 head
        # of 128 for queries and keys) and RMSNorm 3 times (over head_dim = 128, over H = 64, and over H on layer 0's input, the block
        # embeddings, which need no gradient), the recompute reusing each
        assert compiled_graphs() - graphs == {"off": 0, "on": 8}[mode]
    (l_on, g_on), (l_off, g_off) = results["on"], results["off"]
    assert torch.allclose(l_on, l_off, rtol=1e-5)
    assert g_on.keys() == g_off.keys() and any("conv" in n for n in g_on)
    for name in g_on:
        assert torch.allclose(g_on[name], g_off[name], rtol=1e-3, atol=1e-6), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_on_cuda_equals_eager(fuse):
    """On a GPU (launch/gpu_check.sh): train.fuse auto compiles Triton kernels for CUDA tensors; in bf16 at a
    vocabulary of 151,936 the compiled loss, DFlash2's convolution (forward and backward) and the layer ops match
    eager within bf16's rounding."""
    fuse(backend="inductor")
    g = torch.Generator(device="cuda").manual_seed(0)
    n, k, h, v = 70, 15, 256, 151936  # chunk 64: a full chunk and a padded one of 6 blocks
    head = torch.nn.Linear(h, v, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        head.weight.copy_(torch.randn(v, h, generator=g, device="cuda") * 0.05)
    hidden = torch.randn(n, k, h, generator=g, device="cuda").to(torch.bfloat16)
    target = torch.randn(n, k, h, generator=g, device="cuda").to(torch.bfloat16)
    labels = torch.randint(0, v, (n, k), generator=g, device="cuda")
    valid = torch.rand(n, k, generator=g, device="cuda") > 0.2
    for knobs in ({}, {"kl_weight": 0.5}):
        out = {}
        for mode in ("off", "auto"):
            fusion.FUSION.mode = mode
            x = hidden.clone().requires_grad_(True)
            terms = chunked_dflash_loss(x, head, labels, valid, gamma=7.0, target_hidden=target, chunk_blocks=64,
                                        **knobs)
            terms.loss.backward()
            out[mode] = (terms.loss.float(), x.grad.float(), terms.in_top8)
        assert torch.allclose(out["auto"][0], out["off"][0], rtol=1e-4), knobs
        scale = out["off"][1].abs().max()
        assert torch.allclose(out["auto"][1], out["off"][1], rtol=2e-2, atol=1e-2 * float(scale)), knobs
        # bf16 logits tie often at V = 151,936: a tie counts for the label compiled, top-k breaks it by index
        hit_c, hit_e = out["auto"][2], out["off"][2]
        assert not (hit_e & ~hit_c).any() and (hit_c != hit_e).float().mean() < 0.01, knobs
    base = torch.randn(3, h, generator=g, device="cuda")
    x = torch.randn(4, 40 * 16, h, generator=g, device="cuda").to(torch.bfloat16)
    delta = torch.randn(4, 40 * 16, 3, h // 64, generator=g, device="cuda").to(torch.bfloat16)
    ys = {}
    for mode in ("off", "auto"):  # forward and the hand-written backward (models/grouped_conv.py), both compiled
        fusion.FUSION.mode = mode
        leaves = [t.detach().requires_grad_(True) for t in (x, delta, base.to(torch.bfloat16))]
        y = grouped_conv(*leaves, 16)
        ys[mode] = [y.detach().float(), *(grad.float() for grad in torch.autograd.grad((y.float() ** 2).sum(), leaves))]
    for a, b in zip(ys["auto"], ys["off"]):
        assert torch.allclose(a, b, rtol=2e-2, atol=2e-2 * float(b.abs().max()))
    # the layer ops at the Qwen3-8B preset's widths (H 4,096; 32 / 8 heads of 128; MLP 12,288), bf16
    rows, w = 8 * 160, torch.randn(4096, generator=g, device="cuda").to(torch.bfloat16)
    x = torch.randn(2, rows // 2, 4096, generator=g, device="cuda").to(torch.bfloat16)
    q = torch.randn(2, rows // 2, 32, 128, generator=g, device="cuda").to(torch.bfloat16)
    cos, sin = (torch.rand(2, rows // 2, 128, generator=g, device="cuda").to(torch.bfloat16) for _ in range(2))
    gate, up = (torch.randn(rows, 12288, generator=g, device="cuda").to(torch.bfloat16) for _ in range(2))
    ops = {}
    for mode in ("off", "auto"):
        fusion.FUSION.mode = mode
        ops[mode] = [layer_ops.rms_norm(x, w, 1e-6), layer_ops.rope(q, cos, sin), layer_ops.swiglu(gate, up)]
    for a, b in zip(ops["auto"], ops["off"]):
        assert torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def _saved_bytes(layer, b: int, t: int, s: int, width: int, drafter) -> int:
    """Bytes of the storages autograd keeps for one layer's backward (saved-tensor hooks; parameters and inputs
    not counted): block tokens [b, t] and context keys [b, s] both needing gradients."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(b, t, width, generator=g).requires_grad_(True)
    ctx = torch.randn(b, s, width, generator=g).requires_grad_(True)
    cos, sin = drafter._cos_sin(x, torch.arange(t).expand(b, t))
    ccos, csin = drafter._cos_sin(x, torch.arange(s).expand(b, s))
    mask = torch.ones(b, 1, t, s + t, dtype=torch.bool)
    known = {a.untyped_storage().data_ptr() for a in (*layer.parameters(), x, ctx, cos, sin, ccos, csin, mask)}
    _layer_step(layer, x, cos, sin, ctx, ccos, csin, mask)  # compiles (fused)
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        _layer_step(layer, x, cos, sin, ctx, ccos, csin, mask)
    return sum(v for k, v in saved.items() if k not in known)


def test_a_fused_layer_saves_what_the_memory_model_counts(fuse):
    """Saved-tensor hooks over one draft layer's forward (block tokens and context keys both needing gradients):
    compiled, it keeps exactly the bytes `memory_model.per_token_activations(fused=True)` takes off eager's."""
    fuse(backend="inductor")
    cfg = dict(PRESETS["qwen3-8b"], vocab_size=512)
    shape = drafter_shape(cfg, 64, 1, 16, "dflash")
    drafter = DFlashDrafter(micro_step.drafter_arch(cfg, shape, 256))
    b, t, s = 2, 128, 256  # t = 8 blocks of 16 a row
    saved_bytes = {}
    for mode in ("off", "on"):
        fusion.FUSION.mode = mode
        saved_bytes[mode] = _saved_bytes(drafter.layers[0], b, t, s, 64, drafter)
    (a, c), (a_f, c_f) = (mm.per_token_activations(shape, 4, fused) for fused in (False, True))
    assert saved_bytes["off"] - saved_bytes["on"] == (a - a_f) * b * t + (c - c_f) * b * s > 0


@pytest.mark.parametrize("taps,group,mode", [(2, 64, "on"), (3, 32, "off")])
def test_a_dflash2_layer_saves_what_the_memory_model_counts(fuse, taps, group, mode):
    """A DFlash2 layer keeps 4 + 4 taps / group H-wide values per block token more than the same DFlash layer
    (models/dflash2_arch.saved_h: 4.125 at the defaults; autograd's backward of the convolution kept 8.125),
    compiled (the defaults) and eager."""
    from dataclasses import replace

    from dflash_ds.models.dflash2_arch import DFlash2Options

    fuse(backend="inductor")
    fusion.FUSION.mode = mode
    cfg, width, (b, t, s) = dict(PRESETS["qwen3-8b"], vocab_size=512), 256, (2, 128, 256)
    opts = DFlash2Options(conv_kernel_size=taps, conv_group_size=group)
    saved = {}
    for kind in ("dflash", "dflash2"):
        shape = drafter_shape(cfg, width, 1, 16, kind)
        shape = replace(shape, options=opts) if kind == "dflash2" else shape
        drafter = DFlashDrafter(micro_step.drafter_arch(cfg, shape, s))
        saved[kind] = (_saved_bytes(drafter.layers[0], b, t, s, width, drafter), shape)
    added = saved["dflash2"][0] - saved["dflash"][0]
    assert added == (4 + 4 * taps / group) * width * 4 * b * t
    per_token = [mm.per_token_activations(shape, 4)[0] for _, shape in saved.values()]
    assert (per_token[1] - per_token[0]) * b * t == added
