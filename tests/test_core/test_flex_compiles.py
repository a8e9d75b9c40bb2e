"""flex_attention's compiled graphs stay bounded over a real batch stream, and padding changes no result.

The drafter's flex is compiled on CPU (`FLEX_COMPILE.on_cpu`) with a counting dynamo backend: each graph
dynamo hands it is counted, and each call of a compiled graph too, so a flex call that ran eagerly shows as a
missing call as well as by its warning and log line. flex refuses inputs that need a gradient on CPU
(torch 2.13: its fused backward is GPU-only), so the CPU walk of the training mode lifts that check: the
traced graphs then run flex's own eager forward and backward, and dynamo's guards (grad mode, requires_grad,
activation checkpointing's recompute) are the ones a GPU run meets.
"""

from __future__ import annotations

import json
import logging
import random
import warnings
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from dflash_ds.components.loss import block_inputs_and_labels, chunked_dflash_loss, sample_anchors
from dflash_ds.config import load_config
from dflash_ds.data.stream import load_batch, open_data
from dflash_ds.errors import DFlashError
from dflash_ds.models import block_mask
from dflash_ds.models.drafter import MASK_BACKENDS, DFlashDrafter, DrafterArch

H, NT, BLOCK, VOCAB = 32, 3, 8, 512
S, F = "sliding_attention", "full_attention"
MICRO_BATCHES = 40
EAGER = "flex_attention called without torch.compile"


def write_conversations(path: Path, n: int, seed: int = 0) -> Path:
    """ShareGPT rows whose answers run from one to 32 sentences: lengths over every bucket."""
    from dflash_ds.tiny.corpus import generate_corpus

    rng = random.Random(seed)
    lines = generate_corpus(400, seed=seed + 7)
    with path.open("w") as f:
        for i in range(n):
            answer = " ".join(rng.choice(lines) for _ in range(rng.choice([1, 1, 2, 2, 3, 4, 6, 8, 12, 16, 32])))
            f.write(json.dumps({"id": f"c{i}", "conversations": [
                {"from": "human", "value": rng.choice(lines)}, {"from": "gpt", "value": answer}]}) + "\n")
    return path


@pytest.fixture(scope="module")
def run(tiny_target, tmp_path_factory):
    """A prepared 200-conversation dataset and the run config that batches it (4 buckets, small budget)."""
    from dflash_ds.data.prepare import prepare

    root = tmp_path_factory.mktemp("flex_compiles")
    data = root / "data"
    prepare(tiny_target, [write_conversations(root / "conv.jsonl", 200)], data, max_length=512, block_size=BLOCK)
    cfg = load_config(overrides={
        "data": {"path": str(data), "max_length": 512, "token_budget": 1024, "num_buckets": 4},
        "model": {"block_size": BLOCK, "attention_backend": "flex"},
        "loss": {"num_anchors": 64, "max_anchors_per_batch": 192}})
    return cfg, open_data(cfg, num_drafters=1, vocab_size=VOCAB)


def micro_batches(cfg, stream, n: int):
    """The first n micro-batches of the stream with their anchors: (input_ids, loss_mask, lengths, anchors, valid)."""
    gen = torch.Generator().manual_seed(cfg.train.seed)
    for _, (_, spec) in zip(range(n), stream.sampler(0).iterate()):
        batch = load_batch(stream.dataset, spec)
        anchors, valid = sample_anchors(batch["loss_mask"], batch["lengths"], BLOCK, cfg.loss.num_anchors, gen,
                                        max_total=cfg.loss.max_anchors_per_batch)
        yield batch["input_ids"], batch["loss_mask"], batch["lengths"], anchors, valid


def make_drafter(layer_types=(S, F), window=12) -> DFlashDrafter:
    arch = DrafterArch(hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, vocab_size=VOCAB, rms_norm_eps=1e-6,
                       max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                       block_size=BLOCK, num_target_layers=8, mask_token_id=VOCAB - 1, target_layer_ids=[1, 3, 5],
                       layer_types=list(layer_types), sliding_window=window)
    d = DFlashDrafter(arch)
    d.init_weights(0, std=0.1)
    d.mask_backend = "flex"
    return d


class CountingBackend:
    """A dynamo backend counting the graphs and their calls; each graph runs as traced, or as `inner` compiles it."""

    def __init__(self, inner=None) -> None:
        self.inner = inner
        self.graphs = 0
        self.calls = 0
        self.limits: set[int] = set()  # dynamo's recompile limit in force at each compile

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs += 1
        self.limits.add(torch._dynamo.config.recompile_limit)
        compiled = gm.forward if self.inner is None else self.inner(gm, example_inputs)

        def forward(*args):
            self.calls += 1
            return compiled(*args)
        return forward


