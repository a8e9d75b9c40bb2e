"""LK losses, D-PACE position weights and target labels: against hand computations, chunked against whole,
through the objective (which target position labels which token), the config and the metrics."""

from __future__ import annotations

import math

import pytest
import torch
import yaml

from dflash_ds.components.loss import (LK_EPS, acceptance_sums, chunked_dflash_loss, dflash_loss, metric_sums,
                                       metrics_from_sums)
from dflash_ds.components.weights import dpace_weights
from dflash_ds.config import LossConfig, load_config, to_dict
from dflash_ds.errors import DFlashError

# ---- hand computation: plain loops over blocks, positions and the vocabulary (float64, autograd for grads) ----


def _softmax(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    m = max(x.item() for x in xs)
    e = [torch.exp(x - m) for x in xs]
    total = sum(e)
    return [x / total for x in e]


def hand_loss(z, t, data_labels, valid, *, gamma=3.0, kl_weight=0.0, kl_temperature=1.0, streak_weight=0.0,
              labels="data", lk="", lk_weight=1.0, lk_kl_scale=1.0, lk_kl_decay=1.0, position_weighting="decay",
              dpace_alpha=0.5):
    """The loss of docs/DESIGN.md §3, one scalar at a time."""
    n_blocks, k_pos, vocab = z.shape
    T = kl_temperature
    num = den = 0.0
    for n in range(n_blocks):
        ok = [bool(valid[n, k]) for k in range(k_pos)]
        if labels == "target":  # the target's argmax at this position
            y = [max(range(vocab), key=lambda v: t[n, k, v].item()) for k in range(k_pos)]
        else:
            y = [int(data_labels[n, k]) for k in range(k_pos)]
        p = [_softmax([z[n, k, v] for v in range(vocab)]) for k in range(k_pos)]
        q = [p[k][y[k]].item() for k in range(k_pos)]  # confidence in the label, detached
        if position_weighting == "dpace":
            reach, run = [], 1.0
            for k in range(k_pos):
                run *= ((1 - dpace_alpha) * q[k] + dpace_alpha) if ok[k] else 1.0
                reach.append(run if ok[k] else 0.0)
            w = [sum(reach[m] for m in range(k, k_pos)) for k in range(k_pos)]
        else:
            w = [math.exp(-k / gamma) for k in range(k_pos)]
        if streak_weight > 0:
            streak, run = [], 1.0
            for k in range(k_pos):
                streak.append(run)
                run *= q[k] if ok[k] else 1.0
            w = [(1 - streak_weight) * w[k] + streak_weight * streak[k] for k in range(k_pos)]
        for k in range(k_pos):
            if not ok[k]:
                continue
            ce = -torch.log(p[k][y[k]])
            pd = _softmax([z[n, k, v] / T for v in range(vocab)])
            pt = _softmax([t[n, k, v] / T for v in range(vocab)])
            kl = sum(pt[v] * (torch.log(pt[v]) - torch.log(pd[v])) for v in range(vocab))
            alpha = sum(min(pd[v], pt[v]) for v in range(vocab))
            term = (1 - kl_weight) * ce + kl_weight * T * T * kl
            if lk == "log":
                term = (1 - lk_weight) * term + lk_weight * -torch.log(alpha + LK_EPS)
            elif lk == "hybrid":
                share = lk_kl_scale * math.exp(-lk_kl_decay * alpha.item())
                term = (1 - lk_weight) * term + lk_weight * (share * kl + (1 - share) * (1 - alpha))
            num = num + w[k] * term
            den += w[k]
    return num / den


N2, K3, H5, V7 = 2, 3, 5, 7  # 2 blocks of block size 4, vocabulary 7


def _small_case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N2, K3, H5, generator=g, dtype=torch.float64)
    weight = torch.randn(V7, H5, generator=g, dtype=torch.float64)
    target_hidden = torch.randn(N2, K3, H5, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V7, (N2, K3), generator=g)
    valid = torch.tensor([[True, False, True], [True, True, True]])  # a hole in block 0
    return hidden, weight, target_hidden, labels, valid


