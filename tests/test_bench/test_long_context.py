"""One long sequence per micro-batch (memory/long_context.py, `plan --seq-len`): the arithmetic against a hand count."""

from __future__ import annotations

import json

import pytest

from dflash_ds.cli import main
from dflash_ds.memory import long_context as lc
from dflash_ds.memory import model as mm
from dflash_ds.models.presets import PRESETS

Q8 = PRESETS["qwen3-8b"]
RUN = lc.LongRun()  # 5 layers read, 512 anchors, budget 2,048, chunk 64, bs 16, KL, ZeRO-2, bf16
L = 65536


def drafter_step_by_hand(h: int, i: int, nh: int, nkv: int, d: int, v: int, n: int) -> float:
    """docs/MEMORY.md's micro-step terms at B = 1, S = n, 512 anchors (T = 8,192, P = 7,680), bf16, flex,
    all layers recomputed, KL, without parameter gradients: held + the worse of the loss and backward moments."""
    b, t, p, c = 2, 512 * 16, 512 * 15, n
    q, kv = nh * d, nkv * d
    a_tok = 2 * h * (4 + 2 * b) + (q + kv) * (4 + 3 * b) + 4 * b * i + 4 * nh
    c_tok = kv * (4 + 3 * b)
    nq, nk = -(-t // 128), -(-(n + t) // 128)
    flex = 4 * (4 * nq * nk + 2 * nq + 2 * nk)
    held = 2 * (t + c) * d * b + c * h * (4 + 2 * b) + t * h * b + 4 * t * h * b + flex
    loss = t * h * (4 + 2 * b) + 3 * p * h * b + 64 * 15 * v * 32.5
    backward = t * b * (i + 2.5 * h) + c * h * b + t * a_tok + c * c_tok + c * b * (3 * kv + h)
    return held + max(loss, backward)


def test_drafter_step_at_one_long_sequence() -> None:
    d, s = lc.drafter_at(Q8, RUN), lc.step_at(L, RUN)
    assert (s.batch, s.seq_len, s.anchors_per_row) == (1, L, 512)  # 512 anchors: 0.8% of 64K positions
    want = drafter_step_by_hand(4096, 12288, 32, 8, 128, 151936, L)
    assert mm.micro_step_peak(d, s, param_grads=False) == pytest.approx(want, rel=1e-12)
    assert want / 1e9 == pytest.approx(7.72, abs=0.005)  # docs/MEMORY.md's table


def test_target_forward_and_rank_totals_by_hand() -> None:
    h, i, b, n = 4096, 12288, 2, L
    fwd = lc.target_forward_terms(lc.drafter_at(Q8, RUN), n, RUN)
    # the layer's working set is the MLP's, above attention's; the 5 layers read, not the final hidden, are alive
    # while layers 34 and 35 run (ids 1, 9, 17, 25, 33 of 36)
    assert fwd == {"embeddings": n * h * b, "rope_tables": 2 * n * 128 * b, "residual_stream": 2 * n * h * b,
                   "layer_working_set": n * (h + 3 * i) * b, "captured_layers": n * 5 * h * b}
    payload = n * 6 * h * 2  # 5 layers + the final hidden, bf16: 3.22 GB
    step = drafter_step_by_hand(h, i, 32, 8, 128, 151936, n)
    psi = mm.drafter_params(lc.drafter_at(Q8, RUN))

    target = lc.rank_terms(Q8, n, RUN, "target", 1, 16.4e9)
    size_class = payload  # 3,221,225,472 = 3 x 2^30: already a size class of the pool
    assert target == {"target_weights": 16.4e9, "target_forward": sum(fwd.values()), "send_buffers": 3 * size_class}

    drafter = lc.rank_terms(Q8, n, RUN, "drafter", 4, 0.0)
    assert drafter["payload_buffers"] == 8 * size_class  # the bridge: 25.77 GB at 64K, the largest term
    assert sum(drafter.values()) == pytest.approx((2 + 14 / 4) * psi + 2 * 151936 * h * 2 + 8 * payload + step)

    col = lc.rank_terms(Q8, n, RUN, "colocated", 8, 16.4e9)
    # the forward's peak (2 n H b + n (H + 3 I) b + 6 n H b = 9.66 GB) stays under captured batch + step here
    assert col["target_forward_over_step"] == 0.0
    assert sum(col.values()) == pytest.approx(16.4e9 + (2 + 14 / 8) * psi + payload + step)
    # at 128K the forward rises 1.82 GB above the step: 19.39 GB against 6.44 + 11.13
    big = lc.rank_terms(Q8, 2 * n, RUN, "colocated", 8, 16.4e9)
    over = sum(lc.target_forward_terms(lc.drafter_at(Q8, RUN), 2 * n, RUN).values()) - 2 * payload \
        - drafter_step_by_hand(h, i, 32, 8, 128, 151936, 2 * n)
    assert big["target_forward_over_step"] == pytest.approx(over) and over / 1e9 == pytest.approx(1.82, abs=0.005)


def test_longest_fit_is_the_boundary() -> None:
    limit = 72e9  # 80 GB less plan's 8 GB headroom
    n = lc.longest_fit(Q8, RUN, "drafter", 4, 0.0, limit)
    assert n == 131072  # docs/MEMORY.md: a Qwen3-8B drafter rank of 4 holds 128K, not 129K
    assert sum(lc.rank_terms(Q8, n, RUN, "drafter", 4, 0.0).values()) <= limit
    assert sum(lc.rank_terms(Q8, n + 1024, RUN, "drafter", 4, 0.0).values()) > limit
    assert lc.longest_fit(PRESETS["qwen3.6-27b"], RUN, "colocated", 1, 54e9, limit) == 0  # 54 + 29.4 GB: none


def test_plan_seq_len(capsys) -> None:
    assert main(["plan", "--gpus", "8", "--preset", "qwen3.6-27b", "--target-params-b", "27", "--seq-len", "131072",
                 "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    rows = {r["role"]: r for r in p["long_context"]["rows"]}
    assert rows["drafter"]["ranks"] == 7 and rows["drafter"]["fits"] is False
    assert rows["colocated"]["bytes"] == pytest.approx(p["colocated"]["memory"]["total_bytes"] - 8e9)
    assert any("no layout trains 131,072-token" in w for w in p["long_context"]["warnings"])
    assert main(["plan", "--gpus", "8", "--preset", "qwen3-8b", "--target-params-b", "8.2", "--seq-len", "65536"]) == 0
    out = capsys.readouterr().out
    assert "one sequence of 65,536 tokens" in out and "warning" not in out
    assert main(["plan", "--gpus", "8", "--seq-len", "8"]) == 2  # shorter than a block: a clear error
    assert "--seq-len 8" in capsys.readouterr().err


def test_the_model_meets_the_measured_cpu_peaks_at_a_tiny_target(tmp_path) -> None:
    """`bench long-context` at the tiny target's widths (6 layers, 3 read), one sequence of 2K and 4K tokens, fp32:
    the target forward's peak resident set and a colocated rank's whole step (forward, payload, drafter micro-step)
    each within 10% of memory/long_context.py (measured within 2%, docs/MEMORY.md). A process of its own: the
    peak resident set of this one holds every earlier test's heap."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "lc.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "dflash_ds", "bench", "long-context", "--lengths", "2048,4096",
                           "--json", str(out)], capture_output=True, text=True, env=env, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["cpu_allocations_mmapped"] and res["layer_ids"] == [1, 2, 3]
    assert [r["seq_len"] for r in res["rows"]] == [2048, 4096]
    for r in res["rows"]:
        n, hb = r["seq_len"], 128 * 4
        # embeddings + residual stream (3) + MLP working set H + 3 I (7) + 3 layers read, in L H b; cos and sin
        assert r["forward_predicted"] == 13 * n * hb + 2 * n * 32 * 4
        assert abs(r["forward_predicted"] / r["forward_measured"] - 1) < 0.10, r
        assert abs(r["step_predicted"] / r["step_measured"] - 1) < 0.10, r


def test_a_drafter_rank_under_sequence_parallelism_by_hand(capsys) -> None:
    """memory/sequence_parallel.py: SP 1 is the one-rank drafter (kl off); SP 2 at 64K halves the per-position and
    per-block terms (the micro-step at S = 32K, A = 256) and adds the whole mask, the exchanged heads and the ids."""
    from dataclasses import replace

    from dflash_ds.errors import DFlashError
    from dflash_ds.memory import sequence_parallel as sp

    plain = replace(RUN, kl=False)
    assert sp.drafter_rank_terms(Q8, L, RUN, 1, 8) == lc.rank_terms(Q8, L, RUN, "drafter", 8, 0.0)
    assert sp.drafter_rank_terms(Q8, L, plain, 1, 8) == lc.rank_terms(Q8, L, plain, "drafter", 8, 0.0)
    two = sp.drafter_rank_terms(Q8, L, plain, 2, 8)
    d = lc.drafter_at(Q8, plain)
    half = mm.StepShape(batch=1, seq_len=L // 2, anchors_per_row=256, chunk_blocks=64, kl=False, dtype_bytes=2,
                        checkpointing=True, dense_mask=False, cuda=True)
    assert two["micro_step_peak"] == mm.micro_step_peak(d, half, param_grads=False)
    assert two["payload_buffers"] == 8 * (L // 2) * 5 * 4096 * 2  # 8 receive buffers of 32K x 5 layers, bf16
    t = 512 * 16
    # keys/values of every position (4 of 8 kv heads), queries and output of every block token (16 of 32 heads),
    # and their gradients: 2 x ((65,536 + 8,192) x 2 x 4 + 2 x 8,192 x 16) x 128 x 2 bytes
    assert two["sp_exchange"] == 2 * ((L + t) * 2 * 4 + 2 * t * 16) * 128 * 2
    assert two["sequence_ids"] == 16 * L
    assert two["block_mask_whole"] == mm.flex_block_mask_bytes(1, t, L + t) - mm.flex_block_mask_bytes(
        1, t // 2, L // 2 + t // 2)
    # with KL a rank also receives the final hidden's half, and its step has the KL's terms at S/2, A/2
    kl_two = sp.drafter_rank_terms(Q8, L, RUN, 2, 8)
    assert kl_two["payload_buffers"] == 8 * (L // 2) * 6 * 4096 * 2  # 5 layers + the final hidden
    assert kl_two["micro_step_peak"] == mm.micro_step_peak(d, replace(half, kl=True), param_grads=False)
    # what a rank holds falls with N and the longest sequence grows: Qwen3-8B, 8 drafter ranks, 72 GB
    totals = {kl: [round(sum(sp.drafter_rank_terms(Q8, 131072, replace(RUN, kl=kl), n, 8).values()) / 1e9, 1)
                   for n in (1, 2, 4, 8)] for kl in (False, True)}
    assert totals == {False: [60.5, 34.2, 20.5, 14.4], True: [69.1, 40.2, 25.7, 18.4]}  # docs/MEMORY.md
    longest = [sp.longest_fit(Q8, plain, n, 8, 72e9) for n in (1, 2, 4, 8)]
    assert longest == sorted(longest) and longest[0] == 156672 and longest[-1] > 8 * 131072
    longest = [sp.longest_fit(Q8, RUN, n, 8, 72e9) for n in (1, 2, 4, 8)]  # with KL, as plan prices by default
    assert longest == [131072, 262144, 524288, 1048576]
    assert sp.sp_sizes(4, 8) == [1, 2, 4]  # Qwen3.6-27B's drafter: 4 key/value heads, no SP 8
    with pytest.raises(DFlashError, match="4 key/value heads must divide by it"):
        sp.drafter_rank_terms(PRESETS["qwen3.6-27b"], L, RUN, 8, 8)
    # plan's drafter row: the longest per SP size its drafter ranks allow (9 GPUs, no rates: 8 drafter ranks)
    assert main(["plan", "--gpus", "9", "--preset", "qwen3-8b", "--target-params-b", "8.2", "--seq-len", "131072",
                 "--json"]) == 0
    rows = {r["role"]: r for r in json.loads(capsys.readouterr().out)["long_context"]["rows"]}
    assert rows["drafter"]["sp_longest"] == {str(n): v for n, v in zip((1, 2, 4, 8), longest)}
    assert rows["drafter"]["sp_needed"] == 1  # the smallest SP size that holds 128K: 1, none needed
    # Qwen3.6-27B at 128K on 9 GPUs: its 8 drafter ranks do not (95,232 tokens, with KL); SP 2 would
    # (on 8 GPUs, 7 drafter ranks: no SP size tiles them, SP 1 only)
    assert main(["plan", "--gpus", "9", "--preset", "qwen3.6-27b", "--target-params-b", "27", "--seq-len", "131072",
                 "--json"]) == 0
    p = json.loads(capsys.readouterr().out)["long_context"]
    drafter = {r["role"]: r for r in p["rows"]}["drafter"]
    assert drafter["sp_needed"] == 2 and drafter["sp_longest"] == {"1": 95232, "2": 174080, "4": 371712}
    assert any("up to 95,232; by the model, sequence parallelism of 2 over these ranks would hold it" in w
               for w in p["warnings"])


def test_a_colocated_rank_under_sequence_parallelism_by_hand(capsys) -> None:
    """memory/sequence_parallel.colocated_rank_terms, what the trainer runs (--colocate --topology.sequence_parallel):
    SP 1 is long_context's colocated rank; at SP 2 the whole captured batch and target forward stay, the drafter's
    step is an SP rank's and its context shard is added. Without KL, at both presets the target's forward, which
    every rank of a group runs whole, bounds a colocated rank: SP does not move its longest sequence; with KL (plan's
    default) it does not at Qwen3-8B, and lengthens Qwen3.6-27B's from 22,528 to 33,792 tokens at SP 4."""
    from dataclasses import replace

    from dflash_ds.memory import sequence_parallel as sp

    plain, w = replace(RUN, kl=False), 16.4e9
    assert sp.colocated_rank_terms(Q8, L, RUN, 1, 8, w) == lc.rank_terms(Q8, L, RUN, "colocated", 8, w)
    assert sp.colocated_rank_terms(Q8, L, plain, 1, 8, w) == lc.rank_terms(Q8, L, plain, "colocated", 8, w)
    two = sp.colocated_rank_terms(Q8, L, plain, 2, 8, w)
    rank = sp.drafter_rank_terms(Q8, L, plain, 2, 8)
    assert two["captured_batch"] == L * 5 * 4096 * 2  # the whole batch, 5 layers, bf16, no final hidden
    assert two["context_shard"] == L // 2 * 5 * 4096 * 2
    for k in ("micro_step_peak", "block_mask_whole", "sp_exchange", "sequence_ids"):
        assert two[k] == rank[k], k
    d = lc.drafter_at(Q8, plain)
    held = sum(rank[k] for k in ("micro_step_peak", "block_mask_whole", "sp_exchange", "sequence_ids"))
    assert two["target_forward_over_step"] == lc.forward_over_step(d, L, plain, held + two["context_shard"])
    assert main(["plan", "--gpus", "8", "--preset", "qwen3-8b", "--target-params-b", "8.2", "--seq-len", "131072",
                 "--json"]) == 0
    rows = {r["role"]: r for r in json.loads(capsys.readouterr().out)["long_context"]["rows"]}
    assert rows["colocated"]["sp_longest"] == {"1": 348160, "2": 348160, "4": 348160, "8": 348160}
    assert main(["plan", "--gpus", "8", "--preset", "qwen3.6-27b", "--target-params-b", "27", "--seq-len", "65536",
                 "--json"]) == 0
    p = json.loads(capsys.readouterr().out)["long_context"]
    rows = {r["role"]: r for r in p["rows"]}
    assert rows["colocated"]["sp_longest"] == {"1": 22528, "2": 22528, "4": 33792}
    assert rows["colocated"]["sp_needed"] is None  # 64K: no SP size holds it colocated
    assert [sp.longest_fit(PRESETS["qwen3.6-27b"], plain, n, 8, 72e9, target_weight_bytes=54e9)
            for n in (1, 2, 4)] == [55296, 55296, 55296]  # without KL: the target's forward bounds it


def _train_config(line: str):
    """The trainer's config from a launch line plan printed, the placeholders (C T D O) left out: what
    `dflash-ds train` would run with those flags."""
    from dflash_ds.train import config_from_args

    return config_from_args(["--target", "T", "--data", "D", *line.split(" --output-dir O ", 1)[1].split()])


def test_plan_launch_lines_at_a_long_sequence(capsys) -> None:
    """`plan --seq-len` (issue 56, point 5): the SLURM and hostfile lines of the recommended layout carry the
    sequence length and, where the drafter ranks need it, the SP size (KL on, priced); the trainer parses them to that
    config. Qwen3-8B, 5 GPUs, a = 4 b: 1 target + 4 drafter ranks (a tie with colocated keeps disaggregated); a drafter
    rank of 4 holds 131,072 tokens with KL, so 163,840 needs SP 2 (SP must divide the 4 ranks and 8 kv heads)."""
    argv = ("--gpus", "5", "--preset", "qwen3-8b", "--target-params-b", "8.2", "--seq-len", "163840",
            "--target-tok-per-s", "28000", "--drafter-tok-per-s", "7000")
    assert main(["plan", *argv, "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    tail = "--num-target-ranks 1 --data.max_length 163840 --data.token_budget 163840 --topology.sequence_parallel 2"
    assert p["choice"]["mode"] == "disaggregated"
    assert p["sbatch"] == ("sbatch --nodes 1 --ntasks-per-node 1 --gpus-per-node 5 launch/train_slurm.sbatch "
                           f"--config C --target T --data D --output-dir O {tail}")
    assert p["hostfile"] == ["node0 slots=5", "HOSTFILE=hostfile launch/train_deepspeed.sh --config C --target T "
                                              f"--data D --output-dir O {tail}"]
    cfg = _train_config(p["sbatch"])
    assert (cfg.topology.sequence_parallel, cfg.data.max_length, cfg.data.token_budget,
            cfg.topology.num_target_ranks) == (2, 163840, 163840, 1)
    # 3 drafter ranks: SP 2 does not tile them, so no SP size is offered; colocated holds it (and is faster here),
    # its line with the length alone
    assert main(["plan", *argv[:-4], "--target-tok-per-s", "7000", "--drafter-tok-per-s", "7000", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    rows = {r["role"]: r for r in p["long_context"]["rows"]}
    assert rows["drafter"]["ranks"] == 3 and list(rows["drafter"]["sp_longest"]) == ["1"]
    assert p["choice"]["mode"] == "colocated" and "disaggregated ranks do not hold 163,840" in p["choice"]["reason"]
    assert p["sbatch"].endswith("--output-dir O --colocate --data.max_length 163840 --data.token_budget 163840")
    assert _train_config(p["sbatch"]).topology.colocate is True
    # Qwen3.6-27B at 64K on 8 GPUs: no layout holds it (a target rank holds 46,080: SP splits the drafter side
    # only), so no launch line, and the warning says what bounds it
    assert main(["plan", "--gpus", "8", "--preset", "qwen3.6-27b", "--target-params-b", "27", "--seq-len", "65536",
                 "--target-tok-per-s", "9000", "--drafter-tok-per-s", "4500"]) == 0
    out = capsys.readouterr().out
    assert "SLURM:" not in out and "HOSTFILE=" not in out
    assert "no launch line: the recommended layout holds no 65,536-token sequence" in out
    assert "a target rank holds up to 46,080 tokens" in out
