"""`dflash-ds plan`: colocated or disaggregated, how many target and drafter ranks, what the links carry.

Pure arithmetic, no GPU and no process group:

- split: per node, try every t targets + (G - t) drafters (G GPUs per node) and keep the split
  that maximises min(T * a, D * b), with a and b the tokens/s one target rank and one drafter
  rank sustain (measured by `dflash-ds bench pipeline`, or given);
- wire: bytes per token = (K selected layers x H + final hidden H) x dtype bytes + ids and loss
  mask, against shipping the target's vocabulary logits (V x dtype bytes per token);
- links: bytes per token x tokens/s each drafter consumes (inbound) and each target produces;
- colocated (`--colocate`): one GPU runs the target forward, then the drafter step, in series, so
  it sustains c = 1 / (1/a + 1/b) tok/s (or the rate `bench pipeline` measured, phase (d)), N c
  on N GPUs, if the target's weights + the drafter's training memory + a headroom fit one GPU;
- choice: the mode with more tokens/s (a tie keeps disaggregated: less memory per GPU);
- across nodes (`--link-gbit-per-s`): targets on every node against targets on whole nodes, each at
  min(compute, link) tok/s with the hidden states and the drafters' ZeRO traffic that cross (`plan/links.py`).

The colocated rate, its memory check and the choice live in `plan/colocated.py`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from dflash_ds.config import DataConfig, TrainConfig
from dflash_ds.distributed.wire import ID_BYTES
from dflash_ds.errors import DFlashError
from dflash_ds.models.kinds import DFLASH, kind_names
from dflash_ds.models.presets import PRESETS
from dflash_ds.plan import links
from dflash_ds.plan.colocated import (PRESET_NAMES, choice_lines, choose, colocated_lines, colocated_memory,
                                      colocated_option, hostfile_lines, sbatch_line)

_Q8 = PRESETS["qwen3-8b"]
QWEN3_8B = {"hidden": _Q8["hidden_size"], "vocab": _Q8["vocab_size"], "layers": _Q8["num_hidden_layers"]}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `dflash-ds plan`."""
    parser.add_argument("--gpus", type=int, required=True, help="GPUs (ranks) in the whole job")
    parser.add_argument("--nodes", type=int, default=1, help="nodes; the split is the same on every node")
    parser.add_argument("--target-tok-per-s", type=float, default=None, help="tokens/s one target rank sustains (a)")
    parser.add_argument("--drafter-tok-per-s", type=float, default=None, help="tokens/s one drafter rank sustains (b)")
    parser.add_argument("--colocated-tok-per-s", type=float, default=None,
                        help="tokens/s one colocated GPU sustains (target forward then drafter step; `bench pipeline` "
                             "phase (d), per rank); default: measured in --from-bench, else 1 / (1/a + 1/b)")
    parser.add_argument("--from-bench", default=None, metavar="FILE.json",
                        help="read a and b per rank, and the colocated rate (d) when measured, from "
                             "`dflash-ds bench pipeline --json` output")
    parser.add_argument("--target", default=None,
                        help="target HF folder: hidden size, vocabulary and shape from its config.json, weight bytes "
                             "from its safetensors")
    parser.add_argument("--preset", choices=PRESET_NAMES, default=None,
                        help="target shape when there is no --target: H, V and the drafter's heads and MLP for the "
                             "memory estimate (default qwen3-8b)")
    parser.add_argument("--hidden", type=int, default=None,
                        help=f"target hidden size H (default {QWEN3_8B['hidden']}, a Qwen3-8B-sized target)")
    parser.add_argument("--vocab", type=int, default=None, help=f"target vocabulary V (default {QWEN3_8B['vocab']})")
    parser.add_argument("--kind", choices=kind_names(), default=DFLASH,
                        help="drafter kind (model.kind) of the memory estimate: a kind beyond dflash adds its parts' "
                             "parameters, saved activations and loss buffers at config.py's defaults (the memory "
                             "terms of its spec, models/kinds.py; docs/MEMORY.md has each kind's figures)")
    parser.add_argument("--drafter-layers", type=int, default=5, help="drafter layers (= target layers read, by default)")
    parser.add_argument("--num-target-layers-read", type=int, default=None,
                        help="target layers whose outputs are sent, K (default: --drafter-layers)")
    parser.add_argument("--dtype-bytes", type=int, default=2,
                        help="bytes per hidden-state element and per target weight with --target-params-b (2 = bf16)")
    parser.add_argument("--id-bytes", type=int, default=ID_BYTES,
                        help="bytes per token of input_ids + loss_mask (16: both int64, as the bridge sends them)")
    parser.add_argument("--no-last-hidden", action="store_true",
                        help="the final hidden state is not sent (loss.kl_weight = 0: no soft labels)")
    parser.add_argument("--gpu-memory-gb", type=float, default=80.0, help="memory of one GPU in GB (1e9 bytes)")
    parser.add_argument("--headroom-gb", type=float, default=8.0,
                        help="GB kept free on a colocated GPU for what the estimate does not count: the CUDA context, "
                             "NCCL buffers, allocator fragmentation, the target forward's activations")
    parser.add_argument("--target-params-b", type=float, default=None,
                        help="target parameters in billions; weight bytes = this x 1e9 x --dtype-bytes "
                             "(default: the size of --target's safetensors)")
    parser.add_argument("--target-weight-gb", type=float, default=None,
                        help="the target's weight bytes in GB as stored (a quantized checkpoint: e.g. 595 for an INT4 "
                             "1 T model); overrides --target-params-b and --target's safetensors size")
    parser.add_argument("--target-parallel", type=int, default=None, metavar="K",
                        help="ranks that hold one copy of the target (topology.target_parallel); default: the smallest "
                             "power of two whose 1/K of the weights + --headroom-gb fits --gpu-memory-gb")
    parser.add_argument("--drafter-memory-gb", type=float, default=None,
                        help="drafter training memory per GPU in GB, as `dflash-ds bench memory` measures it (its "
                             "total also counts the embedding + LM head and eight pooled payloads: an upper bound here); "
                             "default: bench memory's model at bf16, checkpointing, ZeRO over all colocated GPUs")
    parser.add_argument("--token-budget", type=int, default=DataConfig.token_budget,
                        help=f"tokens per micro-batch of the drafter memory estimate (data.token_budget, default "
                             f"{DataConfig.token_budget})")
    parser.add_argument("--seq-len", type=int, default=None, metavar="L",
                        help="price one long sequence of L tokens per micro-batch (the token budget raised to L when "
                             "below it): the drafter step at that length, the target forward's own peak on a "
                             "colocated GPU, and a disaggregated drafter rank (its receive buffers) and target rank, "
                             "each against --gpu-memory-gb less --headroom-gb, with the longest L that fits "
                             "(docs/MEMORY.md, 'Long context'); default: sequences of data.max_length")
    parser.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=TrainConfig.zero_stage,
                        help=f"ZeRO stage of the drafter memory estimate (train.zero_stage, default "
                             f"{TrainConfig.zero_stage})")
    links.add_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def wire_bytes(hidden: int, layers_read: int, dtype_bytes: int, vocab: int, id_bytes: int = ID_BYTES,
               last_hidden: bool = True) -> dict[str, Any]:
    """Bytes per token on the target -> drafter link, and what shipping logits would cost instead."""
    context = layers_read * hidden * dtype_bytes
    last = hidden * dtype_bytes if last_hidden else 0
    total = context + last + id_bytes
    logits = vocab * dtype_bytes
    alternative = context + logits + id_bytes  # context features plus logits in place of the last hidden
    return {"context": context, "last_hidden": last, "ids": id_bytes, "total": total, "logits": logits,
            "logits_over_total": logits / total, "alternative_total": alternative,
            "alternative_over_total": alternative / total, "saved_per_token": logits - last,
            "fp32_logits_over_total": 2 * logits / total if dtype_bytes == 2 else None,
            "logits_over_last_hidden": logits / (hidden * dtype_bytes)}


