"""Sequence parallelism in the trainer (topology.sequence_parallel, issue #56): two colocated ranks training each
batch together (SP 2: each holds half of every sequence's context and of its anchor blocks) train what two ranks
each training their own batches (SP 1) train, at the same global batch of 2: the same loss at every record, the
same weights (fp32 round-off), ZeRO-2 and ZeRO-3; an SP-2 checkpoint resumes under SP 1 and continues as the SP-1
run did; fed by a target rank instead (disaggregated: it sends each rank of the group only its half of the
context and of the final hidden), ZeRO-3 trains the same, and its walks (est_tau, each rank gathering the rows it
walks) read as the colocated run's. Every run has KL to the target's law on (loss.kl_weight 0.5): a colocated rank reads
the final hidden whole, a rank fed by a target rank fetches its label rows from the group
(sequence_parallel.rows_at). The real anchor sampler on every rank; the exchange itself is tested at 16K positions in
tests/test_distributed/test_sequence_parallel.py."""

from __future__ import annotations

import shutil

import pytest
import torch

from conftest_runtime import COMMON
from runtime_utils import per_batch, read_jsonl, torchrun

STEPS = 6
WALKS = ("--train.est_tau_interval", "3")  # est_tau walked at steps 3 and 6 (no gradient: the weights are the same)


def _args(setup, out, sp: int, stage: int, *extra, colocate: bool = True):
    target, data = setup
    common = [a if a != "20" else str(STEPS) for a in COMMON]  # COMMON's --max-steps
    return [*common, "--target", str(target), "--data", str(data), "--output-dir", str(out), "--no-wandb",
            *(["--colocate"] if colocate else ["--num-target-ranks", "1"]), "--zero-stage", str(stage),
            "--train.global_batch", "2", "--train.save_interval", "3",
            "--topology.sequence_parallel", str(sp), "--noise.max_std", "0.05", "--loss.kl_weight", "0.5", *extra]


def _run(setup, out, sp: int, stage: int, *extra, colocate: bool = True):
    r = torchrun(2 if colocate else 3, _args(setup, out, sp, stage, *extra, colocate=colocate), cwd=out)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r.stdout


def _weights(out, step: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out / "checkpoints" / f"step_{step:08d}" / "export" / "model.safetensors"))


def _same_run(got, want):
    """Every record of `got` equals `want`'s (loss, label positions, tokens), and so do the last weights."""
    mine, theirs = read_jsonl(got / "metrics.jsonl"), read_jsonl(want / "metrics.jsonl")
    assert [r["step"] for r in mine] == [r["step"] for r in theirs] == [5, 6]
    for a, b in zip(mine, theirs):
        assert abs(a["loss"] - b["loss"]) < 1e-4, (a["step"], a["loss"], b["loss"])
        assert a["label_positions"] == b["label_positions"], a["step"]  # every label counted once
        assert a["real_tokens"] == b["real_tokens"], a["step"]  # the group's batch counted once
    _same_weights(got, want)


def _same_weights(got, want):
    w, ref = _weights(got, STEPS), _weights(want, STEPS)
    assert w.keys() == ref.keys()
    worst = max((w[k] - ref[k]).abs().max().item() for k in ref)
    assert worst < 1e-4, worst
    moved = max((ref[k] - _weights(want, 3)[k]).abs().max().item() for k in ref)
    assert moved > 1e-3  # the steps compared did train


@pytest.fixture(scope="module")
def sp1(setup, tmp_path_factory):
    out = tmp_path_factory.mktemp("sp1")
    return out, _run(setup, out, 1, 2)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("stage", [2, 3])
