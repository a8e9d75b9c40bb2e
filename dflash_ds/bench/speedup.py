"""`dflash-ds bench speedup`: how much faster the target decodes with the drafter, measured in wall-clock time.

    dflash-ds bench speedup --target TARGET --drafter EXPORT --data held_out.jsonl --out bench_out/speedup

The same held-out prompts are decoded plain and speculatively, greedy, by each engine:
- `vllm`: the real product path, two `vllm serve` processes of the target side by side, one with the export as
  its drafter (speedup_runs.py), at each --concurrency, and one more speculative server for each further
  --draft-tokens value (vLLM's num_speculative_tokens: on a CPU the verify's cost grows with the drafted tokens,
  so fewer than the block's can pay more); vLLM's CPU build serves DFlash layouts only (a kind whose
  spec says `vllm_v2_only` needs its GPU runner: `--engine auto` then times ours alone);
- `dflash`: dflash-ds's own decoder (eval/speculative.py) at batch 1, which also times the draft and the verify
  forward on their own.
Plain and speculative rounds alternate (order flipped each repeat), warm-up rounds are excluded from the figures,
and each figure is given over the repeats (mean, min-max). Every speculative output must equal the plain output of
the same engine, dtype and concurrency token for token: one differing token fails the bench (exit 2) once its
table and JSON are written. speedup_stats.py has the arithmetic: the measured speedup beside the one tau predicts
from the measured step costs (tau over the step ratio), so a gap between them is explained.

Writes OUT/speedup.json (settings, rows, every round's figures), OUT/speedup.txt (the table), OUT/speedup.png
(tokens/s and speedup by concurrency) and the servers' logs in OUT/vllm/ (vLLM's own "SpecDecoding metrics"
lines are there).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from dflash_ds.errors import DFlashError

ENGINES = ("vllm", "dflash")


def parse_concurrency(text: str) -> list[int]:
    """'1,4,16' -> [1, 4, 16], each >= 1."""
    try:
        values = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise DFlashError(f"--concurrency {text!r}: expected comma-separated integers, e.g. 1,4,16") from None
    if not values or any(c < 1 for c in values):
        raise DFlashError(f"--concurrency {text!r}: every value must be >= 1")
    return sorted(set(values))


def parse_draft_tokens(text: str | None, drafter: str | Path, extra_args: list[str]) -> list[int] | None:
    """'3,7' -> [3, 7]: each a draft length the export can serve (1 .. block - 1); None: the export's own."""
    from dflash_ds.serving.vllm_server import merge_speculative_args, speculative_config

    if not text:
        return None
    try:
        values = sorted({int(k) for k in text.split(",") if k.strip()})
    except ValueError:
        raise DFlashError(f"--draft-tokens {text!r}: expected comma-separated integers, e.g. 3,7") from None
    if not values:
        raise DFlashError(f"--draft-tokens {text!r}: expected comma-separated integers, e.g. 3,7")
    for k in values:
        speculative_config(drafter, k)  # the export's bound, named
    if "num_speculative_tokens" in merge_speculative_args({"model": str(drafter)}, extra_args)[0]:
        raise DFlashError("--draft-tokens and a --vllm-arg --speculative-config with num_speculative_tokens both "
                          "set the draft length: give one")
    return values


GPU_SHARE = 0.9  # of a GPU's memory, split between the bench's servers when --vllm-memory-fraction is not given


def server_memory_fraction(given: float | None, servers: int, cpu: bool) -> float | None:
    """Each server's --gpu-memory-utilization: as given; else on a GPU 0.9 split between the `servers` up at once
    (each claims its fraction of the whole card, so two at vLLM's own 0.92 cannot both start). A Qwen3-8B target
    (16 GB in bf16) on 80 GB: plain + 2 speculative servers get 24 GB each, ~7 GB of it KV cache; 4 servers leave
    ~2 GB each, 5 none. None on a CPU: VLLMServer's own share of RAM."""
    if given is not None or cpu:
        return given
    return round(GPU_SHARE / servers, 3)


