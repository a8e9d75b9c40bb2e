"""`dflash-ds plan`: the split, the wire arithmetic and colocated vs disaggregated, checked by hand (pure, in-process)."""

from __future__ import annotations

import json
import re

import pytest

from dflash_ds.cli import main


def plan_json(capsys, *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_qwen3_8b_wire_bytes(capsys) -> None:
    p = plan_json(capsys, "--gpus", "8", "--hidden", "4096", "--vocab", "151936", "--drafter-layers", "5",
                  "--dtype-bytes", "2")
    w = p["wire_bytes_per_token"]
    ids = w["ids"]
    assert ids == 16  # int64 input_ids + int64 loss_mask, as the bridge sends them
    assert w["total"] == (5 * 4096 + 4096) * 2 + ids == 49168
    assert w["logits"] == 151936 * 2
    assert w["saved_per_token"] == 151936 * 2 - 4096 * 2
    assert w["logits_over_total"] == pytest.approx(303872 / 49168)  # 6.18x: bf16 logits alone
    assert w["alternative_over_total"] == pytest.approx((5 * 4096 * 2 + 303872 + 16) / 49168)  # 7.0x
    assert w["fp32_logits_over_total"] >= 10  # 12.4x against fp32 logits
    assert w["logits_over_last_hidden"] == pytest.approx(151936 / 4096)  # 37.1x: what replaces the logits
    assert p["split"] is None  # no rates given


def test_split_maximises_the_slower_side(capsys) -> None:
    p = plan_json(capsys, "--gpus", "8", "--target-tok-per-s", "20000", "--drafter-tok-per-s", "9000")
    best = p["split"]["best"]
    assert (best["target_ranks"], best["drafter_ranks"]) == (3, 5)  # min(60k, 45k) beats min(40k, 54k)
    assert best["tok_per_s"] == 45000
    assert p["links"]["per_drafter_in_bytes_per_s"] == pytest.approx(49168 * 45000 / 5)
    assert p["links"]["per_target_out_bytes_per_s"] == pytest.approx(49168 * 45000 / 3)


def test_per_node_split_and_bench_input(capsys, tmp_path) -> None:
    bench = tmp_path / "pipe.json"
    bench.write_text("some log line\n" + json.dumps({"target_capacity": {"tok_per_s_per_rank": 1000.0},
                                                     "drafter_capacity": {"tok_per_s_per_rank": 1000.0}}))
    p = plan_json(capsys, "--gpus", "16", "--nodes", "2", "--from-bench", str(bench))
    best = p["split"]["best"]
    assert best["targets_per_node"] == 4 and best["target_ranks"] == 8 and best["tok_per_s"] == 8000
    assert p["links"]["cross_node_fraction"] == 0.0  # per-node layout: routed within each node


def test_text_report_and_errors(capsys) -> None:
    assert main(["plan", "--gpus", "8", "--target-tok-per-s", "100", "--drafter-tok-per-s", "100"]) == 0
    out = capsys.readouterr().out
    assert "(5 x 4096 + 4096) x 2 + 16 = 49,168 B/token" in out and "recommended: 4 target + 4 drafter" in out
    assert main(["plan", "--gpus", "3", "--nodes", "2"]) == 2
    assert "not a multiple" in capsys.readouterr().err
    assert main(["plan", "--gpus", "8", "--target-tok-per-s", "100"]) == 2


# ---------------------------------------------------------------- colocated or disaggregated

GB = 1e9


def drafter_bytes_by_hand(h: int, i: int, nh: int, nkv: int, d: int, ranks: int) -> dict[str, float]:
    """docs/MEMORY.md's terms at the defaults (5 layers, 16,384 tokens, 2,048 anchors x 16, bf16, checkpointing,
    flex, ZeRO-2, KL on), with one captured batch alive (colocated: no bridge) and no embedding + LM head (colocated:
    the target's own, in its weights)."""
    q, kv, b = nh * d, nkv * d, 2
    layer = h * q + 2 * h * kv + q * h + 2 * d + 3 * h * i + 2 * h
    psi = 5 * layer + 5 * h * h + 2 * h
    t, c = 2048 * 16, 16384  # block tokens, context tokens
    a_tok = 2 * h * (4 + 2 * b) + (q + kv) * (4 + 3 * b) + 4 * b * i + 4 * nh
    held = 2 * (t + c) * d * b + c * h * (4 + 2 * b) + t * h * b + 4 * t * h * b  # RoPE, context, embeddings, inputs
    backward = t * b * (i + 2.5 * h) + c * h * b + t * a_tok + c * nkv * d * (4 + 3 * b)  # last layer's backward
    backward += c * b * (3 * kv + h)  # its own context-side gradients: keys, values, keys before RoPE, input
    # flex's BlockMask tile tables (int32): 8 sequences of 2,048 tokens, each 256 blocks x 16 queries = 4,096
    # queries over 2,048 + 4,096 keys: 32 x 48 tiles of 128; counts and indices, and their transposes.
    seqs, nq, nkv = 8, 4096 // 128, 6144 // 128
    held += 4 * (4 * seqs * nq * nkv + 2 * seqs * nq + 2 * seqs * nkv)  # 201,728 B
    return {"model_states": 2 * psi + 14 * psi / ranks, "captured": c * 6 * h * 2,
            "micro": held + backward, "psi": psi}


QWEN3_8B_SHAPE = (4096, 12288, 32, 8, 128)  # H, I, nh, nkv, d
QWEN36_27B_SHAPE = (5120, 17408, 24, 4, 256)


def test_hand_memory_matches_memory_md() -> None:
    """The hand formula above is docs/MEMORY.md's: its published Psi and micro-step peaks."""
    assert drafter_bytes_by_hand(*QWEN3_8B_SHAPE, 1)["psi"] == 1_048_626_432
    assert drafter_bytes_by_hand(*QWEN36_27B_SHAPE, 1)["psi"] == 1_835_072_000
    assert drafter_bytes_by_hand(*QWEN3_8B_SHAPE, 1)["micro"] / GB == pytest.approx(10.97, abs=0.005)
    assert drafter_bytes_by_hand(*QWEN36_27B_SHAPE, 1)["micro"] / GB == pytest.approx(14.58, abs=0.005)


def test_qwen3_8b_colocated_wins(capsys) -> None:
    """Example (a): a target rank 4x a drafter rank on 4 GPUs; 1 + 3 leaves a third of the target idle."""
    p = plan_json(capsys, "--gpus", "4", "--target-tok-per-s", "28000", "--drafter-tok-per-s", "7000",
                  "--target-params-b", "8.2")
    c, dis, mem = p["colocated"], p["disaggregated"], p["colocated"]["memory"]
    assert c["tok_per_s_per_gpu"] == pytest.approx(28000 * 7000 / (28000 + 7000)) == pytest.approx(5600)
    assert c["tok_per_s"] == pytest.approx(4 * 5600) and c["rate_source"] == "1 / (1/a + 1/b)"
    assert (dis["target_ranks"], dis["drafter_ranks"], dis["tok_per_s"]) == (1, 3, min(28000, 3 * 7000))
    assert dis["tok_per_s_per_gpu"] == pytest.approx(21000 / 4)
    hand = drafter_bytes_by_hand(*QWEN3_8B_SHAPE, ranks=4)  # ZeRO over all 4 colocated GPUs
    drafter = hand["model_states"] + hand["captured"] + hand["micro"]
    assert mem["target_bytes"] == pytest.approx(8.2e9 * 2)
    assert mem["drafter_bytes"] == pytest.approx(drafter)
    assert mem["total_bytes"] == pytest.approx(16.4e9 + drafter + 8e9) and mem["total_bytes"] / GB == pytest.approx(41.94, abs=0.005)
    assert mem["fits"] is True and "frozen_embed_head" not in mem["drafter"]["terms"]  # shared with the target
    assert p["choice"]["mode"] == "colocated" and "6.7% faster" in p["choice"]["reason"]  # 22,400 / 21,000
    assert p["split"]["best"]["target_ranks"] == 1  # the existing keys are still there


def test_dflash2_kind_adds_its_parts(capsys) -> None:
    """--kind dflash2: Psi + 30,359,552 (docs/MEMORY.md), ZeRO-2 over 4 ranks of it, + 4.125 H bf16 per block token."""
    argv = ("--gpus", "4", "--target-tok-per-s", "28000", "--drafter-tok-per-s", "7000", "--target-params-b", "8.2")
    base = plan_json(capsys, *argv)["colocated"]["memory"]["drafter"]
    d2 = plan_json(capsys, *argv, "--kind", "dflash2")["colocated"]["memory"]["drafter"]
    added = 30_359_552
    assert d2["params"] - base["params"] == added
    zero2 = d2["terms"]["model_states_zero2"] - base["terms"]["model_states_zero2"]
    assert zero2 == pytest.approx(2 * added + 14 * added / 4)
    # the recomputed layer's saved activations: T = 8 sequences x 256 anchors x 16 = 32,768 block tokens, bf16
    # (backward is the peak in both; the selector's kept K x rank rows belong to the loss phase, below it)
    micro = d2["terms"]["micro_step_peak_backward"] - base["terms"]["micro_step_peak_backward"]
    assert micro == pytest.approx(32768 * 4.125 * 4096 * 2)


def test_qwen36_27b_does_not_fit(capsys) -> None:
    """Example (b): colocated would be faster by the rates, but 54 GB of target leaves no room for training."""
    p = plan_json(capsys, "--gpus", "4", "--preset", "qwen3.6-27b", "--target-params-b", "27",
                  "--target-tok-per-s", "9000", "--drafter-tok-per-s", "5000")
    assert p["model"]["hidden"] == 5120 and p["model"]["vocab"] == 248320
    c, dis, mem = p["colocated"], p["disaggregated"], p["colocated"]["memory"]
    assert c["tok_per_s"] == pytest.approx(4 / (1 / 9000 + 1 / 5000))  # 12,857: more than the split...
    assert (dis["target_ranks"], dis["drafter_ranks"], dis["tok_per_s"]) == (2, 2, min(2 * 9000, 2 * 5000))
    hand = drafter_bytes_by_hand(*QWEN36_27B_SHAPE, ranks=4)
    drafter = hand["model_states"] + hand["captured"] + hand["micro"]
    assert mem["target_bytes"] == pytest.approx(54e9) and mem["drafter_bytes"] == pytest.approx(drafter)
    assert mem["total_bytes"] == pytest.approx(54e9 + drafter + 8e9) and mem["total_bytes"] > 80e9  # ...but 87.4 GB
    assert mem["fits"] is False
    assert p["choice"]["mode"] == "disaggregated"
    assert f"target 54.00 GB + drafter {drafter / GB:.2f} GB + headroom 8.00 GB" in p["choice"]["reason"]


def test_one_gpu_is_colocated_only(capsys) -> None:
    p = plan_json(capsys, "--gpus", "1", "--target-tok-per-s", "28000", "--drafter-tok-per-s", "7000",
                  "--target-params-b", "8.2")
    assert p["disaggregated"]["possible"] is False and p["split"] is None
    assert p["colocated"]["tok_per_s"] == pytest.approx(5600)
    hand = drafter_bytes_by_hand(*QWEN3_8B_SHAPE, ranks=1)
    assert hand["model_states"] == 16 * hand["psi"]  # ZeRO-2 on one rank partitions nothing
    assert p["colocated"]["memory"]["drafter_bytes"] == pytest.approx(
        hand["model_states"] + hand["captured"] + hand["micro"])
    assert p["choice"] == {"mode": "colocated", "reason": "the only mode with 1 GPU per node"}
    # the layers the trainer will recompute beside the target: its rule on the 80 - 16.4 GB left, each layer kept
    # costing its activations (all recomputed: the drafter bytes above; none: every layer's activations kept)
    rc, by_k = p["colocated"]["memory"]["recompute"], p["colocated"]["memory"]["drafter"]["bytes_by_recomputed_layers"]
    assert by_k[5] == pytest.approx(p["colocated"]["memory"]["drafter_bytes"]) and by_k == sorted(by_k, reverse=True)
    assert rc["usable_bytes"] == pytest.approx(0.85 * (80e9 - 16.4e9))
    assert rc["layers"] == next(k for k, need in enumerate(by_k) if need <= rc["usable_bytes"]) == 1
    assert main(["plan", "--gpus", "1", "--target-params-b", "8.2"]) == 0
    assert "layers recomputed          1 of 5 (drafter 53.86 GB then, within 85% of the 63.60 GB" in \
        capsys.readouterr().out
    assert main(["plan", "--gpus", "1"]) == 0  # no rates, no target size: said, not an error
    assert "disaggregated: impossible" in capsys.readouterr().out


def test_one_gpu_too_small_is_an_error(capsys) -> None:
    assert main(["plan", "--gpus", "1", "--preset", "qwen3.6-27b", "--target-params-b", "27"]) == 2
    err = capsys.readouterr().err
    hand = drafter_bytes_by_hand(*QWEN36_27B_SHAPE, ranks=1)
    drafter = hand["model_states"] + hand["captured"] + hand["micro"]
    assert "cannot hold a target and a drafter" in err
    assert f"target 54.00 GB + drafter {drafter / GB:.2f} GB + headroom 8.00 GB = {(62e9 + drafter) / GB:.2f} GB" in err
    # Given a measured drafter memory instead of the estimate, and a bigger GPU, it fits.
    p = plan_json(capsys, "--gpus", "1", "--target-params-b", "27", "--drafter-memory-gb", "50",
                  "--gpu-memory-gb", "141")
    assert p["colocated"]["memory"]["total_bytes"] == pytest.approx((54 + 50 + 8) * GB) and p["choice"]["mode"] == "colocated"


def test_measured_colocated_rate_from_bench(capsys, tmp_path) -> None:
    bench = tmp_path / "pipe.json"
    result = {"target_capacity": {"tok_per_s_per_rank": 28000.0}, "drafter_capacity": {"tok_per_s_per_rank": 7000.0},
              "colocated": {"tok_per_s": 20000.0, "tok_per_s_per_rank": 5000.0}}
    bench.write_text("a log line\n" + json.dumps(result))
    p = plan_json(capsys, "--gpus", "4", "--from-bench", str(bench))
    c = p["colocated"]
    assert c["tok_per_s_per_gpu"] == 5000 and c["tok_per_s"] == 4 * 5000  # measured, preferred over the formula
    assert c["formula_tok_per_s_per_gpu"] == pytest.approx(5600) and c["rate_source"].startswith("measured")
    assert p["choice"]["mode"] == "disaggregated"  # 20,000 < min(28,000, 3 x 7,000) = 21,000
    assert p["choice"]["reason"] == f"disaggregated is {1 - 20000 / 21000:.1%} faster"
    assert main(["plan", "--gpus", "4", "--from-bench", str(bench)]) == 0
    out = capsys.readouterr().out
    assert "c = 5,000 tok/s (measured: bench pipeline (d)" in out and "recommended: 1 target + 3 drafter" in out
    bench.write_text(json.dumps({**result, "colocated": None}))  # bench pipeline --no-colocated: the formula
    assert plan_json(capsys, "--gpus", "4", "--from-bench", str(bench))["colocated"]["tok_per_s"] == pytest.approx(22400)
    p = plan_json(capsys, "--gpus", "4", "--from-bench", str(bench), "--colocated-tok-per-s", "6000")
    assert p["colocated"]["tok_per_s"] == 24000 and p["colocated"]["rate_source"] == "--colocated-tok-per-s"


def test_exact_split_ties_and_keeps_disaggregated(capsys) -> None:
    # N b / (a + b) = 4 x 7,000 / 28,000 = 1 target exactly: 1 x 21,000 = 3 x 7,000 = 4 / (1/21,000 + 1/7,000)
    p = plan_json(capsys, "--gpus", "4", "--target-tok-per-s", "21000", "--drafter-tok-per-s", "7000")
    assert p["colocated"]["tok_per_s"] == pytest.approx(21000) and p["disaggregated"]["tok_per_s"] == 21000
    assert p["choice"]["mode"] == "disaggregated" and "equal" in p["choice"]["reason"]
    assert p["colocated"]["memory"]["fits"] is None  # no target size given: not checked


def test_target_weight_bytes_from_folder(capsys, tmp_path) -> None:
    cfg = {"model_type": "qwen3", "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1000}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"x" * 3000)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"x" * 1000)
    mem = plan_json(capsys, "--gpus", "2", "--target", str(tmp_path))["colocated"]["memory"]
    assert mem["target_bytes"] == 4000 and "sum of 2" in mem["target_source"]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 3500}}))
    mem = plan_json(capsys, "--gpus", "2", "--target", str(tmp_path))["colocated"]["memory"]
    assert mem["target_bytes"] == 3500 and "metadata.total_size" in mem["target_source"]
    assert mem["drafter"]["shape"] == {"hidden": 256, "intermediate": 768, "heads": 4, "kv_heads": 2, "head_dim": 64,
                                       "layers": 5}
    assert mem["fits"] is True


