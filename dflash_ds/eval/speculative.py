"""Real speculative decoding with a DFlash drafter: the target verifies each drafted block in one forward.

One decode step, at block start `s` (the target's KV cache holds positions < s):
- the block is `[anchor, MASK x (B-1)]`: the anchor is the last token the target chose, not yet in its cache;
- the drafter reads the context features of positions < s (incrementally, through a DrafterCache) and
  proposes tokens for positions s+1..s+B-1 in one forward;
- the target runs `[anchor, draft...]` once; the longest draft prefix that matches the target's own
  choices is accepted, plus the target's token after it (the bonus), so a step yields 1..B tokens
  (tau counts them, bonus included, as the DFlash paper does);
- the cache keeps the K/V of the anchor and the accepted tokens; their target features feed the next draft
  (a cache that cannot be cut back, linear attention or a sliding window, is restored and the accepted
  tokens run again: `TargetSession`).
The last step may run past max_new_tokens or an eos: its accepted length is counted in full (as the
reference does) and only the returned tokens are cut.

Temperature > 0 uses speculative sampling: draft x_k from q_k, accepted with probability
min(1, p_k(x_k) / q_k(x_k)); on rejection the token is drawn from norm(max(p_k - q_k, 0)), and after a
fully accepted block the bonus is drawn from p. The output is then distributed exactly as sampling from
the target, whatever q is. Two drafts (`draft_sample`):
- "greedy" (the default): x_k = argmax of the drafter and q_k one-hot on it, so x_k is accepted with
  probability p_k(x_k). This is how the serving engines run a DFlash drafter by default (vLLM's
  `draft_sample_method` "greedy"; SGLang's target-only verification), so it is what served sampling sees.
- "probabilistic": x_k ~ q_k = softmax(draft_logits_k / T), accepted with min(1, p/q): the textbook rule
  (vLLM's `draft_sample_method` "probabilistic"). Its acceptance rate is alpha = sum min(p, q), what the
  LK losses train.
(A drafter's block positions are drafted independently of each other, so q_k is the distribution x_k was
drawn from whatever the earlier draft tokens were: the rule applies as is.) A draft function that returns
token ids is a one-hot q either way: "accept while the target's own sample equals the draft".

Target features are read with forward hooks on the decoder layers, exactly as training captures them
(`models.target.capture_hidden`): HF's `hidden_states[-1]` is the *normed* final state, not the output of
the last layer, so `output_hidden_states` would disagree with training for a drafter that reads layer L-1.
"""

from __future__ import annotations

import copy
import inspect
from typing import Callable, Iterable

import torch
from torch import nn

from dflash_ds.errors import DFlashError
from dflash_ds.eval.summary import SpecOutput, first_mismatch, summarize  # noqa: F401 - re-exported
from dflash_ds.eval.tree import verify_tree
from dflash_ds.eval.walk_draft import WalkDraft, walk_draft_fn
from dflash_ds.models.drafter import DFlashDrafter, DrafterArch, DrafterCache
from dflash_ds.models.target import decoder_layers

# draft_fn(new_context [C, n*H] | None, block_tokens [B] (anchor + MASKs), start) -> either proposed
# token ids [B-1] (long) or logits over the vocabulary [B-1, V] (float) for block positions 1..B-1.
# `new_context` holds the target features of the positions the drafter has not seen yet (up to start-1).
DraftFn = Callable[[torch.Tensor | None, torch.Tensor, int], torch.Tensor]
# A prompt is prefilled this many positions a forward (`TargetSession.prefill`); a prompt within it, in one.
# At Qwen3-8B a chunk's hidden states are 4,096 x 4,096 x 2 B = 32 MiB and its MLP's 4,096 x 12,288 x 2 B = 96 MiB;
# logits are kept for its last position only (151,936 x 4 B).
PREFILL_CHUNK = 4096


def check_drafter_matches_target(arch: DrafterArch, target_cfg: dict, drafter_name: str, target_name: str) -> None:
    """DFlashError naming both values when the drafter was built for a different target."""
    pairs = [("num_target_layers", arch.num_target_layers, "num_hidden_layers"),
             ("hidden_size", arch.hidden_size, "hidden_size"),
             ("vocab_size", arch.vocab_size, "vocab_size")]
    for name, mine, key in pairs:
        theirs = int(target_cfg[key])
        if mine != theirs:
            raise DFlashError(f"drafter {drafter_name} has {name} = {mine} but target {target_name} has {theirs}")
    bad = [i for i in arch.target_layer_ids if not 0 <= i < arch.num_target_layers]
    if bad:
        raise DFlashError(f"drafter {drafter_name} reads target layers {bad}, outside the target's "
                          f"{arch.num_target_layers} layers")


