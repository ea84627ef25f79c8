"""SPO segment credit, docs/related.md §B (AIFrameResearch/SPO @b9fc6a2): pure tensor functions.

SPO-chain (§B chain 3-7), one completion of T tokens with sampling probabilities p_t = π_old(a_t):
    candidates J = {t : p_t < 0.9};  cut states c = t - 1 for t in J[::K]  (c = -1: the prompt)
    V(c) = mean reward of N fresh continuations of prompt + completion[:c+1]  (end state: V = R)
    A_t  = V(c_k) - V(c_{k-1})  for c_{k-1} < t <= c_k;   R - V(c_last) after the last cut;
           0 up to the first cut (no V(prompt) to subtract; those tokens all have p_t >= 0.9)
    M_t  = m_t · 1[p_t < 0.9];  A_t <- 0 where M_t = 0;  A <- whiten(A) over M, every rank
SPO-tree (§B tree 1-4), a forest stored flat: node i has parent[i] (-1 for a root) with
parent[i] < i, and a leaf (a node without children) has a reward:
    V(leaf) = reward,  V(node) = mean of its children's V  (a nested mean, not the leaves' mean)
    A(node) = V(node) - V(parent)  ["grpo": / (population std of the siblings' V + 1e-8)]
    each non-root node with A != 0 is a training sample (query: the parent's text).
The MC continuations and the tree's expansion are the engines' (`generate(..., prefix_ids=)`).
"""
from __future__ import annotations

import torch
from torch import Tensor

from pspo.estimators import ReduceSum, group_mean, whiten

PROB_THRESHOLD = 0.9      # §B chain 3 and 6: the released code's constant
# |V(node) - V(parent)| at or below this is an exact 0 (float rounding of nested means)
ZERO_TOL = 1e-9


# ---- SPO-chain ----

def select_cuts(probs: Tensor, mask: Tensor, interval: int,
                threshold: float = PROB_THRESHOLD) -> tuple[Tensor, Tensor]:
    """Cut states of every row, §B chain 3: rows (C,), cuts (C,) long, row-major and ascending.

    probs, mask (N, T): p_t of each completion token and its validity. A candidate is a valid
    token with p_t < threshold; every `interval`-th (K) candidate of a row is kept, the first
    included (the released code's J[::K]), and its cut state is c = t - 1: the prefix just before the
    token, so c = -1 (V(prompt)) exactly when the first token is a candidate.
    """
    if interval < 1:
        raise ValueError(f"spo.cutpoint_interval: expected an integer >= 1, got {interval}")
    candidate = (probs < threshold) & mask.bool()                         # (N, T) t in J
    # index of t within its row's J
    rank = candidate.long().cumsum(1) - 1                                 # (N, T)
    rows, t = (candidate & (rank % interval == 0)).nonzero(as_tuple=True)   # (C,), (C,)
    return rows, t - 1


def probability_mask(probs: Tensor, mask: Tensor, threshold: float = PROB_THRESHOLD) -> Tensor:
    """M_t = m_t · 1[p_t < threshold], §B chain 6: the only tokens that get gradient. (N, T) float

    (The released code zeroes A where p_t > 0.9 and masks the loss where p_t >= 0.9; one rule here.)"""
    return mask.float() * (probs < threshold)