def test_text_report_shows_the_colocated_arithmetic(capsys) -> None:
    assert main(["plan", "--gpus", "4", "--target-tok-per-s", "28000", "--drafter-tok-per-s", "7000",
                 "--target-params-b", "8.2"]) == 0
    out = capsys.readouterr().out
    hand = drafter_bytes_by_hand(*QWEN3_8B_SHAPE, ranks=4)
    drafter = hand["model_states"] + hand["captured"] + hand["micro"]
    assert "c = 1 / (1/a + 1/b) = 1 / (1/28,000 + 1/7,000) = 5,600 tok/s" in out
    assert "N x c = 4 x 5,600 = 22,400 tok/s" in out
    assert re.search(rf"model_states_zero2 +{hand['model_states'] / GB:.2f}\n", out)
    assert f"16.40 + {drafter / GB:.2f} + 8.00 = {(24.4e9 + drafter) / GB:.2f} GB <= 80 GB: fits" in out
    assert "colocated 22,400 tok/s (5,600 per GPU) vs disaggregated 21,000 tok/s (5,250 per GPU, 1 target + 3 drafter)" in out
    assert "\nrecommended: --colocate on 4 GPU(s), expected 22,400 tok/s: colocated is 6.7% faster\nSLURM: " in out


@pytest.mark.parametrize("gpu_gb, k, per_rank, left, split", [(80, 4, 61.0, 11.0, (4, 1, 4, 3000)),
                                                             (141, 2, 122.0, 11.0, (4, 2, 4, 4000))])
