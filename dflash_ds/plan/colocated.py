"""`dflash-ds plan`'s colocated side: the colocated rate, the memory of one GPU, the choice, their report lines.

Colocated (`--colocate`): one GPU runs the target forward, then the drafter step, in series, so it
sustains c = 1 / (1/a + 1/b) tok/s (or the rate `bench pipeline` measured, phase (d)), N c on N
GPUs, if the target's weights + the drafter's training memory + a headroom fit one GPU. The
choice: the mode with more tokens/s (a tie keeps disaggregated: less memory per GPU). The
disaggregated split and the wire arithmetic are in `plan/capacity.py`.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from dflash_ds.config import DataConfig, DrafterConfig, LossConfig
from dflash_ds.errors import DFlashError
from dflash_ds.models.presets import PRESETS

GB = 1e9
PRESET_NAMES = tuple(PRESETS)


def colocated_rate(a: float, b: float) -> float:
    """Tokens/s of one GPU running a target forward (a tok/s alone) then a drafter step (b) in series."""
    return 1.0 / (1.0 / a + 1.0 / b)


def target_weight_bytes(args: argparse.Namespace) -> tuple[float | None, str]:
    """The target's weight bytes and where they came from (None: unknown)."""
    if getattr(args, "target_weight_gb", None) is not None:
        return args.target_weight_gb * GB, f"--target-weight-gb {args.target_weight_gb:g}"
    if args.target_params_b is not None:
        return (args.target_params_b * 1e9 * args.dtype_bytes,
                f"--target-params-b {args.target_params_b:g} x 1e9 x {args.dtype_bytes} B")
    if not args.target:
        return None, "unknown: give --target-params-b or --target"
    folder = Path(args.target)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            return float(json.loads(index.read_text())["metadata"]["total_size"]), f"{index.name} metadata.total_size"
        except (OSError, ValueError, KeyError, TypeError):
            pass  # fall back to the files themselves
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None, f"unknown: {folder} has no *.safetensors; give --target-params-b"
    return float(sum(f.stat().st_size for f in files)), f"sum of {len(files)} *.safetensors file sizes (as stored)"


