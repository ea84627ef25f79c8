"""DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476, §3.2; docs/methods.md §9): after the rewards,
the groups whose G rewards are all equal (`estimators.zero_variance`: their advantage is 0 under their own
group's statistics, so they carry no gradient and only dilute the batch) are set aside, and more prompts are drawn
from the run's sampler and generated until the step holds B groups with a spread, or
rollout.max_sampling_rounds rounds were drawn; then the step trains on what it has, and says so in its
metrics (`ds_short`).

A round (`Draw`) is drawn by the loop (train.py: `Run.draw`): prompts from the sampler, each rank
generating its equal share, the rewards gathered (prompts, G) on every rank, and the sampler observing
every scored group, set-aside ones included (PPS: priorities; the round's importance weights). The
choices below read only those replicated rewards, so every rank makes the same ones without
communicating. With W ranks:
- round 0 is the step's B prompts, B/W on each rank;
- rank r keeps, from its own share of each round, its groups with a spread, up to its shortfall s_r
  (B/W minus what it holds); the next round draws W·m prompts, m = max_r s_r, so that every rank can
  fill its own shortfall from what it generates;
- when no rank falls short, or the rounds run out, every rank trains its first k = min_r (kept by r)
  groups: the ranks hold equal numbers of completions, as the update's collectives and the methods'
  row slices (`Context.mine`) expect. One rank trains all it kept; with several, a short step leaves
  the groups some ranks kept beyond k unused (`ds_unused_groups`). k = 0: the step trains nothing
  (train.py: `Run.idle_step`).
Departures from verl's DAPO trainer (`algorithm.filter_groups`): an extra round draws the shortfall,
not a whole generation batch of gen_batch_size prompts; a step that is still short after the last
round trains on fewer groups, where verl raises an error; the groups are told apart by the reward
the method trains on (verl's `metric`: acc by default).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from pspo.estimators import zero_variance
from pspo.rewards import RewardResult
from pspo.training.tokens import Rollout


@dataclass(kw_only=True)
class Draw:
    """Prompts generated and scored: one round, or the groups a step trains on, gathered from its rounds."""
    indices: Tensor           # (P,) dataset rows of every rank's prompts, rank-major, the same on all ranks
    rows: list[int]           # (N,) this rank's dataset row of each completion, prompt-major (N = P/W·G)
    seeds: Tensor             # (N,) the completions' seeds
    rollout: Rollout          # this rank's N completions
    scored: RewardResult      # their rewards and reward components, (N,) each
    rewards: Tensor           # (P, G) every rank's rewards
    is_weights: Tensor        # (P, G) importance weights: a round's raw ones (observe), the step's normalized
    metrics: dict[str, float] = field(default_factory=dict)   # the sampler's of its draw (+ dynamic sampling's)

    @property
    def groups(self) -> int:
        """P, every rank's prompts."""
        return len(self.indices)

    def mine(self, rank: int, world: int) -> slice:
        """This rank's rows of the (P, ...) tensors."""
        share = self.groups // world
        return slice(rank * share, (rank + 1) * share)


def keep(informative: Tensor, need: list[int]) -> list[list[int]]:
    """One round's choice: the positions (in the round's (W·m,) groups, rank-major) each rank r keeps,
    its own share's groups with a spread, the first need[r] of them. informative (W·m,) bool."""
    share = len(informative) // len(need)
    return [[j for j in range(r * share, (r + 1) * share) if informative[j]][:n] for r, n in enumerate(need)]