def test_qwen35_122b_a10b_replica_size(capsys, gpu_gb, k, per_rank, left, split) -> None:
    """Qwen3.5-122B-A10B in bf16: 122e9 x 2 B = 244 GB. On 80 GB GPUs: 244/2 + 8 = 130 > 80, 244/4 + 8 = 69 <= 80
    -> k = 4, 4 drafter GPUs. On 141 GB: 244/1 + 8 > 141, 244/2 + 8 = 130 <= 141 -> k = 2, 6 drafters."""
    p = plan_json(capsys, "--gpus", "8", "--target-params-b", "122", "--gpu-memory-gb", str(gpu_gb),
                  "--hidden", "3072", "--vocab", "248320", "--target-tok-per-s", "3000", "--drafter-tok-per-s", "1000")
    tp = p["target_parallel"]
    assert tp["weight_bytes"] == 244e9 and tp["k"] == k and tp["source"] == "smallest k that fits"
    assert tp["weights_per_rank"] == pytest.approx(per_rank * 1e9) and tp["left_per_rank"] == pytest.approx(left * 1e9)
    assert [r["fits"] for r in tp["rows"]] == [r["k"] >= k for r in tp["rows"]]
    # The split counts replicas of k target ranks, a = 3000 tok/s per replica, b = 1000 per drafter rank:
    # k = 4: only 1 replica + 4 drafters, min(3000, 4000); k = 2: 1, 2 or 3 replicas -> min(3000, 6000),
    # min(6000, 4000), min(9000, 2000): 2 replicas (4 ranks) + 4 drafters, 4000 tok/s.
    best = p["split"]["best"]
    assert (best["target_ranks"], best["replicas"], best["drafter_ranks"], best["tok_per_s"]) == split
    assert p["choice"]["mode"] == "disaggregated"  # 244 GB cannot be colocated on one GPU
    main(["plan", "--gpus", "8", "--target-params-b", "122", "--gpu-memory-gb", str(gpu_gb), "--hidden", "3072",
          "--vocab", "248320", "--target-tok-per-s", "3000", "--drafter-tok-per-s", "1000"])
    text = capsys.readouterr().out
    assert f"k = {k}: 244.00 / {k} + 8.00 = {244 / k + 8:.2f} GB <= {gpu_gb}  <- smallest k that fits" in text
    assert f"--num-target-ranks {split[0]} --target-parallel {k}" in text