HAND = {
    "lk-log": {"lk": "log"},
    "lk-log-mixed": {"lk": "log", "lk_weight": 0.4, "kl_weight": 0.3, "kl_temperature": 1.5},
    "lk-hybrid": {"lk": "hybrid", "lk_kl_scale": 0.8, "lk_kl_decay": 2.0},
    "lk-hybrid-mixed": {"lk": "hybrid", "lk_weight": 0.6, "kl_weight": 0.5, "kl_temperature": 0.7},
    "dpace": {"position_weighting": "dpace", "dpace_alpha": 0.4},
    "dpace-streak-kl": {"position_weighting": "dpace", "dpace_alpha": 0.7, "streak_weight": 0.3, "kl_weight": 0.2},
    "labels-target": {"labels": "target"},
    "everything": {"labels": "target", "lk": "hybrid", "lk_weight": 0.5, "kl_weight": 0.3, "kl_temperature": 1.3,
                   "position_weighting": "dpace", "streak_weight": 0.2},
}


@pytest.mark.parametrize("name", list(HAND), ids=list(HAND))
def test_loss_and_gradient_equal_the_hand_computation(name):
    knobs = HAND[name]
    hidden, weight, target_hidden, labels, valid = _small_case()
    h_ref = hidden.clone().requires_grad_(True)
    expected = hand_loss(h_ref @ weight.T, target_hidden @ weight.T, labels, valid, **knobs)
    expected.backward()

    head = torch.nn.Linear(H5, V7, bias=False)
    with torch.no_grad():
        head.weight.copy_(weight.float())
    head.weight.requires_grad_(False)
    whole = dflash_loss(head(hidden.float()), labels, valid, gamma=3.0, target_logits=head(target_hidden.float()),
                        **knobs)
    assert abs(whole.loss.item() - expected.item()) < 1e-5, (whole.loss.item(), expected.item())
    for chunk in (1, 2):
        h = hidden.float().clone().requires_grad_(True)
        out = chunked_dflash_loss(h, head, labels, valid, gamma=3.0, target_hidden=target_hidden.float(),
                                  chunk_blocks=chunk, **knobs)
        out.loss.backward()
        assert abs(out.loss.item() - expected.item()) < 1e-5, (chunk, out.loss.item(), expected.item())
        assert torch.allclose(h.grad.double(), h_ref.grad, atol=1e-5), (chunk, h.grad, h_ref.grad)


def test_dpace_weights_by_hand():
    q = torch.tensor([[0.8, 0.5, 0.9]])
    # smoothed 0.9, 0.75, 0.95; reach 0.9, 0.675, 0.64125; weights = suffix sums of the reach
    w = dpace_weights(q, torch.ones(1, 3, dtype=torch.bool), 0.5)
    assert torch.allclose(w, torch.tensor([[2.21625, 1.31625, 0.64125]]))
    # an invalid middle position neither scales the reach nor adds a term (its weight is masked by the loss)
    w = dpace_weights(q, torch.tensor([[True, False, True]]), 0.5)
    assert torch.allclose(w[0, [0, 2]], torch.tensor([0.9 + 0.855, 0.855]))
    assert torch.allclose(dpace_weights(q, torch.ones(1, 3, dtype=torch.bool), 1.0), torch.tensor([[3.0, 2.0, 1.0]]))


# ---- chunked against whole on a larger random case (fp32) ----

N, K, H, V = 13, 5, 16, 37

