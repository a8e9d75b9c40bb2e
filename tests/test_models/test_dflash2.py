"""DFlash2 parts against hand computations: the block-local convolution, the walk, the identity init, the
export round trip and the errors a user meets (vLLM's own code is compared in test_serving/test_dflash2_vllm.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash_ds.errors import DFlashError
from dflash_ds.models.dflash2 import grouped_conv
from dflash_ds.models.dflash2_arch import DFlash2Options
from dflash_ds.models.dflash2_selector import walk
from dflash_ds.models.drafter import DFlashDrafter, read_drafter_arch
from dflash_ds.models.from_target import drafter_arch_from_target

OPTS = DFlash2Options(conv_kernel_size=3, conv_group_size=32, selector_rank=8, selector_top_k=4)


def test_grouped_conv_matches_hand_loop() -> None:
    """out[i, c] = sum_t (base[t, c] + delta[i, t, c // group]) x[i - t, c], taps inside i's block only."""
    gen = torch.Generator().manual_seed(0)
    block, taps, groups, group = 3, 3, 2, 2
    x = torch.randn(2, 2 * block, groups * group, generator=gen)
    delta = torch.randn(2, 2 * block, taps, groups, generator=gen)
    base = torch.randn(taps, groups * group, generator=gen)
    want = torch.zeros_like(x)
    for b in range(2):
        for i in range(2 * block):
            for c in range(groups * group):
                for t in range(taps):
                    if i % block >= t:  # i - t is in i's block
                        want[b, i, c] += (base[t, c] + delta[b, i, t, c // group]) * x[b, i - t, c]
    torch.testing.assert_close(grouped_conv(x, delta, base, block), want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("taps,block", [(2, 4), (3, 4), (5, 3), (1, 4)])
def test_grouped_conv_backward_is_the_gradient(taps: int, block: int) -> None:
    """The hand-written backward (models/grouped_conv.py) against finite differences in float64 (a tap count past
    the block included), and the other gradients when x needs none."""
    gen = torch.Generator().manual_seed(taps)
    x = torch.randn(2, 3 * block, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    delta = torch.randn(2, 3 * block, taps, 2, dtype=torch.float64, generator=gen, requires_grad=True)
    base = torch.randn(taps, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, d, b: grouped_conv(a, d, b, block), (x, delta, base))
    x.grad = None
    grouped_conv(x.detach().requires_grad_(False), delta, base, block).sum().backward()  # x needs none
    assert delta.grad is not None and base.grad is not None


def test_walk_follows_previous_choice() -> None:
    """Greedy: position 0 takes the best of row 0; each later position the best in the row of the previous pick."""
    cand = torch.tensor([[[10, 11], [20, 21], [30, 31]]])
    scores = torch.zeros(1, 3, 2, 2)
    scores[0, 0] = torch.tensor([[0.0, 1.0], [0.0, 1.0]])  # both rows the anchor's: pick index 1 (token 11)
    scores[0, 1] = torch.tensor([[9.0, 0.0], [0.0, 2.0]])  # row 1 (after 11): index 1, though row 0 has a 9
    scores[0, 2] = torch.tensor([[0.0, 5.0], [3.0, 0.0]])  # row 1 (after 21): index 0
    tokens, rows = walk(scores, cand)
    assert tokens.tolist() == [[11, 21, 30]]
    assert rows[0, 1].tolist() == [0.0, 2.0]
    torch.manual_seed(0)
    sampled, _ = walk(scores * 100, cand, temperature=1.0)  # near-deterministic rows: the same path
    assert sampled.tolist() == [[11, 21, 30]]


def _arch(target: Path, opts: DFlash2Options | None = OPTS, block_size: int = 4):
    return drafter_arch_from_target(target, num_layers=2, block_size=block_size, options=opts)


def test_identity_init_is_the_dflash_backbone_and_train_matches_infer(tiny_target: Path) -> None:
    d2 = DFlashDrafter(_arch(tiny_target))
    d2.init_weights(3)
    d1 = DFlashDrafter(_arch(tiny_target, None))
    missing, unexpected = d1.load_state_dict(d2.state_dict(), strict=False)
    assert not missing and all("_conv." in k or "candidate_selector" in k for k in unexpected)
    h, n = d2.arch.hidden_size, len(d2.arch.target_layer_ids)
    gen = torch.Generator().manual_seed(4)
    ctx, emb = torch.randn(1, 12, n * h, generator=gen), torch.randn(1, 2, 4, h, generator=gen)
    anchors = torch.tensor([[3, 7]])
    with torch.no_grad():
        torch.testing.assert_close(d2.forward_train(ctx, emb, anchors), d1.forward_train(ctx, emb, anchors))
        for p in d2.parameters():  # away from the identity: training and the one-block inference still agree
            if p.dim() == 3:
                p.normal_(generator=gen)
        for layer in d2.layers:
            layer.mlp_conv.kernel_projection.weight.normal_(std=0.2, generator=gen)
        out = d2.forward_train(ctx, emb, anchors)
        for j, a in enumerate((3, 7)):
            torch.testing.assert_close(d2.forward_infer(ctx[:, :a], emb[:, j], a), out[:, j], atol=2e-5, rtol=1e-5)


def test_export_round_trip_and_errors(tiny_target: Path, tmp_path: Path) -> None:
    d2 = DFlashDrafter(_arch(tiny_target))
    d2.init_weights(0)
    out = d2.save_pretrained(tmp_path / "e")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    assert {k: cfg["dflash_config"][k] for k in ("block_size", "conv_kernel_size", "conv_group_size",
                                                 "selector_rank", "selector_top_k")} == {
        "block_size": 4, "conv_kernel_size": 3, "conv_group_size": 32, "selector_rank": 8, "selector_top_k": 4}
    back = DFlashDrafter.from_pretrained(out)
    assert type(back).__name__ == "DFlash2Drafter" and back.arch.options == OPTS
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in d2.state_dict().items())
    assert "candidate_selector.predecessor_codebook" in back.state_dict()  # bare tensor, as vLLM loads it
    del cfg["dflash_config"]["selector_rank"]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DFlashError, match="selector_rank"):
        read_drafter_arch(out)
    with pytest.raises(DFlashError, match="model.conv_group_size = 48 must divide the hidden size 128"):
        _arch(tiny_target, DFlash2Options(conv_group_size=48))


def test_config_and_resume_refuse_a_kind_change(tiny_target: Path) -> None:
    from dflash_ds.config import Config, validate
    from dflash_ds.runtime.checkpoint import arch_record
    from dflash_ds.runtime.resume import check_resume_state

    cfg = Config()
    cfg.model.kind = "dflash3"
    with pytest.raises(DFlashError, match="model.kind = 'dflash3' must be dflash, dflash2 or dspark"):
        validate(cfg)
    saved = {"arch": arch_record(_arch(tiny_target, None))}
    assert saved["arch"]["kind"] == "dflash"
    with pytest.raises(DFlashError, match="has kind = dflash but this run has dflash2"):
        check_resume_state(saved, _arch(tiny_target), Path("ckpt"))


def test_selector_loss_by_hand() -> None:
    """Two positions, K = 2: gold found at slot 1 at position 0; missed (inserted into slot 1) at position 1."""
    import math

    from dflash_ds.models.dflash2_loss import selector_loss
    from dflash_ds.models.dflash2_selector import CandidateSelector

    head_w = torch.tensor([[1.0, 0], [0, 1], [1, 1], [-1, 0], [0, -1]])  # tokens 0..4
    sel = CandidateSelector(2, 5, 2)
    with torch.no_grad():
        sel.hidden_projection.weight.copy_(torch.eye(2))
        sel.predecessor_codebook.zero_()
        sel.predecessor_codebook[4] = torch.tensor([0.5, -1])  # the anchor
        sel.predecessor_codebook[0] = torch.tensor([1.0, 2])  # gold of position 0
        sel.successor_codebook.copy_(torch.tensor([[0.0, 1], [1, 1], [1, 0], [-1, 1.5], [0, 0]]))
    hidden = torch.tensor([[[2.0, 1], [-1, 2.5]]], requires_grad=True)
    labels, valid, anchor = torch.tensor([[0, 3]]), torch.tensor([[True, True]]), torch.tensor([4])
    loss, stats = selector_loss(hidden, lambda x: x @ head_w.T, sel, labels, valid, anchor, top_k=2, gamma=2.0)
    # position 0: logits (2, 1, 3, -2, -1): candidates (2, 0), unary (3, 2); pairs <(1, -1), S> = (1, -1)
    ce0 = math.log(math.exp(4) + math.exp(1)) - 1
    # position 1: logits (-1, 2.5, 1.5, 1, -2.5): top-2 (1, 2) misses 3 -> (1, 3), unary (2.5, 1);
    # predecessor 0: (1, 2) * (-1, 2.5) = (-1, 5); pairs (4, 8.5)
    ce1 = math.log(math.exp(6.5) + math.exp(9.5)) - 9.5
    w1 = math.exp(-1 / 2.0)
    assert loss.item() == pytest.approx((ce0 + w1 * ce1) / (1 + w1), rel=1e-6)
    assert {k: stats[k].item() for k in ("selector_correct", "unary_correct_k", "candidate_hits",
                                          "selector_positions")} == {
        "selector_correct": 1, "unary_correct_k": 0, "candidate_hits": 1, "selector_positions": 2}
    loss.backward()
    assert hidden.grad.abs().sum() > 0
    hidden.grad = None
    detached, _ = selector_loss(hidden, lambda x: x @ head_w.T, sel, labels, valid, anchor, top_k=2, gamma=2.0,
                                detach=True)
    assert detached.item() == pytest.approx(loss.item())
    detached.backward()
    assert hidden.grad is None and sel.successor_codebook.grad is not None
    # loss.selector_gold drop: position 1 (gold missed) carries no term; the statistics count as before
    dropped, drop_stats = selector_loss(hidden, lambda x: x @ head_w.T, sel, labels, valid, anchor, top_k=2,
                                        gamma=2.0, gold_rule="drop")
    assert dropped.item() == pytest.approx(ce0, rel=1e-6) and drop_stats["selector_weight_sum"].item() == 1.0
    assert drop_stats["candidate_hits"].item() == 1 and drop_stats["selector_positions"].item() == 2


def test_the_selector_weight_ramps_over_its_warmup() -> None:
    """loss.selector_warmup_steps N: step s (0-based) trains with weight x (s + 1) / N, full from step N - 1 on."""
    from dflash_ds.config import load_config
    from dflash_ds.runtime.step import loss_at

    cfg = load_config(None, {"loss": {"selector_weight": 0.5, "selector_warmup_steps": 4}})
    assert [loss_at(cfg, s).selector_weight for s in range(6)] == [0.125, 0.25, 0.375, 0.5, 0.5, 0.5]
    assert loss_at(cfg, 0).gamma == cfg.loss.gamma and cfg.loss.selector_weight == 0.5  # only the weight moves
    off = load_config(None, {"loss": {"selector_weight": 0.5}})
    assert loss_at(off, 0) is off.loss


def test_objective_adds_the_weighted_selector_term(tiny_target: Path) -> None:
    """drafter_objective on a DFlash2 drafter: loss = DFlash loss + selector_weight x selector term, any chunking."""
    from dflash_ds.components.objective import TargetStates, drafter_objective
    from dflash_ds.config import LossConfig

    drafter = DFlashDrafter(_arch(tiny_target))
    drafter.init_weights(0)
    h, n, s = drafter.arch.hidden_size, len(drafter.arch.target_layer_ids), 24
    gen = torch.Generator().manual_seed(5)
    states = TargetStates(torch.randint(0, 500, (2, s), generator=gen), torch.ones(2, s, dtype=torch.long),
                          torch.tensor([s, s]), torch.randn(2, s, n * h, generator=gen), None)
    embed_w, head_w = torch.randn(512, h, generator=gen), torch.randn(512, h, generator=gen)
    run = {}
    for weight, chunk in ((0.0, 64), (0.5, 64), (0.5, 1)):
        terms, sums = drafter_objective(drafter, lambda i: embed_w[i], lambda x: x @ head_w.T, states,
                                        LossConfig(num_anchors=3, selector_weight=weight, chunk_blocks=chunk),
                                        anchor_gen=torch.Generator().manual_seed(0))
        run[weight, chunk] = terms.loss.item(), sums
    sel = run[0.5, 64][1]
    term = (sel["selector_loss_sum"] / sel["selector_weight_sum"]).item()
    assert sel["selector_positions"].item() == 6 * 3 and run[0.0, 64][1]["selector_positions"].item() == 0
    assert run[0.5, 64][0] == pytest.approx(run[0.0, 64][0] + 0.5 * term, rel=1e-5)
    assert run[0.5, 1][0] == pytest.approx(run[0.5, 64][0], rel=1e-5)


def test_the_head_runs_once_per_step_and_the_selector_term_is_unchanged(tiny_target: Path) -> None:
    """DFlash2's selector reads its top-K candidates from the DFlash loss's chunks (LossTerms.candidates): the LM head
    runs once per chunk of blocks, not twice, and the selector term, its gradient and statistics are those of its
    own head pass."""
    from dflash_ds.components.loss import chunked_dflash_loss
    from dflash_ds.components.objective import TargetStates, drafter_objective
    from dflash_ds.models.dflash2_loss import selector_loss
    from dflash_ds.config import LossConfig
    from dflash_ds.models.drafter import DFlashDrafter
    from dflash_ds.models.target import capture_hidden, load_target, target_parts

    target = load_target(tiny_target)
    arch = _arch(tiny_target, DFlash2Options(conv_group_size=32, selector_rank=8, selector_top_k=4))
    drafter = DFlashDrafter(arch)
    drafter.init_weights(0)
    parts = target_parts(target)
    calls = []

    def head(h):
        assert h.dim() == 2  # one [rows, H] GEMM per chunk (tests/test_core/test_head_gemm.py)
        calls.append(h.shape[0])
        return parts.head(h)

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 500, (2, 48), generator=gen)
    mask = torch.zeros_like(ids)
    mask[:, 8:] = 1
    context, last = capture_hidden(target, ids, None, arch.target_layer_ids)
    states = TargetStates(ids, mask, torch.tensor([48, 40]), context, last)
    cfg = LossConfig(num_anchors=16, chunk_blocks=5)
    drafter_objective(drafter, parts.embed, head, states, cfg, anchor_gen=torch.Generator().manual_seed(1))
    k = arch.block_size - 1  # 32 blocks, chunks of 5: one pass over the blocks, K positions each
    assert len(calls) == 7 and sum(calls) == 32 * k and calls[0] == 5 * k
    hidden = torch.randn(9, arch.block_size - 1, arch.hidden_size, generator=gen, requires_grad=True)
    labels = torch.randint(0, 512, (9, arch.block_size - 1), generator=gen)
    valid = torch.rand(9, arch.block_size - 1, generator=gen) > 0.2
    anchor = torch.randint(0, 512, (9,), generator=gen)
    terms = chunked_dflash_loss(hidden, parts.head, labels, valid, gamma=4.0, chunk_blocks=4, top_k=4)
    kw = {"top_k": 4, "gamma": 4.0, "chunk_blocks": 4}
    got = selector_loss(hidden, parts.head, drafter.candidate_selector, labels, valid, anchor,
                        candidates=terms.candidates, **kw)
    want = selector_loss(hidden, parts.head, drafter.candidate_selector, labels, valid, anchor, **kw)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    assert all(torch.equal(got[1][k], want[1][k]) for k in want[1])
    g_got = torch.autograd.grad(got[0], hidden)[0]
    g_want = torch.autograd.grad(want[0], hidden)[0]
    assert torch.equal(g_got, g_want) and float(want[1]["candidate_hits"]) < float(want[1]["selector_positions"])
