"""DSpark (models/dspark.py): the objective against a hand computation and autograd, the sequential rule by hand,
the export's config and the errors of a wrong one, the config rules of the kind."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dflash_ds.errors import DFlashError
from dflash_ds.models.drafter import DFlashDrafter
from dflash_ds.models.dspark_arch import DSparkOptions
from dflash_ds.models.from_target import drafter_arch_from_target


def test_l1_term_and_confidence_bce_by_hand() -> None:
    """One position, vocabulary 3: 0.1 CE + 0.9 ||p - q||_1 (DeepSpec's weights), and the BCE against alpha."""
    from dflash_ds.models.dspark_loss import confidence_loss
    from dflash_ds.components.loss import dflash_loss

    z, t = torch.tensor([[[1.0, 0.0, -1.0]]]), torch.tensor([[[0.0, 2.0, 0.0]]])
    q, p = torch.softmax(z[0, 0], -1), torch.softmax(t[0, 0], -1)
    label, valid = torch.tensor([[1]]), torch.tensor([[True]])
    terms = dflash_loss(z, label, valid, gamma=4.0, target_logits=t, lk="l1", lk_weight=0.9)
    l1 = float((q - p).abs().sum())
    assert float(terms.loss) == pytest.approx(0.1 * -math.log(float(q[1])) + 0.9 * l1, rel=1e-6)
    alpha = float(torch.minimum(q, p).sum())
    assert alpha == pytest.approx(1 - 0.5 * l1) and float(terms.alpha[0, 0]) == pytest.approx(alpha)
    logit = torch.tensor([[0.3]])
    loss, sums = confidence_loss(logit, terms.alpha, terms.correct, valid, torch.ones(1))
    s = 1 / (1 + math.exp(-0.3))
    assert float(loss) == pytest.approx(-(alpha * math.log(s) + (1 - alpha) * math.log(1 - s)), rel=1e-6)
    assert float(sums["conf_brier"]) == pytest.approx((s - alpha) ** 2)  # judged on its target, alpha
    assert float(sums["conf_bin5_n"]) == 1 and float(sums["conf_bin5_p"]) == pytest.approx(s)


def test_chunked_loss_with_markov_bias_equals_autograd() -> None:
    """The chunked loss's hand-made gradient through a low-rank bias e @ w^T equals autograd's on whole logits."""
    from dflash_ds.components.loss import chunked_dflash_loss, dflash_loss

    gen = torch.Generator().manual_seed(0)
    n, k, h, v, r = 5, 3, 6, 11, 4
    head_w = torch.randn(v, h, generator=gen)
    hidden = torch.randn(n, k, h, generator=gen, requires_grad=True)
    w1 = torch.randn(v, r, generator=gen, requires_grad=True)
    w2 = torch.randn(v, r, generator=gen, requires_grad=True)
    prev = torch.randint(0, v, (n, k), generator=gen)
    labels = torch.randint(0, v, (n, k), generator=gen)
    valid = torch.rand(n, k, generator=gen) > 0.2
    target_hidden = torch.randn(n, k, h, generator=gen)
    knobs = {"gamma": 4.0, "lk": "l1", "lk_weight": 0.9, "streak_weight": 0.3}
    got = chunked_dflash_loss(hidden, lambda x: x @ head_w.T, labels, valid, target_hidden=target_hidden,
                              chunk_blocks=2, logit_bias=(w1[prev], w2.T), **knobs)
    grads = torch.autograd.grad(got.loss, (hidden, w1, w2))
    ref = dflash_loss(hidden @ head_w.T + w1[prev] @ w2.T, labels, valid, target_logits=target_hidden @ head_w.T,
                      **knobs)
    ref_grads = torch.autograd.grad(ref.loss, (hidden, w1, w2))
    torch.testing.assert_close(got.loss, ref.loss, atol=1e-6, rtol=1e-5)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert torch.equal(got.correct, ref.correct) and torch.allclose(got.alpha, ref.alpha, atol=1e-6)


def deepspec_loss(drafter: DFlashDrafter, embed, head, ids, loss_mask, lengths, context, last, anchors, valid,
                  gamma: float) -> tuple[torch.Tensor, list[float]]:
    """DeepSpec's DSpark loss written out block by block, position by position, on the drafter's own forward:
    sum_k d_k (0.1 CE + 0.9 ||q - p||_1) / sum_k d_k + sum_k d_k BCE(c_k, 1 - 0.5 ||q - p||_1 detached) / sum_k d_k,
    d_k = exp(-(k-1)/gamma), q_k = softmax(head(h_k) + w2 @ w1[x_{a+k-1}]) (teacher-forced: the gold token before
    position k, the anchor for k = 1), p_k = softmax(head(target's last hidden at a+k-1)), c_k the confidence logit
    on [h_k, w1[x_{a+k-1}]]. Also returns each position's 0.5 ||q - p||_1 (the tv_distance it logs)."""
    bs, mask_id = drafter.arch.block_size, drafter.arch.mask_token_id
    w1, w2 = drafter.markov_head.markov_w1.weight, drafter.markov_head.markov_w2.weight
    num = den = conf_num = conf_den = 0.0
    tvs = []
    for row, col in valid.nonzero().tolist():
        a = int(anchors[row, col])
        block = torch.full((1, 1, bs), mask_id)
        block[0, 0, 0] = ids[row, a]
        hidden = drafter.forward_train(context[row:row + 1], embed(block), anchors[row:row + 1, col:col + 1])[0, 0]
        for k in range(1, bs):
            pos = a + k
            if pos >= lengths[row] or not loss_mask[row, pos]:
                continue
            prev = ids[row, pos - 1]
            q = torch.softmax(head(hidden[k]) + w2 @ w1[prev], -1)
            p = torch.softmax(head(last[row, pos - 1]), -1)
            d = math.exp(-(k - 1) / gamma)
            l1 = (q - p).abs().sum()
            num = num + d * (0.1 * -torch.log(q[ids[row, pos]]) + 0.9 * l1)
            den += d
            c = drafter.confidence_head.proj(torch.cat([hidden[k], w1[prev]]))[0]
            conf_num = conf_num + d * F.binary_cross_entropy_with_logits(c, (1 - 0.5 * l1).detach())
            conf_den += d
            tvs.append(float(0.5 * l1.detach()))
    return num / den + conf_num / conf_den, tvs


def test_objective_is_deepspecs_loss(tiny_target: Path) -> None:
    """The trainer's objective (drafter_objective: chunked loss, Markov bias, confidence term) with DeepSpec's recipe
    equals `deepspec_loss` in value and in every parameter's gradient; its tv_distance is the mean 0.5 ||q - p||_1."""
    from dflash_ds.components.anchors import sample_anchors
    from dflash_ds.components.loss import metrics_from_sums
    from dflash_ds.components.objective import TargetStates, drafter_objective
    from dflash_ds.config import LossConfig

    gen = torch.Generator().manual_seed(0)
    block, gamma = 5, 4.0
    arch = drafter_arch_from_target(tiny_target, num_layers=1, block_size=block, options=DSparkOptions(markov_rank=8))
    drafter = DFlashDrafter(arch)
    drafter.init_weights(0)
    with torch.no_grad():  # Markov and confidence heads far from their init, so that every term counts
        for p in (*drafter.markov_head.parameters(), *drafter.confidence_head.parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    v, h = arch.vocab_size, arch.hidden_size
    embed, head = torch.nn.Embedding(v, h), torch.nn.Linear(h, v, bias=False)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(v, h, generator=gen))
        head.weight.copy_(torch.randn(v, h, generator=gen) * 0.2)
    ids = torch.randint(0, v, (2, 20), generator=gen)
    loss_mask, lengths = torch.zeros(2, 20, dtype=torch.long), torch.tensor([20, 16])
    loss_mask[:, 5:] = 1
    loss_mask[1, 11] = 0  # a hole inside a block: its position has no label
    context = torch.randn(2, 20, len(arch.target_layer_ids) * h, generator=gen)
    last = torch.randn(2, 20, h, generator=gen)
    cfg = LossConfig(gamma=gamma, num_anchors=4, chunk_blocks=3, lk="l1", lk_weight=0.9, confidence_weight=1.0,
                     confidence_target="sampled")  # DeepSpec's (the default aims at greedy serving's hit)
    terms, sums = drafter_objective(drafter, embed, head, TargetStates(ids, loss_mask, lengths, context, last), cfg,
                                    anchor_gen=torch.Generator().manual_seed(3))
    params = [p for p in drafter.parameters() if p.requires_grad]
    grads = torch.autograd.grad(terms.loss, params)
    anchors, valid = sample_anchors(loss_mask, lengths, block, 4, torch.Generator().manual_seed(3))  # the same draw
    ref, tvs = deepspec_loss(drafter, embed, head, ids, loss_mask, lengths, context, last, anchors, valid, gamma)
    ref_grads = torch.autograd.grad(ref, params)
    assert len(tvs) >= 20
    torch.testing.assert_close(terms.loss, ref, atol=1e-5, rtol=1e-5)
    for p, a, b in zip(params, grads, ref_grads):
        assert b.abs().max() > 0
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert metrics_from_sums(sums)["tv_distance"] == pytest.approx(sum(tvs) / len(tvs), rel=1e-5)


def test_ece_and_brier_by_hand() -> None:
    """Four confidences 0.05, 0.35, 0.38, 0.95 with outcomes miss, hit, miss, hit (a head trained for greedy
    acceptance): Brier = mean (c - hit)^2 =
    (0.0025 + 0.4225 + 0.1444 + 0.0025) / 4 = 0.142975; ECE over 10 bins = (|0.05 - 0| (bin 0) + |0.73 - 1| (bin 3)
    + |0.95 - 1| (bin 9)) / 4 = 0.0925. Training's (models/dspark_loss.py) and eval's (eval/summary.py)."""
    from dflash_ds.models.dspark_loss import confidence_loss, metrics as confidence_metrics
    from dflash_ds.eval.summary import calibration

    conf, hit = [0.05, 0.35, 0.38, 0.95], [0, 1, 0, 1]
    logits = torch.logit(torch.tensor([conf], dtype=torch.float64)).float()
    _, sums = confidence_loss(logits, None, torch.tensor([hit]).bool(), torch.ones(1, 4, dtype=torch.bool),
                              torch.ones(4))
    got = confidence_metrics({k: float(x) for k, x in sums.items()})
    assert got["confidence_brier"] == pytest.approx(0.142975, abs=1e-6)
    assert got["confidence_ece"] == pytest.approx(0.0925, abs=1e-6)
    served = calibration(list(zip(conf, hit)))
    assert served["brier"] == pytest.approx(0.142975) and served["ece"] == pytest.approx(0.0925)
    # A head trained for sampled acceptance is judged against its target, alpha 0.2, 0.6, 0.4, 0.9, not the hit:
    # Brier (0.0225 + 0.0625 + 0.0004 + 0.0025) / 4 = 0.021975; ECE (|0.05 - 0.2| + |0.73 - 1.0| + |0.95 - 0.9|) / 4
    # = 0.1175 (eval's calibration against alpha alike)
    alpha = [0.2, 0.6, 0.4, 0.9]
    _, sums = confidence_loss(logits, torch.tensor([alpha]), torch.tensor([hit]).bool(),
                              torch.ones(1, 4, dtype=torch.bool), torch.ones(4))
    got = confidence_metrics({k: float(x) for k, x in sums.items()})
    assert got["confidence_brier"] == pytest.approx(0.021975, abs=1e-6)
    assert got["confidence_ece"] == pytest.approx(0.1175, abs=1e-6)
    served = calibration(list(zip(conf, alpha)))
    assert served["brier"] == pytest.approx(0.021975) and served["ece"] == pytest.approx(0.1175)


def _dspark(tiny_target: Path, **kw) -> DFlashDrafter:
    arch = drafter_arch_from_target(tiny_target, num_layers=1, block_size=4, options=DSparkOptions(markov_rank=2, **kw))
    drafter = DFlashDrafter(arch)
    drafter.init_weights(0)
    return drafter


def test_sequential_rule_by_hand(tiny_target: Path) -> None:
    """Position k's logits are the head's plus w2 @ w1[x_{k-1}], x_0 the anchor, x_{k-1} the token drafted before."""
    drafter = _dspark(tiny_target, enable_confidence_head=False)
    v = drafter.arch.vocab_size
    head = lambda x: x  # noqa: E731 - hidden states of width V are the logits themselves
    base = torch.zeros(1, 3, v)
    base[0, :, 10] = 1.0  # the backbone alone drafts 10, 10, 10
    with torch.no_grad():
        drafter.markov_head.markov_w1.weight.zero_()
        drafter.markov_head.markov_w1.weight[5] = torch.tensor([1.0, 0.0])  # the anchor
        drafter.markov_head.markov_w1.weight[20] = torch.tensor([0.0, 1.0])
        drafter.markov_head.markov_w2.weight.zero_()
        drafter.markov_head.markov_w2.weight[20] = torch.tensor([2.0, 0.0])  # after the anchor: 20
        drafter.markov_head.markov_w2.weight[30] = torch.tensor([0.0, 3.0])  # after 20: 30
    draft = drafter.draft_tokens(base, head, torch.tensor([5]))
    assert draft.tokens.tolist() == [[20, 30, 10]]  # after 30 no bias: the backbone's 10
    assert float(draft.logits[0, 1, 30]) == 3.0 and float(draft.logits[0, 2, 10]) == 1.0
    with torch.no_grad():
        drafter.markov_head.markov_w2.weight.zero_()  # a warm start's bias: the backbone's argmax
    assert drafter.draft_tokens(base, head, torch.tensor([5])).tokens.tolist() == [[10, 10, 10]]


def test_export_config_and_its_errors(tiny_target: Path, tmp_path: Path) -> None:
    drafter = _dspark(tiny_target, enable_confidence_head=False)
    out = drafter.save_pretrained(tmp_path / "d")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["markov_rank"] == 2
    assert cfg["enable_confidence_head"] is False and cfg["sample_from_anchor"] is False
    assert cfg["dflash_config"]["block_size"] == 4 and "mask_token_id" in cfg["dflash_config"]
    back = DFlashDrafter.from_pretrained(out)
    assert back.kind == "dspark" and back.confidence_head is None and back.arch.options == drafter.arch.options
    cfg["sample_from_anchor"] = True  # DeepSpec's anchor-as-first layout: block_size 4 is 4 drafts
    (out / "config.json").write_text(json.dumps(cfg))
    anchor_first = DFlashDrafter.from_pretrained(out)
    assert anchor_first.arch.options.sample_from_anchor and anchor_first.arch.block_size == 5
    del cfg["markov_rank"]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DFlashError, match="lacks 'markov_rank'"):
        DFlashDrafter.from_pretrained(out)


def test_config_rules_and_resume_of_the_kind(tiny_target: Path) -> None:
    from dflash_ds.config import Config, validate
    from dflash_ds.runtime.checkpoint import arch_record
    from dflash_ds.runtime.resume import check_resume_state

    cfg = Config()
    cfg.model.markov_rank = 64
    with pytest.raises(DFlashError, match="model.markov_rank = 64 is a dspark field but model.kind = 'dflash'"):
        validate(cfg)
    cfg.model.kind = "dspark"
    validate(cfg)
    cfg.model.selector_rank = 8
    with pytest.raises(DFlashError, match="is a dflash2 field but model.kind = 'dspark'"):
        validate(cfg)
    saved = {"arch": arch_record(_dspark(tiny_target).arch)}
    assert saved["arch"]["kind"] == "dspark" and saved["arch"]["dspark_options"]["markov_rank"] == 2
    with pytest.raises(DFlashError, match="has kind = dspark but this run has dflash"):
        check_resume_state(saved, drafter_arch_from_target(tiny_target, num_layers=1, block_size=4), Path("ckpt"))
