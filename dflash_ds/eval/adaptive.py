"""vLLM's adaptive verification simulated on eval's records: which drafted slots to verify, ranked by confidence.

vLLM 0.32 (`v1/worker/gpu/spec_decode/adaptive_verification.py`, `_assign_draft_token_budget`) scores every
(request, draft position) slot of one engine step by its survival probability, the running product of that
request's confidences up to the slot, and verifies that step's best `budget` slots; survival only falls along a
request, so each request verifies a prefix of its draft. The ranking is within a step: a slot never competes with
the slots of another step. Here eval's prompts stand for requests running together (eval decodes them one after
the other, each decode step of a prompt its own draft): step i of the batch holds the i-th decode step of every
prompt that has one, and a budget of a fraction f keeps the top ceil(f x that step's slots). Cost model: a decode
step verifies its anchor plus the slots it kept (1 + m target tokens) and yields min(accepted, m) + 1 tokens (the
accepted drafts it verified plus the target's own next token), so tokens_per_verified = sum(min(a, m) + 1) /
sum(m + 1); f = 1 is verifying full blocks. Drafting cost and the step's fixed cost are left out (vLLM measures them
into its cost tables, and picks the budget from them: the fractions here stand for its choices).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

FRACTIONS = (0.25, 0.5, 0.75, 1.0)

Draft = tuple[Sequence[float], int]  # (confidences of the drafted slots, accepted drafts) of one decode step


def simulate(prompts: Sequence[Sequence[Draft]], fractions: Sequence[float] = FRACTIONS) -> list[dict]:
    """Per budget fraction: slots verified, tokens per verified token and tokens per decode step, over each prompt's
    decode steps in order (ranked within each batch step, as vLLM ranks: module doc)."""
    batches = [[p[i] for p in prompts if i < len(p)] for i in range(max((len(p) for p in prompts), default=0))]
    out = []
    for f in fractions:
        tokens = verified = kept = 0
        for steps in batches:
            scored = []  # (-survival, slot, step): the best first; ties keep each step's prefix (earlier slots first)
            for s, (conf, _) in enumerate(steps):
                survival = 1.0
                for k, c in enumerate(conf):
                    survival *= float(c)
                    scored.append((-survival, k, s))
            scored.sort()
            keep = [0] * len(steps)
            for _, _, s in scored[: math.ceil(f * len(scored))]:
                keep[s] += 1
            tokens += sum(min(a, m) + 1 for (_, a), m in zip(steps, keep))
            verified += sum(m + 1 for m in keep)
            kept += sum(keep)
        n = sum(len(b) for b in batches)
        out.append({"fraction": f, "verified_slots": kept, "tokens_per_verified": tokens / max(verified, 1),
                    "tokens_per_step": tokens / max(n, 1)})
    return out
