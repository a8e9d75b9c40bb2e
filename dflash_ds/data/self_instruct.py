"""`dflash-ds self-instruct`: the target writes training prompts itself, from seed task types.

Why: `make-prompts` crosses a few templates with topics (577 training prompts); a drafter that learns the target
needs tens of thousands of distinct requests. Here the target continues a numbered list of requests "people sent
to an AI assistant" (a completion, no chat template: SmolLM2-135M-Instruct asked in chat to *write* a request
answers one instead; continuing a list it writes a new one of the same type). Each request shows four examples of
one task type (the type the new prompt is filed under): two from `make-prompts`' training split and, once there
are some, two the target wrote in earlier rounds, so the set drifts from the templates (self-instruct). The
generator never sees a held-out topic of the grid.

Filters (counted in data_stats.json): one line of 4-60 words ending a sentence; no list numbering; not a near
duplicate (word 3-gram Jaccard >= --dedupe, data/dedupe.py) of a seed or of a kept prompt; no held-out grid topic
named in it. Held out by topic words (dedupe.split_by_topic_words): no training prompt contains a held-out
prompt's topic word.

Resumable: every raw completion is appended to OUT/generated.jsonl as it finishes, keyed by request index;
request i's examples depend only on the seed and earlier rounds' kept prompts, and the log is judged in index
order, so the same command run again re-asks only what is missing and keeps what the log holds.

Output (OUT/): train.jsonl (the grid's training prompts and the kept generated ones, shuffled), held_out.jsonl
(generated, held out by topic word), held_out_grid.jsonl (make-prompts' held-out split: a second held-out set
not written by this generator), data_stats.json, generated.jsonl (the raw log).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import random
import re
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from dflash_ds.data.dedupe import NearDuplicates, split_by_topic_words, words
from dflash_ds.data.prompt_grid import natural_prompts, split_prompts, write_jsonl
from dflash_ds.errors import DFlashError

HEADER = "Requests that people sent to an AI assistant:\n"
SHOTS = 4
NUMBERED = re.compile(r"^\s*(\d+[.)]|[-*•])\s*")


def clean(text: str) -> tuple[str | None, str]:
    """(the prompt, "") or (None, why it was rejected) for one raw completion (its first line)."""
    line = text.strip().split("\n")[0].strip()
    if NUMBERED.match(line):
        return None, "numbered"
    n = len(words(line))
    if n < 4:
        return None, "short"
    if n > 60:
        return None, "long"
    if line[-1] not in ".?!\"')":
        return None, "unfinished"
    return line, ""


def request_ids(tok, examples: list[str]) -> list[int]:
    """The numbered list with the next number open, as token ids."""
    text = HEADER + "".join(f"{j + 1}. {e}\n" for j, e in enumerate(examples)) + f"{len(examples) + 1}."
    return tok(text, add_special_tokens=False)["input_ids"]


def examples_for(index: int, seed: int, kind: str, seeds: list[str], written: list[str]) -> list[str]:
    """Request `index`'s examples: two seeds and two earlier generated prompts of `kind` (all seeds before any)."""
    rng = random.Random(f"self-instruct-{seed}-{index}")
    from_written = min(SHOTS // 2, len(written))
    shots = rng.sample(seeds, min(SHOTS - from_written, len(seeds))) + rng.sample(written, from_written)
    rng.shuffle(shots)
    return shots


class Generator:
    """Rounds of requests through one server, the raw log on disk, the kept prompts in memory."""

    def __init__(self, client, tok, out: Path, *, seed: int, temperature: float, top_p: float, max_tokens: int,
                 concurrency: int, dedupe: float, banned_topics: list[str]) -> None:
        self.client, self.tok, self.out, self.seed = client, tok, out, seed
        self.sampling = {"temperature": temperature, "top_p": top_p, "max_tokens": max_tokens}
        self.concurrency = concurrency
        train, held = split_prompts(natural_prompts(seed), seed)
        self.grid_train, self.grid_held = train, held
        self.seeds: dict[str, list[str]] = {}
        for row in train:
            self.seeds.setdefault(row["kind"], []).append(row["messages"][0]["content"])
        self.kinds = sorted(self.seeds)
        self.dups = NearDuplicates(dedupe)
        for row in train + held:  # a copy of a grid prompt, training or held out, is not a new prompt
            self.dups.add(row["messages"][0]["content"])
        self.banned = re.compile(r"\b(" + "|".join(re.escape(t.lower()) for t in banned_topics) + r")\b")
        self.kept: list[dict] = []
        self.written: dict[str, list[str]] = {k: [] for k in self.kinds}
        self.rejected: Counter[str] = Counter()
        self.raw: dict[int, dict] = {}
        self.log = out / "generated.jsonl"
        if self.log.is_file():
            for line in self.log.read_text(encoding="utf-8").splitlines():
                with contextlib.suppress(ValueError, KeyError):
                    rec = json.loads(line)
                    self.raw[int(rec["i"])] = rec
        self.lock = threading.Lock()
        self.new_tokens = 0

    def kind_of(self, index: int) -> str:
        return self.kinds[index % len(self.kinds)]

    def ask(self, index: int) -> dict:
        kind = self.kind_of(index)
        shots = examples_for(index, self.seed, kind, self.seeds[kind], self.written[kind])
        # No per-request seed: vLLM 0.32's CPU build fails a seeded request whose prefill is split over steps
        # ("CPU Generator does not use offset", the engine dies); sampling follows the server's --seed, and a
        # rerun reuses the raw log rather than re-drawing.
        answer = self.client.complete_ids(request_ids(self.tok, shots), stop=["\n"], **self.sampling)
        return {"i": index, "kind": kind, "text": answer.text, "tokens": len(answer.token_ids or [])}

    def run_round(self, first: int, count: int, sink) -> None:
        missing = [i for i in range(first, first + count) if i not in self.raw]
        with ThreadPoolExecutor(self.concurrency) as pool:
            for future in as_completed([pool.submit(self.ask, i) for i in missing]):
                rec = future.result()
                with self.lock:
                    self.raw[rec["i"]] = rec
                    self.new_tokens += rec["tokens"]
                    sink.write(json.dumps(rec, ensure_ascii=False) + "\n")
                    sink.flush()
        for i in range(first, first + count):  # in index order: the kept set does not depend on finishing order
            self.judge(self.raw[i])

    def judge(self, rec: dict) -> None:
        text, why = clean(rec["text"])
        if text is not None and self.banned.search(text.lower()):
            text, why = None, "held-out grid topic"
        if text is not None and not self.dups.add(text):
            text, why = None, "near duplicate"
        if text is None:
            self.rejected[why] += 1
            return
        self.written[rec["kind"]].append(text)
        rid = f"si-{rec['kind']}-{hashlib.sha1(text.encode()).hexdigest()[:12]}"
        self.kept.append({"id": rid, "kind": rec["kind"], "source": "self-instruct",
                          "messages": [{"role": "user", "content": text}]})

    def generate(self, target: int, max_requests: int, round_size: int) -> int:
        """Rounds until `target` prompts are kept or `max_requests` asked; the number of requests asked."""
        t0, asked, last = time.perf_counter(), 0, 0.0
        with open(self.log, "a", encoding="utf-8") as sink:
            while len(self.kept) < target and asked < max_requests:
                # a round asks for what is missing, with a margin for the filters (~10% rejected)
                count = min(round_size, max_requests - asked, max(self.concurrency, 2 * (target - len(self.kept))))
                self.run_round(asked, count, sink)
                asked += count
                elapsed = time.perf_counter() - t0
                if elapsed - last > 10 or len(self.kept) >= target:
                    last = elapsed
                    print(f"self-instruct: {len(self.kept):,}/{target:,} kept of {asked:,} asked "
                          f"({sum(self.rejected.values()):,} rejected); {self.new_tokens / max(elapsed, 1e-9):,.0f} "
                          f"new tokens/s, {elapsed:,.0f} s", flush=True)
        return asked


def summarize(rows: list[dict]) -> dict:
    """Counts by task type and the word-length quantiles of a prompt set."""
    lengths = sorted(len(words(r["messages"][0]["content"])) for r in rows) or [0]
    q = lambda p: lengths[min(len(lengths) - 1, int(p * len(lengths)))]  # noqa: E731
    return {"prompts": len(rows), "by_kind": dict(sorted(Counter(r["kind"] for r in rows).items())),
            "words_p10_p50_p90": [q(0.1), q(0.5), q(0.9)]}


def finish(gen: Generator, out: Path, held_out: int, seed: int, asked: int, grid_train: int | None = None) -> dict:
    """Split the kept prompts by topic word, write the sets and data_stats.json; the stats. `grid_train`: how many
    of the grid's training prompts join train.jsonl (its first ones: the split deals task types round-robin);
    None: all."""
    texts = [r["messages"][0]["content"] for r in gen.kept]
    train_i, held_i, held_words = split_by_topic_words(texts, held_out, seed)
    if not held_i:
        raise DFlashError(f"{out}: none of the {len(texts):,} kept prompts has a topic word to hold out (a word in 2 "
                          f"to 40 prompts, not a template word): raise --prompts")
    held = [dict(gen.kept[i], topic=next(w for w in held_words if w in set(words(texts[i])))) for i in held_i]
    train = gen.grid_train[:grid_train] + [gen.kept[i] for i in train_i]
    train = random.Random(f"self-instruct-shuffle-{seed}").sample(train, len(train))
    write_jsonl(train, out / "train.jsonl")
    write_jsonl(held, out / "held_out.jsonl")
    write_jsonl(gen.grid_held, out / "held_out_grid.jsonl")
    stats = {"requests": asked, "kept": len(gen.kept), "rejected": dict(gen.rejected),
             "dropped_by_topic_split": len(gen.kept) - len(train_i) - len(held_i), "held_out_topic_words": held_words,
             "train": summarize(train), "held_out": summarize(held), "held_out_grid": summarize(gen.grid_held),
             "generated_train": summarize([gen.kept[i] for i in train_i])}
    tmp = out / ".data_stats.json.tmp"
    tmp.write_text(json.dumps(stats, indent=1) + "\n")
    tmp.replace(out / "data_stats.json")
    return stats


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the self-instruct flags."""
    parser.add_argument("--target", required=True, help="target model folder (HF format): its tokenizer lays out the "
                        "requests; the server (--server or --engine vllm) runs it")
    parser.add_argument("--out", required=True, help="output folder: train.jsonl, held_out.jsonl, held_out_grid.jsonl, "
                        "data_stats.json and generated.jsonl (the raw log a rerun resumes from)")
    parser.add_argument("--prompts", type=int, default=2000, help="generated prompts to keep, after the filters and "
                        "before the held-out split (default 2000)")
    parser.add_argument("--held-out", type=int, default=64, help="generated prompts held out by topic word (default 64)")
    parser.add_argument("--grid-train", type=int, default=None, metavar="N", help="how many of make-prompts' "
                        "training prompts (the template grid, 577 at seed 0) join train.jsonl beside the generated "
                        "ones, its first N (task types dealt round-robin); 0: the generated prompts only (default: all)")
    parser.add_argument("--max-requests", type=int, default=None, help="stop asking after this many requests even if "
                        "fewer prompts were kept (default 4 x --prompts)")
    parser.add_argument("--round-size", type=int, default=256, help="requests per round: later rounds draw examples "
                        "from earlier rounds' prompts (default 256)")
    parser.add_argument("--dedupe", type=float, default=0.5, help="word 3-gram Jaccard overlap at which a prompt is a "
                        "near duplicate of a kept one (default 0.5)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the grid, the examples, sampling and the split")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the requests (default 1.0)")
    parser.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling threshold (default 0.95)")
    parser.add_argument("--max-tokens", type=int, default=80, help="token limit of one generated request (default 80)")
    served = parser.add_argument_group("the server that runs the target")
    served.add_argument("--server", default=None, metavar="URL", help="an OpenAI-compatible server already running "
                        "the target with token-id completions (vLLM, SGLang)")
    served.add_argument("--engine", choices=["vllm"], default="vllm", help="vllm: start a local vLLM server for "
                        "--target (default, when --server is not given)")
    served.add_argument("--concurrency", type=int, default=64, help="requests in flight (default 64)")
    from dflash_ds.serving.vllm_server import add_server_arguments

    add_server_arguments(served)


def run(args: argparse.Namespace) -> int:
    """CLI entry: generate, filter, split, write; print what the data holds."""
    if args.prompts < 1 or args.held_out < 1 or args.concurrency < 1 or args.round_size < 1:
        raise DFlashError("--prompts, --held-out, --concurrency and --round-size must be >= 1")
    if args.grid_train is not None and args.grid_train < 0:
        raise DFlashError(f"--grid-train {args.grid_train}: must be >= 0 (0: no grid prompt in train.jsonl)")
    from dflash_ds.data.chat import load_tokenizer
    from dflash_ds.serving.client import OpenAIClient
    from dflash_ds.serving.vllm_server import VLLMServer, generation_threads

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    grid_held = split_prompts(natural_prompts(args.seed), args.seed)[1]
    banned = sorted({t for r in grid_held for t in r["topic"].split(" / ") if not t.startswith("math-")})
    with contextlib.ExitStack() as stack:
        url = args.server
        if url is None:
            server = stack.enter_context(VLLMServer(
                args.target, python=args.vllm_python, dtype=args.vllm_dtype, max_model_len=args.vllm_max_model_len,
                memory_fraction=args.vllm_memory_fraction, seed=args.seed, log_path=args.vllm_log or out / "vllm.log",
                startup_timeout_s=args.vllm_startup_timeout, extra_args=args.vllm_arg,
                threads=generation_threads(args.vllm_threads)))
            url = server.url
        gen = Generator(OpenAIClient(url), load_tokenizer(str(args.target)), out, seed=args.seed,
                        temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                        concurrency=args.concurrency, dedupe=args.dedupe, banned_topics=banned)
        asked = gen.generate(args.prompts, args.max_requests or 4 * args.prompts, args.round_size)
    stats = finish(gen, out, args.held_out, args.seed, asked, args.grid_train)
    if stats["kept"] < args.prompts:
        print(f"self-instruct: only {stats['kept']:,} of {args.prompts:,} prompts kept after {asked:,} requests "
              f"(--max-requests): the sets are written with what was kept")
    for name in ("train", "held_out", "held_out_grid"):
        s = stats[name]
        kinds = ", ".join(f"{k} {n}" for k, n in s["by_kind"].items())
        print(f"{out / (name + '.jsonl')}: {s['prompts']:,} prompts ({kinds}); words p10/p50/p90 "
              f"{'/'.join(map(str, s['words_p10_p50_p90']))}")
    print(f"self-instruct: {asked:,} requests, {stats['kept']:,} kept, rejected {stats['rejected']}, "
          f"{stats['dropped_by_topic_split']:,} dropped by the topic split -> {out / 'data_stats.json'}")
    return 0