def drafter_memory(args: argparse.Namespace, shape_cfg: dict[str, Any], hidden: int, vocab: int, layers_read: int,
                   ranks: int) -> dict[str, Any]:
    """Per-GPU drafter training bytes: bench memory's model at the GPU settings, ZeRO over `ranks`, no bridge.

    Colocated, the context comes from this GPU's own target forward: one captured batch alive (the
    disaggregated drafter keeps four received payloads), and the frozen embedding and LM head are
    the target's own tensors (`runtime/engine.frozen_head`), counted in its weights, not here.
    """
    if args.drafter_memory_gb is not None:
        return {"bytes": args.drafter_memory_gb * GB, "source": "--drafter-memory-gb", "terms": {}}
    from dflash_ds.memory import model as mm
    from dflash_ds.memory import shapes

    loss = LossConfig()
    missing = [k for k in shapes.SHAPE_FIELDS if k not in shape_cfg]
    if missing:
        return {"bytes": None, "source": f"unknown: the target config has no {missing[0]!r}; give --drafter-memory-gb",
                "terms": {}}
    shape = replace(shapes.drafter_shape({**shape_cfg, "vocab_size": vocab}, hidden, args.drafter_layers,
                                         DrafterConfig.block_size), num_read=layers_read,
                    kind=getattr(args, "kind", "dflash"))  # a kind: + its parts (its spec's memory terms)
    kl = not args.no_last_hidden
    seq_len = getattr(args, "seq_len", None)  # --seq-len: one long sequence (the budget raised to hold it)
    budget = max(args.token_budget, seq_len or 0)
    step_args = argparse.Namespace(token_budget=budget,
                                   seq_len=seq_len or min(DataConfig.max_length, budget),
                                   block_size=shape.block_size, num_anchors=loss.num_anchors,
                                   max_anchors=loss.max_anchors_per_batch, chunk_blocks=loss.chunk_blocks,
                                   kl_weight=1.0 if kl else 0.0)
    step = shapes.step_shape(step_args, dtype_bytes=2, checkpointing=True, dense=False, cuda=True)
    micro = mm.micro_step_terms(shape, step, param_grads=False)
    phase = max(mm.PHASES, key=lambda ph: sum(micro[ph].values()))
    static = mm.static_terms(shape, budget, args.zero_stage, ranks, kl=kl, payloads_alive=1, pooled=False)
    terms = {k: v for k, v in static.items() if k not in ("payload_buffers", "frozen_embed_head")}
    terms["captured_batch"] = static["payload_buffers"]
    terms[f"micro_step_peak_{phase}"] = sum(micro["held"].values()) + sum(micro[phase].values())
    if seq_len:  # at long context the target's own forward may rise above the drafter step (memory/long_context.py)
        from dflash_ds.memory import long_context as lc

        run = lc.LongRun(layers_read=layers_read, drafter_layers=shape.num_layers, kl=kl, zero_stage=args.zero_stage)
        terms["target_forward_over_step"] = lc.forward_over_step(
            shape, step.batch * step.seq_len, run, terms[f"micro_step_peak_{phase}"])
    # the same drafter with its first k layers recomputed, k = 0..L (the trainer recomputes the fewest that fit);
    # with --seq-len the target forward's rise above the all-recomputed step is kept in each: an upper bound
    fixed = sum(v for k, v in terms.items() if not k.startswith("micro_step_peak"))
    by_recomputed = [fixed + mm.micro_step_peak(shape, replace(step, checkpointing=k > 0, checkpoint_layers=k),
                                                param_grads=False) for k in range(shape.num_layers + 1)]
    return {"bytes": sum(terms.values()), "terms": terms, "params": mm.drafter_params(shape),
            "bytes_by_recomputed_layers": by_recomputed,
            "source": f"memory model: bf16, checkpointing, token budget {budget:,}"
                      + (f" ({step.batch} x {seq_len:,} tokens)" if seq_len else "") + f", ZeRO-{args.zero_stage} "
                      f"over {ranks} rank(s), KL {'on' if kl else 'off'}",
            "shape": {"hidden": shape.hidden, "intermediate": shape.intermediate, "heads": shape.heads,
                      "kv_heads": shape.kv_heads, "head_dim": shape.head_dim, "layers": shape.num_layers}}


def colocated_memory(args: argparse.Namespace, shape_cfg: dict[str, Any], hidden: int, vocab: int,
                     layers_read: int) -> dict[str, Any]:
    """Does one GPU hold the target's weights, the drafter's training memory and the headroom?"""
    target, target_source = target_weight_bytes(args)
    drafter = drafter_memory(args, shape_cfg, hidden, vocab, layers_read, args.gpus)
    headroom, limit = args.headroom_gb * GB, args.gpu_memory_gb * GB
    total = None if target is None or drafter["bytes"] is None else target + drafter["bytes"] + headroom
    return {"target_bytes": target, "target_source": target_source, "drafter_bytes": drafter["bytes"],
            "drafter": drafter, "headroom_bytes": headroom, "gpu_bytes": limit, "total_bytes": total,
            "fits": None if total is None else total <= limit, "recompute": recompute_choice(drafter, target, limit)}


def recompute_choice(drafter: dict[str, Any], target: float | None, limit: float) -> dict[str, Any] | None:
    """The draft layers a colocated rank will recompute: the trainer's rule (runtime/checkpointing.py) with the
    GPU's memory less the target's weights as its free memory: none when the step fits 85% of it without, else
    the fewest that do (all when none does)."""
    from dflash_ds.runtime.checkpointing import USABLE_SHARE, fewest_recomputed

    by_k = drafter.get("bytes_by_recomputed_layers")
    if target is None or not by_k:
        return None
    usable = USABLE_SHARE * (limit - target)
    k = fewest_recomputed(by_k, usable)
    return {"layers": k, "of": len(by_k) - 1, "bytes": by_k[k], "usable_bytes": usable}