KNOBS = {
    "lk-log": {"lk": "log"},
    "lk-hybrid": {"lk": "hybrid", "lk_kl_scale": 0.9, "lk_kl_decay": 3.0},
    "lk-hybrid+kl": {"lk": "hybrid", "lk_weight": 0.7, "kl_weight": 0.4, "kl_temperature": 1.7},
    "lk-log+kl+streak": {"lk": "log", "lk_weight": 0.5, "kl_weight": 0.5, "kl_temperature": 0.8, "streak_weight": 0.3},
    "dpace": {"position_weighting": "dpace"},
    "dpace+streak": {"position_weighting": "dpace", "dpace_alpha": 0.2, "streak_weight": 0.5},
    "labels-target": {"labels": "target"},
    "labels-target+kl+lk+dpace": {"labels": "target", "kl_weight": 0.3, "lk": "hybrid", "lk_weight": 0.5,
                                  "position_weighting": "dpace"},
}


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, K, H, generator=g)
    head = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g))
    head.weight.requires_grad_(False)
    labels = torch.randint(0, V, (N, K), generator=g)
    valid = torch.rand(N, K, generator=g) > 0.25
    valid[3] = False  # a block with no valid position
    return hidden, head, labels, valid, torch.randn(N, K, H, generator=g)


@pytest.mark.parametrize("knobs", list(KNOBS), ids=list(KNOBS))
@pytest.mark.parametrize("chunk", [1, 4, 13])
def test_chunked_equals_whole(knobs, chunk):
    hidden, head, labels, valid, target_hidden = _case()
    kw = KNOBS[knobs]
    h1 = hidden.clone().requires_grad_(True)
    whole = dflash_loss(head(h1), labels, valid, gamma=3.0, target_logits=head(target_hidden), **kw)
    whole.loss.backward()
    h2 = hidden.clone().requires_grad_(True)
    chunked = chunked_dflash_loss(h2, head, labels, valid, gamma=3.0, target_hidden=target_hidden,
                                  chunk_blocks=chunk, **kw)
    chunked.loss.backward()
    assert abs(chunked.loss.item() - whole.loss.item()) < 1e-5
    assert torch.allclose(h2.grad, h1.grad, atol=1e-5, rtol=1e-5)
    assert h2.grad.abs().sum() > 0
    for a, b in zip(metric_sums(chunked).values(), metric_sums(whole).values()):
        assert torch.equal(a, b)
    if whole.alpha is None:  # D-PACE alone reads no target distribution
        assert chunked.alpha is None and not {"lk", "kl_weight", "labels"} & set(kw)
    else:
        assert torch.allclose(chunked.alpha, whole.alpha, atol=1e-6)
        assert torch.allclose(chunked.argmax_alpha, whole.argmax_alpha, atol=1e-6)
    assert torch.allclose(chunked.weight_sum, whole.weight_sum, atol=1e-5)


def test_target_labels_are_the_target_argmax_and_alpha_is_the_overlap():
    hidden, head, labels, valid, target_hidden = _case(3)
    t_logits = head(target_hidden)
    as_target = chunked_dflash_loss(hidden, head, labels, valid, gamma=3.0, target_hidden=target_hidden,
                                    labels="target", chunk_blocks=4)
    as_data = chunked_dflash_loss(hidden, head, t_logits.argmax(-1), valid, gamma=3.0, chunk_blocks=4)
    assert torch.allclose(as_target.loss, as_data.loss, atol=1e-6) and torch.equal(as_target.correct, as_data.correct)
    overlap = torch.minimum(head(hidden).softmax(-1), t_logits.softmax(-1)).sum(-1) * valid
    assert torch.allclose(as_target.alpha, overlap, atol=1e-6)
    assert as_data.alpha is None  # no target distribution read: no acceptance estimate
    sums = acceptance_sums(as_target)
    assert torch.allclose(sums["alpha"], overlap.sum()) and sums["alpha_positions"] == valid.sum()
    m = metrics_from_sums({**metric_sums(as_target), **sums})
    assert abs(m["alpha"] - (overlap.sum() / valid.sum()).item()) < 1e-6
    assert "alpha" not in metrics_from_sums({**metric_sums(as_data), **acceptance_sums(as_data)})
    assert "alpha_tau" not in metrics_from_sums({**metric_sums(as_data), **acceptance_sums(as_data)})
    # alpha_tau by hand: per block whose first position is valid, alpha_1 + alpha_1 alpha_2 + ...
    per_block = [sum(math.prod(overlap[b, :k + 1].tolist()) for k in range(valid.shape[1]))
                 for b in range(valid.shape[0]) if valid[b, 0]]
    assert abs(m["alpha_tau"] - (1 + sum(per_block) / len(per_block))) < 1e-5
    # argmax_alpha: the target's probability of the drafter's argmax, what an engine drafting the argmax accepts
    picked = t_logits.softmax(-1).gather(-1, head(hidden).argmax(-1, keepdim=True)).squeeze(-1) * valid
    assert torch.allclose(as_target.argmax_alpha, picked, atol=1e-6)
    per_block = [sum(math.prod(picked[b, :k + 1].tolist()) for k in range(valid.shape[1]))
                 for b in range(valid.shape[0]) if valid[b, 0]]
    assert abs(m["argmax_alpha"] - (picked.sum() / valid.sum()).item()) < 1e-6
    assert abs(m["argmax_alpha_tau"] - (1 + sum(per_block) / len(per_block))) < 1e-5