def choose_engines(text: str, drafter: str | Path) -> list[str]:
    """The engines to time: as named, or `auto`: vLLM where it serves this drafter here, and ours always."""
    from dflash_ds.eval.served import serving_env

    if text != "auto":
        engines = [e.strip() for e in text.split(",") if e.strip()]
        bad = [e for e in engines if e not in ENGINES]
        if bad or not engines:
            raise DFlashError(f"--engine {text!r}: expected auto or a comma-separated subset of {', '.join(ENGINES)}")
        if "vllm" in engines:
            serving_env(drafter)  # what vLLM cannot serve here fails before any model loads
        return engines
    try:
        serving_env(drafter)
    except DFlashError as exc:
        print(f"bench speedup: --engine auto: dflash only ({exc})", flush=True)
        return ["dflash"]
    return ["vllm", "dflash"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the flags of bench speedup."""
    parser.add_argument("--target", required=True, help="local HF folder of the target model")
    parser.add_argument("--drafter", required=True, help="drafter export folder (config.json + model.safetensors)")
    parser.add_argument("--data", required=True, help="held-out prompts: a .jsonl/.json conversation file (prompt = "
                        "up to the last user turn) or a prepared dataset folder (tokens before the first loss token)")
    parser.add_argument("--num-prompts", type=int, default=16, help="prompts per round (default 16)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt (default 128)")
    parser.add_argument("--engine", default="auto", help="auto (default: vllm and dflash where vLLM serves the "
                        "drafter here, else dflash), or a comma-separated subset of vllm, dflash")
    parser.add_argument("--concurrency", default="1,4,16", help="vLLM: requests in flight, comma-separated "
                        "(default 1,4,16); our decoder runs at 1")
    parser.add_argument("--draft-tokens", default=None, metavar="K[,K...]", help="vLLM: draft tokens a speculative "
                        "step (its num_speculative_tokens), comma-separated, one speculative server each beside the "
                        "one plain server (default: the export's block - 1). A CPU's verify costs more with each "
                        "token drafted (docs/QUALITY.md: SmolLM2 on 2 cores, a step 1.97 plain steps at 7, 1.59 at "
                        "3), so fewer can pay more; on a GPU the block's is the usual choice. Our decoder drafts the "
                        "block's")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds of each decoder per concurrency, "
                        "plain and speculative interleaved (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds of each before them (default 1)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                        help="weights dtype of both decoders, plain and speculative alike (default float32)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads of our decoder (default: torch's)")
    parser.add_argument("--device", default=None, help="torch device of our decoder (default: cuda if available)")
    parser.add_argument("--out", default="bench_out/speedup", help="folder of speedup.json, speedup.txt, "
                        "speedup.png and the servers' logs (vllm/) (default bench_out/speedup)")
    from dflash_ds.serving.vllm_server import add_server_arguments

    add_server_arguments(parser, for_eval=True)
    # The shared flag's help describes eval's folders; the bench keeps its logs in its own output folder.
    parser._option_string_actions["--vllm-log"].help = "folder for the two servers' logs (default OUT/vllm)"
    parser._option_string_actions["--vllm-memory-fraction"].help = (
        "each server's --gpu-memory-utilization (default: on a GPU 0.9 split between the servers up at once, plain "
        "and one per --draft-tokens value; on a CPU 0.1 of RAM each, reserved as KV cache)")


def _own(args: argparse.Namespace, prompts: list[list[int]]) -> list:
    import torch

    from dflash_ds.bench.speedup_runs import own_rounds
    from dflash_ds.models.drafter import DFlashDrafter
    from dflash_ds.models.target import load_target

    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    target = load_target(args.target, dtype=dtype, device=device)
    drafter = DFlashDrafter.from_pretrained(args.drafter, device=device).to(dtype).eval()
    return own_rounds(target, drafter, prompts, max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                      warmup=args.warmup, log=lambda s: print(s, flush=True))


def run(args: argparse.Namespace) -> int:
    """Time every engine, write the table, JSON and plot; exit 2 if any speculative output differs from plain."""
    from dflash_ds.bench.speedup_stats import format_table, mismatches, plot, summarize
    from dflash_ds.eval.cli import load_prompts
    from dflash_ds.eval.speculative import check_drafter_matches_target
    from dflash_ds.models.drafter import read_drafter_arch
    from dflash_ds.models.target import read_target_config

    if args.num_prompts < 1 or args.max_new_tokens < 1 or args.repeats < 1 or args.warmup < 0:
        raise DFlashError("--num-prompts, --max-new-tokens and --repeats must be >= 1, --warmup >= 0")
    concurrencies = parse_concurrency(args.concurrency)
    engines = choose_engines(args.engine, args.drafter)
    check_drafter_matches_target(read_drafter_arch(args.drafter), read_target_config(args.target),
                                 args.drafter, args.target)
    draft_tokens = parse_draft_tokens(args.draft_tokens, args.drafter, args.vllm_arg or []) if "vllm" in engines \
        else None
    prompts = load_prompts(args.data, args.target, args.num_prompts)
    if "vllm" in engines and max(concurrencies) > len(prompts):
        raise DFlashError(f"--concurrency {max(concurrencies)}: a round has {len(prompts)} prompts, so no more than "
                          f"{len(prompts)} requests are ever in flight; raise --num-prompts or lower --concurrency")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"bench speedup: {len(prompts)} prompts x {args.max_new_tokens} tokens, engines {', '.join(engines)}, "
          f"{args.warmup} warm-up + {args.repeats} timed rounds each", flush=True)
    rounds, spec_cfgs = [], []
    if "vllm" in engines:
        from dflash_ds.bench.speedup_runs import vllm_rounds
        from dflash_ds.eval.served import serving_env
        from dflash_ds.serving.vllm_server import on_cpu, thread_env

        servers = 1 + len(draft_tokens or [None])
        server = {"python": args.vllm_python, "dtype": args.vllm_dtype or args.dtype,
                  "memory_fraction": server_memory_fraction(args.vllm_memory_fraction, servers, on_cpu()),
                  "max_model_len": args.vllm_max_model_len,
                  "startup_timeout_s": args.vllm_startup_timeout, "extra_args": args.vllm_arg,
                  "env": {**serving_env(args.drafter), **thread_env(args.vllm_threads)}}
        vr, spec_cfgs = vllm_rounds(args.target, args.drafter, prompts, max_new_tokens=args.max_new_tokens,
                                    concurrencies=concurrencies, repeats=args.repeats, warmup=args.warmup,
                                    log_dir=Path(args.vllm_log) if args.vllm_log else out / "vllm", server=server,
                                    log=lambda s: print(s, flush=True), draft_tokens=draft_tokens)
        rounds += vr
    if "dflash" in engines:
        rounds += _own(args, prompts)
    rows, bad = summarize(rounds), mismatches(rounds)
    table = format_table(rows)
    print(table, flush=True)
    settings = {"target": str(args.target), "drafter": str(args.drafter), "data": str(args.data),
                "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "engines": engines,
                "concurrency": concurrencies, "repeats": args.repeats, "warmup": args.warmup, "dtype": args.dtype,
                "speculative_config": spec_cfgs[0] if spec_cfgs else None, "speculative_configs": spec_cfgs,
                "cpu_threads": os.cpu_count()}
    per_round = [{k: v for k, v in dataclasses.asdict(r).items() if k != "outputs"} for r in rounds]
    result = {"settings": settings, "rows": rows, "mismatches": bad, "rounds": per_round}
    (out / "speedup.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "speedup.txt").write_text(table + "\n")
    plot(rows, out / "speedup.png")
    print(f"bench speedup: table -> {out / 'speedup.txt'}, results -> {out / 'speedup.json'}, plot -> "
          f"{out / 'speedup.png'}", flush=True)
    if bad:
        m = bad[0]
        print(f"bench speedup: {len(bad)} output(s) differ from plain decoding", file=sys.stderr)
        k = "" if m["drafts"] is None else f", k {m['drafts']}"
        raise DFlashError(f"{m['engine']} at concurrency {m['concurrency']}, round {m['repeat']} ({m['mode']}{k}): "
                          f"prompt {m['prompt']} differs from plain decoding at generated token {m['token']} "
                          f"({m['got']} vs {m['plain']}): speculative decoding must not change an output")
    return 0
