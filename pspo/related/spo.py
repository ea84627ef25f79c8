"""SPO's rollouts, docs/related.md §B: what SPO-chain and SPO-tree generate and score beyond the step's
completions, for the methods `methods.spo_chain` and `methods.spo_tree`.

segments.py holds the math (cuts, values, advantages on a flat forest); this module makes the
engine calls around it, on one rank's rows: token advantages A (N, T) and the loss mask M (N, T).
- `chain_advantages_of` (§B chain 2-7): from the π_old of the step's G completions per prompt
  (logits / T; p_t = exp), the cuts are chosen, each distinct state (prompt + prefix) gets
  spo.num_mc continuations, V(cut) = their mean reward, then A and M (whitened over M).
- `SPOTree` (§B tree 1-5): grows each prompt's depth-3 tree from the step's b0 completions of at
  most M0 tokens (b1 continuations of at most M1 more under each one that did not finish; b2 to
  rollout.max_new_tokens under those), scores the leaves, keeps every non-root node with A != 0
  as an edge (query = prompt + parent's tokens, response = the node's segment) with its π_old at
  generation time, and trains edges drawn from a replay buffer: at most spo.edges_per_question
  per question per step, each drawn once, none older than spo.replay_iterations steps.
Continuations are seeded by content (sequences.prefix_seeds: the chain's states) or by the parent
(sequences.child_seeds: the tree's branches), so they do not depend on batching or ranks.

Ranks: each rank generates for its own prompts. With the transformers engine under FSDP
(`lockstep`) every rank must run the same forward passes, so continuation calls are padded to the
busiest rank's request count (copies, whose results are dropped but whose tokens are counted as
generated: they were). Departure from the released code (edges kept per process): the tree's
replay buffer is all-gathered and identical on every rank, the drawn edges are dealt out
round-robin, so the trained edges do not depend on the number of ranks and the buffer is
checkpointed with the rest of the replicated trainer state.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from pspo.training import distributed
from pspo.estimators import whiten
from pspo.training.config import Config
from pspo.training.distributed import Dist
from pspo.rewards import RewardResult, Score
from pspo.related.spo_segments import (add_children, chain_advantages, mc_values, probability_mask,
                                       select_cuts, tree_advantages, tree_edges, tree_values, unique_prefixes)
from pspo.training.logprobs import score_policy
from pspo.training.metrics import ChainSums, RolloutSums, TreeSums
from pspo.training.tokens import Rollout
from pspo.training.micro_batches import TokenRows, token_rows
from pspo.engines.sampling import child_seeds, prefix_seeds


def _continue(engine, prompt_ids: list[list[int]], prefixes: list[list[int]], n: int, temperature: float,
              top_p: float, max_new_tokens: int, seeds: Tensor, lockstep: bool, filler: list[int],
              device: torch.device) -> Rollout | None:
    """engine.generate(prompt_ids, n, ..., prefix_ids=prefixes), or None with nothing to continue.

    lockstep: every rank calls with as many requests as the busiest (all-reduce), the extra ones
    copies of the first request (of `filler` + an empty prefix on a rank with none); only the
    real requests' n rows each come back.
    """
    count = len(prefixes)
    total = int(distributed.all_reduce_max(torch.tensor(float(count), device=device))) if lockstep else count
    if total == 0:
        return None
    if total > count:
        first = ((prompt_ids[0], prefixes[0], seeds[:n]) if count
                 else (filler, [], torch.zeros(n, dtype=torch.long)))
        prompt_ids = prompt_ids + [first[0]] * (total - count)
        prefixes = prefixes + [first[1]] * (total - count)
        seeds = torch.cat([seeds, first[2].repeat(total - count)])
    out = engine.generate(prompt_ids, n, temperature, top_p, max_new_tokens, seeds, prefix_ids=prefixes)
    k = count * n
    return Rollout(out.completion_ids[:k], out.mask[:k], out.logprobs[:k], out.truncated[:k], out.texts[:k],
                   out.gen_time_s) if count else None


def _old_logp(policy, prompts: list[list[int]], completion_ids: Tensor, mask: Tensor, pad_id: int,
              cfg: Config, device: torch.device) -> Tensor:
    """The trainer's log π_old (logits / T) of completions (N, T) after `prompts`, on the CPU.
    A forward pass, micro-batched as the update's: every rank must call it together."""
    rows = token_rows(prompts, completion_ids, mask, pad_id, device)
    old, _ = score_policy(policy, None, rows, cfg=cfg, need_old=True, need_ref=False)
    return old.cpu()


