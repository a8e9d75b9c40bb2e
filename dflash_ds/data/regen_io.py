"""The rows of `regenerate`, whichever engine generates them: reading the input, resuming, shards, merging.

Rows are JSONL, one per conversation, keyed by id (the row's `id`, else a hash of file:line).
`read_done` finds the rows an earlier run finished (cutting off a torn last line), `merge_shards`
puts OUT and the per-rank OUT.rank{r} files together in input order, and `next_turn` walks a
conversation's turns the way every engine regenerates them (data/regenerate.py's multi-turn rule).
"""

from __future__ import annotations

import glob
import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator

from dflash_ds.data import formats
from dflash_ds.data.chat import check_special_tokens
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


def next_turn(src: list[dict[str, str]], out: list[dict[str, str]], pos: int) -> tuple[int, bool]:
    """Copy system/user turns of `src` from `pos` into `out` up to the next assistant turn: (new pos, answer due)."""
    while True:
        while pos < len(src) and src[pos]["role"] != "assistant":
            out.append(dict(src[pos]))
            pos += 1
        if pos == len(src):
            return pos, bool(out) and out[-1]["role"] == "user"
        if any(m["role"] == "user" for m in out):
            return pos, True
        pos += 1  # an assistant turn before any user turn answers nothing: drop it


def shard_files(out: Path) -> list[Path]:
    """Existing per-rank outputs OUT.rank{r}, in rank order."""
    shards = [p for p in out.parent.glob(f"{glob.escape(out.name)}.rank*") if p.name[len(out.name) + 5:].isdigit()]
    return sorted(shards, key=lambda p: int(p.name[len(out.name) + 5:]))


def barrier() -> None:
    """A gloo barrier over the torchrun job (initialised here if needed), with a 7-day timeout."""
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


def open_outputs(out: str | Path, rank: int, world: int) -> tuple[Path, Path, set[str]]:
    """OUT, this rank's file (OUT, or OUT.rank{r} under torchrun) and the ids an earlier run finished.

    Rows in OUT and in any shard left by an earlier (killed, maybe other-sized) torchrun job count as done.
    Each file is repaired only by its owner (OUT by rank 0); the barrier keeps everyone from appending
    before all ranks have read the old outputs.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    shard = out if world == 1 else out.with_name(f"{out.name}.rank{rank}")
    done = set(read_done(out, repair=rank == 0))
    for path in shard_files(out):
        done |= set(read_done(path, repair=path == shard))
    if world > 1:
        barrier()
    return out, shard, done


def rows_to_generate(data: str | Path, limit: int | None, rank: int, world: int, specials, done: set[str],
                     stats: dict[str, int]) -> Iterator[tuple[int, int, str, list[dict]]]:
    """This rank's rows still to generate: `(index, line, id, messages)`; counts rows, bad and done ones in `stats`.

    A bad row (unparsable, a duplicate id, a literal special token in its text) is printed with its file:line
    and skipped; every rank tracks all ids, so a duplicate is reported the same way at any world size.
    """
    seen: set[str] = set()
    for index, line, rid, messages in iter_rows(data, limit):
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
                check_special_tokens(specials, messages)
            except formats.RowError as err:
                messages = err
        if isinstance(messages, formats.RowError):
            stats["bad"] += 1
            print(f"regenerate: skipped {data}:{line}: {messages.reason}: {messages.detail}")
            continue
        if rid in done:
            stats["skipped_done"] += 1
            continue
        yield index, line, rid, messages


def count_to_generate(data: str | Path, limit: int | None, rank: int, world: int, done: set[str]) -> int:
    """This rank's parsable rows not yet done: the progress bar's total (duplicates and rows with a literal special
    token are counted too, so it is an upper bound; the bar is corrected when the run ends)."""
    return sum(1 for index, _, rid, messages in iter_rows(data, limit)
               if index % world == rank and not isinstance(messages, formats.RowError) and rid not in done)


class _LineWriter:
    """A stream tqdm writes to that turns each redraw into a line of its own: in a log file (stderr not a
    terminal) `\r`-overwritten redraws would pile up into one endless line."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        """Write one redraw as one line."""
        text = text.replace("\r", "").rstrip("\n")
        if text.strip():
            self.stream.write(text + "\n")

    def flush(self) -> None:
        """Flush the underlying stream."""
        self.stream.flush()


def progress_bar(total: int, rank: int) -> Any:
    """A tqdm bar on stderr: rows done of `total`, rows/s, elapsed and ETA. On a terminal it redraws every
    second; elsewhere (a log) it writes a line every 30 s, and always one at the start and one at the end.
    With nothing to do (`total` 0: every row already done) it writes nothing: the closing summary says so."""
    from tqdm import tqdm

    tty = sys.stderr.isatty()
    return tqdm(total=total, disable=total == 0, desc=f"regenerate[rank {rank}]", unit=" rows", file=sys.stderr if tty else
                _LineWriter(sys.stderr), mininterval=1.0 if tty else 30.0, dynamic_ncols=tty, ascii=not tty,
                # miniters=1: redraw on time alone (tqdm's adaptive miniters lets its monitor thread write a
                # stale extra line 10 s after a batch)
                miniters=1,
                bar_format="{desc}: {n_fmt}/{total_fmt} rows {percentage:3.0f}%|{bar:20}| "
                           "[{elapsed} elapsed, ETA {remaining}, {rate_noinv_fmt}{postfix}]")


def end_bar_at_done(bar: Any) -> None:
    """Make what was done the bar's total (the count was an upper bound), so its closing line reads n/n."""
    bar.total = bar.n