def test_kimi_k25_needs_a_node_of_its_own(capsys) -> None:
    """Kimi-K2.5, 1.04 T parameters: in bf16 (2,080 GB) no node of 8 x 141 GB holds it (260 + 8 > 141); its INT4
    release (about 595 GB) needs all 8 GPUs of a 141 GB node (595/4 + 8 = 156.75 > 141, 595/8 + 8 = 82.38 <= 141),
    so the drafters take a second node; on 8 x 80 GB even k = 8 does not fit (82.38 > 80)."""
    assert main(["plan", "--gpus", "8", "--target-params-b", "1040", "--gpu-memory-gb", "141"]) == 2
    assert ("the target's 2,080.00 GB of weights do not fit one node: even over all 8 GPUs of a node, 260.00 GB a GPU "
            "+ 8.00 GB headroom = 268.00 GB > 141.00 GB") in capsys.readouterr().err
    assert main(["plan", "--gpus", "8", "--target-weight-gb", "595", "--gpu-memory-gb", "80"]) == 2
    assert "74.38 GB a GPU + 8.00 GB headroom = 82.38 GB > 80.00 GB" in capsys.readouterr().err
    p = plan_json(capsys, "--gpus", "16", "--nodes", "2", "--target-weight-gb", "595", "--gpu-memory-gb", "141",
                  "--hidden", "7168", "--vocab", "163840", "--target-tok-per-s", "2000", "--drafter-tok-per-s", "3000")
    tp, best = p["target_parallel"], p["split"]["best"]
    assert tp["k"] == 8 and tp["weights_per_rank"] == pytest.approx(595e9 / 8)
    assert tp["left_per_rank"] == pytest.approx(141e9 - 595e9 / 8 - 8e9)  # 58.62 GB
    assert (best["target_nodes"], best["target_ranks"], best["replicas"], best["drafter_ranks"]) == (1, 8, 1, 8)
    assert p["links"]["cross_node_fraction"] == 1.0
    assert p["disaggregated"]["possible"] and p["choice"]["mode"] == "disaggregated"
    assert main(["plan", "--gpus", "8", "--target-weight-gb", "595", "--gpu-memory-gb", "141"]) == 2  # one node
    err = capsys.readouterr().err
    assert "disaggregated is impossible (a target replica of 8 ranks leaves no drafter GPU on a node of 8)" in err
    assert "colocated does not fit one GPU: target 595.00 GB" in err


