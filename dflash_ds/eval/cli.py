"""`dflash-ds eval`: acceptance length of a drafter by real speculative decoding against its target.

Per prompt: plain greedy decoding (the lossless reference, at temperature 0), the single-path
speculative run, and one tree run per `--tree-budget`. The tables report tau (tokens per decode
step, bonus included; the mean over prompts of each prompt's mean, as the reference benchmark counts
it), tau_pooled (the mean over all steps together), the accepted-length histogram, P(position k
accepted) and target forwards per generated token. Any speculative output that differs from greedy
decoding is an error (exit 2).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Sequence

import torch

from dflash_ds.errors import DFlashError
from dflash_ds.eval.speculative import (DRAFT_SAMPLES, SpecOutput, check_drafter_matches_target, eos_token_ids,
                                        first_mismatch, greedy_generate, speculative_generate, summarize)


def load_prompts(data: str | Path, target_dir: str | Path, num_prompts: int) -> list[list[int]]:
    """Prompt token ids from a prepared dataset folder or a JSONL/JSON conversation file."""
    data = Path(data)
    if not data.exists():
        raise DFlashError(f"--data {data}: no such file or folder")
    prompts = _prepared_prompts(data, num_prompts) if data.is_dir() else _file_prompts(data, target_dir, num_prompts)
    if not prompts:
        raise DFlashError(f"--data {data}: no usable prompt (need a user turn, or tokens before the first loss token)")
    return prompts


def _prepared_prompts(folder: Path, num_prompts: int) -> list[list[int]]:
    # A prepared row's prompt is everything before the first loss-mask token (chat header included).
    import datasets

    try:
        ds = datasets.load_from_disk(str(folder))
    except (FileNotFoundError, ValueError) as exc:
        raise DFlashError(f"--data {folder}: not a prepared dataset folder ({str(exc).splitlines()[0]})") from None
    missing = {"input_ids", "loss_mask"} - set(ds.column_names)
    if missing:
        raise DFlashError(f"--data {folder}: dataset has no column(s) {sorted(missing)}")
    prompts = []
    for row in ds.select_columns(["input_ids", "loss_mask"]):
        first = next((i for i, m in enumerate(row["loss_mask"]) if m), 0)
        if first > 0:
            prompts.append(list(row["input_ids"][:first]))
        if len(prompts) == num_prompts:
            break
    return prompts


def _file_prompts(path: Path, target_dir: str | Path, num_prompts: int) -> list[list[int]]:
    # The conversation up to its last user turn, rendered with the generation prompt.
    from dflash_ds.data import formats
    from dflash_ds.data.chat import load_tokenizer

    tok = load_tokenizer(str(target_dir))
    prompts = []
    for _line, raw in formats.iter_raw_rows(path):
        try:
            messages = formats.to_messages(formats.parse_row(raw), require_assistant=False)
        except formats.RowError:
            continue
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
        if last_user is None:
            continue
        text = tok.apply_chat_template(messages[: last_user + 1], tokenize=False, add_generation_prompt=True)
        prompts.append(tok(text, add_special_tokens=False)["input_ids"])
        if len(prompts) == num_prompts:
            break
    return prompts


def parse_budgets(text: str) -> list[int]:
    """'16,64,256' -> [16, 64, 256]; '' -> []."""
    try:
        budgets = [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        raise DFlashError(f"--tree-budget {text!r}: expected comma-separated integers, e.g. 16,64,256") from None
    if any(b < 1 for b in budgets):
        raise DFlashError(f"--tree-budget {text!r}: every budget must be >= 1")
    return budgets


def evaluate(target, drafter, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 0.0,
             tree_budgets: Sequence[int] = (), seed: int = 0, log=print, draft_sample: str = "greedy",
             confidence_stop: float | None = None, head_target: str = "sampled") -> dict:
    """Run every prompt through greedy, single-path and tree decoding (and single-path under a confidence stop);
    return the results dict. `head_target`: what the confidence head trained for (`head_target_of`)."""
    eos = eos_token_ids(target)
    block = drafter.arch.block_size
    runs: dict[str, list[SpecOutput]] = {"chain": [], **{f"tree{b}": [] for b in tree_budgets},
                                         **({"stop": []} if confidence_stop is not None else {})}
    mismatches: list[dict] = []
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        reference = greedy_generate(target, prompt, max_new_tokens, eos) if temperature <= 0 else None
        for name in runs:
            budget = int(name[4:]) if name.startswith("tree") else None
            gen = torch.Generator().manual_seed(seed + i)  # the same prompt samples the same way across runs
            out = speculative_generate(target, prompt, drafter=drafter, max_new_tokens=max_new_tokens, eos_ids=eos,
                                       temperature=temperature, tree_budget=budget, generator=gen,
                                       draft_sample=draft_sample,
                                       confidence_stop=confidence_stop if name == "stop" else None)
            runs[name].append(out)
            at = None if reference is None else first_mismatch(out.tokens, reference)
            if at is not None:
                mismatches.append({"prompt": i, "mode": name, "token": at,
                                   "speculative": out.tokens[at:at + 1], "greedy": reference[at:at + 1]})
        chain = runs["chain"][-1]
        tau = summarize([chain], block)["tau"]
        log(f"eval: prompt {i + 1}/{len(prompts)}: {len(chain.tokens)} tokens, tau {tau:.2f} "
            f"({time.perf_counter() - t0:.1f}s)")
    results = {"num_prompts": len(prompts), "block_size": block, "max_new_tokens": max_new_tokens,
               "temperature": temperature, "lossless_checked": temperature <= 0,
               **({"draft_sample": draft_sample} if temperature > 0 else {}),
               **summarize(runs["chain"], block),
               "tree": {str(b): summarize(runs[f"tree{b}"], block) for b in tree_budgets},
               # each draft cut where the running product of the confidence head's estimates falls below the
               # threshold: fewer verified tokens per accepted one, at what cost in tau
               **({"confidence_stop": {"threshold": confidence_stop, **summarize(runs["stop"], block)}}
                  if confidence_stop is not None else {}),
               "mismatches": mismatches}
    # What eval's acceptance is: at T = 0 the greedy hit; sampled drafts under rejection sampling accept with
    # probability alpha = sum min(p, q), the sampled target; greedy drafts at T > 0 are neither.
    # At T = 0 alpha is computed beside the hit (greedy chain, distributions at T = 1): the head is judged on its own.
    judged = "greedy" if temperature <= 0 else "sampled" if draft_sample == "probabilistic" else "greedy draft, T > 0"
    for x in (results, results.get("confidence_stop") or {}):
        if "confidence_calibration" not in x:
            continue
        x["confidence_calibration"].update(trained_for=head_target, judged_against=judged)
        alpha = x.pop("confidence_calibration_alpha", None)
        if alpha is not None:
            alpha.update(trained_for=head_target, judged_against="sampled")
            mine, other = (alpha, x["confidence_calibration"]) if head_target == "sampled" else (
                x["confidence_calibration"], alpha)
            x["confidence_calibration"], x["confidence_calibration_other"] = mine, other
    return results


def head_target_of(drafter_dir: str | Path) -> str:
    """What a drafter's confidence head trained for, as its kind reads the export's recorded loss settings
    (dflash_ds_training.loss, written by the trainer; models/kinds.py `KindSpec.head_target`); sampled without one."""
    from dflash_ds.models.kinds import kind_of_architecture, kind_spec

    try:
        cfg = json.loads((Path(drafter_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return "sampled"
    kind = kind_of_architecture(cfg.get("architectures"))
    read = None if kind is None else kind_spec(kind).head_target
    return "sampled" if read is None else read((cfg.get("dflash_ds_training") or {}).get("loss") or {})


def format_table(r: dict) -> str:
    """A short text table of the results."""
    rows = [("single path", "-", r)] + [("tree", b, t) for b, t in r["tree"].items()]
    lines = [f"{'mode':<12} {'budget':>6} {'tau':>6} {'pooled':>6} {'steps':>6} {'fwd/token':>9}"]
    lines += [f"{m:<12} {b:>6} {x['tau']:>6.3f} {x['tau_pooled']:>6.3f} {x['decode_steps']:>6} "
              f"{x['target_forwards_per_token']:>9.3f}" for m, b, x in rows]
    lines.append("tau = mean over prompts of each prompt's mean accepted length (the reference's); "
                 "pooled = over all steps together")
    lines.append("accepted length histogram (1.." + str(r["block_size"]) + "): "
                 + " ".join(str(n) for n in r["accept_length_histogram"]))
    lines.append("P(position k accepted), k = 1..: " + " ".join(f"{p:.2f}" for p in r["per_position_acceptance"]))
    if r.get("tau_by_context"):
        lines.append("tau by context length (prompt + tokens before the step): " + ", ".join(
            f"{name} {b['tau']:.3f} ({b['steps']} steps)" for name, b in r["tau_by_context"].items()))
    for name, x in (("", r), ("with --confidence-stop: ", r.get("confidence_stop"))):
        if x and "confidence_calibration" in x:
            c = x["confidence_calibration"]
            lines.append(f"{name}confidence head (trained for {c.get('trained_for', '?')} acceptance, judged against "
                         f"{c.get('judged_against', '?')}): ECE {c['ece']:.3f}, Brier {c['brier']:.3f} over "
                         f"{c['judged_tokens']} judged tokens; drafted per accepted {x['drafted_per_accepted']:.2f}, "
                         f"tau {x['tau']:.3f}")
            if "confidence_calibration_other" in x:
                o = x["confidence_calibration_other"]
                lines.append(f"  against {o['judged_against']} acceptance: ECE {o['ece']:.3f}, Brier {o['brier']:.3f}")
            if c.get("trained_for") not in (None, c.get("judged_against")):
                flags = ("--temperature 0" if c["trained_for"] == "greedy"
                         else "--temperature 1 --draft-sample probabilistic")
                lines.append(f"  (to judge it on its own target: {flags})")
    for f in r.get("adaptive_verification", []):
        lines.append(f"adaptive verification, top {f['fraction']:.0%} of drafted slots by running confidence: "
                     f"{f['verified_slots']} verified, {f['tokens_per_verified']:.3f} tokens per verified token, "
                     f"{f['tokens_per_step']:.3f} per step")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the eval flags."""
    parser.add_argument("--target", required=True, help="local HF folder of the target model")
    parser.add_argument("--drafter", required=True, help="drafter export folder (config.json + model.safetensors)")
    parser.add_argument("--data", required=True, help="prepared dataset folder (prompt = tokens before the first "
                        "loss token) or a .jsonl/.json conversation file (prompt = up to the last user turn)")
    parser.add_argument("--num-prompts", type=int, default=32, help="prompts to evaluate (default 32)")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="tokens generated per prompt (default 256)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy, checked lossless against plain "
                        "greedy decoding; > 0 = speculative sampling (no tree, no lossless check)")
    parser.add_argument("--draft-sample", choices=DRAFT_SAMPLES, default="greedy", help="with --temperature > 0: "
                        "greedy (default) drafts the drafter's argmax, accepted with the target's probability of it, "
                        "as vLLM (draft_sample_method greedy, its default) and SGLang serve; probabilistic samples "
                        "the draft and accepts with min(1, p/q) (vLLM's draft_sample_method probabilistic)")
    parser.add_argument("--tree-budget", default="", help="comma-separated draft-node budgets for tree drafting, "
                        "e.g. 16,64,256 (default: single path only)")
    parser.add_argument("--confidence-stop", type=float, default=None, metavar="P",
                        help="a drafter with a confidence head: also decode with each draft cut before the "
                             "first token whose running product of confidences falls below P (one token always "
                             "drafted); the JSON's confidence_stop has tau, drafted_per_accepted and "
                             "target_forwards_per_token beside the uncut run's. Not what vLLM does with the head: "
                             "its adaptive verification ranks the running products across requests (docs/DRAFTERS.md)")
    parser.add_argument("--json", default=None, help="write the results to this JSON file")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed for --temperature > 0 (default 0)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                        help="weights dtype of target and drafter (default float32: low precision can flip "
                             "near-tied greedy choices between block and one-token forwards)")
    served = parser.add_argument_group("the serving engine (eval/served.py)")
    served.add_argument("--engine", choices=["dflash", "vllm"], default="dflash", help="dflash: speculative decoding "
                        "here (default); vllm: also serve the target with the export as vLLM's DFlash drafter, read "
                        "vLLM's acceptance from its /metrics, check its outputs against plain serving, and print both")
    served.add_argument("--concurrency", type=int, default=8, help="prompts in flight on the server (--engine vllm)")
    served.add_argument("--plain-cache", default=None, metavar="DIR",
                        help="--engine vllm at temperature 0: keep the plain server's outputs (the lossless "
                             "reference) as a JSON file in DIR, and reuse them instead of starting the plain server "
                             "when an eval serves the same target (its folder's path and each file's name, size "
                             "and mtime: the weights are not hashed), prompts, --max-new-tokens, served dtype, "
                             "--vllm-max-model-len, --concurrency, --vllm-arg, the variables eval sets for the server "
                             "(VLLM_USE_V2_MODEL_RUNNER) and --vllm-python again. Helps when evaluating several "
                             "drafters or checkpoints against one target and prompt set: the plain server starts "
                             "and generates once. Not keyed: your shell's environment and a vLLM upgraded inside "
                             "the same venv: empty DIR then (default: no cache)")
    from dflash_ds.serving.vllm_server import add_server_arguments

    add_server_arguments(served, for_eval=True)