def test_alpha_tau_by_hand():
    from dflash_ds.components.loss import LossTerms

    alpha = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.5, 0.5], [0.0, 0.0, 0.0]])
    valid = torch.tensor([[True, True, False], [True, True, True], [False, False, False]])
    terms = LossTerms(loss=torch.zeros(()), correct=valid & False, in_top4=valid & False, in_top8=valid & False,
                      valid=valid, weight_sum=torch.zeros(()), alpha=alpha * valid, argmax_alpha=alpha * valid / 2)
    m = metrics_from_sums({**metric_sums(terms), **acceptance_sums(terms)})
    # block 0: 0.5 + 0.25 + 0 (its third position is past the mask); block 1: 1 + 0.5 + 0.25; block 2 has no anchor
    assert m["alpha_tau"] == pytest.approx(1 + (0.75 + 1.75) / 2) and m["alpha"] == pytest.approx(3.0 / 5)
    # halved rates: block 0: 0.25 + 0.0625; block 1: 0.5 + 0.125 + 0.03125
    assert m["argmax_alpha_tau"] == pytest.approx(1 + (0.3125 + 0.65625) / 2) and m["argmax_alpha"] == \
        pytest.approx(1.5 / 5)


def test_terms_that_need_the_target_are_off_without_it():
    hidden, head, labels, valid, _ = _case(4)
    plain = chunked_dflash_loss(hidden, head, labels, valid, gamma=3.0)
    for kw in ({"lk": "log"}, {"labels": "target"}, {"lk": "hybrid", "kl_weight": 0.5}):
        out = chunked_dflash_loss(hidden, head, labels, valid, gamma=3.0, **kw)
        assert torch.equal(out.loss, plain.loss) and out.alpha is None, kw


def test_no_valid_position_gives_zero_loss_and_zero_grad():
    hidden, head, labels, _, target_hidden = _case(2)
    h = hidden.clone().requires_grad_(True)
    out = chunked_dflash_loss(h, head, labels, torch.zeros(N, K, dtype=torch.bool), gamma=7.0, chunk_blocks=3,
                              target_hidden=target_hidden, lk="log", position_weighting="dpace", labels="target")
    assert out.loss.item() == 0.0
    out.loss.backward()
    assert torch.all(h.grad == 0)


def test_bad_knobs_are_a_clear_error():
    hidden, head, labels, valid, _ = _case()
    for kw, name in (({"lk": "exp"}, "lk"), ({"labels": "gold"}, "labels"), ({"position_weighting": "x"}, "position")):
        with pytest.raises(ValueError, match=name):
            chunked_dflash_loss(hidden, head, labels, valid, gamma=3.0, **kw)


# ---- through the objective: which target position labels which token ----