def dynamic_sampling(first: Draw, draw: Callable[[int, int], Draw], *, world: int, rank: int, max_rounds: int,
                     pad_id: int, normalize: Callable[[Tensor], Tensor]) -> Draw:
    """The step's groups with a spread (module docstring), from round 0 `first` (B prompts) and, while a
    rank falls short and fewer than max_rounds rounds were drawn, more rounds: draw(k, W·m) is round k of
    W·m prompts. Each round's importance weights are its draw's raw ones (the sampler's observe with
    normalized=False); the trained groups' are normalized together, as one batch, by `normalize` (the
    sampler's: PPS's is_norm over the B' prompts, docs/methods.md §3b). Returns them as one Draw (B' = W·k
    groups, B' <= B; this rank's completions padded to the longest, with pad_id) with its metrics: the last
    round's (the sampler's diagnostics of its draw), ds_rounds,
    ds_scored_groups, ds_set_aside_groups (all rewards equal), ds_trained_groups (B'), ds_unused_groups
    (with a spread, not trained) and ds_short (1 when B' < B)."""
    rounds, share = [first], first.groups // world
    need = [share] * world                                   # each rank's shortfall
    taken: list[list[tuple[int, int]]] = [[] for _ in range(world)]   # each rank's (round, position)
    set_aside = 0
    while True:
        k, current = len(rounds) - 1, rounds[-1]
        informative = ~zero_variance(current.rewards)        # (W·m,)
        set_aside += int((~informative).sum())
        for r, positions in enumerate(keep(informative, need)):
            taken[r] += [(k, j) for j in positions]
            need[r] -= len(positions)
        if max(need) == 0 or len(rounds) == max_rounds:
            break
        rounds.append(draw(len(rounds), world * max(need)))
    trained = share - max(need)                              # k: what the shortest rank holds
    out = _gather(rounds, [t[:trained] for t in taken], rank, world, pad_id)
    out.is_weights = normalize(out.is_weights)                          # (B', G) one batch's weights
    scored = sum(d.groups for d in rounds)
    out.metrics = {**rounds[-1].metrics,                                # the sampler's, of the last round's draw
                   "ds_rounds": float(len(rounds)), "ds_scored_groups": float(scored),
                   "ds_set_aside_groups": float(set_aside), "ds_trained_groups": float(out.groups),
                   "ds_unused_groups": float(scored - set_aside - out.groups),
                   "ds_short": float(out.groups < first.groups)}
    return out


def _gather(rounds: list[Draw], taken: list[list[tuple[int, int]]], rank: int, world: int, pad_id: int) -> Draw:
    """The groups `taken` (each rank's (round, position) pairs) as one Draw: every rank's in rank order,
    this rank's completions from its rounds' rollouts. Reward failures count every round's calls."""
    G = rounds[0].rewards.shape[1]
    chosen = [pair for pairs in taken for pair in pairs]                      # rank-major

    def pick(name: str) -> Tensor:
        """The chosen groups' rows of every rank's (P, ...) tensor `name`."""
        if not chosen:
            return getattr(rounds[0], name)[:0]
        return torch.stack([getattr(rounds[k], name)[j] for k, j in chosen])

    local: list[Tensor] = []                                                  # this rank's rows, per round
    for k, d in enumerate(rounds):
        start = rank * (d.groups // world)                                    # the rank's first position
        groups = torch.tensor([j - start for kk, j in taken[rank] if kk == k], dtype=torch.long)
        local.append((groups[:, None] * G + torch.arange(G)).reshape(-1))     # (n_k·G,) completion rows
    scored = [d.scored for d in rounds]
    components = {name: torch.cat([s.components[name][i] for s, i in zip(scored, local)])
                  for name in scored[0].components}
    failures = {name: sum(s.failures.get(name, 0) for s in scored) for name in scored[0].failures}
    return Draw(indices=pick("indices"), rows=[d.rows[i] for d, idx in zip(rounds, local) for i in idx.tolist()],
                seeds=torch.cat([d.seeds[i] for d, i in zip(rounds, local)]),
                rollout=_rollout_rows([d.rollout for d in rounds], local, pad_id),
                scored=RewardResult(torch.cat([s.rewards[i] for s, i in zip(scored, local)]), components, failures),
                rewards=pick("rewards"), is_weights=pick("is_weights"))


def _rollout_rows(rollouts: list[Rollout], rows: list[Tensor], pad_id: int) -> Rollout:
    """The rows `rows[k]` of each rollouts[k], in order, as one Rollout, padded on the right to the widest
    rollout that gives rows (pad_id; mask and log-probs 0)."""
    widths = [r.completion_ids.shape[1] for r, i in zip(rollouts, rows) if len(i)] or [rollouts[0].mask.shape[1]]
    T = max(widths)

    def cat(name: str, value) -> Tensor:
        parts = [getattr(r, name)[i] for r, i in zip(rollouts, rows)]
        return torch.cat([torch.nn.functional.pad(p[:, :T], (0, T - min(p.shape[1], T)), value=value)
                          for p in parts])

    texts = [r.texts[i] for r, idx in zip(rollouts, rows) for i in idx.tolist()]
    return Rollout(cat("completion_ids", pad_id), cat("mask", 0.0), cat("logprobs", 0.0),
                   torch.cat([r.truncated[i] for r, i in zip(rollouts, rows)]), texts,
                   sum(r.gen_time_s for r in rollouts))
