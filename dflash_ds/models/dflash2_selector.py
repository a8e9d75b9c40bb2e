"""DFlash2's candidate selector: unary scores from the target head, edge scores between neighbours, the walk.

Semantics read in vLLM 0.32 (`qwen3_dflash2.py` `CandidateSelector` / `_score_edges`, the logits
processor's `get_top_k_tokens`, `spec_decode/dflash2/speculator.py` `_selector_walk_kernel`):

- candidates of a draft position: the target head's top-K token ids of the drafter's final-normed
  hidden state h; their unary score is the logit times `output_multiplier`, then
  cap * tanh(. / cap) when `final_logit_softcapping` > 0 (scale first, cap second, as vLLM's top-K path);
- score of candidate c after predecessor p at position l:
  unary[l, c] + <predecessor_codebook[p] * hidden_projection(h_l), successor_codebook[c]>, where the
  predecessors of position l are the K candidates of position l - 1 and those of the first drafted
  position are the anchor token (all K rows alike);
- the walk: at the first position take the best candidate in row 0, then at each position the best
  candidate in the row of the previous choice (greedy). Sampled (T > 0): draw from softmax(row / T) over
  the K candidates; that K-way distribution is the draft distribution for lossless verification.
"""

from __future__ import annotations

import torch
from torch import nn


def unary_candidates(hidden: torch.Tensor, lm_head, top_k: int, output_multiplier: float = 1.0,
                     softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K token ids of lm_head(hidden) [..., K] and their scaled, soft-capped scores [..., K] (fp32)."""
    values, ids = lm_head(hidden).float().topk(top_k, dim=-1)
    return ids, soft_cap(values * output_multiplier, softcap)


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap); the identity when cap is 0."""
    return torch.tanh(x / cap) * cap if cap > 0 else x


def predecessor_ids(candidate_ids: torch.Tensor, anchor_ids: torch.Tensor) -> torch.Tensor:
    """[N, L, K] predecessors of each position's rows: the anchor (K times) first, then position l-1's candidates."""
    n, _, k = candidate_ids.shape
    return torch.cat([anchor_ids.view(n, 1, 1).expand(n, 1, k), candidate_ids[:, :-1]], dim=1)


class CandidateSelector(nn.Module):
    """Two vocab x rank codebooks and an H -> rank projection (export names as vLLM's `load_weights` reads them).

    `predecessor_codebook` and `successor_codebook` are bare tensors (no `.weight`): embedding tables
    indexed by token id, not layers.
    """

    def __init__(self, hidden_size: int, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def forward(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The selector's tables through its own forward: the two codebooks [V, r] and the hidden projection as an
        [H, r] matrix. ZeRO-3 gathers a module's parameters only inside its forward, and a caller that scores
        many chunks (the selector loss, est_tau's walk) must make the same module calls on every rank: it takes
        the tables once and passes them to `pair_scores`."""
        w = self.hidden_projection.weight
        eye = torch.eye(self.hidden_projection.in_features, device=w.device, dtype=w.dtype)
        return self.predecessor_codebook * 1.0, self.successor_codebook * 1.0, self.hidden_projection(eye)

    def pair_scores(self, hidden: torch.Tensor, prev_ids: torch.Tensor, cand_ids: torch.Tensor,
                    tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Edge scores without the unary term: hidden [..., H], prev_ids [..., P], cand_ids [..., C] -> [..., P, C]."""
        if tables is None:
            pred_cb, succ_cb, h = self.predecessor_codebook, self.successor_codebook, self.hidden_projection(hidden)
        else:
            pred_cb, succ_cb, h = tables[0], tables[1], hidden @ tables[2].to(hidden.dtype)
        pred = pred_cb[prev_ids] * h.unsqueeze(-2)
        return torch.matmul(pred, succ_cb[cand_ids].transpose(-1, -2)).float()

    def edge_scores(self, hidden: torch.Tensor, candidate_ids: torch.Tensor, unary: torch.Tensor,
                    anchor_ids: torch.Tensor, tables: tuple | None = None) -> torch.Tensor:
        """Scores [N, L, K(predecessor), K(candidate)] of a block's drafted positions.

        hidden [N, L, H] (final-normed), candidate_ids / unary [N, L, K], anchor_ids [N]; `tables`: `forward()`'s.
        """
        pairs = self.pair_scores(hidden, predecessor_ids(candidate_ids, anchor_ids), candidate_ids, tables)
        return unary.float().unsqueeze(-2) + pairs


def walk(scores: torch.Tensor, candidate_ids: torch.Tensor, temperature: float = 0.0,
         generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-to-right walk over [N, L, K, K] scores: drafted tokens [N, L] and the rows walked [N, L, K].

    Greedy at temperature 0 (the first best index on ties, as argmax); else a draw from
    softmax(row / T). The rows walked are each position's K-way draft scores (logits over its candidates).
    """
    n, length, k, _ = scores.shape
    rows = torch.arange(n, device=scores.device)
    prev = torch.zeros(n, dtype=torch.long, device=scores.device)  # position 0: every row is the anchor's
    tokens, walked = [], []
    for pos in range(length):
        row = scores[rows, pos, prev]
        if temperature > 0:
            probs = torch.softmax(row.double() / temperature, dim=-1)
            idx = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        else:
            idx = row.argmax(dim=-1)
        tokens.append(candidate_ids[rows, pos, idx])
        walked.append(row)
        prev = idx
    return torch.stack(tokens, dim=1), torch.stack(walked, dim=1)