def test_target_labels_through_the_objective_are_the_data_when_the_data_is_greedy():
    """The label of block position k after anchor a is x_{a+k}; the target predicts it at a+k-1. Final hidden
    states built so that lm_head(h_{s-1}) has its argmax at x_s: target labels = data labels, same loss and grads."""
    from dflash_ds.components.objective import TargetStates, drafter_objective
    from dflash_ds.models.drafter import DFlashDrafter, DrafterArch

    vocab, hid = 48, 64
    arch = DrafterArch(hidden_size=hid, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=32, vocab_size=vocab, rms_norm_eps=1e-6,
                       max_position_embeddings=512, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                       block_size=4, num_target_layers=4, mask_token_id=vocab - 1, target_layer_ids=[1, 2])
    torch.manual_seed(0)
    drafter = DFlashDrafter(arch)
    drafter.init_weights(0)
    embed = torch.nn.Embedding(vocab, hid)
    lm_head = torch.nn.Linear(hid, vocab, bias=False)
    with torch.no_grad():
        lm_head.weight.copy_(torch.eye(vocab, hid))  # logits = the first 48 hidden coordinates
    ids = torch.randint(0, vocab - 1, (2, 40))
    loss_mask = torch.ones_like(ids)
    loss_mask[:, :6] = 0
    lengths = torch.tensor([40, 33])
    greedy = torch.zeros(2, 40, hid)
    greedy[:, :-1] = 4.0 * torch.nn.functional.one_hot(ids[:, 1:], hid).float()  # argmax at s-1 is x_s
    shifted = 4.0 * torch.nn.functional.one_hot(ids, hid).float()  # off by one: argmax at s is x_s
    context = torch.randn(2, 40, 2 * hid)

    def run(last_hidden, **loss):
        drafter.zero_grad()
        states = TargetStates(ids, loss_mask, lengths, context, last_hidden)
        cfg = LossConfig(num_anchors=6, position_weighting="dpace", **loss)
        gen = torch.Generator().manual_seed(1)
        terms, sums = drafter_objective(drafter, embed, lm_head, states, cfg, anchor_gen=gen)
        terms.loss.backward()
        return terms, sums, [p.grad.clone() for p in drafter.parameters() if p.grad is not None]

    data, data_sums, data_grads = run(greedy)
    target, target_sums, target_grads = run(greedy, labels="target")
    assert data.alpha is None and data_sums["alpha_positions"] == 0  # labels=data, no KL/LK: target not read
    assert target.alpha is not None and target_sums["alpha_positions"] == target.valid.sum() > 0
    assert torch.allclose(target.loss, data.loss, atol=1e-6) and torch.equal(target.correct, data.correct)
    for a, b in zip(target_grads, data_grads):
        assert torch.allclose(a, b, atol=1e-6)
    off, _, _ = run(shifted, labels="target")
    assert abs(off.loss.item() - data.loss.item()) > 1e-3  # the test tells the positions apart


def test_host_reads_stay_within_the_bound_with_every_new_term():
    from test_host_syncs import ARCH, SyncCount

    from dflash_ds.components.objective import TargetStates
    from dflash_ds.models.drafter import DFlashDrafter
    from dflash_ds.runtime.engine import DrafterTrainModule

    torch.manual_seed(0)
    drafter = DFlashDrafter(ARCH)
    drafter.init_weights(0)
    module = DrafterTrainModule(drafter, torch.nn.Embedding(100, 64), torch.nn.Linear(64, 100, bias=False))
    ids = torch.randint(0, 99, (2, 64))
    states = TargetStates(ids, torch.ones_like(ids), torch.tensor([64, 50]), torch.randn(2, 64, 128),
                          torch.randn(2, 64, 64))
    cfg = LossConfig(num_anchors=8, kl_weight=0.3, lk="hybrid", lk_weight=0.5, labels="target",
                     position_weighting="dpace", streak_weight=0.2)
    with SyncCount() as counted:
        terms, sums = module(states, cfg, 1, 0.0, 2)
        terms.loss.backward()
    assert counted.calls == {"item": 1, "blocking to": 2}, counted.calls
    assert {"alpha", "alpha_positions"} <= set(sums)


