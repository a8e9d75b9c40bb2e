"""The arithmetic of `dflash-ds bench speedup`: timed rounds -> tokens/s, latency, speedup and its spread, the
step-cost model that predicts the speedup from tau, and the output check.

A *round* is every held-out prompt decoded once by one decoder (plain or speculative) of one engine at one
concurrency. Plain and speculative rounds of the same repeat are paired: the speedup of a repeat is the ratio of
their output tokens/s, and its spread over repeats is reported (warm-up rounds are checked but never timed). A
speculative round drafts `drafts` tokens a step (vLLM's num_speculative_tokens); rounds of several draft lengths
each pair with the same plain round, one row per length.

The step-cost model. Per decode step a plain decoder spends t_plain and yields one token; a speculative decoder
spends t_spec (one draft and one verify of the block) and yields tau tokens on average (bonus included). Away from
prefill and the end of a request,

    speedup = tau * t_plain / t_spec          (decode only; t_spec / t_plain is the step ratio)

so a step ratio of 1.25 needs tau 1.875 for 1.5x and tau 1.25 to break even. The end-to-end figure is lower by
what the model leaves out: the prefill both decoders pay once per request, and the tokens of a last step that run
past --max-new-tokens and are cut. Where a drafter's forward and the verify forward are timed on their own (our
decoder, batch 1), t_spec is split into drafting, verifying and the step's bookkeeping, each against a one-token
target forward.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from dflash_ds.eval.summary import first_mismatch


@dataclass
class Round:
    """Every prompt through one decoder (`mode` plain or spec) of one engine at one concurrency, timed."""

    engine: str
    mode: str
    concurrency: int
    repeat: int  # < 0: a warm-up round (its outputs are checked, its times are not reported)
    seconds: float  # wall time of the round
    outputs: list[list[int]]
    request_seconds: list[float]  # each request's own time, first byte sent to last token received
    steps: int = 0  # decode steps after the first token (a plain step yields one token, a speculative step tau)
    decode_seconds: float = 0.0  # time in those steps, summed over requests (no prefill)
    accepted: int = 0  # accepted draft tokens (spec): tau = 1 + accepted / steps
    drafts: int | None = None  # spec: draft tokens a step (the block's - 1 unless set); None for plain rounds
    # our decoder only: each timed target forward of a block, each one-token forward, each draft
    verify_s: list[float] = field(default_factory=list)
    one_token_s: list[float] = field(default_factory=list)
    draft_s: list[float] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        """Output tokens of the round."""
        return sum(len(o) for o in self.outputs)

    @property
    def tok_per_s(self) -> float:
        """Output tokens per second of wall time."""
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")

    @property
    def ms_per_token(self) -> float:
        """Per-token latency a client sees: the mean over requests of its time over its tokens, in ms."""
        per = [1000.0 * s / len(o) for s, o in zip(self.request_seconds, self.outputs) if o]
        return sum(per) / len(per) if per else float("nan")


def spread(values: list[float]) -> dict:
    """Mean, min, max and sample standard deviation of repeated figures (std 0 for one value)."""
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return {"mean": float("nan"), "min": float("nan"), "max": float("nan"), "std": float("nan"), "n": 0}
    return {"mean": sum(vals) / len(vals), "min": min(vals), "max": max(vals),
            "std": statistics.stdev(vals) if len(vals) > 1 else 0.0, "n": len(vals)}


def step_seconds(rounds: list[Round]) -> float:
    """Seconds per decode step over rounds (their decode time over their steps)."""
    steps = sum(r.steps for r in rounds)
    return sum(r.decode_seconds for r in rounds) / steps if steps else float("nan")


def tau_of(rounds: list[Round]) -> float:
    """Mean tokens per speculative step over rounds, bonus included (vLLM's mean acceptance length)."""
    steps = sum(r.steps for r in rounds)
    return 1.0 + sum(r.accepted for r in rounds) / steps if steps else float("nan")


def predicted_speedup(tau: float, step_ratio: float) -> float:
    """What tau buys at a speculative step that costs `step_ratio` plain steps (decode only)."""
    return tau / step_ratio if step_ratio > 0 else float("nan")


def tau_needed(speedup: float, step_ratio: float) -> float:
    """The tau a speedup needs at this step ratio (step_ratio itself: the break-even tau)."""
    return speedup * step_ratio


def median(values: list[float]) -> float:
    """The median, NaN for none (robust to the odd slow forward a busy machine adds)."""
    return statistics.median(values) if values else float("nan")


def step_split(plain: list[Round], spec: list[Round]) -> dict | None:
    """Our decoder's step at batch 1 in parts, each over one one-token target forward (None without timings)."""
    one = median([s for r in plain for s in r.one_token_s])
    verify, draft = median([s for r in spec for s in r.verify_s]), median([s for r in spec for s in r.draft_s])
    if any(math.isnan(x) or x <= 0 for x in (one, verify, draft)):
        return None
    t_spec, t_plain = step_seconds(spec), step_seconds(plain)
    return {"one_token_forward_ms": 1000 * one, "verify_forward_ms": 1000 * verify, "draft_ms": 1000 * draft,
            "verify_over_one": verify / one, "draft_over_one": draft / one,
            # what a step spends outside the two models (acceptance, cache cut, Python), per one-token forward
            "bookkeeping_over_one": (t_spec - verify - draft) / one,
            "plain_bookkeeping_over_one": (t_plain - one) / one,
            # the forwards alone: what tau would buy with no bookkeeping on either side
            "forward_step_ratio": (draft + verify) / one}


def summarize(rounds: list[Round]) -> list[dict]:
    """One row per (engine, concurrency, draft length): tokens/s and latency of each decoder, the speedup over repeats
    with its spread, tau, the measured step ratio and the speedup it predicts."""
    rows = []
    keys = sorted({(r.engine, r.concurrency, r.drafts) for r in rounds if r.mode == "spec"},
                  key=lambda k: (k[0] != "vllm", k[0], k[1], k[2] or 0))
    for engine, conc, drafts in keys:
        timed = [r for r in rounds if r.engine == engine and r.concurrency == conc and r.repeat >= 0]
        plain = {r.repeat: r for r in timed if r.mode == "plain"}
        spec = {r.repeat: r for r in timed if r.mode == "spec" and r.drafts == drafts}
        repeats = sorted(set(plain) & set(spec))
        if not repeats:
            continue
        p, s = [plain[i] for i in repeats], [spec[i] for i in repeats]
        tau = tau_of(s)
        ratio = step_seconds(s) / step_seconds(p)
        row = {"engine": engine, "concurrency": conc, "draft_tokens": drafts, "repeats": len(repeats),
               "plain_tok_s": spread([r.tok_per_s for r in p]), "spec_tok_s": spread([r.tok_per_s for r in s]),
               "speedup": spread([b.tok_per_s / a.tok_per_s for a, b in zip(p, s)]),
               "plain_ms_per_token": spread([r.ms_per_token for r in p]),
               "spec_ms_per_token": spread([r.ms_per_token for r in s]),
               "tau": tau, "plain_step_ms": 1000 * step_seconds(p), "spec_step_ms": 1000 * step_seconds(s),
               "step_ratio": ratio, "predicted_speedup": predicted_speedup(tau, ratio),
               "tau_for_1.5x": tau_needed(1.5, ratio), "tokens_per_round": p[0].tokens}
        split = step_split(p, s)
        if split is not None:
            row["step_split"] = split
            row["forward_predicted_speedup"] = predicted_speedup(tau, split["forward_step_ratio"])
        rows.append(row)
    return rows


def mismatches(rounds: list[Round]) -> list[dict]:
    """Every speculative output that differs from the plain output of the same engine, concurrency and repeat (and
    every plain output that differs from the engine's first plain round at that concurrency: a reference that
    moves between rounds checks nothing)."""
    found = []
    plain = {(r.engine, r.concurrency, r.repeat): r for r in rounds if r.mode == "plain"}
    for r in rounds:
        if r.mode == "spec":
            ref = plain.get((r.engine, r.concurrency, r.repeat))
        else:
            ref = plain[min(k for k in plain if k[:2] == (r.engine, r.concurrency))]
        if ref is None or ref is r:
            continue
        for i, (out, want) in enumerate(zip(r.outputs, ref.outputs)):
            at = first_mismatch(out, want)
            if at is not None:
                found.append({"engine": r.engine, "concurrency": r.concurrency, "repeat": r.repeat, "mode": r.mode,
                              "drafts": r.drafts, "prompt": i, "token": at, "got": out[at:at + 1],
                              "plain": want[at:at + 1]})
    return found


def _cell(x: dict, fmt: str) -> str:
    return f"{x['mean']:{fmt}} ({x['min']:{fmt}}-{x['max']:{fmt}})"


def _k(r: dict) -> str:
    return "-" if r.get("draft_tokens") is None else str(r["draft_tokens"])


def format_table(rows: list[dict]) -> str:
    """The speedup table: one line per (engine, concurrency, draft tokens k), then each row's step costs."""
    head = (f"{'engine':<7} {'conc':>4} {'k':>2} {'plain tok/s':>19} {'spec tok/s':>19} {'speedup':>19} "
            f"{'ms/token plain':>14} {'spec':>6} {'tau':>5} {'step':>5} {'predicted':>9}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['engine']:<7} {r['concurrency']:>4} {_k(r):>2} {_cell(r['plain_tok_s'], '.1f'):>19} "
                     f"{_cell(r['spec_tok_s'], '.1f'):>19} {_cell(r['speedup'], '.2f'):>19} "
                     f"{r['plain_ms_per_token']['mean']:>14.1f} {r['spec_ms_per_token']['mean']:>6.1f} "
                     f"{r['tau']:>5.2f} {r['step_ratio']:>5.2f} {r['predicted_speedup']:>8.2f}x")
    lines.append("k: draft tokens a speculative step; speedup: spec / plain output tokens/s, mean (min-max) over "
                 "repeats; tau: tokens per speculative step; step: a speculative step's time over a plain one (decode "
                 "only); predicted = tau / step")
    for r in rows:
        lines.append(f"{r['engine']} at {r['concurrency']}, k {_k(r)}: plain step {r['plain_step_ms']:.1f} ms, "
                     f"speculative step {r['spec_step_ms']:.1f} ms; tau needed for 1.5x {r['tau_for_1.5x']:.2f}, "
                     f"to break even {r['step_ratio']:.2f}")
        s = r.get("step_split")
        if s:
            lines.append(f"  its step in one-token forwards ({s['one_token_forward_ms']:.1f} ms): draft "
                         f"{s['draft_over_one']:.2f} + verify {s['verify_over_one']:.2f} + bookkeeping "
                         f"{s['bookkeeping_over_one']:.2f} (plain: 1 + {s['plain_bookkeeping_over_one']:.2f}); "
                         f"the forwards alone predict {r['forward_predicted_speedup']:.2f}x")
    return "\n".join(lines)


def plot(rows: list[dict], path) -> None:
    """Output tokens/s of each decoder, and the measured speedup beside the predicted one, by concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    series = list(dict.fromkeys((r["engine"], r.get("draft_tokens")) for r in rows))
    ks = {e: [k for e2, k in series if e2 == e] for e, _ in series}
    for n, (engine, k) in enumerate(series):
        mine = [r for r in rows if (r["engine"], r.get("draft_tokens")) == (engine, k)]
        conc = [r["concurrency"] for r in mine]
        name = engine if len(ks[engine]) == 1 else f"{engine} k={k}"
        # the plain decoder once per engine (every draft length pairs with the same plain rounds)
        for mode, style in ((("plain", "o--"),) if k == ks[engine][0] else ()) + (("spec", "o-"),):
            cells = [r[f"{mode}_tok_s"] for r in mine]
            ax1.errorbar(conc, [c["mean"] for c in cells], fmt=style, capsize=3,
                         label=f"{engine if mode == 'plain' else name} {mode}",
                         yerr=[[c["mean"] - c["min"] for c in cells], [c["max"] - c["mean"] for c in cells]])
        cells = [r["speedup"] for r in mine]
        color = colors[n % len(colors)]
        ax2.errorbar(conc, [c["mean"] for c in cells], fmt="o-", capsize=3, label=f"{name} measured", color=color,
                     yerr=[[c["mean"] - c["min"] for c in cells], [c["max"] - c["mean"] for c in cells]])
        ax2.plot(conc, [r["predicted_speedup"] for r in mine], "x:", color=color, label=f"{name} tau / step ratio")
    ax1.set(xlabel="concurrency", ylabel="output tokens/s", xscale="log")
    ax2.set(xlabel="concurrency", ylabel="speedup over plain decoding", xscale="log")
    ax2.axhline(1.0, color="grey", lw=0.8)
    ticks = sorted({r["concurrency"] for r in rows})
    for ax in (ax1, ax2):
        ax.set_xticks(ticks, [str(t) for t in ticks])  # the concurrencies measured, not powers of ten
        ax.minorticks_off()
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