# ---- SPO-chain ----

def chain_advantages_of(engine, rollout: Rollout, *, rewards: Tensor, old_logp: Tensor,
                        prompt_ids: list[list[int]], examples: list[int], score: Score, cfg: Config,
                        step: int, device: torch.device,
                        lockstep: bool) -> tuple[Tensor, Tensor, ChainSums]:
    """SPO-chain's token advantages and loss mask for this rank's N completions, §B chain 2-7.

    rollout: the step's completions (N rows, prompt-major); rewards (N,) their R; old_logp (N, T)
    their π_old (logits / T), scored by the trainer; prompt_ids and examples (dataset rows) one per
    completion; score(rows, texts) scores completions of rows. The cuts are chosen from p_t =
    exp(old_logp), each distinct state (prompt + prefix) gets spo.num_mc continuations, V(cut) = their
    mean reward, then A and M (whitened over M). Returns A (N, T), M (N, T) on the CPU and this
    rank's counts (C cuts, U distinct states, Σ M).
    Collective: the whitening all-reduce and, under lockstep, the continuation calls.
    """
    r, s, mask = cfg.rollout, cfg.spo, rollout.mask
    # top-p ignored (§B chain 2)
    probs = old_logp.cpu().exp()                                          # (N, T) p_t
    rows, cuts = select_cuts(probs, mask, s.cutpoint_interval)            # (C,), (C,)
    owners, prefixes, inverse = unique_prefixes(prompt_ids, rollout.completion_ids,
                                                rows, cuts)               # (U,), U, (C,)
    owners = owners.tolist()
    seeds = prefix_seeds(cfg.train.seed, step, [prompt_ids[o] + q for o, q in zip(owners, prefixes)],
                         s.num_mc)
    out = _continue(engine, [prompt_ids[o] for o in owners], prefixes, s.num_mc, r.temperature, r.top_p,
                    r.max_new_tokens, seeds, lockstep, prompt_ids[0], device)
    values = torch.zeros(0)
    # V(c): mean reward of N continuations
    if out is not None:
        mc_rewards = score([examples[o] for o in owners for _ in range(s.num_mc)],
                           out.texts).rewards                             # (U*N,)
        values = mc_values(mc_rewards, s.num_mc, inverse)                 # (C,)
    advantages, loss_mask = chain_advantages(rows, cuts, values, rewards=rewards.cpu(), probs=probs, mask=mask,
                                             reduce_sum=distributed.all_reduce_sum)   # (N, T) each
    counts = ChainSums(spo_cuts=float(len(cuts)), spo_states=float(len(owners)),
                       spo_mask_tokens=float(loss_mask.sum()))
    return advantages, loss_mask, counts


# ---- SPO-tree ----

@dataclass
class Edge:
    """One SPO-tree training sample (§B tree 4): query = the prompt + `prefix`, response = `segment`."""
    example: int              # dataset row of the prompt: the question the replay buffer groups by
    born: int                 # the step whose tree it came from
    prefix: Tensor            # (L_p,) long, the parent's completion tokens
    segment: Tensor           # (L_s,) long, the node's own tokens
    old_logp: Tensor          # (L_s,) float32, the trainer's log π_old of the segment when it was generated
    advantage: float          # A(node) = V(node) - V(parent) [/ (sibling std + 1e-8)]


@dataclass
class _Forest:
    """One rank's trees, flat (segments.py's layout): per node its parent (-1: a root, the prompt),
    the prompt it grew from, its completion tokens so far, its seed, and how its segment ended."""
    parent: Tensor            # (nodes,) long
    owner: list[int]          # index of the node's prompt among the rank's prompts
    tokens: list[list[int]]   # completion tokens from the prompt to the end of this node's segment
    seed: list[int]           # the seed that generated the segment (its children's come from it)
    truncated: list[bool]     # the segment hit its token budget without a stop token
    leaf: list[bool]          # finished, or at the last depth: scored, not continued
    text: list[str]           # the decoded completion so far (what a leaf is scored on)

    def add(self, parents: list[int], b: int, out: Rollout, seeds: Tensor, last: bool) -> list[int]:
        """b children under each of `parents` from one generate call (rows parent-major); returns
        the new nodes to continue (not leaves)."""
        self.parent = add_children(self.parent, torch.tensor(parents, dtype=torch.long), b)
        first = len(self.owner)
        for k, i in enumerate(j for j in parents for _ in range(b)):
            self.owner.append(self.owner[i])
            self.tokens.append(self.tokens[i] + out.completion_ids[k, :int(out.mask[k].sum())].tolist())
            self.seed.append(int(seeds[k]))
            self.truncated.append(bool(out.truncated[k]))
            self.text.append(out.texts[k])
            self.leaf.append(last or not self.truncated[-1])              # depth 2 is scored whatever
        return [j for j in range(first, len(self.owner)) if not self.leaf[j]]