class LogLines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextmanager
def counted_compile(monkeypatch, inner=None, **settings):
    """FLEX_COMPILE with a counting backend, on CPU too; dynamo's caches empty before and after."""
    backend = CountingBackend(inner)
    for name, value in {"backend": backend, "on_cpu": True, **settings}.items():
        monkeypatch.setattr(block_mask.FLEX_COMPILE, name, value)
    monkeypatch.setattr(block_mask, "_compiled", None)
    torch._dynamo.reset()
    try:
        yield backend
    finally:
        torch._dynamo.reset()


def walk(run, monkeypatch, n: int = MICRO_BATCHES, device: str = "cpu", inner=None, modes=(False,),
         **settings) -> dict:
    """The drafter's compiled flex on the first n micro-batches of the stream, each in every grad mode of
    `modes` (True: forward and backward with activation checkpointing, as the trainer runs on a GPU)."""
    cfg, stream = run
    d = make_drafter().to(device)
    d.mask_backend = cfg.model.attention_backend  # what the trainer does with the config field
    d.activation_checkpointing = True  # the trainer's default on a GPU; it acts in the training mode only
    g = torch.Generator().manual_seed(1)
    shapes, flex_calls = set(), 0
    import torch.nn.attention.flex_attention as fa

    if device == "cpu":
        monkeypatch.setattr(fa, "_validate_device", lambda *args: None)  # module docstring
    fa._WARNINGS_SHOWN.discard("flex_attention_performance")  # shown once per process: let it show again
    logs = LogLines()
    dynamo_log = logging.getLogger("torch._dynamo")
    dynamo_log.addHandler(logs)
    try:
        with counted_compile(monkeypatch, inner, **settings) as backend, \
                warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _, _, lengths, anchors, _ in micro_batches(cfg, stream, n):
                b, s, a = len(lengths), int(lengths.max()), anchors.shape[1]
                ctx = torch.randn(b, s, NT * H, generator=g).to(device)
                emb = torch.randn(b, a, BLOCK, H, generator=g).to(device)
                for grads in modes:
                    with torch.set_grad_enabled(grads):
                        out = d.forward_train(ctx, emb, anchors.to(device))
                        assert out.shape == (b, a, BLOCK, H) and torch.isfinite(out).all()
                        if grads:  # the recompute calls flex again: once more per layer
                            out.float().square().mean().backward()
                    flex_calls += d.arch.num_hidden_layers * (2 if grads else 1)
                shapes.add((b, s, a))
    finally:
        dynamo_log.removeHandler(logs)
    return {"graphs": backend.graphs, "calls": backend.calls, "flex_calls": flex_calls, "shapes": shapes,
            "limits": backend.limits, "messages": [str(w.message) for w in caught] + logs.lines}


def test_compiled_flex_graphs_stay_within_the_bound_over_a_batch_stream(run, monkeypatch):
    res = walk(run, monkeypatch)
    shapes = res["shapes"]
    # The stream really moves every dimension, and holds a one-row batch (the B = 1 graph).
    assert len(shapes) >= 30 and min(b for b, _, _ in shapes) == 1
    assert len({s for _, s, _ in shapes}) >= 20 and len({a for _, _, a in shapes}) >= 8
    # Two mask kinds (sliding, full), one grad mode (no_grad): block_mask's stated bound.
    bound = block_mask.GRAPHS_PER_MASK * 2
    assert 2 <= res["graphs"] <= bound, res["graphs"]
    assert res["calls"] == res["flex_calls"]  # every flex call ran a compiled graph: none fell back to eager
    bad = [m for m in res["messages"] if "recompile_limit" in m or EAGER in m]
    assert not bad, bad[:2]


def test_both_grad_modes_with_checkpointing_stay_under_the_limit_with_room(run, monkeypatch):
    """Training (forward, backward, activation checkpointing's recompute) and no_grad (validation) on each
    micro-batch, both mask kinds (sliding + full, the layout of configs/qwen3.6-27b.yaml): 2 x 2 x 2 = 8
    graphs, dynamo's default limit exactly; flex's own limit is twice that, so a guard nobody foresaw is an
    error long before it could be the step that runs flex eagerly. The first 6 micro-batches hold B = 1."""
    res = walk(run, monkeypatch, n=6, modes=(True, False))
    assert min(b for b, _, _ in res["shapes"]) == 1 and max(b for b, _, _ in res["shapes"]) >= 2
    bound = block_mask.GRAPHS_PER_MASK * 2 * 2  # block_mask's stated bound: mask kinds x grad modes
    assert res["graphs"] == bound == 8, res["graphs"]  # measured: each (kind, B class, grad mode) its own graph
    # The limit in force at every compile (dynamo's default is 8: no room at all).
    assert min(res["limits"]) >= 2 * bound and res["limits"] == {block_mask.FLEX_COMPILE.recompile_limit}
    assert res["calls"] == res["flex_calls"]  # the recompute ran compiled graphs too: none eager
    bad = [m for m in res["messages"] if "recompile_limit" in m or EAGER in m]
    assert not bad, bad[:2]


