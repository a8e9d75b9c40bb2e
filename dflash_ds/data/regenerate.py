"""`dflash-ds regenerate`: rewrite the assistant turns of conversations with the target's own answers.

Multi-turn rule: every assistant turn is regenerated in order, each given the *regenerated*
history (system and user turns are kept verbatim); a conversation that ends with a user turn
gets one generated answer appended. So the output is what the target itself would have said.

Output: JSONL rows `{"id", "messages", "finish_reasons", "source"}` (OpenAI form, read by
`prepare`). The id is the row's `id` field, else a hash of `file:line`. Resumable: ids already
in the output are skipped; each batch is appended and flushed, so a kill loses at most one
batch, and a torn last line is cut off on the next start. Greedy outputs do not depend on
batching (up to float rounding); sampled outputs depend on the seed and the batch composition.

Under torchrun (RANK / WORLD_SIZE set), rank r takes input rows i with i % world == r and
writes OUT.rank{r}; after a gloo barrier (7-day timeout: ranks may finish far apart) rank 0
merges OUT and all shards into OUT in input order and removes the shards. Rows already in OUT
or in a rank's shard from an earlier run are skipped, so a killed torchrun job resumes too.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator

from dflash_ds.data import formats
from dflash_ds.data.chat import check_special_tokens, special_token_pattern
from dflash_ds.errors import DFlashError


def read_done(path: Path, repair: bool = True) -> dict[str, int]:
    """Ids already in an output file -> byte offset of their line; cut off a torn last line if `repair`."""
    done: dict[str, int] = {}
    if not path.exists():
        return done
    with open(path, "rb+" if repair else "rb") as f:
        offset = 0
        for lineno, line in enumerate(iter(f.readline, b""), start=1):
            try:
                if not line.endswith(b"\n"):
                    raise ValueError("no newline")
                done[str(json.loads(line)["id"])] = offset
            except (ValueError, KeyError, TypeError):
                if f.read(1):  # damage before the end is not a torn write: refuse to guess
                    raise DFlashError(f"{path}:{lineno}: corrupt output line; fix or remove it") from None
                if repair:
                    print(f"regenerate: {path}:{lineno}: dropping a torn last line (interrupted write)")
                    f.truncate(offset)
                break
            offset += len(line)
    return done


def iter_rows(data: str | Path, limit: int | None) -> Iterator[tuple[int, int, str | None, Any]]:
    """Yield `(index, line, id, messages | RowError)` for the first `limit` input records."""
    for index, (line, raw) in enumerate(formats.iter_raw_rows(data)):
        if limit is not None and index >= limit:
            return
        try:
            record = formats.parse_row(raw)
            messages = formats.to_messages(record, require_assistant=False)
            if not any(m["role"] == "user" for m in messages):
                raise formats.RowError(formats.NO_USER_TURN, "no user turn to answer")
            yield index, line, formats.row_id(record, data, line), messages
        except formats.RowError as err:
            yield index, line, None, err


class Generator:
    """The target model + tokenizer, generating batches of chat answers with left padding."""

    def __init__(self, target: str | Path, max_new_tokens: int, temperature: float, top_p: float,
                 seed: int, device: str | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if not Path(target).is_dir():
            raise DFlashError(f"--target {target}: not a folder (a local HF model folder is required)")
        self.torch = torch
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda":
            self.device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        try:
            self.tok = AutoTokenizer.from_pretrained(target, padding_side="left")
            # Checked before the model loads: a target without a template should not cost a model load.
            if not self.tok.chat_template:
                raise DFlashError(f"--target {target}: the tokenizer has no chat_template")
            dtype = torch.bfloat16 if self.device.startswith("cuda") else torch.float32
            self.model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype).to(self.device).eval()
        except (OSError, ValueError) as exc:
            raise DFlashError(f"--target {target}: cannot load ({str(exc).splitlines()[0]})") from None
        if self.tok.pad_token is None:
            self.tok.pad_token = self.tok.eos_token
        # Stop on the tokenizer's eos and on every eos the model's generation config lists (Qwen3 has two).
        eos = self.model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        self.stop_ids = sorted({self.tok.eos_token_id, *eos} - {None})
        self.kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "pad_token_id": self.tok.pad_token_id,
                                       "eos_token_id": self.stop_ids}
        if temperature > 0:
            self.kwargs.update(do_sample=True, temperature=temperature, top_p=top_p)
        else:
            self.kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        self.special_re = special_token_pattern(self.tok)
        torch.manual_seed(seed)
        self.new_tokens = 0

    def answer(self, histories: list[list[dict[str, str]]]) -> list[tuple[str, str]]:
        """One assistant answer per history: `(text, finish_reason)` with reason 'stop' or 'length'."""
        prompts = [self.tok.apply_chat_template(h, tokenize=False, add_generation_prompt=True) for h in histories]
        enc = self.tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(self.device)
        with self.torch.no_grad():
            out = self.model.generate(**enc, **self.kwargs)
        results = []
        for row in out[:, enc["input_ids"].shape[1]:].tolist():
            eos_at = next((k for k, t in enumerate(row) if t in self.stop_ids), None)
            tokens = row[:eos_at] if eos_at is not None else row  # no stop token: it ran to max_new_tokens
            self.new_tokens += len(tokens)
            results.append((self.tok.decode(tokens, skip_special_tokens=True), "stop" if eos_at is not None else "length"))
        return results


def _advance(src: list[dict[str, str]], out: list[dict[str, str]], pos: int) -> tuple[int, bool]:
    # Copy system/user turns until the next assistant turn; say whether an answer is due there.
    while True:
        while pos < len(src) and src[pos]["role"] != "assistant":
            out.append(dict(src[pos]))
            pos += 1
        if pos == len(src):
            return pos, bool(out) and out[-1]["role"] == "user"
        if any(m["role"] == "user" for m in out):
            return pos, True
        pos += 1  # an assistant turn before any user turn answers nothing: drop it


def regenerate_batch(gen: Generator, conversations: list[list[dict[str, str]]]) -> list[tuple[list, list]]:
    """Regenerate every assistant turn in order, batched across conversations; returns (messages, finishes)."""
    outs: list[list[dict[str, str]]] = [[] for _ in conversations]
    finishes: list[list[str]] = [[] for _ in conversations]
    pos = [0] * len(conversations)
    while True:
        pending = []
        for j, src in enumerate(conversations):
            pos[j], due = _advance(src, outs[j], pos[j])
            if due:
                pending.append(j)
        if not pending:
            return list(zip(outs, finishes))
        for j, (text, finish) in zip(pending, gen.answer([outs[j] for j in pending])):
            outs[j].append({"role": "assistant", "content": text})
            finishes[j].append(finish)
            pos[j] = min(pos[j] + 1, len(conversations[j]))


def regenerate(target: str | Path, data: str | Path, out: str | Path, batch_size: int = 8,
               max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
               limit: int | None = None, rank: int | None = None, world: int | None = None) -> dict[str, int]:
    """Regenerate the assistant turns of `data` into `out` (resumable; sharded under torchrun)."""
    from tqdm import tqdm

    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world = int(os.environ.get("WORLD_SIZE", 1)) if world is None else world
    formats.file_kind(data)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    shard = out if world == 1 else out.with_name(f"{out.name}.rank{rank}")
    # Skip rows in OUT and in any shard left by an earlier (killed, maybe other-sized) torchrun job.
    # Each file is repaired only by its owner (OUT by rank 0); the barrier below keeps everyone from
    # appending before all ranks have read the old outputs.
    done = set(read_done(out, repair=rank == 0))
    for path in shard_files(out):
        done |= set(read_done(path, repair=path == shard))
    if world > 1:
        _barrier()
    gen = Generator(target, max_new_tokens, temperature, top_p, seed + rank)
    stats = {"rows": 0, "skipped_done": 0, "bad": 0, "written": 0}
    seen: set[str] = set()
    t0 = time.perf_counter()

    with open(shard, "a", encoding="utf-8") as sink, tqdm(desc=f"regenerate[rank {rank}]", unit="row",
                                                          disable=None) as bar:
        def flush(batch: list[tuple[str, int, list]]) -> None:
            for (rid, line, _), (messages, finishes) in zip(batch, regenerate_batch(gen, [b[2] for b in batch])):
                sink.write(json.dumps({"id": rid, "messages": messages, "finish_reasons": finishes,
                                       "source": f"{data}:{line}"}, ensure_ascii=False) + "\n")
            sink.flush()
            os.fsync(sink.fileno())
            stats["written"] += len(batch)
            bar.update(len(batch))

        batch: list[tuple[str, int, list]] = []
        for index, line, rid, messages in iter_rows(data, limit):
            # Every rank tracks all ids, so a duplicate is reported the same way at any world size.
            duplicate = rid is not None and rid in seen
            if rid is not None:
                seen.add(rid)
            if index % world != rank:
                continue
            stats["rows"] += 1
            if duplicate:
                messages = formats.RowError(formats.DUPLICATE_ID, f"id {rid!r} seen before")
            elif not isinstance(messages, formats.RowError):
                try:  # a literal control token in a prompt would be encoded as the real token
                    check_special_tokens(gen.special_re, messages)
                except formats.RowError as err:
                    messages = err
            if isinstance(messages, formats.RowError):
                stats["bad"] += 1
                print(f"regenerate: skipped {data}:{line}: {messages.reason}: {messages.detail}")
                continue
            if rid in done:
                stats["skipped_done"] += 1
                continue
            batch.append((rid, line, messages))
            if len(batch) == batch_size:
                flush(batch)
                batch = []
        if batch:
            flush(batch)
    elapsed = time.perf_counter() - t0
    print(f"regenerate[rank {rank}]: {stats['rows']} rows, {stats['written']} written, "
          f"{stats['skipped_done']} already done, {stats['bad']} bad; {gen.new_tokens:,} new tokens "
          f"({gen.new_tokens / max(elapsed, 1e-9):,.0f} tokens/s) -> {shard}")
    if world > 1:
        _barrier()
    if rank == 0 and shard_files(out):
        stats["merged"] = merge_shards(data, out, limit)
    return stats


def shard_files(out: Path) -> list[Path]:
    """Existing per-rank outputs OUT.rank{r}, in rank order."""
    shards = [p for p in out.parent.glob(f"{glob.escape(out.name)}.rank*") if p.name[len(out.name) + 5:].isdigit()]
    return sorted(shards, key=lambda p: int(p.name[len(out.name) + 5:]))


def _barrier() -> None:
    # gloo on CPU works beside any accelerator; the long timeout covers unbalanced generation
    # (a rank with longer answers may finish hours later). torchrun kills the job if a rank dies.
    import torch.distributed as dist

    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:
            raise DFlashError("WORLD_SIZE > 1 but MASTER_ADDR is not set: launch with torchrun")
        dist.init_process_group("gloo", timeout=timedelta(days=7))
    dist.barrier()


def merge_shards(data: str | Path, out: Path, limit: int | None) -> int:
    """Merge OUT and OUT.rank* into OUT, in input order (rows not in the input keep their place at the end)."""
    sources = [out] + shard_files(out)
    where = {}  # id -> (source, byte offset): an index, not the rows, so memory stays small
    for src in sources:
        for rid, offset in read_done(src).items():
            where.setdefault(rid, (src, offset))
    order, listed = [], set()
    for rid in [rid for _, _, rid, _ in iter_rows(data, limit)] + list(where):
        if rid in where and rid not in listed:
            order.append(rid)
            listed.add(rid)
    tmp = out.with_name(f".{out.name}.merge-{os.getpid()}")
    handles = {src: open(src, "rb") for src in sources if src.exists()}
    try:
        with open(tmp, "wb") as f:
            for rid in order:
                src, offset = where[rid]
                handles[src].seek(offset)
                f.write(handles[src].readline())
    finally:
        for h in handles.values():
            h.close()
    os.replace(tmp, out)
    for src in sources[1:]:
        src.unlink(missing_ok=True)
    print(f"regenerate: merged {len(order)} rows from {len(sources) - 1} shards -> {out}")
    return len(order)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the regenerate flags."""
    parser.add_argument("--target", required=True, help="target model folder (HF format)")
    parser.add_argument("--data", required=True, help="conversations (.jsonl/.json/.parquet, ShareGPT or OpenAI form)")
    parser.add_argument("--out", required=True, help="output JSONL (OpenAI form); existing rows are kept and skipped")
    parser.add_argument("--batch-size", type=int, default=8, help="conversations generated together")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="token limit per generated answer")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (with --temperature > 0)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (rank r uses seed + r)")
    parser.add_argument("--limit", type=int, default=None, help="only the first N input rows")


def run(args: argparse.Namespace) -> int:
    """CLI entry: regenerate."""
    if args.batch_size < 1 or args.max_new_tokens < 1:
        raise DFlashError("--batch-size and --max-new-tokens must be >= 1")
    regenerate(args.target, args.data, args.out, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
               temperature=args.temperature, top_p=args.top_p, seed=args.seed, limit=args.limit)
    return 0
