"""`dflash-ds regenerate`: rewrite the assistant turns of conversations with the target's own answers.

Multi-turn rule: every assistant turn is regenerated in order, each given the *regenerated*
history (system and user turns are kept verbatim); a conversation that ends with a user turn
gets one generated answer appended. So the output is what the target itself would have said.

Output: JSONL rows `{"id", "messages", "finish_reasons", "token_ids", "source"}` (OpenAI form,
read by `prepare`): `finish_reasons[k]` is 'stop' or 'length' and `token_ids[k]` the ids the
target generated, without the stop token, for the k-th assistant message. `prepare` trains on
those ids, not on the text re-tokenized, and the prompt of a later turn is laid out from them the
same way (data/token_ids.py). The id is the row's `id` field, else a hash of `file:line`.
Resumable: ids already in the output are skipped; each batch is appended and flushed, so a kill
loses at most one batch, and a torn last line is cut off on the next start. Greedy outputs do not depend on
batching (up to float rounding); sampled outputs depend on the seed and the batch composition.

Under torchrun (RANK / WORLD_SIZE set), rank r takes input rows i with i % world == r and
writes OUT.rank{r}; after a gloo barrier (7-day timeout: ranks may finish far apart) rank 0
merges OUT and all shards into OUT in input order and removes the shards. Rows already in OUT
or in a rank's shard from an earlier run are skipped, so a killed torchrun job resumes too.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from dflash_ds.data import formats
from dflash_ds.data.chat import special_token_pattern
from dflash_ds.data.regen_io import (barrier, count_to_generate, end_bar_at_done, merge_shards, next_turn, open_outputs,
                                     progress_bar, rows_to_generate, shard_files)
from dflash_ds.data.token_ids import prompt_ids
from dflash_ds.errors import DFlashError


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
            self.model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype, use_kernels=False).to(self.device).eval()
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

    def prompt(self, history: list[dict[str, str]], token_ids: list[list[int]], finishes: list[str]) -> list[int]:
        """Prompt ids for the next answer: earlier answers as generated, the rest as the template renders it."""
        return prompt_ids(self.tok, self.special_re, history, token_ids, finishes)

    def answer(self, prompts: list[list[int]]) -> list[tuple[list[int], str]]:
        """One answer per prompt: `(ids without the stop token, finish_reason)`, reason 'stop' or 'length'."""
        enc = self.tok.pad({"input_ids": prompts}, return_tensors="pt").to(self.device)  # left padding
        with self.torch.no_grad():
            out = self.model.generate(**enc, **self.kwargs)
        results = []
        for row in out[:, enc["input_ids"].shape[1]:].tolist():
            eos_at = next((k for k, t in enumerate(row) if t in self.stop_ids), None)
            tokens = row[:eos_at] if eos_at is not None else row  # no stop token: it ran to max_new_tokens
            self.new_tokens += len(tokens)
            results.append((tokens, "stop" if eos_at is not None else "length"))
        return results


def regenerate_batch(gen: Generator, conversations: list[list[dict[str, str]]]) -> list[tuple[list, list, list]]:
    """Regenerate every assistant turn in order, batched across conversations; (messages, finishes, token_ids) each."""
    outs: list[list[dict[str, str]]] = [[] for _ in conversations]
    finishes: list[list[str]] = [[] for _ in conversations]
    token_ids: list[list[list[int]]] = [[] for _ in conversations]
    pos = [0] * len(conversations)
    while True:
        pending = []
        for j, src in enumerate(conversations):
            pos[j], due = next_turn(src, outs[j], pos[j])
            if due:
                pending.append(j)
        if not pending:
            return list(zip(outs, finishes, token_ids))
        prompts = [gen.prompt(outs[j], token_ids[j], finishes[j]) for j in pending]
        for j, (ids, finish) in zip(pending, gen.answer(prompts)):
            outs[j].append({"role": "assistant", "content": gen.tok.decode(ids, skip_special_tokens=True)})
            finishes[j].append(finish)
            token_ids[j].append(ids)
            pos[j] = min(pos[j] + 1, len(conversations[j]))


def regenerate(target: str | Path, data: str | Path, out: str | Path, batch_size: int = 8,
               max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
               limit: int | None = None, rank: int | None = None, world: int | None = None) -> dict[str, int]:
    """Regenerate the assistant turns of `data` into `out` (resumable; sharded under torchrun)."""
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world = int(os.environ.get("WORLD_SIZE", 1)) if world is None else world
    formats.file_kind(data)
    out, shard, done = open_outputs(out, rank, world)
    gen = Generator(target, max_new_tokens, temperature, top_p, seed + rank)
    stats = {"rows": 0, "skipped_done": 0, "bad": 0, "written": 0}
    t0 = time.perf_counter()

    with open(shard, "a", encoding="utf-8") as sink, \
            progress_bar(count_to_generate(data, limit, rank, world, done), rank) as bar:
        def flush(batch: list[tuple[str, int, list]]) -> None:
            answers = regenerate_batch(gen, [b[2] for b in batch])
            for (rid, line, _), (messages, finishes, token_ids) in zip(batch, answers):
                sink.write(json.dumps({"id": rid, "messages": messages, "finish_reasons": finishes,
                                       "token_ids": token_ids, "source": f"{data}:{line}"}, ensure_ascii=False) + "\n")
            sink.flush()
            os.fsync(sink.fileno())
            stats["written"] += len(batch)
            bar.set_postfix_str(f"{gen.new_tokens / max(time.perf_counter() - t0, 1e-9):,.0f} tok/s", refresh=False)
            bar.update(len(batch))

        batch: list[tuple[str, int, list]] = []
        for _, line, rid, messages in rows_to_generate(data, limit, rank, world, gen.special_re, done, stats):
            batch.append((rid, line, messages))
            if len(batch) == batch_size:
                flush(batch)
                batch = []
        if batch:
            flush(batch)
        end_bar_at_done(bar)
    elapsed = time.perf_counter() - t0
    print(f"regenerate[rank {rank}]: {stats['rows']} rows, {stats['written']} written, "
          f"{stats['skipped_done']} already done, {stats['bad']} bad; {gen.new_tokens:,} new tokens "
          f"({gen.new_tokens / max(elapsed, 1e-9):,.0f} tokens/s) -> {shard}")
    if world > 1:
        barrier()
    if rank == 0 and shard_files(out):
        stats["merged"] = merge_shards(data, out, limit)
    return stats


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the regenerate flags."""
    parser.add_argument("--target", required=True, help="target model folder (HF format)")
    parser.add_argument("--data", required=True, help="conversations (.jsonl/.json/.parquet, ShareGPT or OpenAI form)")
    parser.add_argument("--out", required=True, help="output JSONL (OpenAI form); existing rows are kept and skipped")
    parser.add_argument("--batch-size", type=int, default=8, help="conversations generated together (--engine hf)")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="token limit per generated answer")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (with --temperature > 0)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (rank r uses seed + r)")
    parser.add_argument("--limit", type=int, default=None, help="only the first N input rows")
    served = parser.add_argument_group("through a serving engine (regenerate_server.py)")
    served.add_argument("--server", default=None, metavar="URL", help="an OpenAI-compatible server already running "
                        "the target (vLLM, SGLang, `transformers serve`), e.g. http://127.0.0.1:8000; --target still "
                        "names the local folder whose tokenizer checks the prompts")
    served.add_argument("--engine", choices=["hf", "vllm"], default="hf", help="hf: transformers generate in this "
                        "process (default); vllm: start a local vLLM server for --target and generate through it")
    served.add_argument("--api", choices=["completions", "chat"], default="completions", help="completions: "
                        "prompts as token ids laid out here, as the HF path does (rows equal HF's; vLLM, SGLang); "
                        "chat: messages, the server applies the template (for servers without token-id prompts)")
    served.add_argument("--concurrency", type=int, default=32, help="conversations in flight on the server (default 32)")
    served.add_argument("--retries", type=int, default=4, help="retries of a request that failed for a reason that "
                        "may pass (connection, timeout, 5xx), with backoff from 1 s doubling (default 4)")
    served.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take (default 600)")
    served.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token for --server "
                        "(default: $OPENAI_API_KEY)")
    from dflash_ds.serving.vllm_server import add_server_arguments

    add_server_arguments(served)


