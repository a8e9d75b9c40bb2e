"""`dflash-ds regenerate --server URL | --engine vllm`: the target's answers from a serving engine.

The same rows as HF regenerate (`regenerate.py`: the multi-turn rule, ids, resume, torchrun shards),
generated through an OpenAI-compatible chat-completions endpoint with `--concurrency` conversations
in flight; each conversation's turns go in order, each given the regenerated history. Per row, beside
the messages: `finish_reasons` and `token_ids` (the ids the target generated for each assistant turn,
without the stop token that ended it; vLLM returns them with `return_token_ids`), and the reasoning
part of an answer as the message's `reasoning_content` where the server splits it off (a reasoning
parser). Sampled requests carry `seed + row index`, so a row's answer does not depend on what else
is in flight.

Failures: a request is retried with backoff (`--retries`) while the failure may pass (connection,
timeout, 5xx); a row that still fails is reported with its file:line and not written. After a
failure, if the server no longer answers /health, no new row is started. Finished rows are always
kept (appended and flushed as they finish; the file is put back in input order at the end), so the
same command run again completes the rest; the exit status is non-zero while rows are missing.
"""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

from dflash_ds.data import formats
from dflash_ds.data.chat import check_special_tokens, load_tokenizer, special_token_pattern
from dflash_ds.data.regenerate import _advance, _barrier, iter_rows, merge_shards, read_done, shard_files
from dflash_ds.errors import DFlashError
from dflash_ds.serving.client import OpenAIClient, ServerError


def stop_token_ids(target: str | Path) -> set[int]:
    """The ids that end an answer: the tokenizer's eos and every eos the generation config lists."""
    tok = load_tokenizer(str(target))
    ids = {tok.eos_token_id}
    gen = Path(target) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids |= set([eos] if isinstance(eos, int) else eos or [])
    return ids - {None}


def answer_conversation(client: OpenAIClient, src: list[dict], *, stop_ids: set[int], max_tokens: int,
                        temperature: float, top_p: float, seed: int | None) -> dict:
    """Regenerate every assistant turn of one conversation, in order: the row's messages, finishes and ids."""
    out: list[dict] = []
    finishes: list[str] = []
    token_ids: list[list[int]] | None = []
    pos = 0
    while True:
        pos, due = _advance(src, out, pos)
        if not due:
            row = {"messages": out, "finish_reasons": finishes}
            if token_ids is not None:
                row["token_ids"] = token_ids
            return row
        answer = client.chat(out, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed)
        message = {"role": "assistant", "content": answer.text}
        if answer.reasoning:
            message["reasoning_content"] = answer.reasoning
        out.append(message)
        finishes.append(answer.finish_reason)
        if answer.token_ids is None or token_ids is None:
            token_ids = None  # a server that does not return ids: the row's labels come from its text
        else:
            ids = list(answer.token_ids)
            if answer.finish_reason == "stop" and ids and ids[-1] in stop_ids:
                ids.pop()
            token_ids.append(ids)
        pos = min(pos + 1, len(src))


