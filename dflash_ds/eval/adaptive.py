"""vLLM's adaptive verification simulated on eval's records: which drafted slots to verify, ranked by confidence.

vLLM 0.32 (`v1/worker/gpu/spec_decode/adaptive_verification.py`, `_assign_draft_token_budget`) scores every
(request, draft position) slot of a step by its survival probability, the running product of that request's
confidences up to the slot, and verifies the globally best `budget` slots; survival only falls along a request,
so each request verifies a prefix of its draft. Here the requests are eval's decode steps (one draft each, its
confidences and its accepted length), pooled; a budget of a fraction f of all drafted slots keeps the top
ceil(f x slots). Cost model: a step verifies its anchor plus the slots it kept (1 + m target tokens) and yields
min(accepted, m) + 1 tokens (the accepted drafts it verified plus the target's own next token), so
tokens_per_verified = sum(min(a, m) + 1) / sum(m + 1); f = 1 is verifying full blocks. Drafting cost and the
step's fixed cost are left out (vLLM measures them into its cost tables).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

FRACTIONS = (0.25, 0.5, 0.75, 1.0)


def simulate(steps: Sequence[tuple[Sequence[float], int]], fractions: Sequence[float] = FRACTIONS) -> list[dict]:
    """Per budget fraction: slots verified, tokens per verified token and tokens per step, over steps given as
    (confidences of the drafted slots, accepted drafts)."""
    scored = []  # (-survival, slot, step): the best first; ties keep each step's prefix (earlier slots first)
    for s, (conf, _) in enumerate(steps):
        survival = 1.0
        for k, c in enumerate(conf):
            survival *= float(c)
            scored.append((-survival, k, s))
    scored.sort()
    total = len(scored)
    out = []
    for f in fractions:
        keep = [0] * len(steps)
        for _, _, s in scored[: math.ceil(f * total)]:
            keep[s] += 1
        tokens = sum(min(a, m) + 1 for (_, a), m in zip(steps, keep))
        verified = sum(m + 1 for m in keep)
        out.append({"fraction": f, "verified_slots": sum(keep), "tokens_per_verified": tokens / max(verified, 1),
                    "tokens_per_step": tokens / max(len(steps), 1)})
    return out
