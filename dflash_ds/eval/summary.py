"""What a speculative run reports: per-prompt outputs (`SpecOutput`) and their summary (tau, histograms,
target forwards per token, drafted tokens per accepted one, and a confidence head's calibration)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash_ds.eval.adaptive import simulate

CALIBRATION_BINS = 10  # equal-width bins of the confidence for the expected calibration error
# Context-length buckets of `tau_by_context`: a step falls in the first bucket whose upper end exceeds its context
# (the prompt and the tokens before the step's anchor); doubling from 512 to 128K, then one open bucket.
CONTEXT_EDGES = [512 << k for k in range(9)]  # 512, 1K, ..., 128K


@dataclass
class SpecOutput:
    """One prompt's speculative generation."""

    tokens: list[int]  # generated tokens (after the prompt), cut at max_new_tokens and the first eos
    prompt_length: int = 0  # the prompt's tokens: a decode step's context is these and the tokens before its anchor
    accept_lengths: list[int] = field(default_factory=list)  # tokens per decode step, bonus included
    target_forwards: int = 0  # prefill + one per decode step + replay_forwards
    replay_forwards: int = 0  # forwards that re-ran accepted tokens after restoring a cache that cannot be cut back
    drafted_tokens: int = 0  # draft tokens sent to verification (fewer than block - 1 a step under a confidence stop)
    # (confidence, accepted) of every drafted token verification reached: the accepted ones and the first rejected
    # one of each step (a token after a rejection is never judged)
    confidence: list[tuple[float, int]] = field(default_factory=list)
    # at T = 0, (confidence, alpha = sum min(p, q)) of the same judged tokens: the sampled acceptance rate
    confidence_alpha: list[tuple[float, float]] = field(default_factory=list)
    # (confidences of every drafted slot, accepted drafts) per decode step: adaptive verification's input
    draft_confidence: list[tuple[list[float], int]] = field(default_factory=list)


def first_mismatch(spec: list[int], reference: list[int]) -> int | None:
    """Index of the first generated token where two outputs differ (a length difference counts), or None."""
    for i, (a, b) in enumerate(zip(spec, reference)):
        if a != b:
            return i
    return None if len(spec) == len(reference) else min(len(spec), len(reference))


def calibration(pairs: list[tuple[float, int]], bins: int = CALIBRATION_BINS) -> dict:
    """Expected calibration error (equal-width bins, weighted by count), Brier score and mean confidence against
    the acceptance rate, over (confidence, accepted) pairs (accepted: a hit 0/1, or a probability alpha)."""
    if not pairs:
        return {}
    n = len(pairs)
    counts, conf_sum, hit_sum = [0] * bins, [0.0] * bins, [0.0] * bins
    for c, hit in pairs:
        b = min(int(c * bins), bins - 1)
        counts[b] += 1
        conf_sum[b] += c
        hit_sum[b] += hit
    ece = sum(abs(conf_sum[b] - hit_sum[b]) for b in range(bins)) / n
    return {"ece": ece, "brier": sum((c - hit) ** 2 for c, hit in pairs) / n,
            "mean_confidence": sum(c for c, _ in pairs) / n, "acceptance_rate": sum(h for _, h in pairs) / n,
            "judged_tokens": n}


def summarize(outputs: list[SpecOutput], block_size: int) -> dict:
    """tau, accepted-length histogram, per-position acceptance and target forwards per token over prompts.

    `tau` is the public reference benchmark's "average acceptance length": the mean over prompts of each
    prompt's mean accepted length (prompts without a decode step have none and are left out). `tau_pooled`
    is the mean over all decode steps together, which weighs long prompts more. `drafted_per_accepted`: draft
    tokens verified per draft token accepted. `confidence_calibration` and `adaptive_verification` (a drafter with a
    confidence head).
    """
    lengths = [n for o in outputs for n in o.accept_lengths]
    steps = max(len(lengths), 1)
    per_prompt = [sum(o.accept_lengths) / len(o.accept_lengths) for o in outputs if o.accept_lengths]
    tokens = sum(len(o.tokens) for o in outputs)
    hist = [sum(1 for n in lengths if n == k) for k in range(1, block_size + 1)]
    accepted = sum(lengths) - len(lengths)
    pairs = [p for o in outputs for p in o.confidence]
    drafts = [o.draft_confidence for o in outputs if o.draft_confidence]  # per prompt: ranked within a step
    alphas = [p for o in outputs for p in o.confidence_alpha]
    return {
        "tau": sum(per_prompt) / max(len(per_prompt), 1),
        "tau_pooled": sum(lengths) / steps,
        # each prompt's mean accepted length, in prompt order (None: no decode step), for tau per task type
        "tau_per_prompt": [sum(o.accept_lengths) / len(o.accept_lengths) if o.accept_lengths else None
                           for o in outputs],
        "decode_steps": len(lengths),
        "generated_tokens": tokens,
        # histogram[i] = steps that yielded i+1 tokens (i accepted draft tokens + the bonus)
        "accept_length_histogram": hist,
        # per_position_acceptance[k-1] = P(draft position k accepted) = P(accept length >= k + 1)
        "per_position_acceptance": [sum(1 for n in lengths if n >= k + 1) / steps for k in range(1, block_size)],
        # tokens per step by the step's context length (prompt + tokens before its anchor): {"<512": {steps, tau}}
        "tau_by_context": tau_by_context(outputs),
        "target_forwards_per_token": sum(o.target_forwards for o in outputs) / max(tokens, 1),
        "replay_forwards": sum(o.replay_forwards for o in outputs),
        "drafted_per_accepted": sum(o.drafted_tokens for o in outputs) / max(accepted, 1),
        **({"confidence_calibration": calibration(pairs)} if pairs else {}),
        **({"confidence_calibration_alpha": calibration(alphas)} if alphas else {}),
        # the top fraction of drafted slots by running confidence product, verified (eval/adaptive.py)
        **({"adaptive_verification": simulate(drafts)} if drafts else {}),
    }


def bucket_name(k: int) -> str:
    """`CONTEXT_EDGES` bucket k's label: "<512", "512-1K", ..., ">=128K"."""
    def short(n: int) -> str:
        return f"{n // 1024}K" if n >= 1024 else str(n)
    if k == 0:
        return f"<{short(CONTEXT_EDGES[0])}"
    if k == len(CONTEXT_EDGES):
        return f">={short(CONTEXT_EDGES[-1])}"
    return f"{short(CONTEXT_EDGES[k - 1])}-{short(CONTEXT_EDGES[k])}"


def tau_by_context(outputs: list[SpecOutput]) -> dict[str, dict]:
    """Tokens per decode step over the steps whose context length falls in each bucket (non-empty ones, in order):
    where a drafter trained on short rows falls off as the context grows (issue #56). A step's context is the
    prompt and every token before its anchor (the anchor is the last token the previous step yielded)."""
    import bisect

    sums: dict[int, list[int]] = {}
    for o in outputs:
        context = o.prompt_length  # the first step's anchor is the prefill's token, at position prompt_length
        for n in o.accept_lengths:
            s = sums.setdefault(bisect.bisect_right(CONTEXT_EDGES, context), [0, 0])
            s[0] += n
            s[1] += 1
            context += n
    return {bucket_name(k): {"steps": s[1], "tau": s[0] / s[1]} for k, s in sorted(sums.items())}