# ---- config ----


def test_config_round_trip_and_overrides(tmp_path):
    default = LossConfig()
    assert (default.labels, default.lk, default.lk_weight, default.position_weighting) == ("data", "", 1.0, "decay")
    assert (default.lk_kl_scale, default.lk_kl_decay, default.dpace_alpha) == (1.0, 1.0, 0.5)
    assert not default.needs_last_hidden
    f = tmp_path / "run.yaml"
    f.write_text("loss:\n  lk: hybrid\n  lk_weight: 0.3\n  lk_kl_scale: 0.9\n  lk_kl_decay: 3\n"
                 "  position_weighting: dpace\n  dpace_alpha: 0.25\n  labels: target\n")
    cfg = load_config(f)
    loss = cfg.loss
    assert (loss.lk, loss.lk_weight, loss.lk_kl_scale, loss.lk_kl_decay) == ("hybrid", 0.3, 0.9, 3.0)
    assert (loss.position_weighting, loss.dpace_alpha, loss.labels) == ("dpace", 0.25, "target")
    assert loss.needs_last_hidden
    again = tmp_path / "again.yaml"
    again.write_text(yaml.safe_dump(to_dict(cfg)))
    assert load_config(again) == cfg
    cli = load_config(f, ["--loss.lk", "log", "--loss.labels", "data", "--loss.position_weighting", "decay"])
    assert (cli.loss.lk, cli.loss.labels, cli.loss.position_weighting) == ("log", "data", "decay")
    assert cli.loss.needs_last_hidden  # LK reads the target's distribution
    assert not load_config(f, ["--loss.lk", "", "--loss.labels", "data"]).loss.needs_last_hidden


@pytest.mark.parametrize("overrides, message", [
    (["--loss.lk", "exp"], "loss.lk = 'exp' must be \"\" (off), log, hybrid or l1"),
    (["--loss.labels", "gold"], "loss.labels = 'gold' must be data or target"),
    (["--loss.position_weighting", "linear"], "loss.position_weighting = 'linear' must be decay or dpace"),
    (["--loss.dpace_alpha", "1.5"], "loss.dpace_alpha = 1.5 must be in [0, 1]"),
    (["--loss.lk_weight", "-0.1"], "loss.lk_weight = -0.1 must be in [0, 1]"),
    (["--loss.lk_kl_scale", "2"], "loss.lk_kl_scale = 2.0 must be in [0, 1]"),
    (["--loss.lk_kl_decay", "-1"], "loss.lk_kl_decay = -1.0 must be >= 0"),
])
def test_bad_config_values_name_the_field(overrides, message):
    with pytest.raises(DFlashError) as err:
        load_config(None, overrides)
    assert message in str(err.value)


def test_window_record_has_alpha_only_when_measured():
    from dflash_ds.runtime.step_metrics import LOSS_SUMS, STEP_SUMS, WALK_KEYS, WindowTotals

    sums = {**{k: 1.0 for k in STEP_SUMS + LOSS_SUMS}, **{k: 0.0 for k in WALK_KEYS}}
    args = (5, 0, 1.0, 1, 1, 1, 10, 0.1)
    with_alpha = WindowTotals({**sums, "alpha": 3.0, "alpha_positions": 4.0, "alpha_streak": 2.5, "argmax_alpha": 2.0,
                               "argmax_alpha_streak": 1.5}, 0.0, [1.0], [1.0], [1.0], [0.0])
    rec = with_alpha.record(*args)
    assert (rec["alpha"], rec["alpha_tau"], rec["argmax_alpha"], rec["argmax_alpha_tau"]) == (0.75, 3.5, 0.5, 2.5)
    without = WindowTotals({**sums, "alpha": 0.0, "alpha_positions": 0.0}, 0.0, [1.0], [1.0], [1.0], [0.0])
    assert "alpha" not in without.record(*args)
