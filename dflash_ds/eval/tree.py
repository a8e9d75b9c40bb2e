"""Tree drafting (DDTree-style): many candidate continuations from one drafter forward, verified at once.

One DFlash block forward gives an independent distribution per block position k = 1..B-1. A path
(t_1, ..., t_d) scores sum_k log q_k(t_k); the tree holds the `budget` highest-scoring paths' nodes,
built best-first: a node at depth k picks among the top tokens of position k. Because a child never
scores above its parent and the (k+1)-th best sibling never above the k-th, a heap holding each
placed node's first child and next sibling always holds the best node not yet placed, so the tree
is exactly the top-`budget` set and is nested across budgets (a bigger budget only adds nodes).

Verification: the target runs [anchor, node_1, ..., node_N] in one forward, with position ids
start + depth and a 4D additive mask where a node sees the cached prefix, its ancestors and itself.
transformers 5 passes a 4D mask through unchanged (`masking_utils._preprocess_mask_arguments`), and
an additive float mask works for both the sdpa and eager attention (a boolean one would be *added*
by eager). Walking from the root along children that equal the target's greedy choice gives the
accepted path; the target's choice after its last node is the bonus.

Targets whose cache cannot be cut back (sliding windows, linear attention) verify the root-to-leaf paths
as rows of one batched forward on a copy of the cache instead (`path_choices`), then run the accepted path
once on the real cache: exact for any causal LM, at the price of that second forward.

Cache handling (cut-back caches): the forward appended the K/V of all N+1 tree tokens. Each entry was computed with
its true position and only its ancestors in view, i.e. exactly what sequential decoding of the path
would store, so the cache keeps the prefix and *gathers* the path's entries behind it (no second
forward). Keys carry RoPE of their position, and the path's positions are start, start+1, ... in order.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch


# Each row of a batched path verification holds its own copy of the cache: this caps the copies alive at once.
ROWS_PER_FORWARD = 16


@dataclass
class DraftTree:
    """Draft nodes in placement order; index 0 of the verify sequence is the anchor (root)."""

    tokens: list[int]  # token of node i (verify index i + 1)
    parents: list[int]  # verify index of node i's parent (0 = the anchor)
    depths: list[int]  # block position of node i (1..B-1)
    scores: list[float]  # path log-probability of node i


def build_tree(logprobs: torch.Tensor, budget: int, top_k: int | None = None) -> DraftTree:
    """Best-first tree of the `budget` highest path scores; logprobs [B-1, V] per block position.

    top_k caps the children per node (top_k=1 gives the single greedy chain); tokens with log-prob
    -inf are never placed.
    """
    if budget < 1:
        raise ValueError(f"tree budget must be >= 1, got {budget}")
    depth_max, vocab = logprobs.shape
    k = min(budget if top_k is None else top_k, vocab)
    top_lp, top_tok = logprobs.float().topk(k, dim=-1)
    top_lp, top_tok = top_lp.tolist(), top_tok.tolist()
    tree = DraftTree([], [], [], [])
    # heap entries: (-score, tiebreak, parent verify index, parent score, position index d (depth d+1), rank)
    heap = [(-top_lp[0][0], 0, 0, 0.0, 0, 0)]
    pushed = 1
    while heap and len(tree.tokens) < budget:
        neg, _, parent, parent_score, d, rank = heapq.heappop(heap)
        if neg == float("inf"):
            break  # only impossible tokens are left
        tree.tokens.append(top_tok[d][rank])
        tree.parents.append(parent)
        tree.depths.append(d + 1)
        tree.scores.append(-neg)
        me = len(tree.tokens)  # this node's verify index
        if rank + 1 < k:  # next sibling
            heapq.heappush(heap, (-(parent_score + top_lp[d][rank + 1]), pushed, parent, parent_score, d, rank + 1))
            pushed += 1
        if d + 1 < depth_max:  # first child
            heapq.heappush(heap, (neg - top_lp[d + 1][0], pushed, me, -neg, d + 1, 0))
            pushed += 1
    return tree


def ancestor_matrix(parents: list[int]) -> torch.Tensor:
    """[N+1, N+1] boolean: row i is True at i's ancestors (root included) and i itself."""
    n = len(parents) + 1
    anc = torch.zeros(n, n, dtype=torch.bool)
    anc[0, 0] = True
    for i, p in enumerate(parents, start=1):  # parents precede children, so row p is complete
        anc[i] = anc[p]
        anc[i, i] = True
    return anc