def test_two_ranks_on_one_sequence_train_what_two_ranks_on_two_batches_train(setup, sp1, tmp_path, stage):
    ref, _ = sp1
    out = tmp_path / "sp2"
    out.mkdir()
    stdout = _run(setup, out, 2, stage, *WALKS)
    assert "sequence parallel over 2 ranks: 1 batch(es) a micro-step" in stdout
    assert "global batch 2 = 1 x 2 accumulated micro-batch(es) (one per group of 2)" in stdout
    _same_run(out, ref)
    records = [read_jsonl(out / "records" / f"drafter{d}.jsonl") for d in (0, 1)]
    assert [r["batch_id"] for r in records[0]] == [r["batch_id"] for r in records[1]] == list(range(2 * STEPS))
    if stage == 3:  # fed by a target rank that sends each rank of the group its half of every context
        fed = tmp_path / "fed"
        fed.mkdir()
        stdout = _run(setup, fed, 2, stage, *WALKS, colocate=False)
        assert "drafters [0, 1]; sequence parallel over 2 ranks: 1 batch(es) a micro-step, each rank sent its " \
               "shard" in stdout
        _same_run(fed, ref)
        # the walks read the rows whole (each rank gathers its group's shards): the colocated SP-2 run's est_tau
        walked = [(r["step"], r["est_tau"]) for r in read_jsonl(out / "metrics.jsonl") if "est_tau" in r]
        assert len(walked) == 2 and walked == [(r["step"], r["est_tau"]) for r in read_jsonl(fed / "metrics.jsonl")
                                               if "est_tau" in r]
    if stage == 2:  # resumed under SP 1 from the SP-2 step-3 checkpoint: the SP-1 run's second half
        resumed = tmp_path / "resumed"
        shutil.copytree(out, resumed)
        shutil.rmtree(resumed / "checkpoints" / f"step_{STEPS:08d}")
        stdout = _run(setup, resumed, 1, 2, "--resume", "auto")
        assert "resuming from" in stdout and "at step 3" in stdout
        got, want = per_batch(resumed), per_batch(ref)  # each batch's loss, as trained after the resume
        assert sorted(got) == sorted(want) == list(range(2 * STEPS))
        for b in range(6, 2 * STEPS):
            assert got[b]["step"] == want[b]["step"] and abs(got[b]["loss"] - want[b]["loss"]) < 1e-4, b
        _same_weights(resumed, ref)


def test_what_sequence_parallelism_does_not_run_yet_is_refused():
    from dflash_ds.config import load_config
    from dflash_ds.distributed.layout import Layout
    from dflash_ds.distributed.sequence_parallel import check_supported
    from dflash_ds.errors import DFlashError
    from dflash_ds.models.drafter_arch import DrafterArch
    from dflash_ds.models.dspark_arch import DSparkOptions

    cfg = load_config(None, ["--topology.colocate", "true", "--topology.sequence_parallel", "2", "--loss.kl_weight",
                             "0.5", "--loss.lk", "l1", "--loss.labels", "target"])  # the target's law: carried
    assert (cfg.topology.sequence_parallel, cfg.loss.needs_last_hidden) == (2, True)
    with pytest.raises(DFlashError, match="topology.sequence_parallel 3 does not divide the 2 drafter ranks"):
        Layout(2, [], [0, 1], colocated=True, sequence_parallel=3)
    layout = Layout(4, [], [0, 1, 2, 3], colocated=True, sequence_parallel=2)
    assert (layout.data_parallel, [layout.data_rank(d) for d in range(4)]) == (2, [0, 0, 1, 1])
    assert layout.sequence_groups() == [[0, 1], [2, 3]]
    assert layout.groups_across_nodes(4) == [] and layout.groups_across_nodes(None) == []
    # 2 nodes of 3 ranks, the last of each a target: drafters 0, 1, 3, 4 -> groups [0, 1] and [3, 4], each on its node;
    # 6 ranks a node, 3 targets: drafters 0, 1, 2 and 6, 7, 8 in groups of 2 -> [2, 6] crosses
    from dflash_ds.distributed.layout import make_layout

    assert make_layout(6, None, nproc_per_node=3, targets_per_node=1, sequence_parallel=2).groups_across_nodes(3) == []
    wide = make_layout(12, None, nproc_per_node=6, targets_per_node=3, sequence_parallel=2)
    assert wide.drafter_ranks == [0, 1, 2, 6, 7, 8] and wide.groups_across_nodes(6) == [[2, 6]]
    arch = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=6,
                num_key_value_heads=3, head_dim=8, vocab_size=64, rms_norm_eps=1e-6, max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6}, block_size=4, num_target_layers=4,
                mask_token_id=63, target_layer_ids=[1])
    with pytest.raises(DFlashError, match="3 key/value heads must divide by it"):  # checked before any group forms
        check_supported(DrafterArch(**arch), 2)
    with pytest.raises(DFlashError, match="the drafter kind 'dspark' is not supported"):
        check_supported(DrafterArch(**{**arch, "num_key_value_heads": 2, "num_attention_heads": 4},
                                    options=DSparkOptions()), 2)