def segment_advantages(rows: Tensor, cuts: Tensor, values: Tensor, *, rewards: Tensor, probs: Tensor,
                       mask: Tensor, threshold: float = PROB_THRESHOLD) -> Tensor:
    """Raw SPO-chain token advantages, §B chain 5-6, zero outside M. (N, T) float32

    rows, cuts (C,) from `select_cuts`; values (C,) V at each cut (`mc_values`); rewards (N,) R,
    the end state's value; probs, mask (N, T). Token t takes V(next cut at or after t) - V(last
    cut before t), where the end of the completion stands for "no next cut" (V = R) and "no cut
    before" gives 0.
    """
    N, T = probs.shape
    # Column j = c + 1 in [0, T-1] holds the cut c: "c < t" is "j <= t", "c >= t" is "j >= t+1".
    col = cuts + 1                                                        # (C,)
    is_cut = torch.zeros(N, T, dtype=torch.bool, device=probs.device)
    is_cut[rows, col] = True
    vals = torch.zeros(N, T, dtype=torch.float64, device=probs.device)    # (N, T) V at cut columns
    vals[rows, col] = values.to(torch.float64)
    j = torch.arange(T, device=probs.device).expand(N, T)                 # (N, T)
    prev = torch.where(is_cut, j, -1).cummax(1).values                    # (N, T) last j <= t, -1 if none
    first_after = torch.where(is_cut, j, T).flip(1).cummin(1).values.flip(1)   # (N, T) first j' >= j
    nxt = torch.cat([first_after[:, 1:], torch.full((N, 1), T, device=probs.device)], 1)  # first j >= t+1
    v_prev = vals.gather(1, prev.clamp(min=0))                            # (N, T) V(c_{k-1})
    v_next = torch.where(nxt < T, vals.gather(1, nxt.clamp(max=T - 1)),
                         rewards.to(torch.float64)[:, None].expand(N, T))  # (N, T) V(c_k), or R
    # No cut before t (prev = -1) only happens up to the first cut, whose tokens all have
    # p_t >= threshold (the first candidate is always kept): M zeroes them, as §B's "first cut gets 0".
    return ((v_next - v_prev) * probability_mask(probs, mask, threshold)).float()   # (N, T) A_t


def chain_advantages(rows: Tensor, cuts: Tensor, values: Tensor, *, rewards: Tensor, probs: Tensor,
                     mask: Tensor, threshold: float = PROB_THRESHOLD,
                     variance: str = "bessel", reduce_sum: ReduceSum) -> tuple[Tensor, Tensor]:
    """SPO-chain advantages and loss mask, §B chain 5-7: (A, M), (N, T) each.

    `segment_advantages` whitened with the mean and variance ("bessel", as §B) of the M-masked
    tokens of every rank (advantages.whiten, one all-reduce: every rank must call this together).
    The loss is then a masked mean over M, not over the completion mask.
    """
    M = probability_mask(probs, mask, threshold)                          # (N, T)
    raw = segment_advantages(rows, cuts, values, rewards=rewards, probs=probs, mask=mask, threshold=threshold)
    return whiten(raw, M, variance, reduce_sum=reduce_sum), M


def unique_prefixes(prompt_ids: list[list[int]], completion_ids: Tensor, rows: Tensor,
                    cuts: Tensor) -> tuple[Tensor, list[list[int]], Tensor]:
    """The distinct states to continue, §B chain 4: (owners (U,), prefixes (U,), inverse (C,)).

    prompt_ids: one per completion row (N); completion_ids (N, T); rows, cuts (C,). The state of a
    cut is (prompt, completion[:c+1]); identical states (the same prompt and prefix, e.g. two
    samples that agree up to their first low-probability token) are continued once. Unique
    states come in first-seen order; owners[u] is the row of state u's first cut (its prompt and
    answer), inverse[i] cut i's unique index. Continue them with
    `engine.generate([prompt_ids[r] for r in owners], N_mc, ..., prefix_ids=prefixes)`.
    """
    index: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
    owners, prefixes, inverse = [], [], []
    for row, c in zip(rows.tolist(), cuts.tolist()):
        prefix = completion_ids[row, :c + 1].tolist()
        key = (tuple(prompt_ids[row]), tuple(prefix))
        if key not in index:
            index[key] = len(owners)
            owners.append(row)
            prefixes.append(prefix)
        inverse.append(index[key])
    return torch.tensor(owners, dtype=torch.long), prefixes, torch.tensor(inverse, dtype=torch.long)


def mc_values(rewards: Tensor, n: int, inverse: Tensor) -> Tensor:
    """V(c) = mean reward of the state's n continuations, §B chain 4. (U*n,) -> (C,)

    rewards are prompt-major (state u, continuation j -> row u*n + j), as `generate` returns them.
    """
    return group_mean(rewards.view(-1, n).float())[inverse]


