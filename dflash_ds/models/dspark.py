"""The DSpark drafter: the DFlash backbone, a sequential Markov head and an acceptance-confidence head.

What the engine runs, read in vLLM 0.32 (`qwen3_dspark.py`, `spec_decode/dspark/speculator.py`
`_sample_sequential`): the backbone drafts the block's hidden states h_1..h_{B-1} in one pass, as DFlash;
then, left to right, position k's logits are

    z_k = lm_head(h_k) + markov_w2 @ markov_w1[x_{k-1}]

with x_0 the anchor and x_{k-1} the token drafted at k-1 (argmax at T = 0; a draw from softmax(z_k / T) when
drafts are sampled), and the confidence that x_k is accepted is sigmoid(proj([h_k, markov_w1[x_{k-1}]]))
(`confidence_head_with_markov`; proj over h_k alone otherwise). Training teacher-forces x_{k-1} to the gold
token (DeepSpec), which is what the sequential draft reads wherever the draft so far was right, so the
training accuracy's leading run is the greedy acceptance. A fresh drafter's Markov head is drawn like its
other weights (std 0.02: a bias of ~r x 4e-4, nothing against the head's logits, but both factors get
gradients); a warm-started one has markov_w2 = 0 and drafts exactly as its DFlash source (models/warm_start.py).
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_ds.models.drafter import BlockDraft, DFlashDrafter
from dflash_ds.models.drafter_arch import DrafterArch


class MarkovHead(nn.Module):
    """`markov_w1` (an embedding of the previous token, vocab x r) and `markov_w2` (a bias-free head, r -> vocab)."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def embed(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """[...] previous token ids -> [..., r] Markov embeddings."""
        return self.markov_w1(prev_ids)

    def bias(self, embed: torch.Tensor) -> torch.Tensor:
        """[..., r] Markov embeddings -> [..., V] logit biases."""
        return self.markov_w2(embed)


class ConfidenceHead(nn.Module):
    """`proj`: one logit from the hidden state (and the Markov embedding), computed in fp32 as vLLM does."""

    def __init__(self, input_dim: int, with_markov: bool) -> None:
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(input_dim, 1, bias=True)

    def forward(self, hidden: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
        """Confidence logits [...] of hidden [..., H] and Markov embeddings [..., r] (fp32 out)."""
        x = torch.cat([hidden, embed.to(hidden.dtype)], dim=-1) if self.with_markov else hidden
        # through proj's own forward (ZeRO-3 gathers a parameter only inside its module's forward)
        return self.proj(x.to(self.proj.weight.dtype)).float().squeeze(-1)


class DSparkDrafter(DFlashDrafter):
    """DSpark: DFlash layers, `markov_head`, optional `confidence_head`; DFlash's forwards, export and loading."""

    kind = "dspark"
    sequential = True  # the Markov chain (`draft_tokens`)

    def __init__(self, arch: DrafterArch) -> None:
        if arch.options is None:
            raise ValueError("DSparkDrafter needs arch.options (the DSpark options)")
        super().__init__(arch)
        o = arch.options
        self.markov_head = MarkovHead(arch.vocab_size, o.markov_rank)
        self.confidence_head = None
        if o.enable_confidence_head:
            dim = arch.hidden_size + (o.markov_rank if o.confidence_head_with_markov else 0)
            self.confidence_head = ConfidenceHead(dim, o.confidence_head_with_markov)


    # DeepSpec's anchor-as-first layout (models/dspark_arch.py): the backbone sees the block's first B - 1 tokens
    # (its N query slots, so attention spans exactly DeepSpec's block) and slot k reads query k - 1's state; slot 0
    # (the anchor's own, never a prediction) repeats query 0's. Everything downstream reads slots 1..B-1 as before.
    def forward_train(self, context_features: torch.Tensor, block_embeds: torch.Tensor, anchors: torch.Tensor,
                      pad: bool | None = None) -> torch.Tensor:
        """DFlash's forward_train; in the anchor-as-first layout, shifted as above."""
        if not self.arch.options.sample_from_anchor:
            return super().forward_train(context_features, block_embeds, anchors, pad)
        out = super().forward_train(context_features, block_embeds[:, :, :-1], anchors, pad)
        return torch.cat([out[:, :, :1], out], dim=2)

    def forward_infer(self, context_features: torch.Tensor | None, block_embeds: torch.Tensor, start: int,
                      cache=None) -> torch.Tensor:
        """DFlash's forward_infer; in the anchor-as-first layout, shifted as above."""
        if not self.arch.options.sample_from_anchor:
            return super().forward_infer(context_features, block_embeds, start, cache)
        out = super().forward_infer(context_features, block_embeds[:, :-1], start, cache)
        return torch.cat([out[:, :1], out], dim=1)

    @property
    def has_confidence_head(self) -> bool:
        """Whether it was built with the confidence head (model.enable_confidence_head)."""
        return self.confidence_head is not None

    def confidence_logits(self, hidden: torch.Tensor, embed: torch.Tensor) -> torch.Tensor | None:
        """The confidence head's logits [...] (None without the head)."""
        return None if self.confidence_head is None else self.confidence_head(hidden, embed)

    def draft_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """markov_w1 [V, r] and markov_w2 as [r, V], each through its module's forward: a caller that drafts many
        chunks of blocks (est_tau) then makes a fixed number of module calls, as ZeRO-3's gathers need on every rank."""
        w1 = self.markov_head.markov_w1.weight
        rows = torch.arange(w1.shape[0] if w1.numel() else self.arch.vocab_size, device=w1.device)
        eye = torch.eye(self.arch.options.markov_rank, device=w1.device, dtype=w1.dtype)
        return self.markov_head.embed(rows), self.markov_head.bias(eye)

    def draft_tokens(self, hidden: torch.Tensor, lm_head, anchor_ids: torch.Tensor, temperature: float = 0.0,
                     generator: torch.Generator | None = None,
                     tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> BlockDraft:
        """The sequential draft of final-normed hidden states [N, L, H] after anchors [N]: vLLM's rule (module doc).

        With `tables` (`draft_tables`) the Markov head is read from them and no confidence is computed."""
        base = lm_head(hidden).float()
        prev = anchor_ids
        tokens, logits, embeds = [], [], []
        for pos in range(hidden.shape[1]):
            embed = self.markov_head.embed(prev) if tables is None else tables[0][prev]
            z = base[:, pos] + (self.markov_head.bias(embed) if tables is None else embed @ tables[1]).float()
            if temperature > 0:
                probs = torch.softmax(z.double() / temperature, dim=-1)
                prev = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
            else:
                prev = z.argmax(dim=-1)
            tokens.append(prev)
            logits.append(z)
            embeds.append(embed)
        conf = None if tables is not None else self.confidence_logits(hidden, torch.stack(embeds, dim=1))
        return BlockDraft(torch.stack(tokens, dim=1), torch.stack(logits, dim=1),
                          None if conf is None else torch.sigmoid(conf))
