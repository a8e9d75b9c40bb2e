"""`dflash-ds prepare`: conversations -> token ids + assistant loss mask, as an Arrow dataset.

Loss-mask rule (works with any chat template, no `{% generation %}` markers needed): for each
assistant turn k, render `messages[:k]` with the generation prompt (P) and `messages[:k+1]` (R);
the assistant span is the text R adds after P, i.e. the content plus the end-of-turn token
(`<|im_end|>`), without the header `<|im_start|>assistant\\n` and without trailing whitespace
after it. Where the template is not prefix-stable (e.g. it rewrites earlier turns), the span is
found in the full rendering after the previous span: the next assistant header (P's text after
the rendered history) up to the next end-of-turn token, else R[len(P):], else the raw content.
Spans are mapped to tokens with the fast tokenizer's offsets: a token is a loss token when its
first character lies inside a span.

A row with `token_ids` (written by `regenerate`: the ids the target generated per assistant turn)
is laid out from those ids, not from its text re-tokenized (data/token_ids.py): the loss tokens of
a turn are its ids plus the end-of-turn token when it finished with 'stop'; a cut answer
('length') has no end-of-turn label. Where the chat template rewrites earlier turns there is no
such layout: the row takes the text path above (a cut answer's end-of-turn token still unlabelled)
and is counted in the manifest's `rows_ids_fallback`. Rows without `token_ids` take the text path.

A row whose text contains a special token string (e.g. a literal `<|im_end|>` in scraped data) is
dropped (`special_token_in_content`): rendered and tokenized, it would become a control token.

Every input row is either kept or dropped with a reason (formats.DROP_REASONS): rows_read ==
rows_kept + sum(rows_dropped), and every dropped row is listed in `dropped.jsonl` as file:line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import time
import uuid
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from dflash_ds.data import formats
from dflash_ds.data.chat import check_special_tokens, load_tokenizer, special_token_pattern
from dflash_ds.data.token_ids import encode, layout, read_token_ids
from dflash_ds.errors import DFlashError

MAX_PRINTED_DROPS = 20
FROM_IDS, IDS_FALLBACK = 1, 2  # the from_ids column: laid out from token_ids / has them, took the text path


@lru_cache(maxsize=4)
def _special_token_re(target: str) -> re.Pattern | None:
    return special_token_pattern(load_tokenizer(target))


def _render(tok, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def assistant_spans(tok, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """Render a conversation; return the text and the character spans of the assistant turns."""
    with _template_errors():
        full = _render(tok, messages, False)
        spans, cursor = [], 0
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = _render(tok, messages[:k], True)
            turn = _render(tok, messages[: k + 1], False)
            if turn.startswith(prompt) and full.startswith(turn) and len(prompt) >= cursor:
                start, end = len(prompt), len(turn)
            else:
                start, end = _search_span(tok, full, messages, k, prompt, turn, cursor)
            end = start + len(full[start:end].rstrip())
            spans.append((start, end))
            cursor = end
    return full, spans


@contextmanager
def _template_errors() -> Iterator[None]:
    # jinja raise_exception / TemplateError: the template rejects this row.
    try:
        yield
    except formats.RowError:
        raise
    except Exception as exc:
        raise formats.RowError(formats.TEMPLATE_ERROR,
                               str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None


def _search_span(tok, full: str, messages: list[dict[str, str]], k: int, prompt: str, turn: str,
                 cursor: int) -> tuple[int, int]:
    # The template rewrites turns depending on what follows (Qwen3 drops the <think> block of
    # earlier turns), so turn k renders differently inside the full conversation. Try, in order:
    # the next assistant header (the generation prompt's own text) up to the end-of-turn token,
    # then the rendered turn itself, then the raw content. The header comes first because the
    # next header after the cursor is always turn k, while the same text may recur in a later turn.
    eos = tok.eos_token or ""
    before = _render(tok, messages[:k], False)
    header = prompt[len(before):] if prompt.startswith(before) else ""
    if header.strip() and eos and (at := full.find(header, cursor)) >= 0:
        stop = full.find(eos, at + len(header))
        if stop >= 0:
            return at + len(header), stop + len(eos)
    piece = turn[len(prompt):] if turn.startswith(prompt) else ""
    if piece.strip() and (at := full.find(piece, cursor)) >= 0:
        return at, at + len(piece)
    content = messages[k]["content"]
    at = full.find(content, cursor) if content else -1
    if at < 0:
        raise formats.RowError(formats.TEMPLATE_ERROR, "assistant turn not found in the rendered chat template")
    end = at + len(content)
    rest = full[end:]
    if eos and rest.lstrip().startswith(eos):
        end += len(rest) - len(rest.lstrip()) + len(eos)
    return at, end


def tokenize_batch(batch: dict[str, list], target: str, max_length: int, block_size: int,
                   overlong: str) -> dict[str, list]:
    """datasets.map function: raw rows -> input_ids, loss_mask, length, loss_tokens, from_ids, reason, detail."""
    tok = load_tokenizer(target)
    specials = _special_token_re(target)
    n = len(batch["raw"])
    out: dict[str, list] = {"input_ids": [[] for _ in range(n)], "loss_mask": [[] for _ in range(n)],
                            "length": [0] * n, "loss_tokens": [0] * n, "truncated": [False] * n,
                            "from_ids": [0] * n, "reason": [""] * n, "detail": [""] * n}
    texts, span_lists, text_rows = [], [], []
    layouts, id_rows = [], []
    for i, raw in enumerate(batch["raw"]):
        try:
            record = formats.parse_row(raw)
            messages = formats.to_messages(record)
            generated = read_token_ids(record, messages, len(tok))
            check_special_tokens(specials, messages)
            if generated is not None:
                with _template_errors():
                    parts = layout(tok, messages, *generated, specials)
                if parts is not None:
                    out["from_ids"][i] = FROM_IDS
                    layouts.append(parts)
                    id_rows.append(i)
                    continue
                out["from_ids"][i] = IDS_FALLBACK
            text, spans = assistant_spans(tok, messages)
            if generated is not None:
                spans = _unlabel_cut_ends(tok, text, spans, generated[1])
        except formats.RowError as err:
            out["reason"][i], out["detail"][i] = err.reason, err.detail
            continue
        texts.append(text)
        span_lists.append(spans)
        text_rows.append(i)
    for i, (ids, mask) in zip(id_rows, encode(tok, layouts)):
        _keep(out, i, ids, mask, max_length, block_size, overlong)
    if not texts:
        return out
    # One batched call into the Rust tokenizer; the chat template already holds every special token.
    for i, enc, text, spans in zip(text_rows, tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False),
                                   texts, span_lists):
        in_span = np.zeros(len(text) + 1, dtype=np.int8)
        for s, e in spans:
            in_span[s:e] = 1
        starts = np.fromiter((a for a, _ in enc.offsets), dtype=np.int64, count=len(enc.ids))
        _keep(out, i, enc.ids, in_span[np.minimum(starts, len(text))].tolist(), max_length, block_size, overlong)
    return out


def _unlabel_cut_ends(tok, text: str, spans: list[tuple[int, int]], finishes: list[str]) -> list[tuple[int, int]]:
    # A cut answer never emitted the end-of-turn token the template put after it: no label on it.
    eos = tok.eos_token or ""
    return [(s, e - len(eos)) if finish == "length" and eos and text[s:e].endswith(eos) else (s, e)
            for (s, e), finish in zip(spans, finishes)]


def _keep(out: dict[str, list], i: int, ids: list[int], mask: list[int], max_length: int, block_size: int,
          overlong: str) -> None:
    # Row i's ids and mask, or its drop reason: over --max-length, or too few loss tokens.
    if len(ids) > max_length:
        if overlong == "drop":
            out["reason"][i], out["detail"][i] = formats.OVERLONG, f"{len(ids)} tokens > --max-length {max_length}"
            return
        ids, mask = ids[:max_length], mask[:max_length]
        out["truncated"][i] = True
    n_loss = sum(mask)
    if n_loss < 2 * block_size:
        out["reason"][i] = formats.TOO_FEW_LOSS_TOKENS
        out["detail"][i] = f"{n_loss} loss tokens < 2 x --block-size {block_size}"
        return
    out["input_ids"][i], out["loss_mask"][i] = ids, mask
    out["length"][i], out["loss_tokens"][i] = len(ids), n_loss


def length_histogram(lengths_counts: dict[int, int], max_length: int) -> list[dict[str, int]]:
    """Power-of-two bins (lo, hi] up to max_length with their row counts."""
    edges = [0, 16]
    while edges[-1] < max_length:
        edges.append(min(edges[-1] * 2, max_length))
    bins = [{"lo": lo + 1, "hi": hi, "count": 0} for lo, hi in zip(edges, edges[1:])]
    for length, count in lengths_counts.items():
        for b in bins:
            if length <= b["hi"]:
                b["count"] += count
                break
        else:
            bins[-1]["count"] += count
    return bins


def _raw_rows(files: list[str]):
    # A generator for Dataset.from_generator: rows stream to Arrow, never held as one Python list.
    for file_idx, path in enumerate(files):
        for line, raw in formats.iter_raw_rows(path):
            yield {"file_idx": file_idx, "line": line, "raw": raw}


def prepare(target: str | Path, data: list[str | Path], out: str | Path, max_length: int = 2048,
            block_size: int = 16, overlong: str = "truncate", strict: bool = False, num_proc: int = 1,
            seed: int | None = None, force: bool = False) -> dict[str, Any]:
    """Tokenize conversation files into an Arrow dataset at `out`; return the manifest."""
    import datasets

    t0 = time.perf_counter()
    target, out = str(target), Path(out)
    files = [str(Path(f)) for f in data]
    for f in files:
        formats.file_kind(f)
    if overlong not in ("truncate", "drop"):
        raise DFlashError(f"--overlong must be 'truncate' or 'drop', got {overlong!r}")
    if max_length < 2 * block_size:
        raise DFlashError(f"--max-length {max_length} is below 2 x --block-size {block_size}")
    if out.exists() and not force:
        raise DFlashError(f"--out {out} already exists; pass --force to replace it")
    load_tokenizer(target)
    out.parent.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    work, tmp_out = out.parent / f".{out.name}.work-{tag}", out.parent / f".{out.name}.tmp-{tag}"
    try:
        features = datasets.Features({"file_idx": datasets.Value("int32"), "line": datasets.Value("int64"),
                                      "raw": datasets.Value("string")})
        raw = datasets.Dataset.from_generator(_raw_rows, features=features, cache_dir=str(work),
                                              gen_kwargs={"files": files})
        if len(raw) == 0:
            raise DFlashError(f"no rows in {', '.join(files)}")
        tokenized = raw.map(
            tokenize_batch, batched=True, batch_size=256, num_proc=num_proc if num_proc > 1 else None,
            remove_columns=["raw"], desc="tokenizing",
            fn_kwargs={"target": target, "max_length": max_length, "block_size": block_size, "overlong": overlong},
            features=datasets.Features({
                "file_idx": datasets.Value("int32"), "line": datasets.Value("int64"),
                "input_ids": datasets.List(datasets.Value("int32")), "loss_mask": datasets.List(datasets.Value("int8")),
                "length": datasets.Value("int32"), "loss_tokens": datasets.Value("int32"),
                "truncated": datasets.Value("bool"), "from_ids": datasets.Value("int8"),
                "reason": datasets.Value("string"), "detail": datasets.Value("string")}),
        )
        manifest = _account(tokenized, files, tmp_out, max_length, strict)
        kept = tokenized.filter(lambda r: [x == "" for x in r], input_columns="reason", batched=True,
                                num_proc=num_proc if num_proc > 1 else None, desc="keeping")
        kept = kept.select_columns(["input_ids", "loss_mask", "length"])
        if seed is not None:
            kept = kept.shuffle(seed=seed)
        kept.save_to_disk(str(tmp_out))
        elapsed = time.perf_counter() - t0
        manifest.update({
            "target": target, "inputs": files, "max_length": max_length, "block_size": block_size,
            "overlong": overlong, "shuffle_seed": seed, "elapsed_s": round(elapsed, 3),
            "tokens_per_s": round(manifest["tokens"] / max(elapsed, 1e-9), 1),
            "mask_rule": "assistant content + end-of-turn token, found by prefix rendering of the chat template; "
                         "rows with token_ids: those ids + end-of-turn token after a 'stop' answer only",
        })
        (tmp_out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp_out, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(tmp_out, ignore_errors=True)
    return manifest


def _account(ds, files: list[str], tmp_out: Path, max_length: int, strict: bool) -> dict[str, Any]:
    # One streaming pass over the per-row metadata: counts, histogram, and dropped.jsonl.
    read = kept = tokens = loss_tokens = truncated = 0
    from_ids = {FROM_IDS: 0, IDS_FALLBACK: 0}
    dropped = {r: 0 for r in formats.DROP_REASONS}
    first_drops: dict[str, list[str]] = {}
    lengths: dict[int, int] = {}
    tmp_out.mkdir(parents=True)
    cols = ds.select_columns(["file_idx", "line", "length", "loss_tokens", "truncated", "from_ids", "reason",
                              "detail"])
    with open(tmp_out / "dropped.jsonl", "w", encoding="utf-8") as drop_log:
        for batch in cols.iter(batch_size=4096):
            for fi, line, length, n_loss, trunc, ids_path, reason, detail in zip(
                    batch["file_idx"], batch["line"], batch["length"], batch["loss_tokens"],
                    batch["truncated"], batch["from_ids"], batch["reason"], batch["detail"]):
                read += 1
                if reason:
                    where = f"{files[fi]}:{line}"
                    if strict:
                        raise DFlashError(f"{where}: {reason}: {detail} (--strict)")
                    dropped[reason] += 1
                    first_drops.setdefault(reason, [])
                    if len(first_drops[reason]) < 3:
                        first_drops[reason].append(where)
                    drop_log.write(json.dumps({"file": files[fi], "line": line, "reason": reason,
                                               "detail": detail}) + "\n")
                    if sum(dropped.values()) <= MAX_PRINTED_DROPS:
                        print(f"dropped {where}: {reason}: {detail}")
                    continue
                kept += 1
                tokens += length
                loss_tokens += n_loss
                truncated += int(trunc)
                if ids_path:
                    from_ids[ids_path] += 1
                lengths[length] = lengths.get(length, 0) + 1
    dropped = {r: n for r, n in dropped.items() if n}
    if kept == 0:
        top = ", ".join(f"{r}={n} (e.g. {first_drops[r][0]})" for r, n in
                        sorted(dropped.items(), key=lambda kv: -kv[1])[:3])
        raise DFlashError(f"no rows kept from {', '.join(files)}: {read} read, dropped {top}")
    assert kept + sum(dropped.values()) == read
    return {"rows_read": read, "rows_kept": kept, "rows_dropped": dropped, "rows_truncated": truncated,
            "rows_from_token_ids": from_ids[FROM_IDS], "rows_ids_fallback": from_ids[IDS_FALLBACK],
            "dropped_examples": first_drops, "tokens": tokens, "loss_tokens": loss_tokens,
            "length_histogram": length_histogram(lengths, max_length)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the prepare flags."""
    parser.add_argument("--target", required=True, help="target model folder (its tokenizer and chat template are used)")
    parser.add_argument("--data", required=True, nargs="+", help="conversation files: .jsonl, .json or .parquet "
                        "(ShareGPT 'conversations' or OpenAI 'messages' rows)")
    parser.add_argument("--out", required=True, help="output folder (Arrow dataset + manifest.json + dropped.jsonl)")
    parser.add_argument("--max-length", type=int, default=2048, help="maximum tokens per conversation")
    parser.add_argument("--block-size", type=int, default=16, help="drafter block size; rows need >= 2x this many loss tokens")
    parser.add_argument("--overlong", choices=["truncate", "drop"], default="truncate",
                        help="what to do with conversations longer than --max-length")
    parser.add_argument("--strict", action="store_true", help="fail on the first bad row instead of skipping it")
    parser.add_argument("--num-proc", type=int, default=1, help="tokenizer worker processes")
    parser.add_argument("--seed", type=int, default=None, help="shuffle the kept rows with this seed (default: keep input order)")
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")


def run(args: argparse.Namespace) -> int:
    """CLI entry: prepare and print a summary."""
    m = prepare(args.target, args.data, args.out, max_length=args.max_length, block_size=args.block_size,
                overlong=args.overlong, strict=args.strict, num_proc=args.num_proc, seed=args.seed, force=args.force)
    drops = ", ".join(f"{r}={n}" for r, n in m["rows_dropped"].items()) or "none"
    print(f"prepare: read {m['rows_read']} rows, kept {m['rows_kept']} ({m['rows_truncated']} truncated), "
          f"dropped {sum(m['rows_dropped'].values())} [{drops}]")
    if m["rows_ids_fallback"]:
        print(f"prepare: {m['rows_ids_fallback']} of {m['rows_from_token_ids'] + m['rows_ids_fallback']} rows with "
              f"token_ids took the text path: the chat template rewrites earlier turns (labels from re-tokenized text)")
    print(f"prepare: {m['tokens']:,} tokens, {m['loss_tokens']:,} loss tokens, {m['tokens_per_s']:,.0f} tokens/s "
          f"-> {args.out}")
    return 0