def test_static_unpadded_compile_passes_the_bound_and_that_is_an_error(run, monkeypatch):
    """What the drafter did before (dynamic=False, no padding): a graph per shape and mask kind, past any
    limit; here flex's limit set to 4 is reached within 8 micro-batches, and the next graph is one clear
    error, not dynamo's silent eager flex."""
    with pytest.raises(DFlashError, match="recompile_limit = 4 compiled graphs.*eagerly"):
        walk(run, monkeypatch, n=8, dynamic=False, pad=False, recompile_limit=4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_inductor_flex_forward_and_backward_on_gpu_stay_within_the_bound(run, monkeypatch):
    """The real compile (inductor, Triton kernels, forward and backward): its guards too must hold."""
    from torch._inductor.compile_fx import compile_fx

    # The training mode only (with checkpointing): each cold inductor graph is 40-70 s on a fresh machine, and
    # the no_grad graphs differ from these by the grad mode alone, which the CPU walk covers.
    res = walk(run, monkeypatch, n=16, device="cuda", inner=compile_fx, modes=(True,))
    assert min(b for b, _, _ in res["shapes"]) == 1 and len(res["shapes"]) >= 10
    assert 2 <= res["graphs"] <= block_mask.GRAPHS_PER_MASK * 2, res["graphs"]  # two mask kinds, grad mode on
    assert res["calls"] == res["flex_calls"]
    bad = [m for m in res["messages"] if "recompile_limit" in m or EAGER in m]
    assert not bad, bad[:2]


def loss_and_grads(d: DFlashDrafter, head: torch.nn.Linear, batch, pad: bool, grads: bool = True):
    """The DFlash loss of one micro-batch (random context, the tiny vocabulary), its output and gradients."""
    input_ids, loss_mask, lengths, anchors, valid = batch
    g = torch.Generator().manual_seed(2)
    b, s = input_ids.shape
    ctx = torch.randn(b, s, NT * H, generator=g).requires_grad_(grads)
    blocks, labels, label_valid = block_inputs_and_labels(input_ids, loss_mask, lengths, anchors, valid, BLOCK,
                                                          d.arch.mask_token_id)
    emb = torch.nn.functional.embedding(blocks, torch.randn(VOCAB, H, generator=g))
    d.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(grads), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex on CPU warns that it is unfused
        hidden = d.forward_train(ctx, emb, anchors, pad=pad)
        n = anchors.numel()
        terms = chunked_dflash_loss(hidden[:, :, 1:].reshape(n, BLOCK - 1, H), head, labels.reshape(n, -1),
                                    label_valid.reshape(n, -1), gamma=4.0, chunk_blocks=7)
    if not grads:
        return [hidden, terms.loss]
    terms.loss.backward()
    return [hidden.detach(), terms.loss.detach(), ctx.grad] + [p.grad for p in d.parameters()]


@pytest.mark.parametrize("backend", ["dense", "flex"])
def test_padding_changes_no_loss_and_no_gradient(run, backend):
    """Dense path: loss, output and every gradient; flex on CPU (eager, forward only): output and loss."""
    cfg, stream = run
    head = torch.nn.Linear(H, VOCAB, bias=False)
    torch.nn.init.normal_(head.weight, std=0.2, generator=torch.Generator().manual_seed(3))
    d = make_drafter()
    d.mask_backend = backend
    checked = 0
    for batch in micro_batches(cfg, stream, 12):
        s, a = batch[0].shape[1], batch[3].shape[1]
        if block_mask.flex_shapes(s, a, BLOCK) == (s, a):
            continue
        ref = loss_and_grads(d, head, batch, pad=False, grads=backend == "dense")
        padded = loss_and_grads(d, head, batch, pad=True, grads=backend == "dense")
        assert len(ref) == len(padded) and padded[1] > 0
        for x, y in zip(padded, ref):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
        checked += 1
        if checked == 3:
            break
    assert checked == 3


def test_flex_shapes_pads_width_to_tiles_and_anchors_to_two_query_tiles():
    assert block_mask.flex_shapes(1, 1, 16) == (128, 9)  # Q = 144: two query tiles
    assert block_mask.flex_shapes(129, 300, 16) == (256, 300)
    assert block_mask.flex_shapes(2048, 9, 16) == (2048, 9)
    assert block_mask.flex_shapes(300, 1, 8) == (384, 17) and block_mask.flex_shapes(5, 1, 256) == (128, 2)


def test_attention_backend_config_field_takes_the_drafters_mask_backends():
    assert load_config(overrides=["--model.attention_backend", "dense"]).model.attention_backend == "dense"
    assert load_config().model.attention_backend == "auto"
    with pytest.raises(DFlashError, match=r"model.attention_backend = 'sparse' must be auto, dense or flex"):
        load_config(overrides=["--model.attention_backend", "sparse"])
    assert set(MASK_BACKENDS) == {"auto", "dense", "flex"}  # the values the drafter's mask_backend takes