def test_replica_size_respects_the_key_value_heads(capsys, tiny_target) -> None:
    """A target folder with 2 key/value heads (the tiny target's; Qwen3.5-122B-A10B's too) and 244 GB of weights:
    on 80 GB GPUs k = 4 and 8 fit the memory but cannot split 2 heads -> one error; on 141 GB k = 2 fits."""
    argv = ["plan", "--gpus", "8", "--target", str(tiny_target), "--target-weight-gb", "244"]
    assert main([*argv, "--gpu-memory-gb", "80"]) == 2
    assert ("the target's 2 key/value heads do not split over any replica size whose share of the weights fits a "
            "80 GB GPU (k = 4, k = 8)") in capsys.readouterr().err
    p = plan_json(capsys, *argv[1:], "--gpu-memory-gb", "141")
    assert p["target_parallel"]["k"] == 2 and [r["heads_split"] for r in p["target_parallel"]["rows"]] == \
        [True, True, False, False]


def test_link_limits_per_layout_by_hand(capsys) -> None:
    """2 nodes x 2 GPUs at 10 Mbit/s: per node, the 2 drafters' ZeRO-2 exchange crosses the link; on a target
    node, every hidden state does (and no ZeRO byte: both drafters on the other node)."""
    p = plan_json(capsys, "--gpus", "4", "--nodes", "2", "--target-tok-per-s", "1000", "--drafter-tok-per-s",
                  "1000", "--hidden", "128", "--vocab", "1000", "--drafter-layers", "2", "--dtype-bytes", "4",
                  "--drafter-params", "1e6", "--zero-stage", "2", "--token-budget", "1024",
                  "--padding-efficiency", "0.5", "--link-gbit-per-s", "0.01")
    mn = p["multinode"]
    rate = 0.01e9 / 8 * 1448 / 1514  # payload of 1514-byte frames
    assert mn["payload_bytes_per_s"] == pytest.approx(rate)
    per_node, target_node = mn["best"]["per node"], mn["best"]["target nodes"]
    zero = 3 * (1 / 2) * 1e6 * 4  # (2A + 1) passes (all-reduce, all-gather) x (n-1)/n x P x 4 B, A = 1, n = 2
    assert per_node["zero_bytes_per_step"] == pytest.approx(zero)
    step_tokens = 2 * 1 * 1024 * 0.5  # real tokens: 2 drafters x 1 micro-batch x budget x efficiency
    assert per_node["link_tok_per_s"] == pytest.approx(rate / (zero / step_tokens))  # 306
    wire = ((2 * 128 + 128) * 4 + 16) / 0.5  # padded tokens cross too
    assert target_node["hidden_bytes_per_token"] == wire and target_node["zero_bytes_per_token"] == 0
    assert target_node["link_tok_per_s"] == pytest.approx(rate / wire)  # 385
    assert per_node["compute_tok_per_s"] == target_node["compute_tok_per_s"] == 2000
    # per node, the ZeRO exchange is inside every step: its time adds to the compute's; the pipelined hidden
    # states only bound the rate
    assert per_node["tok_per_s"] == pytest.approx(1 / (1 / 2000 + (zero / step_tokens) / rate))  # 185.1
    assert target_node["tok_per_s"] == pytest.approx(min(2000, rate / wire))  # 385.2
    assert (per_node["bound"], target_node["bound"]) == ("compute + ZeRO", "link (hidden states)")
    assert mn["winner"] is not None and mn["winner"]["layout"] == "target nodes"
    whole = plan_json(capsys, "--gpus", "4", "--nodes", "2", "--target-parallel", "2", "--target-tok-per-s", "1000",
                      "--drafter-tok-per-s", "1000", "--drafter-params", "1e6", "--link-gbit-per-s", "0.01")
    assert whole["multinode"]["best"]["per node"] is None  # a replica fills a node: only whole target nodes
    assert whole["multinode"]["winner"]["layout"] == "target nodes"
    assert main(["plan", "--gpus", "4", "--target-tok-per-s", "1", "--drafter-tok-per-s", "1",
                 "--link-gbit-per-s", "1"]) == 2  # one node: nothing crosses
    assert "--nodes >= 2" in capsys.readouterr().err