def colocated_option(args: argparse.Namespace, a: float | None, b: float | None, measured: float | None,
               memory: dict[str, Any]) -> dict[str, Any]:
    """The colocated option: its rate per GPU (and where it comes from), total and memory."""
    formula = colocated_rate(a, b) if a and b else None
    if args.colocated_tok_per_s is not None:
        c, source = args.colocated_tok_per_s, "--colocated-tok-per-s"
    elif measured is not None:
        c, source = measured, f"measured: bench pipeline (d), {args.from_bench}"
    else:
        c, source = formula, "1 / (1/a + 1/b)" if formula else None
    if c is not None and c <= 0:
        raise DFlashError("the colocated tokens/s must be > 0")
    return {"tok_per_s_per_gpu": c, "tok_per_s": None if c is None else c * args.gpus, "rate_source": source,
            "formula_tok_per_s_per_gpu": formula, "gpus": args.gpus, "memory": memory}


def _unchecked(mem: dict[str, Any]) -> str:
    """Why the colocated memory was not checked ('' when it was)."""
    if mem["fits"] is not None:
        return ""
    return f" (memory not checked: {mem['target_source'] if mem['target_bytes'] is None else mem['drafter']['source']})"


def choose(p: dict[str, Any]) -> dict[str, Any]:
    """Colocated or disaggregated: more total tok/s wins; a tie or an unknown rate keeps disaggregated."""
    col, dis, mem = p["colocated"], p["disaggregated"], p["colocated"]["memory"]
    why_not_col = None
    if mem["fits"] is False:
        gb = {k: f"{mem[k] / GB:,.2f} GB" for k in ("target_bytes", "drafter_bytes", "headroom_bytes", "total_bytes",
                                                    "gpu_bytes")}
        why_not_col = (f"colocated does not fit one GPU: target {gb['target_bytes']} + drafter {gb['drafter_bytes']} + "
                       f"headroom {gb['headroom_bytes']} = {gb['total_bytes']} > {gb['gpu_bytes']}")
    long_why = _long_context_choice(p, why_not_col, dis["possible"])
    if long_why:
        return long_why
    if not dis["possible"]:
        if why_not_col:
            raise DFlashError(f"disaggregated is impossible ({dis['reason']}), and {why_not_col}: add GPUs or "
                              f"nodes, or lower the drafter's memory (--token-budget, ZeRO-3)")
        return {"mode": "colocated", "reason": "the only mode with 1 GPU per node" + _unchecked(mem)}
    if why_not_col:
        return {"mode": "disaggregated", "reason": why_not_col}
    if col["tok_per_s"] is None or dis["tok_per_s"] is None:
        return {"mode": None, "reason": "no rates: give --target-tok-per-s and --drafter-tok-per-s (or --from-bench)"}
    gain = col["tok_per_s"] / dis["tok_per_s"] - 1
    if abs(gain) < 1e-9:  # N b / (a + b) whole: the split is exact and both modes give N ab / (a + b)
        gain = 0.0
    if gain > 0:
        return {"mode": "colocated", "reason": f"colocated is {gain:.1%} faster" + _unchecked(mem)}
    return {"mode": "disaggregated", "reason": f"disaggregated is {-gain:.1%} faster" if gain < 0 else
            "equal tok/s: disaggregated kept (less memory per GPU)"}


