"""How many ranks one copy of the target needs (topology.target_parallel k): the smallest that fits a GPU.

A target replica of k ranks holds 1/k of the target's weights on each GPU (tensor parallelism splits
attention heads, MLP and expert matrices; norms and the router are replicated, a fraction of a percent at
real scale). k is tried in powers of two (what head counts divide) up to the GPUs of one node, since a
replica's all-reduces must stay on a node's links: weights / k + the headroom (the forward's activations,
the CUDA context, NCCL buffers, fragmentation) must fit the GPU. A replica's ranks never train: every
other GPU of the node is a drafter (docs/MEMORY.md "Targets larger than one GPU").
"""

from __future__ import annotations

from typing import Any

from dflash_ds.errors import DFlashError

GB = 1e9


def target_parallel_choice(weight_bytes: float, gpu_bytes: float, headroom_bytes: float, per_node: int,
                           forced: int | None = None, kv_heads: int | None = None) -> dict[str, Any]:
    """The rows tried (k, bytes per rank, fits) and the chosen k: `forced`, else the smallest that fits.

    `kv_heads` (known from a --target folder): tensor parallelism splits whole key/value heads, so a k that
    does not divide them cannot be used (Qwen3.5-122B-A10B has 2: k <= 2)."""
    rows = []
    k = 1
    while k <= per_node:
        need = weight_bytes / k + headroom_bytes
        splits = kv_heads is None or kv_heads % k == 0
        rows.append({"k": k, "weights_per_rank": weight_bytes / k, "need": need, "fits": need <= gpu_bytes and splits,
                     "heads_split": splits})
        k *= 2
    if forced is not None:
        if forced < 1 or forced > per_node:
            raise DFlashError(f"--target-parallel {forced}: a replica must hold 1..{per_node} GPUs of one node")
        if forced not in [r["k"] for r in rows]:
            need = weight_bytes / forced + headroom_bytes
            splits = kv_heads is None or kv_heads % forced == 0
            rows.append({"k": forced, "weights_per_rank": weight_bytes / forced, "need": need,
                         "fits": need <= gpu_bytes and splits, "heads_split": splits})
            rows.sort(key=lambda r: r["k"])
        chosen = next(r for r in rows if r["k"] == forced)
        source = "--target-parallel"
    else:
        fitting = [r for r in rows if r["fits"]]
        if not fitting and any(r["need"] <= gpu_bytes for r in rows):
            raise DFlashError(f"the target's {kv_heads} key/value heads do not split over any replica size whose "
                              f"share of the weights fits a {gpu_bytes / GB:,.0f} GB GPU ("
                              + ", ".join(f"k = {r['k']}" for r in rows if r["need"] <= gpu_bytes)
                              + "): use GPUs with more memory")
        if not fitting:
            last = rows[-1]
            raise DFlashError(
                f"the target's {weight_bytes / GB:,.2f} GB of weights do not fit one node: even over all {per_node} "
                f"GPUs of a node, {last['weights_per_rank'] / GB:,.2f} GB a GPU + {headroom_bytes / GB:,.2f} GB "
                f"headroom = {last['need'] / GB:,.2f} GB > {gpu_bytes / GB:,.2f} GB; use GPUs with more memory or a "
                f"quantized checkpoint (a replica's tensor-parallel ranks must share one node)")
        chosen, source = fitting[0], "smallest k that fits"
    return {"k": chosen["k"], "source": source, "fits": chosen["fits"], "rows": rows,
            "weights_per_rank": chosen["weights_per_rank"], "left_per_rank": gpu_bytes - chosen["need"],
            "weight_bytes": weight_bytes, "gpu_bytes": gpu_bytes, "headroom_bytes": headroom_bytes,
            "kv_heads": kv_heads}


def sharding_lines(tp: dict[str, Any], weight_source: str) -> list[str]:
    """The arithmetic of the choice, one line per k tried."""
    g = tp["gpu_bytes"] / GB
    lines = [f"target replica: {tp['weight_bytes'] / GB:,.2f} GB of weights ({weight_source}), {g:,.0f} GB GPUs, "
             f"{tp['headroom_bytes'] / GB:,.2f} GB headroom a GPU:"]
    for r in tp["rows"]:
        mark = f"  <- {tp['source']}" if r["k"] == tp["k"] else ""
        heads = "" if r["heads_split"] else f"; {tp['kv_heads']} key/value heads do not split {r['k']} ways"
        lines.append(f"  k = {r['k']}: {tp['weight_bytes'] / GB:,.2f} / {r['k']} + {tp['headroom_bytes'] / GB:,.2f} = "
                     f"{r['need'] / GB:,.2f} GB {'<=' if r['need'] <= tp['gpu_bytes'] else '>'} {g:,.0f}{heads}{mark}")
    if tp["k"] > 1:
        lines.append(f"  --target-parallel {tp['k']}: each target GPU holds {tp['weights_per_rank'] / GB:,.2f} GB of "
                     f"weights, {tp['left_per_rank'] / GB:,.2f} GB left beyond the headroom; drafters get the other "
                     f"GPUs")
    if not tp["fits"]:
        lines.append(f"  warning: k = {tp['k']} does not fit: {tp['weights_per_rank'] / GB:,.2f} + "
                     f"{tp['headroom_bytes'] / GB:,.2f} GB > {g:,.0f} GB")
    return lines