def best_split(gpus: int, nodes: int, a: float, b: float, k: int = 1) -> dict[str, Any]:
    """Targets per node maximising min(T a, D b); ties go to the split with less idle capacity.

    With target replicas of k ranks (topology.target_parallel), target ranks come k at a time and T counts
    replicas: a is then the tokens/s of one replica."""
    if nodes < 1 or gpus % nodes:
        raise DFlashError(f"--gpus {gpus} is not a multiple of --nodes {nodes}")
    per_node = gpus // nodes
    if per_node < 2:
        raise DFlashError(f"{per_node} GPU(s) per node cannot hold a target and a drafter: need at least 2")
    if a <= 0 or b <= 0:
        raise DFlashError("target and drafter tokens/s must be > 0")
    if k >= per_node and nodes < 2:
        raise DFlashError(f"a target replica of {k} ranks leaves no drafter GPU on a node of {per_node}")
    options = []
    # A replica as large as a node: whole nodes of targets, the drafters on the others (a global layout, so the
    # hidden states cross nodes); otherwise every node splits alike.
    whole_nodes = k >= per_node
    for t in (range(1, nodes) if whole_nodes else range(k, per_node, k)):
        tt, dd = (t * per_node, (nodes - t) * per_node) if whole_nodes else (t * nodes, (per_node - t) * nodes)
        reps = tt // k
        options.append({"targets_per_node": None if whole_nodes else t, "target_nodes": t if whole_nodes else None,
                        "target_ranks": tt, "replicas": reps, "drafter_ranks": dd,
                        "target_tok_per_s": reps * a, "drafter_tok_per_s": dd * b, "tok_per_s": min(reps * a, dd * b),
                        "bottleneck": "target" if reps * a < dd * b else "drafter"})
    best = max(options, key=lambda o: (o["tok_per_s"], -abs(o["target_tok_per_s"] - o["drafter_tok_per_s"])))
    return {"best": best, "options": options}


