"""`bench context-falloff` on a real target's own data (issue 56, point 4: SmolLM2-135M-Instruct's 8K window).

Three `prepare`d folders, each of rows the target answered itself (`regenerate`):
- `--short-data`: short rows (one-turn answers to `make-prompts`' training prompts), the base's and the short
  continuation's;
- `--long-data`: long multi-turn conversations (`long-conversations`, then `regenerate`: every answer the
  target's, given the whole conversation before it), the long continuation's, one a step;
- `--held-out`: long conversations from held-out prompts. Each is cut before one of its answers, once per context
  bucket of `eval.summary.CONTEXT_EDGES` up to `--length`: the longest cut whose prompt and `--max-new-tokens`
  stay within the bucket's upper edge and whose prompt reaches its lower edge, `--per-bucket` conversations a
  bucket. A cut is where the labels start (the prompt holds the answer's header, as `prepare` lays it out).

The target's teacher-forced accuracy on the held-out answers (by bucket) is checked first, as on the tiny target:
near 1 where the answers are the target's own greedy text (vLLM and transformers differ only on near-ties); low
where the file holds another model's answers. Each row's context features come from one chunked prefill
(`TargetSession.prefill`) and are kept for every seed: at SmolLM2's width (576) and two target layers, 4.6 KB a
position in fp32, so 10 conversations of 7.6K tokens hold 350 MB; at Qwen3-8B's (4,096, five layers) 82 KB a
position, 6 GB for the same 76K positions, which is why this is a bench on a small target and the trainer's own
`--data.max_length` is the route at real scale.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from dflash_ds.errors import DFlashError


@dataclass
class Sources:
    """What the seed loop trains and serves on: the target, the held-out prompts, each seed's short and long
    training rows (`TargetStates`) and how many rows a step takes of each (a step's anchors spread evenly over them),
    and how the fresh drafter starts."""

    target: Any
    target_dir: Path
    accuracy: dict[str, float]
    prompts: list[list[int]]
    short: Callable[[int], Any]
    long: Callable[[int], Any]
    short_per_step: int
    long_per_step: int = 1
    mask_token_id: int | None = None
    layers_from_target: bool = False


def data_sources(args: argparse.Namespace):
    """`context_falloff.Sources` of a real target's prepared short, long and held-out rows."""
    from transformers import AutoConfig

    from dflash_ds.models.target import load_target

    missing = [f for f, v in (("--target", args.target), ("--short-data", args.short_data),
                              ("--long-data", args.long_data), ("--held-out", args.held_out)) if not v]
    if missing:
        raise DFlashError(f"a real target's falloff needs --target, --short-data, --long-data and --held-out; "
                          f"missing {', '.join(missing)}")
    if args.anchors % args.short_batch:
        raise DFlashError(f"--anchors {args.anchors} must divide evenly over --short-batch {args.short_batch} rows")
    target_dir = Path(args.target)
    held = prepared_rows(Path(args.held_out), args.length)
    short_rows, long_rows = prepared_rows(Path(args.short_data), args.length), prepared_rows(Path(args.long_data),
                                                                                             args.length)
    prompts = cut_prompts(held, args.length, args.max_new_tokens, args.per_bucket, args.held_out)
    target = load_target(target_dir)
    print(f"{len(short_rows)} short rows (median {_median(short_rows)} tokens), {len(long_rows)} long (median "
          f"{_median(long_rows)}), {len(prompts)} held-out prompts of {[len(p) for p in prompts]} tokens", flush=True)
    layers = AutoConfig.from_pretrained(str(target_dir)).num_hidden_layers
    clock = time.perf_counter()
    from_target = args.init == "target"
    short = states(target, short_rows, layers, args.layers, from_target)
    long = states(target, long_rows, layers, args.layers, from_target)
    print(f"context features of {len(short_rows) + len(long_rows)} rows in {time.perf_counter() - clock:.0f} s; the "
          "target's accuracy on the held-out answers next", flush=True)
    return Sources(target, target_dir, answer_accuracy(target, held), prompts, short=lambda seed: short,
                   long=lambda seed: long, short_per_step=args.short_batch, mask_token_id=args.mask_token_id,
                   layers_from_target=from_target)


def answer_accuracy(target, rows: list[tuple[list[int], list[int]]]) -> dict[str, float]:
    """Teacher-forced argmax accuracy of the target on each row's labelled tokens (mask 1), by context bucket
    (`eval.summary.bucket_name` of the position predicting the token), over all rows."""
    import bisect

    import torch

    from dflash_ds.eval.speculative import PREFILL_CHUNK, TargetSession
    from dflash_ds.eval.summary import CONTEXT_EDGES, bucket_name

    hits: dict[int, list[int]] = {}
    for ids, mask in rows:
        with TargetSession(target, []) as tgt:
            for lo in range(0, len(ids), PREFILL_CHUNK):  # chunked like the prefill; every position's logits
                chunk = ids[lo: lo + PREFILL_CHUNK]
                logits, _ = tgt.forward(chunk, torch.arange(lo, lo + len(chunk)))
                pred = logits.argmax(-1).tolist()
                for i, p in enumerate(pred, start=lo):
                    if i + 1 < len(ids) and mask[i + 1]:
                        h = hits.setdefault(bisect.bisect_right(CONTEXT_EDGES, i), [0, 0])
                        h[0] += int(p == ids[i + 1])
                        h[1] += 1
    return {bucket_name(k): h[0] / h[1] for k, h in sorted(hits.items())}


def prepared_rows(folder: Path, length: int) -> list[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask) of a `prepare`d folder's rows; a row over `length` is an error naming the folder."""
    from datasets import load_from_disk

    if not folder.is_dir():
        raise DFlashError(f"{folder}: not a folder (run `dflash-ds prepare` on the regenerated rows first)")
    try:
        ds = load_from_disk(str(folder))
    except Exception as exc:  # noqa: BLE001 - datasets raises many kinds
        raise DFlashError(f"{folder}: not a prepared dataset ({exc})") from None
    if not {"input_ids", "loss_mask"} <= set(ds.column_names) or len(ds) == 0:
        raise DFlashError(f"{folder}: no rows with input_ids and loss_mask (a `dflash-ds prepare` output?)")
    rows = [(r["input_ids"], r["loss_mask"]) for r in ds]
    longest = max(len(ids) for ids, _ in rows)
    if longest > length:
        raise DFlashError(f"{folder}: a row of {longest} tokens is longer than --length {length}")
    return rows


def cut_prompts(rows: list[tuple[list[int], list[int]]], length: int, max_new_tokens: int, per_bucket: int,
                where: str) -> list[list[int]]:
    """Per bucket up to `length`, `per_bucket` prompts: each a held-out row cut where one of its answers starts (the
    longest cut with prompt + `max_new_tokens` under the bucket's upper edge and prompt at or past its lower one);
    the rows taken in turn, one bucket at a time, so each bucket's prompts come from different conversations where
    the rows allow. A bucket no row can fill is an error naming it."""
    from dflash_ds.eval.summary import CONTEXT_EDGES, bucket_name

    starts = [[i for i in range(1, len(m)) if m[i] and not m[i - 1]] for _, m in rows]
    prompts = []
    for k, edge in enumerate(e for e in CONTEXT_EDGES if e <= length):
        lower = CONTEXT_EDGES[k - 1] if k else 0
        found = 0
        for r in range(len(rows)):
            cuts = [i for i in starts[(r + k) % len(rows)] if lower <= i and i + max_new_tokens <= edge]
            if cuts:
                prompts.append(rows[(r + k) % len(rows)][0][: max(cuts)])
                found += 1
                if found == per_bucket:
                    break
        if found < per_bucket:
            raise DFlashError(f"--held-out {where}: {found} of --per-bucket {per_bucket} conversations have an "
                              f"answer starting in bucket {bucket_name(k)} with room for --max-new-tokens "
                              f"{max_new_tokens}")
    return prompts


def states(target, rows: list[tuple[list[int], list[int]]], target_layers: int, draft_layers: int,
           from_target: bool = False):
    """`TargetStates` of `rows`, padded to the longest: the target's features at the drafter's default layers (those of
    a drafter whose layers start as the target's when `from_target`) by
    chunked prefill, the loss on the rows' labels; no final hidden (cross-entropy on the data's tokens)."""
    import torch

    from dflash_ds.components.objective import TargetStates
    from dflash_ds.eval.speculative import TargetSession
    from dflash_ds.models.drafter_arch import default_target_layer_ids

    layer_ids = default_target_layer_ids(target_layers, draft_layers, from_target=from_target)
    n, width = len(rows), max(len(ids) for ids, _ in rows)
    ids = torch.zeros(n, width, dtype=torch.long)
    loss_mask = torch.zeros_like(ids)
    lengths = torch.tensor([len(r) for r, _ in rows])
    context = torch.zeros(n, width, len(layer_ids) * target.config.hidden_size)
    for r, (row, mask) in enumerate(rows):
        ids[r, : len(row)] = torch.tensor(row)
        loss_mask[r, : len(row)] = torch.tensor(mask)
        with TargetSession(target, layer_ids) as tgt:
            context[r, : len(row)] = tgt.prefill(row)[1]
    return TargetStates(ids, loss_mask, lengths, context, None)


def _median(rows: list[tuple[list[int], list[int]]]) -> int:
    return sorted(len(ids) for ids, _ in rows)[len(rows) // 2]