@dataclass
class TreeStep:
    """This rank's share of the step's drawn edges, with what the step's trees were."""
    rows: TokenRows           # prompt + parent prefix, then the segment, on the rank's device
    advantages: Tensor        # (E, T) A broadcast over each segment's tokens of M, whitened
    loss_mask: Tensor         # (E, T) M
    old_logp: Tensor          # (E, T) the segments' π_old, from when they were generated
    leaves: RolloutSums       # this rank's trees' leaves: the step's completions
    counts: TreeSums


class SPOTree:
    """SPO-tree's expansion, edges and replay buffer (§B tree 1-5); the buffer is replicated."""

    def __init__(self, cfg: Config, train_ids: list[list[int]], pad_id: int, dist_: Dist, lockstep: bool):
        self.cfg, self.train_ids, self.pad_id = cfg, train_ids, pad_id
        self.dist, self.lockstep = dist_, lockstep
        self.edges: list[Edge] = []

    def step(self, engine, policy, *, examples: list[int], rollout: Rollout, seeds: Tensor, scored: RewardResult,
             step: int, score: Score) -> TreeStep:
        """Grow the trees of this rank's prompts (dataset rows `examples`) from their depth-0 completions
        (`rollout`: b0 per prompt, at most M0 tokens, generated with `seeds` and scored as `scored`),
        add their edges to the buffer, draw this step's. Collective."""
        r, s = self.cfg.rollout, self.cfg.spo
        b, (m0, m1) = s.branch_factors, s.segments
        prompts = [self.train_ids[e] for e in examples]
        n = len(examples)
        forest = _Forest(torch.full((n,), -1, dtype=torch.long), list(range(n)), [[] for _ in range(n)],
                         [0] * n, [False] * n, [False] * n, [""] * n)     # the roots are the prompts
        frontier = forest.add(list(range(n)), b[0], rollout, seeds, last=False)   # §B tree 1, depth 0
        # b_d continuations of each unfinished node
        for depth, budget in ((1, m0 + m1), (2, r.max_new_tokens)):
            kids = child_seeds(torch.tensor([forest.seed[i] for i in frontier], dtype=torch.long), b[depth])
            out = _continue(engine, [prompts[forest.owner[i]] for i in frontier],
                            [forest.tokens[i] for i in frontier], b[depth], r.temperature, r.top_p, budget,
                            kids, self.lockstep, prompts[0], self.dist.device)
            if out is not None:  # None: nothing to grow here (no break: under lockstep other ranks may call)
                frontier = forest.add(frontier, b[depth], out, kids, last=depth == 2)
        leaves = [j for j in range(len(forest.owner)) if forest.leaf[j]]
        leaf_scores = _leaf_scores(leaves, n, len(rollout.texts), scored, score,
                                   [examples[forest.owner[j]] for j in leaves],
                                   [forest.text[j] for j in leaves])
        node_rewards = torch.full((len(forest.owner),), float("nan"), dtype=torch.float64)
        node_rewards[leaves] = leaf_scores.rewards.double()
        values = tree_values(forest.parent, node_rewards)                 # (nodes,) §B tree 2
        advantages = tree_advantages(forest.parent, values, s.tree_scale)   # (nodes,) §B tree 3
        new = self._score_edges(policy, forest, tree_edges(forest.parent, advantages).tolist(), advantages,
                                examples, step)
        self.edges += self._gather(new, step)
        drawn, expired = self._draw(step)
        share = drawn[self.dist.rank::self.dist.world_size]
        rewards = leaf_scores.rewards.double()                            # (leaves,)
        per_tree = [rewards[[k for k, j in enumerate(leaves) if forest.owner[j] == q]] for q in range(n)]
        sums = RolloutSums(
            completions=len(leaves), groups=n, completion_tokens=sum(len(forest.tokens[j]) for j in leaves),
            reward=float(rewards.sum()), reward_sq=float((rewards ** 2).sum()),
            accuracy=float(leaf_scores.components["accuracy"].sum()),
            format=float(leaf_scores.components["format"].sum()),
            zero_std_groups=sum(bool((x == x[0]).all()) for x in per_tree),
            truncated=sum(forest.truncated[j] for j in leaves),
            reward_failures=sum(leaf_scores.failures.values()))
        counts = TreeSums(spo_nodes=len(forest.owner) - n, spo_new_edges=len(new), spo_edges=len(share),
                          # replicated values, the same on every rank: counted once
                          spo_buffer=len(self.edges) if self.dist.is_main else 0,
                          spo_expired=expired if self.dist.is_main else 0)
        return self._batch(share or [self._dummy(forest.tokens[n], examples[0], step)], sums, counts)

    def _score_edges(self, policy, forest: _Forest, ids: list[int], advantages: Tensor, examples: list[int],
                     step: int) -> list[Edge]:
        """This rank's new edges (nodes `ids`) with the trainer's π_old of their segments: one
        forward pass, of at least one row so that every rank runs it (a rank without edges scores
        its first depth-0 node and drops it)."""
        rows = ids or [len(examples)]
        edges = []
        for i in rows:
            tokens, start = forest.tokens[i], len(forest.tokens[int(forest.parent[i])])
            edges.append(Edge(examples[forest.owner[i]], step, torch.tensor(tokens[:start], dtype=torch.long),
                              torch.tensor(tokens[start:], dtype=torch.long), torch.zeros(0),
                              float(advantages[i])))
        completion, mask = _pad([e.segment for e in edges], self.pad_id)
        prompts = [self.train_ids[e.example] + e.prefix.tolist() for e in edges]
        old = _old_logp(policy, prompts, completion, mask, self.pad_id, self.cfg, self.dist.device)   # (E, T)
        for e, logp in zip(edges, old):
            e.old_logp = logp[:len(e.segment)].float().clone()
        return edges if ids else []

    def _gather(self, edges: list[Edge], step: int) -> list[Edge]:
        """Every rank's new edges, in rank order (all-gathers of ragged tensors)."""
        gather = distributed.all_gather_ragged
        meta = gather(torch.tensor([[e.example, len(e.prefix), len(e.segment)] for e in edges],
                                   dtype=torch.long).reshape(-1)).view(-1, 3)
        adv = gather(torch.tensor([e.advantage for e in edges], dtype=torch.float64))
        tokens = [torch.cat([e.prefix, e.segment]) for e in edges] or [torch.zeros(0, dtype=torch.long)]
        toks = gather(torch.cat(tokens))
        logp = gather(torch.cat([e.old_logp for e in edges] or [torch.zeros(0)]))
        out, t, j = [], 0, 0
        # copies: no view keeps the step's tensors
        for (example, p, q), a in zip(meta.tolist(), adv.tolist()):
            out.append(Edge(example, step, toks[t:t + p].clone(), toks[t + p:t + p + q].clone(),
                            logp[j:j + q].clone(), a))
            t, j = t + p + q, j + q
        return out

    def _draw(self, step: int) -> tuple[list[Edge], int]:
        """§B tree 5: edges from spo.replay_iterations or more steps ago expire; then at most
        spo.edges_per_question per question are drawn at random and leave the buffer; of those at
        most spo.edges_per_step (if > 0) are kept, a random subset (the released code's cap). Seeded by
        (seed, step): the same on every rank. Returns (drawn, number expired)."""
        s = self.cfg.spo
        alive = [e for e in self.edges if step - e.born < s.replay_iterations]
        expired = len(self.edges) - len(alive)
        g = torch.Generator().manual_seed(self.cfg.train.seed * 1_000_003 + step)
        by_question: dict[int, list[int]] = {}
        for i, e in enumerate(alive):
            by_question.setdefault(e.example, []).append(i)
        drawn: list[int] = []
        for ids in by_question.values():
            if len(ids) > s.edges_per_question:
                ids = [ids[int(k)] for k in torch.randperm(len(ids), generator=g)[:s.edges_per_question]]
            drawn += ids
        taken = set(drawn)
        self.edges = [e for i, e in enumerate(alive) if i not in taken]
        if s.edges_per_step and len(drawn) > s.edges_per_step:
            drawn = [drawn[int(k)] for k in torch.randperm(len(drawn), generator=g)[:s.edges_per_step]]
        return [alive[i] for i in sorted(drawn)], expired

    def _dummy(self, segment: list[int], example: int, step: int) -> Edge:
        """A rank that draws no edge trains one with no loss (M = 0: π_old = 1, A = 0), so that
        every rank runs the update's forward and backward passes."""
        tokens = torch.tensor(segment, dtype=torch.long)
        return Edge(example, step, torch.zeros(0, dtype=torch.long), tokens, torch.zeros(len(tokens)), 0.0)

    def _batch(self, edges: list[Edge], leaves: RolloutSums, counts: TreeSums) -> TreeStep:
        """§B tree 4 and 7: A broadcast over each segment, zeroed outside M = 1[p < 0.9] (p from
        the stored π_old), whitened over the M tokens of every rank (collective)."""
        device = self.dist.device
        completion, mask = _pad([e.segment for e in edges], self.pad_id)  # (N, T)
        old_logp, _ = _pad([e.old_logp for e in edges], 0.0)              # (N, T)
        loss_mask = probability_mask(old_logp.exp(), mask)               # (N, T) M
        raw = torch.tensor([e.advantage for e in edges], dtype=torch.float32)[:, None] * loss_mask
        advantages = whiten(raw, loss_mask, reduce_sum=distributed.all_reduce_sum)   # (N, T)
        prompts = [self.train_ids[e.example] + e.prefix.tolist() for e in edges]
        rows = token_rows(prompts, completion, mask, self.pad_id, device)
        return TreeStep(rows, advantages.to(device), loss_mask.to(device), old_logp.to(device), leaves,
                        counts)

    def state_dict(self) -> dict:
        e = self.edges
        return {"example": torch.tensor([x.example for x in e], dtype=torch.long),
                "born": torch.tensor([x.born for x in e], dtype=torch.long),
                "advantage": torch.tensor([x.advantage for x in e], dtype=torch.float64),
                "prefix": [x.prefix for x in e], "segment": [x.segment for x in e],
                "old_logp": [x.old_logp for x in e]}

    def load_state_dict(self, state: dict) -> None:
        self.edges = [Edge(int(q), int(b), p, s, lp, float(a)) for q, b, a, p, s, lp in
                      zip(state["example"], state["born"], state["advantage"], state["prefix"],
                          state["segment"], state["old_logp"])]