def _rates(args: argparse.Namespace) -> tuple[float | None, float | None, str, float | None]:
    """(a, b, their source, the colocated rate per rank that bench pipeline measured or None)."""
    if args.from_bench:
        try:
            r = json.loads(Path(args.from_bench).read_text().strip().splitlines()[-1])
            a, b = r["target_capacity"]["tok_per_s_per_rank"], r["drafter_capacity"]["tok_per_s_per_rank"]
            measured = (r.get("colocated") or {}).get("tok_per_s_per_rank")
        except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
            raise DFlashError(f"--from-bench {args.from_bench}: not `bench pipeline --json` output ({exc})") from None
        return a, b, f"bench pipeline ({args.from_bench})", float(measured) if measured else None
    if (args.target_tok_per_s is None) != (args.drafter_tok_per_s is None):
        raise DFlashError("give both --target-tok-per-s and --drafter-tok-per-s (or --from-bench)")
    return args.target_tok_per_s, args.drafter_tok_per_s, "given", None


def plan(args: argparse.Namespace) -> dict[str, Any]:
    """The whole recommendation as a JSON-ready dict."""
    if args.gpus < 1 or args.nodes < 1 or args.gpus % args.nodes:
        raise DFlashError(f"--gpus {args.gpus} is not a multiple of --nodes {args.nodes}")
    hidden, vocab, source = args.hidden, args.vocab, "flags"
    shape_cfg: dict[str, Any] = {}
    if args.target:
        from dflash_ds.models.target import read_target_config

        shape_cfg = read_target_config(args.target)
        hidden, vocab, source = hidden or int(shape_cfg["hidden_size"]), vocab or int(shape_cfg["vocab_size"]), args.target
    else:

        shape_cfg = dict(PRESETS[args.preset or "qwen3-8b"])  # the drafter's heads and MLP, scaled to H if H differs
        if hidden is None or vocab is None:
            source = f"preset {args.preset}" if args.preset else "defaults (Qwen3-8B-sized)"
            hidden, vocab = hidden or int(shape_cfg["hidden_size"]), vocab or int(shape_cfg["vocab_size"])
    k = args.num_target_layers_read or args.drafter_layers
    if min(hidden, vocab, k, args.dtype_bytes, args.token_budget) < 1 or args.id_bytes < 0:
        raise DFlashError("--hidden, --vocab, layer counts, --dtype-bytes and --token-budget must be >= 1")
    wire = wire_bytes(hidden, k, args.dtype_bytes, vocab, args.id_bytes, not args.no_last_hidden)
    a, b, rate_source, measured = _rates(args)
    tp = _target_parallel(args)
    k_tp = tp["k"] if tp else (args.target_parallel or 1)
    out: dict[str, Any] = {"target_parallel": tp, "model": {"hidden": hidden, "vocab": vocab, "layers_read": k, "dtype_bytes": args.dtype_bytes,
                                     "source": source},
                           "wire_bytes_per_token": wire, "gpus": args.gpus, "nodes": args.nodes, "split": None}
    per_node = args.gpus // args.nodes
    dis: dict[str, Any] = {"possible": per_node >= 2, "tok_per_s": None, "tok_per_s_per_gpu": None,
                           "target_ranks": None, "drafter_ranks": None,
                           "reason": None if per_node >= 2 else
                           f"{per_node} GPU per node cannot hold a target and a drafter rank: need at least 2"}
    if 1 < k_tp and per_node >= 2 and k_tp >= per_node and args.nodes < 2:
        dis.update(possible=False, reason=f"a target replica of {k_tp} ranks leaves no drafter GPU on a node of "
                                          f"{per_node}")
    if a is not None and dis["possible"]:
        split = best_split(args.gpus, args.nodes, a, b, k_tp)
        best = split["best"]
        tok = best["tok_per_s"]
        out["split"] = {**split, "rate_source": rate_source, "target_tok_per_s_per_rank": a,
                        "drafter_tok_per_s_per_rank": b}
        out["links"] = {
            "per_drafter_in_bytes_per_s": wire["total"] * tok / best["drafter_ranks"],
            "per_target_out_bytes_per_s": wire["total"] * tok / best["replicas"],  # a replica's first rank sends
            "total_bytes_per_s": wire["total"] * tok,
            # With more than one node the split is per node (--targets-per-node), and a per-node layout
            # routes every drafter's batches to the targets of its own node (Layout.route).
            "cross_node_fraction": 1.0 if best["target_nodes"] else 0.0,
        }
        dis.update(tok_per_s=tok, tok_per_s_per_gpu=tok / args.gpus, target_ranks=best["target_ranks"],
                   drafter_ranks=best["drafter_ranks"])
    elif a is not None and (a <= 0 or b <= 0):
        raise DFlashError("target and drafter tokens/s must be > 0")
    out["disaggregated"] = dis
    out["colocated"] = colocated_option(args, a, b, measured, colocated_memory(args, shape_cfg, hidden, vocab, k))
    out["colocated"]["rates"] = {"a": a, "b": b, "source": rate_source if a is not None else None}
    if getattr(args, "seq_len", None):
        from dflash_ds.plan.long_context import long_context

        out["long_context"] = long_context(args, shape_cfg, hidden, vocab, k, out)
    out["choice"] = choose(out)
    out["multinode"] = links.multinode(args, out, a, b, k_tp)
    out["sbatch"] = sbatch_line(out)
    out["hostfile"] = hostfile_lines(out)
    return out