def regenerate_served(client: OpenAIClient, target: str | Path, data: str | Path, out: str | Path, *,
                      concurrency: int = 32, max_new_tokens: int = 256, temperature: float = 0.0,
                      top_p: float = 1.0, seed: int = 0, limit: int | None = None, rank: int | None = None,
                      world: int | None = None) -> dict[str, int]:
    """Regenerate the assistant turns of `data` into `out` through `client` (resumable; sharded under torchrun)."""
    from tqdm import tqdm

    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world = int(os.environ.get("WORLD_SIZE", 1)) if world is None else world
    formats.file_kind(data)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    shard = out if world == 1 else out.with_name(f"{out.name}.rank{rank}")
    done = set(read_done(out, repair=rank == 0))
    for path in shard_files(out):
        done |= set(read_done(path, repair=path == shard))
    if world > 1:
        _barrier()
    special_re = special_token_pattern(load_tokenizer(str(target)))
    stop_ids = stop_token_ids(target)
    client.model()  # fail now, with the server's address, if nothing answers there
    stats = {"rows": 0, "skipped_done": 0, "bad": 0, "written": 0, "failed": 0, "not_attempted": 0}
    counts = {"new_tokens": 0, "no_ids": 0}
    lock = threading.Lock()
    t0 = time.perf_counter()

    def work(index: int, messages: list[dict]) -> dict:
        return answer_conversation(client, messages, stop_ids=stop_ids, max_tokens=max_new_tokens,
                                   temperature=temperature, top_p=top_p, seed=seed + index if temperature > 0 else None)

    with open(shard, "a", encoding="utf-8") as sink, ThreadPoolExecutor(concurrency) as pool, \
            tqdm(desc=f"regenerate[rank {rank}]", unit="row", disable=None) as bar:
        def finish(future: Future, rid: str, line: int) -> bool:
            try:
                row = future.result()
            except ServerError as exc:
                stats["failed"] += 1
                print(f"regenerate: failed {data}:{line} (id {rid}): {exc}", flush=True)
                return False
            with lock:
                sink.write(json.dumps({"id": rid, **row, "source": f"{data}:{line}"}, ensure_ascii=False) + "\n")
                sink.flush()
            stats["written"] += 1
            counts["new_tokens"] += sum(len(t) for t in row.get("token_ids", []))
            counts["no_ids"] += "token_ids" not in row
            bar.update(1)
            return True

        in_flight: dict[Future, tuple[str, int]] = {}
        server_gone = False

        def drain(block_until: int) -> None:
            nonlocal server_gone
            while len(in_flight) > block_until:
                finished, _ = wait(in_flight, return_when=FIRST_COMPLETED)
                for future in finished:
                    if not finish(future, *in_flight.pop(future)) and not server_gone and not client.healthy():
                        server_gone = True
                        print(f"regenerate: {client.url} no longer answers /health: no new row is started",
                              flush=True)
            os.fsync(sink.fileno())

        seen: set[str] = set()
        for index, line, rid, messages in iter_rows(data, limit):
            duplicate = rid is not None and rid in seen  # tracked on every rank, as the HF path does
            if rid is not None:
                seen.add(rid)
            if index % world != rank:
                continue
            stats["rows"] += 1
            if duplicate:
                messages = formats.RowError(formats.DUPLICATE_ID, f"id {rid!r} seen before")
            elif not isinstance(messages, formats.RowError):
                try:
                    check_special_tokens(special_re, messages)
                except formats.RowError as err:
                    messages = err
            if isinstance(messages, formats.RowError):
                stats["bad"] += 1
                print(f"regenerate: skipped {data}:{line}: {messages.reason}: {messages.detail}")
                continue
            if rid in done:
                stats["skipped_done"] += 1
                continue
            if server_gone:
                stats["not_attempted"] += 1
                continue
            in_flight[pool.submit(work, index, messages)] = (rid, line)
            drain(concurrency - 1)
        drain(0)
    elapsed = time.perf_counter() - t0
    print(f"regenerate[rank {rank}]: {stats['rows']} rows, {stats['written']} written, {stats['skipped_done']} "
          f"already done, {stats['bad']} bad, {stats['failed']} failed, {stats['not_attempted']} not attempted; "
          f"{counts['new_tokens']:,} new tokens ({counts['new_tokens'] / max(elapsed, 1e-9):,.0f} tokens/s) "
          f"via {client.url} -> {shard}", flush=True)
    if counts["no_ids"]:
        print(f"regenerate: {client.url} returned no token ids for {counts['no_ids']} rows: prepare labels them "
              f"from their re-tokenized text (vLLM returns ids with return_token_ids)")
    if world > 1:
        _barrier()
    if rank == 0:
        stats["merged"] = merge_shards(data, out, limit)  # also puts OUT back in input order
    missing = stats["failed"] + stats["not_attempted"]
    if missing:
        raise DFlashError(f"{missing} rows not generated ({stats['failed']} failed, {stats['not_attempted']} not "
                          f"attempted); the {stats['written']} finished rows are kept in {out}: run the same command "
                          f"again to complete the rest")
    return stats