def _leaf_scores(leaves: list[int], n: int, depth0: int, scored: RewardResult, score: Score,
                 examples: list[int], texts: list[str]) -> RewardResult:
    """The rewards of a forest's leaves (node ids `leaves`, in node order; examples / texts one per
    leaf). A depth-0 leaf (node n .. n + depth0 - 1) keeps its score from the step's rollout
    (`scored`, one per depth-0 node); the deeper leaves are scored here, in one call. A failed call
    on a depth-0 node that was continued still counts in `failures` (it was made)."""
    first = [k for k, j in enumerate(leaves) if j < n + depth0]          # the depth-0 leaves come first
    rows = torch.tensor([leaves[k] - n for k in first], dtype=torch.long)
    names = scored.components.keys()
    if len(first) < len(leaves):
        deeper = score(examples[len(first):], texts[len(first):])
    else:                                                                 # every tree ended at depth 0
        deeper = RewardResult(torch.zeros(0), {k: torch.zeros(0) for k in names}, {})
    return RewardResult(torch.cat([scored.rewards[rows], deeper.rewards]),
                        {k: torch.cat([scored.components[k][rows], deeper.components[k]]) for k in names},
                        {k: scored.failures.get(k, 0) + deeper.failures.get(k, 0)
                         for k in set(scored.failures) | set(deeper.failures)})


def _pad(rows: list[Tensor], value) -> tuple[Tensor, Tensor]:
    """Right-padded (N, T) stack of 1-D tensors and its (N, T) float validity mask."""
    width = max(1, max(len(x) for x in rows))
    out = torch.full((len(rows), width), value, dtype=rows[0].dtype)
    mask = torch.zeros(len(rows), width)
    for i, x in enumerate(rows):
        out[i, :len(x)], mask[i, :len(x)] = x, 1.0
    return out, mask