def _target_parallel(args: argparse.Namespace) -> dict[str, Any] | None:
    """The replica size for the target's weights (None when they are unknown and no --target-parallel is given)."""
    from dflash_ds.plan.colocated import target_weight_bytes
    from dflash_ds.plan.sharding import target_parallel_choice

    weights, source = target_weight_bytes(args)
    if weights is None:
        return None
    kv_heads = None
    if args.target:
        from dflash_ds.models.target import read_target_config

        cfg = read_target_config(args.target)
        kv_heads = cfg.get("num_key_value_heads") or cfg.get("num_attention_heads")
    tp = target_parallel_choice(weights, args.gpu_memory_gb * 1e9, args.headroom_gb * 1e9, args.gpus // args.nodes,
                                args.target_parallel, kv_heads if isinstance(kv_heads, int) else None)
    return {**tp, "weight_source": source}


def _gb(x: float) -> str:
    return f"{x / 1e9:,.3f} GB/s ({x * 8 / 1e9:,.2f} Gbit/s)"


def _wire_lines(p: dict[str, Any]) -> list[str]:
    m, w = p["model"], p["wire_bytes_per_token"]
    h, k, db, v = m["hidden"], m["layers_read"], m["dtype_bytes"], m["vocab"]
    lines = [f"model: hidden {h}, vocabulary {v}, {k} target layers read, {db}-byte elements ({m['source']})",
             "bytes per token, target -> drafter:",
             f"  context features   K x H x dtype = {k} x {h} x {db} = {w['context']:,}",
             f"  final hidden       H x dtype     = {h} x {db} = {w['last_hidden']:,}"
             + ("" if w["last_hidden"] else "  (not sent: --no-last-hidden)"),
             f"  ids + loss mask                  = {w['ids']:,}",
             f"  total                            = ({k} x {h} + {h if w['last_hidden'] else 0}) x {db} + {w['ids']} "
             f"= {w['total']:,} B/token",
             "shipping the target's vocabulary logits instead (the drafter recomputes them from the final hidden):",
             f"  logits             V x dtype     = {v} x {db} = {w['logits']:,} B/token "
             f"= {w['logits_over_total']:.2f}x our whole payload",
             f"  final hidden in place of logits  = {w['logits']:,} / {h * db:,} = {w['logits_over_last_hidden']:.1f}x "
             "smaller (V / H)",
             f"  saved per token by recomputing   = {w['logits']:,} - {w['last_hidden']:,} = {w['saved_per_token']:,} B",
             f"  context + logits + ids           = {w['alternative_total']:,} B/token "
             f"= {w['alternative_over_total']:.2f}x ours"]
    if w["fp32_logits_over_total"]:
        lines.append(f"  logits in fp32                   = {2 * w['logits']:,} B/token = "
                     f"{w['fp32_logits_over_total']:.2f}x ours")
    return lines