def _long_context_choice(p: dict[str, Any], why_not_col: str | None, dis_possible: bool) -> dict[str, Any] | None:
    """With --seq-len: the only mode whose ranks hold one such sequence (by the model), whatever the rates say."""
    if "long_context" not in p or why_not_col:
        return None
    from dflash_ds.plan.long_context import holds

    L, hold = p["long_context"]["seq_len"], holds(p["long_context"])
    if hold["colocated"] is None and dis_possible and hold["disaggregated"] is not None:
        return {"mode": "disaggregated", "reason": f"a colocated rank does not hold {L:,}-token sequences"}
    if dis_possible and hold["colocated"] is not None and hold["disaggregated"] is None \
            and p["colocated"]["memory"]["fits"] is not None:
        return {"mode": "colocated", "reason": f"disaggregated ranks do not hold {L:,}-token sequences, even "
                                              "with sequence parallelism"}
    return None


def launch_flags(p: dict[str, Any]) -> str | None:
    """The trainer's flags for the recommended layout (None while nothing is recommended, or when the layout holds
    no sequence of --seq-len): the mode's or the split's, then --seq-len's (plan/long_context.launch_flags)."""
    mode, mn = p["choice"]["mode"], p.get("multinode")
    if mode == "colocated":
        flags = "--colocate"
    elif mode == "disaggregated" and p["split"]:
        flags = split_flag(p, mn["winner"]["flag"].split(" (")[0] if mn else None)  # across nodes: the link's winner
    else:
        return None
    if "long_context" in p:
        from dflash_ds.plan.long_context import launch_flags as long_flags

        extra = long_flags(p["long_context"], mode)
        if extra is None:
            return None
        flags += " " + extra
    return flags


def split_flag(p: dict[str, Any], flag: str | None = None) -> str:
    """The trainer's flags for the best split (or for `flag`, a layout's own), with the replica size."""
    best = p["split"]["best"]
    flag = flag or (f"--num-target-ranks {best['target_ranks']}" if p["nodes"] == 1 or best.get("target_nodes")
                    else f"--targets-per-node {best['targets_per_node']}")
    tp = p.get("target_parallel") or {}
    return flag + (f" --target-parallel {tp['k']}" if tp.get("k", 1) > 1 else "")


def sbatch_line(p: dict[str, Any]) -> str | None:
    """The SLURM submission of the recommended layout (launch/train_slurm.sbatch: one task per node, whose torchrun
    starts a rank per GPU); None while nothing is recommended."""
    flags = launch_flags(p)
    if flags is None:
        return None
    return (f"sbatch --nodes {p['nodes']} --ntasks-per-node 1 --gpus-per-node {p['gpus'] // p['nodes']} "
            f"launch/train_slurm.sbatch --config C --target T --data D --output-dir O {flags}")


def hostfile_lines(p: dict[str, Any]) -> list[str] | None:
    """The same layout through the deepspeed launcher over a hostfile (launch/train_deepspeed.sh): the hostfile's
    lines, one per node with its GPUs as slots, and the command; None while nothing is recommended."""
    flags = launch_flags(p)
    if flags is None:
        return None
    per_node = p["gpus"] // p["nodes"]
    return [f"node{i} slots={per_node}" for i in range(p["nodes"])] + [
        f"HOSTFILE=hostfile launch/train_deepspeed.sh --config C --target T --data D --output-dir O {flags}"]


def _num(x: float | None, fmt: str = "8.2f", scale: float = GB) -> str:
    return "       ?" if x is None else format(x / scale, fmt)