def vllm_log_dir(args: argparse.Namespace) -> Path | None:
    """Where eval --engine vllm keeps its servers' logs: --vllm-log, else beside --json (JSON_STEM.vllm/), else
    nowhere: VLLMServer's own files in the current folder, removed after a clean run, kept on a failure."""
    if args.vllm_log:
        return Path(args.vllm_log)
    return Path(args.json).with_suffix(".vllm") if args.json else None


def run(args: argparse.Namespace) -> int:
    """CLI entry: check the pair, evaluate, print the table, write --json; exit 2 on a lossless mismatch."""
    from dflash_ds.models.drafter import DFlashDrafter, read_drafter_arch
    from dflash_ds.models.target import load_target, read_target_config

    if args.num_prompts < 1 or args.max_new_tokens < 1:
        raise DFlashError("--num-prompts and --max-new-tokens must be >= 1")
    if args.temperature < 0:
        raise DFlashError(f"--temperature {args.temperature}: must be >= 0")
    budgets = parse_budgets(args.tree_budget)
    if args.confidence_stop is not None and not 0 < args.confidence_stop < 1:
        raise DFlashError(f"--confidence-stop {args.confidence_stop}: must be in (0, 1)")
    if args.plain_cache and args.engine != "vllm":
        raise DFlashError("--plain-cache keeps vLLM's plain outputs: it needs --engine vllm")
    if args.engine == "vllm" and budgets:
        raise DFlashError("--engine vllm measures single-path acceptance: no --tree-budget")
    if args.engine == "vllm":
        from dflash_ds.eval.served import serving_env

        serving_env(args.drafter, args.temperature)  # what vLLM cannot serve here fails before any model loads
    if budgets and args.temperature > 0:
        raise DFlashError("--tree-budget needs --temperature 0 (tree verification accepts greedy matches only)")
    check_drafter_matches_target(read_drafter_arch(args.drafter), read_target_config(args.target),
                                 args.drafter, args.target)
    prompts = load_prompts(args.data, args.target, args.num_prompts)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    target = load_target(args.target, dtype=dtype, device=device)
    if budgets and target.config._attn_implementation not in ("sdpa", "eager"):
        target.set_attn_implementation("sdpa")  # flash kernels take no custom 4D tree mask
    drafter = DFlashDrafter.from_pretrained(args.drafter, device=device).to(dtype).eval()
    print(f"eval: {len(prompts)} prompts, block {drafter.arch.block_size}, max {args.max_new_tokens} new tokens, "
          f"temperature {args.temperature}, tree budgets {budgets or 'none'}", flush=True)
    results = evaluate(target, drafter, prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       tree_budgets=budgets, seed=args.seed, log=lambda s: print(s, flush=True),
                       draft_sample=args.draft_sample, confidence_stop=args.confidence_stop,
                       head_target=head_target_of(args.drafter))
    results.update({"target": str(args.target), "drafter": str(args.drafter), "data": str(args.data)})
    print(format_table(results))
    if args.engine == "vllm":
        from dflash_ds.eval.served import format_comparison, served_eval

        served = served_eval(args.target, args.drafter, prompts, max_new_tokens=args.max_new_tokens,
                             dtype=args.vllm_dtype or args.dtype,
                             concurrency=args.concurrency, python=args.vllm_python,
                             memory_fraction=args.vllm_memory_fraction, max_model_len=args.vllm_max_model_len,
                             startup_timeout_s=args.vllm_startup_timeout, log_dir=vllm_log_dir(args),
                             extra_args=args.vllm_arg, temperature=args.temperature, seed=args.seed,
                             draft_sample=args.draft_sample, plain_cache=args.plain_cache,
                             threads=args.vllm_threads)
        results["vllm"] = served
        print(format_comparison(results, served))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
        print(f"eval: results -> {args.json}")
    if args.engine == "vllm" and results["vllm"]["mismatches"]:
        m = results["vllm"]["mismatches"][0]
        raise DFlashError(f"prompt {m['prompt']}: vLLM's speculative output differs from its plain output at "
                          f"generated token {m['token']} ({m['speculative']} vs {m['plain']})")
    if results["mismatches"]:
        m = results["mismatches"][0]
        raise DFlashError(f"prompt {m['prompt']} ({m['mode']}): speculative output differs from greedy decoding at "
                          f"generated token {m['token']} ({m['speculative']} vs {m['greedy']}); "
                          f"{len(results['mismatches'])} mismatching run(s) in all")
    return 0