def _rank_device_env() -> dict[str, str]:
    # Under torchrun with --engine vllm every rank starts a server of its own: on its own GPU.
    local = os.environ.get("LOCAL_RANK")
    return {"CUDA_VISIBLE_DEVICES": local} if local is not None and int(os.environ.get("WORLD_SIZE", 1)) > 1 else {}


def run(args: argparse.Namespace) -> int:
    """CLI entry: regenerate (HF generate here, or through --server / --engine vllm)."""
    if args.batch_size < 1 or args.max_new_tokens < 1 or args.concurrency < 1:
        raise DFlashError("--batch-size, --max-new-tokens and --concurrency must be >= 1")
    if args.server is None and args.engine == "hf":
        regenerate(args.target, args.data, args.out, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                   temperature=args.temperature, top_p=args.top_p, seed=args.seed, limit=args.limit)
        return 0
    if args.server and args.engine == "vllm":
        raise DFlashError("--server and --engine vllm both name a server: give one")
    import contextlib

    from dflash_ds.data.regenerate_server import regenerate_served
    from dflash_ds.serving.client import OpenAIClient
    from dflash_ds.serving.vllm_server import VLLMServer, generation_threads

    with contextlib.ExitStack() as stack:
        url = args.server
        if url is None:
            log = args.vllm_log or f"{args.out}.vllm.log"
            server = stack.enter_context(VLLMServer(
                args.target, python=args.vllm_python, dtype=args.vllm_dtype, max_model_len=args.vllm_max_model_len,
                memory_fraction=args.vllm_memory_fraction, seed=args.seed, log_path=log,
                startup_timeout_s=args.vllm_startup_timeout, extra_args=args.vllm_arg, env=_rank_device_env(),
                threads=generation_threads(args.vllm_threads)))
            url = server.url
        client = OpenAIClient(url, timeout_s=args.request_timeout, retries=args.retries, api_key=args.api_key)
        regenerate_served(client, args.target, args.data, args.out, api=args.api, concurrency=args.concurrency,
                          max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                          seed=args.seed, limit=args.limit)
    return 0