class TargetSession:
    """The target with one prompt's KV cache and hooks on the layers the drafter reads.

    Full-attention cache layers keep every position's K/V, so a partial acceptance just cuts them back
    (`keep`). Layers that cannot be cut back — a sliding window drops old entries, linear attention (Gated
    DeltaNet) folds every token into a recurrent state — are copied before a verify forward (`snapshot`)
    and put back after a partial acceptance (`restore`); the accepted tokens are then run again (`replays`).
    """

    def __init__(self, model: nn.Module, layer_ids: list[int]) -> None:
        from transformers import DynamicCache

        self.model = model
        self.layer_ids = list(layer_ids)
        # With the config the cache gets each layer's own kind (sliding window, linear-attention state).
        self.cache = DynamicCache(config=model.config)
        self.device = next(model.parameters()).device
        self.replays = 0
        self.verified_logits: torch.Tensor | None = None  # the last verify forward's logits (eval's alpha)
        # transformers 5.2x renamed `past_key_values` to `cache`; accept both spellings.
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._captured: dict[int, torch.Tensor] = {}
        layers = decoder_layers(model)
        self._hooks = [layers[i].register_forward_hook(self._keep(i)) for i in sorted(set(self.layer_ids))]

    def _keep(self, idx: int):
        def hook(_mod, _inp, out):
            self._captured[idx] = out[0] if isinstance(out, tuple) else out
        return hook

    def __enter__(self) -> "TargetSession":
        return self

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()

    @property
    def length(self) -> int:
        """Positions held in the KV cache, as an int (transformers 5.25 gives a 0-d tensor updated in place)."""
        return int(self.cache.get_seq_length())

    @property
    def croppable(self) -> bool:
        """Whether every cache layer holds plain full-attention K/V, so that `keep` can roll it back."""
        from transformers.cache_utils import DynamicLayer

        # Exact type: subclasses (sliding windows, indexer caches) hold state that slicing would corrupt.
        return all(type(layer) is DynamicLayer for layer in self.cache.layers)

    @torch.no_grad()
    def forward(self, ids: Iterable[int] | torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None = None, last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ids at positions on top of the cache; return logits [N or 1, V] and features [N, n*H] (or None)."""
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device).view(1, -1)
        out = self.model(input_ids=ids, position_ids=positions.to(self.device).view(1, -1), attention_mask=mask,
                         use_cache=True, logits_to_keep=1 if last_only else 0, **{self._cache_kw: self.cache})
        feats = torch.cat([self._captured[i][0] for i in self.layer_ids], dim=-1) if self.layer_ids else None
        return out.logits[0].float(), feats

    def prefill(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A prompt into the empty cache, `PREFILL_CHUNK` positions a forward; the last position's logits [1, V]
        and every position's features [N, n*H] (or None). A sliding-window layer's mask then spans a chunk by the
        chunk and the window, not the prompt squared: the tiny sliding-window target's 32K-token prompt took 38.6 s
        and 6 GB in one forward (bench context-falloff)."""
        feats = []
        for lo in range(0, len(ids), PREFILL_CHUNK):
            chunk = ids[lo: lo + PREFILL_CHUNK]
            logits, f = self.forward(chunk, torch.arange(lo, lo + len(chunk)), last_only=True)
            feats.append(f)
        return logits, None if feats[0] is None else torch.cat(feats)

    @torch.no_grad()
    def forward_rows(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits [R, N, V] of R independent continuations of the cache (a throwaway copy; the cache is unchanged)."""
        cache = copy.deepcopy(self.cache)
        cache.reorder_cache(torch.zeros(ids.shape[0], dtype=torch.long, device=self.device))  # batch 1 -> R
        out = self.model(input_ids=ids.to(self.device), position_ids=positions.to(self.device), use_cache=True,
                         **{self._cache_kw: cache})
        return out.logits.float()

    def snapshot(self) -> dict:
        """Copies of the cache layers that `keep` cannot roll back, and the length, for `restore`."""
        from transformers.cache_utils import DynamicLayer

        return {"length": self.length, "layers": {i: copy.deepcopy(layer) for i, layer in enumerate(self.cache.layers)
                                                  if type(layer) is not DynamicLayer}}

    def restore(self, snap: dict) -> None:
        """Put the cache back as it was at `snapshot` time (full-attention layers are cut back, the rest replaced)."""
        for i, layer in enumerate(self.cache.layers):
            if i in snap["layers"]:
                self.cache.layers[i] = snap["layers"][i]
            else:
                layer.keys, layer.values = layer.keys[..., :snap["length"], :], layer.values[..., :snap["length"], :]

    def keep(self, length: int, extra: torch.Tensor | None = None) -> None:
        """Keep cache positions < length, then append the entries at indices `extra` (the accepted tree path)."""
        if not self.croppable:
            raise DFlashError("this target's cache cannot be cut back (sliding-window / linear-attention layers): "
                              "use snapshot() and restore()")
        for layer in self.cache.layers:
            # Written against the layer tensors, not Cache.crop, whose argument changed meaning within 5.x.
            k, v = layer.keys, layer.values
            if extra is None:
                layer.keys, layer.values = k[..., :length, :], v[..., :length, :]
            else:
                idx = extra.to(k.device)
                layer.keys = torch.cat([k[..., :length, :], k[..., idx, :]], dim=-2)
                layer.values = torch.cat([v[..., :length, :], v[..., idx, :]], dim=-2)


def eos_token_ids(target: nn.Module) -> list[int]:
    """The target's end-of-sequence ids (generation config first, then model config)."""
    for cfg in (getattr(target, "generation_config", None), target.config):
        eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if eos is not None:
            return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
    return []


def _finish(tokens: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
    tokens = tokens[:max_new_tokens]
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def _pick(logits: torch.Tensor, temperature: float, gen: torch.Generator | None) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))


@torch.no_grad()
def greedy_generate(target: nn.Module, prompt_ids: list[int], max_new_tokens: int,
                    eos_ids: Iterable[int] = ()) -> list[int]:
    """Plain greedy decoding, one target forward per token with a KV cache: the lossless reference."""
    eos = set(eos_ids)
    with TargetSession(target, []) as tgt:
        logits, _ = tgt.prefill(prompt_ids)
        out = [int(logits[-1].argmax())]
        while len(out) < max_new_tokens and out[-1] not in eos:
            pos = torch.tensor([len(prompt_ids) + len(out) - 1])
            logits, _ = tgt.forward([out[-1]], pos)
            out.append(int(logits[-1].argmax()))
    return _finish(out, max_new_tokens, eos)


def drafter_draft_fn(drafter: DFlashDrafter, target: nn.Module) -> DraftFn:
    """The real drafter as a DraftFn, with its own DrafterCache: make a fresh one per prompt."""
    cache = DrafterCache(drafter.arch.num_hidden_layers)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    dtype = next(drafter.parameters()).dtype

    @torch.no_grad()
    def draft(new_context: torch.Tensor | None, block_tokens: torch.Tensor, start: int) -> torch.Tensor:
        block = embed(block_tokens.view(1, -1).to(embed.weight.device)).to(dtype)
        ctx = None if new_context is None else new_context.unsqueeze(0).to(dtype)
        hidden = drafter.forward_infer(ctx, block, start, cache)
        return head(hidden[0, 1:].to(head.weight.dtype)).float()

    return draft


def draft_fn_of(drafter: DFlashDrafter, target: nn.Module, temperature: float = 0.0, draft_sample: str = "greedy",
                generator: torch.Generator | None = None, confidence_stop: float | None = None) -> DraftFn:
    """The drafter's own draft function for one prompt: one parallel block, or the walk of a kind that drafts
    sequentially (`DFlashDrafter.sequential`, `draft_tokens`: eval/walk_draft.py)."""
    if drafter.sequential:
        return walk_draft_fn(drafter, target, temperature, draft_sample, generator, confidence_stop)
    return drafter_draft_fn(drafter, target)


# How a sampled draft is drawn (temperature > 0): the argmax, as vLLM and SGLang serve by default, or a sample.
DRAFT_SAMPLES = ("greedy", "probabilistic")


def _as_logits(draft: torch.Tensor, vocab: int) -> torch.Tensor:
    # Token ids from an oracle become one-hot "logits" (0 on the token, -inf elsewhere): argmax and
    # top-k pick the token, and softmax is a one-hot q for speculative sampling.
    if isinstance(draft, WalkDraft) or draft.dtype.is_floating_point:  # a WalkDraft carries its own q
        return draft if isinstance(draft, WalkDraft) else draft.float().cpu()
    logits = torch.full((draft.numel(), vocab), float("-inf"))
    logits[torch.arange(draft.numel()), draft.long().cpu().view(-1)] = 0.0
    return logits


def _accept_sampled(draft: list[int], q: torch.Tensor, p: torch.Tensor, gen: torch.Generator | None) -> tuple[int, int]:
    """Speculative sampling over a chain: (accepted draft tokens, next token)."""
    for k, x in enumerate(draft):
        if float(torch.rand((), generator=gen)) * float(q[k, x]) < float(p[k, x]):  # u < p/q without dividing
            continue
        resid = (p[k] - q[k]).clamp(min=0)
        resid = resid if float(resid.sum()) > 0 else p[k]
        return k, int(torch.multinomial(resid / resid.sum(), 1, generator=gen))
    return len(draft), int(torch.multinomial(p[len(draft)], 1, generator=gen))


def draw_draft(draft_logits: torch.Tensor, temperature: float, draft_sample: str,
               gen: torch.Generator | None) -> tuple[list[int], torch.Tensor | None]:
    """The chain's draft tokens and the distribution q they were drawn from (None at temperature 0)."""
    if isinstance(draft_logits, WalkDraft):  # drawn by a sequential drafter (eval/walk_draft.py)
        return draft_logits.tokens, draft_logits.q
    if temperature <= 0:
        return draft_logits.argmax(-1).tolist(), None
    if draft_sample == "greedy":  # the argmax as a one-hot q: accepted with probability p(x)
        draft = draft_logits.argmax(-1).tolist()
        q = torch.zeros_like(draft_logits)
        q[torch.arange(len(draft)), draft] = 1.0
        return draft, q
    q = torch.softmax(draft_logits / temperature, dim=-1)
    return torch.multinomial(q, 1, generator=gen).view(-1).tolist(), q


def _verify_chain(tgt: TargetSession, anchor: int, draft_logits: torch.Tensor, start: int, temperature: float,
                  gen: torch.Generator | None,
                  draft_sample: str = "greedy") -> tuple[list[int], int, torch.Tensor | None]:
    """Draft a chain, verify it in one forward, roll the cache back: (accepted tokens, bonus, their features)."""
    draft, q = draw_draft(draft_logits, temperature, draft_sample, gen)
    ids = [anchor] + draft
    snap = None if tgt.croppable else tgt.snapshot()
    logits, feats = tgt.forward(ids, torch.arange(start, start + len(ids)))
    tgt.verified_logits = logits
    if temperature <= 0:
        choice = logits.argmax(-1).tolist()
        a = 0
        while a < len(draft) and draft[a] == choice[a]:
            a += 1
        bonus = choice[a]
    else:
        p = torch.softmax(logits.cpu() / temperature, dim=-1)
        a, bonus = _accept_sampled(draft, q, p, gen)
    # The cache keeps the anchor and the accepted tokens; the bonus is the next anchor, not yet in it.
    if snap is None:
        tgt.keep(start + a + 1)
    elif a < len(draft):
        # The state has seen the rejected tokens too: back to before the block, then the accepted ones again
        # (their features from this forward are those of the accepted tokens only).
        tgt.restore(snap)
        _, feats = tgt.forward(ids[: a + 1], torch.arange(start, start + a + 1), last_only=True)
        tgt.replays += 1
    return draft[:a], bonus, None if feats is None else feats[: a + 1]


def speculative_generate(target: nn.Module, prompt_ids: list[int], *, drafter: DFlashDrafter | None = None,
                         draft_fn: DraftFn | None = None, block_size: int | None = None,
                         layer_ids: list[int] | None = None, mask_token_id: int | None = None,
                         max_new_tokens: int = 128, eos_ids: Iterable[int] = (), temperature: float = 0.0,
                         tree_budget: int | None = None, tree_top_k: int | None = None,
                         generator: torch.Generator | None = None, draft_sample: str = "greedy",
                         confidence_stop: float | None = None) -> SpecOutput:
    """Speculative decoding of one prompt; a tree_budget switches to tree drafting (temperature 0 only).

    `draft_sample` (temperature > 0): "greedy" drafts the argmax, as serving engines do by default, or
    "probabilistic" samples the draft from the drafter's distribution (module docstring). `confidence_stop`
    (a drafter with a confidence head): cut each draft where the running product of confidences falls below it.

    Block size, target layers and MASK id come from the drafter unless given; `draft_fn` replaces the
    drafter's drafting step (oracles in tests), `drafter` alone builds the real one.
    """
    if drafter is not None:
        a = drafter.arch
        block_size = a.block_size if block_size is None else block_size
        layer_ids = a.target_layer_ids if layer_ids is None else layer_ids
        mask_token_id = a.mask_token_id if mask_token_id is None else mask_token_id
        walks = drafter.sequential  # drafts token by token (models/drafter.py)
        draft_fn = draft_fn or draft_fn_of(drafter, target, temperature, draft_sample, generator, confidence_stop)
        if walks and tree_budget is not None:
            raise DFlashError(f"tree drafting is not implemented for a {drafter.kind} drafter: drop --tree-budget")
        if confidence_stop is not None and not drafter.has_confidence_head:
            raise DFlashError(f"--confidence-stop needs a drafter with a confidence head: this {drafter.kind} drafter "
                              "has none (its kind has none, or it was built without: `dflash-ds init-drafter --help` "
                              "lists each kind's fields)")
    if draft_fn is None or block_size is None:
        raise ValueError("speculative_generate needs a drafter, or a draft_fn and a block_size")
    if tree_budget is not None and temperature > 0:
        raise DFlashError("tree drafting is evaluated at temperature 0 only")
    if draft_sample not in DRAFT_SAMPLES:
        raise DFlashError(f"draft sampling {draft_sample!r}: expected one of {', '.join(DRAFT_SAMPLES)}")
    if not prompt_ids:
        raise DFlashError("empty prompt: speculative decoding needs at least one prompt token")
    eos, vocab = set(eos_ids), int(target.config.vocab_size)
    mask_id = 0 if mask_token_id is None else int(mask_token_id)
    with TargetSession(target, list(layer_ids or [])) as tgt:
        logits, new_ctx = tgt.prefill(prompt_ids)
        out = SpecOutput(tokens=[_pick(logits[-1], temperature, generator)], target_forwards=1,
                         prompt_length=len(prompt_ids))
        start = len(prompt_ids)
        while len(out.tokens) < max_new_tokens and not eos & set(out.tokens):
            anchor = out.tokens[-1]
            block = torch.full((block_size,), mask_id, dtype=torch.long)
            block[0] = anchor
            draft_logits = _as_logits(draft_fn(new_ctx, block, start), vocab)
            cut = confidence_stop is not None and 0 < draft_logits.shape[0] < block_size - 1  # a confidence stop
            if draft_logits.shape[0] != block_size - 1 and not cut:
                raise ValueError(f"draft_fn returned {draft_logits.shape[0]} positions, expected {block_size - 1}")
            if tree_budget is None:
                accepted, bonus, new_ctx = _verify_chain(tgt, anchor, draft_logits, start, temperature, generator,
                                                         draft_sample)
            else:
                accepted, bonus, new_ctx = verify_tree(tgt, anchor, draft_logits, start, tree_budget, tree_top_k)
            out.target_forwards += 1 + tgt.replays
            out.replay_forwards += tgt.replays
            tgt.replays = 0
            out.accept_lengths.append(len(accepted) + 1)
            out.drafted_tokens += draft_logits.shape[0]
            if isinstance(draft_logits, WalkDraft) and draft_logits.confidence is not None:
                judged = draft_logits.confidence[: len(accepted) + 1]  # the accepted ones and the first rejected
                out.confidence += [(c, int(k < len(accepted))) for k, c in enumerate(judged)]
                out.draft_confidence.append((list(draft_logits.confidence), len(accepted)))
                if draft_logits.logits is not None and temperature <= 0:  # what sampled drafts would be accepted at
                    z, n = draft_logits.logits, len(judged)
                    p = torch.softmax(tgt.verified_logits[:n].float().cpu(), -1)
                    alpha = torch.minimum(p, torch.softmax(z[:n].float().cpu(), -1)).sum(-1).tolist()
                    out.confidence_alpha += list(zip(judged, alpha))
            out.tokens += accepted + [bonus]
            start += len(accepted) + 1
            if tgt.length != start:
                raise RuntimeError(f"target cache holds {tgt.length} positions after a step, expected {start}")
    out.tokens = _finish(out.tokens, max_new_tokens, eos)
    return out