# ---- SPO-tree ----

def _depths(parent: Tensor) -> Tensor:
    """Depth of every node (roots 0); checks that parents precede their children. (n,) long"""
    n = parent.shape[0]
    if ((parent >= torch.arange(n)) | (parent < -1)).any():
        raise ValueError("parent: expected parent[i] in [-1, i) for every node (parents before children)")
    depth = torch.zeros(n, dtype=torch.long)
    while True:                                                           # max depth + 1 rounds
        new = torch.where(parent >= 0, depth[parent.clamp(min=0)] + 1, 0)
        if torch.equal(new, depth):
            return depth
        depth = new


def tree_values(parent: Tensor, rewards: Tensor) -> Tensor:
    """V of every node, §B tree 2: a leaf's reward, else the mean of its children's V. (n,) float64

    parent (n,) long, -1 for a root, parent[i] < i; rewards (n,): read at the leaves only (the
    nodes nobody names as parent; an internal node's entry may be anything, NaN included).
    """
    parent = parent.cpu()
    depth = _depths(parent)
    n = parent.shape[0]
    idx = torch.arange(n)
    child = parent >= 0
    n_children = torch.bincount(parent[child], minlength=n)               # (n,)
    values = torch.where(n_children > 0, 0.0, rewards.cpu().to(torch.float64))   # (n,)
    if values[n_children == 0].isnan().any():
        raise ValueError("rewards: every leaf (a node without children) needs a reward, got NaN")
    for d in range(int(depth.max()), 0, -1):                              # deepest level first
        at = idx[depth == d]                                              # every child of a depth d-1 node
        sums = torch.zeros(n, dtype=torch.float64).index_add_(0, parent[at], values[at])
        inner = (depth == d - 1) & (n_children > 0)
        values[inner] = sums[inner] / n_children[inner]
    return values


def tree_advantages(parent: Tensor, values: Tensor, scale: bool = False, eps: float = 1e-8) -> Tensor:
    """A(node) = V(node) - V(parent), §B tree 3; 0 at the roots. (n,) float64

    scale (spo "grpo" option): divided by (std + eps), std the population std of the V of the node
    and its siblings (np.std in the released code). Departure from the released code (exact
    `!= 0`, harmless with its 0/1 rewards): a difference within ZERO_TOL of 0 is set to 0, so that
    float rounding of nested means (six rewards of 0.7 average to 0.6999999999999998) does not
    keep an edge that exact arithmetic drops.
    """
    parent, values = parent.cpu(), values.cpu().to(torch.float64)
    n = parent.shape[0]
    child = parent >= 0
    # roots point at node 0, masked below
    up = parent.clamp(min=0)                                              # (n,)
    centered = torch.where(child, values - values[up], 0.0)               # (n,) V(node) - V(parent)
    centered = centered.masked_fill(centered.abs() <= ZERO_TOL, 0.0)
    if not scale:
        return centered
    n_children = torch.bincount(parent[child], minlength=n).clamp(min=1)  # (n,)
    sq = torch.zeros(n, dtype=torch.float64).index_add_(0, parent[child], centered[child] ** 2)
    # population std of the children
    std = (sq / n_children).sqrt()                                        # (n,)
    return centered / (std[up] + eps)


def tree_edges(parent: Tensor, advantages: Tensor) -> Tensor:
    """The training samples, §B tree 4: every non-root node with A != 0, ascending. (E,) long"""
    return ((parent.cpu() >= 0) & (advantages.cpu() != 0)).nonzero(as_tuple=True)[0]


def add_children(parent: Tensor, nodes: Tensor, b: int) -> Tensor:
    """The forest with b new children under each of `nodes`, appended in order (node k's children
    are contiguous, node k+1's follow): how a tree grows one depth at a time. (n,) -> (n + len(nodes)·b,)"""
    return torch.cat([parent.cpu(), nodes.cpu().long().repeat_interleave(b)])