def _split_lines(p: dict[str, Any]) -> list[str]:
    s, w, dis = p["split"], p["wire_bytes_per_token"], p["disaggregated"]
    if not dis["possible"]:
        return [f"disaggregated: impossible, {dis['reason']}"]
    if s is None:
        return ["split: give --target-tok-per-s and --drafter-tok-per-s (or --from-bench) to size it"]
    best, links = s["best"], p["links"]
    k = (p.get("target_parallel") or {}).get("k", 1)
    per = "target rank" if k == 1 else f"target replica of {k} ranks"
    lines = [f"split of {p['gpus']} GPUs on {p['nodes']} node(s), a = {s['target_tok_per_s_per_rank']:,.0f} tok/s per "
             f"{per}, b = {s['drafter_tok_per_s_per_rank']:,.0f} per drafter rank ({s['rate_source']}):",
             "  targets/node  T  D  T*a tok/s  D*b tok/s  min tok/s  bound by"
             + ("" if k == 1 else f"   (T: replicas of {k} ranks)")]
    for o in s["options"]:
        mark = " <-" if o is best else ""
        where = f"{o['target_nodes']} node(s)" if o["target_nodes"] else o["targets_per_node"]
        lines.append(f"  {where:>12} {o['replicas']:>2} {o['drafter_ranks']:>2} "
                     f"{o['target_tok_per_s']:>10,.0f} {o['drafter_tok_per_s']:>10,.0f} {o['tok_per_s']:>10,.0f}  "
                     f"{o['bottleneck']}{mark}")
    lines += [f"link bandwidth at the best split's rate ({w['total']:,} B/token):",
              f"  into each drafter   {w['total']:,} x {best['tok_per_s']:,.0f} / {best['drafter_ranks']} = "
              f"{_gb(links['per_drafter_in_bytes_per_s'])}",
              f"  out of each target  {w['total']:,} x {best['tok_per_s']:,.0f} / {best['replicas']} = "
              f"{_gb(links['per_target_out_bytes_per_s'])}",
              f"  whole job           {_gb(links['total_bytes_per_s'])}"]
    if p["nodes"] > 1:
        lines.append(f"  {links['cross_node_fraction']:.0%} of it crosses nodes: " + (
            "a replica fills whole nodes, the drafters run on the others" if links["cross_node_fraction"] else
            "with --targets-per-node every drafter is fed by the targets of its own node"))
    return lines


def report(p: dict[str, Any]) -> str:
    """The recommendation as text, arithmetic shown."""
    from dflash_ds.plan.sharding import sharding_lines

    tp = p["target_parallel"]
    sbatch = [f"SLURM: {p['sbatch']}"] if p["sbatch"] else []
    if p["choice"]["mode"] and "long_context" in p and not p["sbatch"] and (p["split"] or p["choice"]["mode"] == "colocated"):
        sbatch.append(f"no launch line: the recommended layout holds no {p['long_context']['seq_len']:,}-token "
                      "sequence (the warnings above)")
    if p["hostfile"]:  # the node names are placeholders: the user's hosts, reachable by ssh
        sbatch += ["deepspeed launcher: a file `hostfile` with one line per node (your host names), then"] + [
            f"  {line}" for line in p["hostfile"]]
    return "\n".join((sharding_lines(tp, tp["weight_source"]) if tp else []) + _wire_lines(p) + _split_lines(p)
                     + colocated_lines(p) + _long_lines(p) + choice_lines(p) + links.lines(p) + sbatch)


def _long_lines(p: dict[str, Any]) -> list[str]:
    if "long_context" not in p:
        return []
    from dflash_ds.plan.long_context import long_context_lines

    return long_context_lines(p["long_context"])


def run(args: argparse.Namespace) -> int:
    """Entry point of `dflash-ds plan`."""
    p = plan(args)
    print(json.dumps(p) if args.json else report(p))
    return 0
