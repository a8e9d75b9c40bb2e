"""The DFlash2 drafter: the DFlash backbone with a grouped dynamic convolution around each sublayer, plus the
candidate selector (models/dflash2_selector.py). What the engines run is read in vLLM 0.32 (below).

Convolution, as vLLM 0.32 runs it (`qwen3_dflash2.py`: `DFlashGroupedConv`, `_grouped_conv`): for the
sublayer input x (after its RMSNorm) one projection gives per-token deltas `(2, taps, groups)`;
`prepare` convolves x with side 0, `finish` the sublayer's output with side 1:

    out[i, c] = sum_{t < taps} (base_kernel[side, t, c] + delta[i, side, t, c // group]) * x[i - t, c]

where a tap reaches position i - t only inside i's block (the conv block is vLLM's
1 + num_speculative_tokens, i.e. the export's block_size when served with block_size - 1 tokens).
Context keys/values do not pass through it (the engines project them straight from the target's
features). A fresh drafter starts with the identity kernel (tap 0 = 1, zero projection): its output
is its DFlash backbone's until training moves it.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_ds.models.dflash2_selector import CandidateSelector, unary_candidates, walk
from dflash_ds.models.drafter import BlockDraft, DFlashDrafter, DrafterLayer
from dflash_ds.models.drafter_arch import DrafterArch
from dflash_ds.models.grouped_conv import grouped_conv


class GroupedDynamicConv(nn.Module):
    """`base_kernel` (2, taps, H) and `kernel_projection` H -> 2 * taps * groups (vLLM's names)."""

    def __init__(self, hidden_size: int, taps: int, group_size: int, block_size: int) -> None:
        super().__init__()
        self.taps, self.groups, self.block_size = taps, hidden_size // group_size, block_size
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.groups, bias=False)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Convolve the sublayer input with side 0; return it and side 1's deltas for `finish`."""
        delta = self.kernel_projection(x).unflatten(-1, (2, self.taps, self.groups))
        return grouped_conv(x, delta[..., 0, :, :], self.base_kernel[0], self.block_size), delta[..., 1, :, :]

    def finish(self, y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Convolve the sublayer output with side 1 (deltas from the sublayer input)."""
        return grouped_conv(y, delta, self.base_kernel[1], self.block_size)


class DFlash2Layer(DrafterLayer):
    """A DFlash draft layer whose attention and MLP are each wrapped by a convolution."""

    def __init__(self, arch: DrafterArch) -> None:
        super().__init__(arch)
        opts = arch.options
        args = (arch.hidden_size, opts.conv_kernel_size, opts.conv_group_size, arch.block_size)
        self.attention_conv = GroupedDynamicConv(*args)
        self.mlp_conv = GroupedDynamicConv(*args)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask) -> torch.Tensor:
        h, delta = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(h, cos, sin, ctx_k, ctx_v, mask), delta)
        h, delta = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), delta)


class DFlash2Drafter(DFlashDrafter):
    """DFlash2: DFlash2 layers and a `candidate_selector`; same forwards, export and loading as DFlash."""

    kind = "dflash2"
    layer_cls = DFlash2Layer
    sequential = True  # the selector's walk over the head's top-K (`draft_tokens`)

    def __init__(self, arch: DrafterArch) -> None:
        if arch.options is None:
            raise ValueError("DFlash2Drafter needs arch.options (the DFlash2 options)")
        super().__init__(arch)
        self.candidate_selector = CandidateSelector(arch.hidden_size, arch.vocab_size, arch.options.selector_rank)

    def init_weights(self, seed: int, std: float = 0.02) -> None:
        """As DFlash's, then identity convolutions: tap 0 of each base kernel 1, projections 0."""
        super().init_weights(seed, std)
        with torch.no_grad():
            for layer in self.layers:
                for conv in (layer.attention_conv, layer.mlp_conv):
                    conv.base_kernel.zero_()
                    conv.base_kernel[:, 0] = 1.0
                    conv.kernel_projection.weight.zero_()

    def _scaled(self, block_embeds: torch.Tensor) -> torch.Tensor:
        scale = self.arch.options.input_embedding_scale
        return block_embeds if scale == 1.0 else block_embeds * scale

    def forward_train(self, context_features, block_embeds, anchors, pad=None) -> torch.Tensor:
        """DFlash's training forward on the scaled block embeddings (`input_embedding_scale`)."""
        return super().forward_train(context_features, self._scaled(block_embeds), anchors, pad)

    def forward_infer(self, context_features, block_embeds, start, cache=None) -> torch.Tensor:
        """DFlash's inference forward on the scaled block embeddings (`input_embedding_scale`)."""
        return super().forward_infer(context_features, self._scaled(block_embeds), start, cache)

    def candidates(self, hidden: torch.Tensor, lm_head) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-K candidate ids and unary scores of final-normed hidden states [..., H] -> two [..., K]."""
        o = self.arch.options
        return unary_candidates(hidden, lm_head, o.selector_top_k, o.output_multiplier, o.final_logit_softcapping)

    def block_scores(self, hidden: torch.Tensor, lm_head, anchor_ids: torch.Tensor, tables: tuple | None = None):
        """Candidates [N, L, K] and edge scores [N, L, K, K] of the drafted positions' hidden states [N, L, H]."""
        ids, unary = self.candidates(hidden, lm_head)
        return ids, self.candidate_selector.edge_scores(hidden, ids, unary, anchor_ids, tables)

    def draft_tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The selector's tables, read once for a caller that drafts many chunks (dflash2_selector.CandidateSelector)."""
        return self.candidate_selector()

    def draft_tokens(self, hidden: torch.Tensor, lm_head, anchor_ids: torch.Tensor, temperature: float = 0.0,
                     generator: torch.Generator | None = None, tables: tuple | None = None) -> BlockDraft:
        """The walk's drafts [N, L], the walked K-way score rows [N, L, K] and their candidates [N, L, K]."""
        ids, scores = self.block_scores(hidden, lm_head, anchor_ids, tables)
        tokens, rows = walk(scores, ids, temperature, generator)
        return BlockDraft(tokens, rows, None, ids)