def test_sbatch_line_of_the_recommended_layout(capsys) -> None:
    """A 70B target on 2 nodes of 8 x 80 GB: colocated does not fit, so 4 target + 4 drafter ranks per node, the
    target a replica of 2 ranks; `plan` prints the SLURM submission of that layout (one task per node, whose
    torchrun starts a rank per GPU: launch/train_slurm.sbatch)."""
    argv = ["plan", "--gpus", "16", "--nodes", "2", "--target-tok-per-s", "20000", "--drafter-tok-per-s", "9000",
            "--target-params-b", "70"]
    assert main(argv) == 0
    line = ("sbatch --nodes 2 --ntasks-per-node 1 --gpus-per-node 8 launch/train_slurm.sbatch --config C --target T "
            "--data D --output-dir O --targets-per-node 4 --target-parallel 2")
    assert capsys.readouterr().out.splitlines()[-5:] == [
        f"SLURM: {line}", "deepspeed launcher: a file `hostfile` with one line per node (your host names), then",
        "  node0 slots=8", "  node1 slots=8",
        "  HOSTFILE=hostfile launch/train_deepspeed.sh --config C --target T --data D --output-dir O "
        "--targets-per-node 4 --target-parallel 2"]
    assert plan_json(capsys, *argv[1:])["sbatch"] == line
    colocated = plan_json(capsys, "--gpus", "4", "--target-tok-per-s", "10000", "--drafter-tok-per-s", "20000")
    assert colocated["sbatch"].startswith("sbatch --nodes 1 --ntasks-per-node 1 --gpus-per-node 4 ")
    assert colocated["sbatch"].endswith(" --colocate")
    assert plan_json(capsys, "--gpus", "8")["sbatch"] is None  # no rates: nothing recommended