def tree_attention_mask(parents: list[int], past_len: int, dtype: torch.dtype,
                        device: torch.device | str = "cpu") -> torch.Tensor:
    """Additive 4D mask [1, 1, N+1, past_len + N+1]: 0 where a tree token may look, dtype-min elsewhere."""
    anc = ancestor_matrix(parents)
    seen = torch.cat([torch.ones(anc.shape[0], past_len, dtype=torch.bool), anc], dim=1)
    mask = torch.zeros(seen.shape, dtype=dtype).masked_fill(~seen, torch.finfo(dtype).min)
    return mask.to(device)[None, None]


def accept_path(tree: DraftTree, choice: list[int]) -> tuple[list[int], int]:
    """Longest root path whose tokens are the target's greedy choices: (verify indices incl. root, bonus)."""
    children: dict[int, dict[int, int]] = {}
    for i, (tok, parent) in enumerate(zip(tree.tokens, tree.parents), start=1):
        children.setdefault(parent, {})[tok] = i
    path = [0]
    while (nxt := children.get(path[-1], {}).get(choice[path[-1]])) is not None:
        path.append(nxt)
    return path, choice[path[-1]]


def root_paths(parents: list[int]) -> list[list[int]]:
    """Verify indices from the root (0) to each leaf, leaves in placement order."""
    inner = set(parents)
    paths = []
    for leaf in range(1, len(parents) + 1):
        if leaf in inner:
            continue
        path = [leaf]
        while path[-1] != 0:
            path.append(parents[path[-1] - 1])
        paths.append(path[::-1])
    return paths or [[0]]


def path_choices(tgt, ids: list[int], tree: DraftTree, start: int) -> list[int]:
    """The target's greedy choice after every verify index, from batched forwards of the root-to-leaf paths.

    For targets whose cache cannot be cut back: linear attention runs its recurrence over the tokens in
    sequence order and ignores a 4D mask, so a tree cannot share one sequence there. Each path is its own
    row (right-padded with its last token; a causal row never sees its padding) on a copy of the cache.
    """
    paths = root_paths(tree.parents)
    width = max(len(p) for p in paths)
    rows = torch.tensor([[ids[i] for i in p] + [ids[p[-1]]] * (width - len(p)) for p in paths])
    positions = start + torch.arange(width).expand(len(paths), width)
    best = []
    for r in range(0, len(paths), ROWS_PER_FORWARD):
        best += tgt.forward_rows(rows[r:r + ROWS_PER_FORWARD], positions[r:r + ROWS_PER_FORWARD]).argmax(-1).tolist()
    choice = [0] * len(ids)
    for path, row in zip(paths, best):
        for j, node in enumerate(path):
            choice[node] = row[j]
    return choice


@torch.no_grad()
def verify_tree(tgt, anchor: int, draft_logits: torch.Tensor, start: int, budget: int,
                top_k: int | None = None) -> tuple[list[int], int, torch.Tensor | None]:
    """Build, verify and accept one tree on a TargetSession: (accepted tokens, bonus, path features)."""
    tree = build_tree(torch.log_softmax(draft_logits.float(), dim=-1), budget, top_k)
    ids = [anchor] + tree.tokens
    if not tgt.croppable:
        path, bonus = accept_path(tree, path_choices(tgt, ids, tree, start))
        # The session's cache is still at `start`: advancing it over the accepted path gives its state and features.
        _, feats = tgt.forward([ids[i] for i in path], torch.arange(start, start + len(path)), last_only=True)
        tgt.replays += 1
        return [ids[i] for i in path[1:]], bonus, feats
    positions = start + torch.tensor([0] + tree.depths)
    dtype = next(tgt.model.parameters()).dtype
    mask = tree_attention_mask(tree.parents, start, dtype, tgt.device)
    logits, feats = tgt.forward(ids, positions, mask=mask)
    path, bonus = accept_path(tree, logits.argmax(-1).tolist())
    idx = torch.tensor(path)
    tgt.keep(start, extra=start + idx)
    return [ids[i] for i in path[1:]], bonus, None if feats is None else feats[idx.to(feats.device)]