def colocated_lines(p: dict[str, Any]) -> list[str]:
    c, mem, r = p["colocated"], p["colocated"]["memory"], p["colocated"]["rates"]
    n, d = c["gpus"], mem["drafter"]
    lines = [f"colocated (--colocate): each of the {n} GPU(s) runs the target forward, then the drafter step, "
             "in series (no overlap assumed):"]
    if c["formula_tok_per_s_per_gpu"] is not None:
        lines.append(f"  per GPU   c = 1 / (1/a + 1/b) = 1 / (1/{r['a']:,.0f} + 1/{r['b']:,.0f}) = "
                     f"{c['formula_tok_per_s_per_gpu']:,.0f} tok/s")
    if c["tok_per_s_per_gpu"] is None:
        lines.append("  rate: give --target-tok-per-s and --drafter-tok-per-s, --colocated-tok-per-s or --from-bench")
    else:
        if c["rate_source"] != "1 / (1/a + 1/b)":
            lines.append(f"  per GPU   c = {c['tok_per_s_per_gpu']:,.0f} tok/s ({c['rate_source']}), used in place of "
                         "the formula")
        lines.append(f"  total     N x c = {n} x {c['tok_per_s_per_gpu']:,.0f} = {c['tok_per_s']:,.0f} tok/s")
    lines += [f"  memory per GPU (GB = 1e9 bytes), against {mem['gpu_bytes'] / GB:,.0f} GB:",
              f"    target weights             {_num(mem['target_bytes'])}  ({mem['target_source']})",
              f"    drafter training           {_num(d['bytes'])}  ({d['source']})"]
    lines += [f"      {name:<24} {_num(v)}" for name, v in d["terms"].items()]
    lines.append(f"    headroom                   {_num(mem['headroom_bytes'])}  (--headroom-gb)")
    if mem["total_bytes"] is None:
        lines.append("    total                      not checked (a term is unknown)")
    else:
        sign, verdict = ("<=", "fits") if mem["fits"] else (">", "does NOT fit")
        lines.append(f"    total                      {_num(mem['target_bytes'], '.2f')} + {_num(d['bytes'], '.2f')} + "
                     f"{_num(mem['headroom_bytes'], '.2f')} = {_num(mem['total_bytes'], '.2f')} GB {sign} "
                     f"{_num(mem['gpu_bytes'], ',.0f')} GB: {verdict}")
    rc = mem.get("recompute")
    if rc:
        which = "none" if not rc["layers"] else f"{rc['layers']} of {rc['of']}"
        fits = "within" if rc["bytes"] <= rc["usable_bytes"] else "over"
        lines.append(f"    layers recomputed          {which} (drafter {_num(rc['bytes'], '.2f')} GB then, {fits} 85% of "
                     f"the {_num(rc['usable_bytes'] / 0.85, '.2f')} GB beside the target; above: all recomputed)")
    return lines


def choice_lines(p: dict[str, Any]) -> list[str]:
    ch, c, dis = p["choice"], p["colocated"], p["disaggregated"]
    col = "n/a" if c["tok_per_s"] is None else f"{c['tok_per_s']:,.0f} tok/s ({c['tok_per_s_per_gpu']:,.0f} per GPU)"
    if not dis["possible"]:
        split = "impossible"
    elif dis["tok_per_s"] is None:
        split = "n/a"
    else:
        split = (f"{dis['tok_per_s']:,.0f} tok/s ({dis['tok_per_s_per_gpu']:,.0f} per GPU, {dis['target_ranks']} "
                 f"target + {dis['drafter_ranks']} drafter)")
    lines = [f"colocated {col} vs disaggregated {split}"]
    if ch["mode"] == "colocated":
        expected = "" if c["tok_per_s"] is None else f", expected {c['tok_per_s']:,.0f} tok/s"
        lines.append(f"recommended: --colocate on {p['gpus']} GPU(s){expected}: {ch['reason']}")
    elif ch["mode"] == "disaggregated" and p["split"]:
        best = p["split"]["best"]
        lines.append(f"recommended: {best['target_ranks']} target + {best['drafter_ranks']} drafter ranks "
                     f"({split_flag(p)}), expected {best['tok_per_s']:,.0f} tok/s (drafter side assumes "
                     f"data-parallel scaling): {ch['reason']}")
    elif ch["mode"] == "disaggregated":
        lines.append(f"recommended: disaggregated ({ch['reason']}); give rates to size the split")
    else:
        lines.append(f"recommended: {ch['reason']}")
    return lines
