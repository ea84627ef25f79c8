"""PPS: prompt-level prioritized sampling with importance weights (ALGORITHMS.md §3).

Per prompt q a priority p_q; after its group is scored

    p_q = (mean_i |A_i^GRPO| + ε_p)^α                 (raw GRPO advantages; ε_p = 1e-6)

Every step draws B distinct prompts with P(q) = p_q / Σ_k p_k from the CURRENT priorities, and
weights them as prioritized experience replay does:

    w_q = (N·P(q))^(-β) / max over the drawn batch     (w ≤ 1; β annealed linearly to beta_end)

Departures from the reference code, on purpose: sampling follows the live priorities every step
(the reference effectively froze them per epoch); the weights are normalized by the batch max
(the reference's reach ~27; `is_norm: none` keeps them so, `mean` divides by the batch mean);
the priority is the group's mean |A| (`priority: mean_abs`), the expected value of the
reference's last-sample |A| (`last_abs` keeps that, `max_abs` is offered).
Unseen prompts carry the running maximum priority (1.0 at the start), so every prompt is tried.

Priorities live in a sum-tree (one float64 array, leaves at [S, S+N)), so a draw is a
vectorized descent of log2(N) levels: B of N = 10^6 costs well under a millisecond
(bench/priority_sampler.py). When the running maximum rises, the unseen leaves are raised with it
and the tree is rebuilt in O(N); that happens only on a new maximum.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

PRIORITIES = ("mean_abs", "max_abs", "last_abs")
IS_NORMS = ("batch_max", "mean", "none")   # w / max over the batch | w / mean over the batch | w as is


class PrioritySampler:
    def __init__(self, num_prompts: int, alpha: float = 0.6, beta: float = 0.4, eps: float = 1e-6,
                 priority: str = "mean_abs", seed: int = 0, beta_end: float | None = None, total_steps: int = 1,
                 is_norm: str = "batch_max"):
        if priority not in PRIORITIES:
            raise ValueError(f"pps.priority: expected one of {', '.join(PRIORITIES)}, got {priority!r}")
        if is_norm not in IS_NORMS:
            raise ValueError(f"pps.is_norm: expected one of {', '.join(IS_NORMS)}, got {is_norm!r}")
        if num_prompts < 1:
            raise ValueError("PrioritySampler: the dataset has no prompts")
        self.num_prompts, self.alpha, self.beta, self.eps, self.priority = num_prompts, alpha, beta, eps, priority
        self.is_norm = is_norm
        self.beta_end = beta if beta_end is None else beta_end
        self.total_steps = max(1, total_steps)
        self.size = 1 << max(0, (num_prompts - 1).bit_length())                 # S, a power of two ≥ N
        self.depth = self.size.bit_length() - 1
        self.tree = torch.zeros(2 * self.size, dtype=torch.float64)             # node i: children 2i, 2i+1
        self.seen = torch.zeros(num_prompts, dtype=torch.bool)
        self.max_priority = 1.0
        self.steps = 0                                                          # sample() calls so far
        self.generator = torch.Generator().manual_seed(seed)
        self.tree[self.size:self.size + num_prompts] = self.max_priority
        self._rebuild()

    # ---- the sum-tree ----
    def _rebuild(self) -> None:
        lo = self.size
        while lo > 1:
            hi, lo = lo, lo // 2
            self.tree[lo:hi] = self.tree[2 * lo:2 * hi:2] + self.tree[2 * lo + 1:2 * hi:2]

    def _set(self, indices: Tensor, values: Tensor) -> None:
        """Set leaves and re-sum their ancestors, one level at a time (numpy view of the tree).

        A parent shared by several leaves is written several times with the same sum: harmless.
        """
        tree = self.tree.numpy()
        nodes = indices.numpy() + self.size
        tree[nodes] = values.numpy()
        for _ in range(self.depth):
            nodes = nodes // 2
            tree[nodes] = tree[2 * nodes] + tree[2 * nodes + 1]

    def _draw(self, n: int) -> Tensor:
        """n independent draws (with replacement) with P(q) = p_q / Σ p. (n,)

        The descent runs in numpy on a view of the tree: the same float64 arithmetic as torch,
        at a fraction of the per-op overhead (log2 N tiny ops dominate the cost).
        """
        tree = self.tree.numpy()                                                # shares memory
        u = torch.rand(n, dtype=torch.float64, generator=self.generator).numpy() * tree[1]
        node = np.ones(n, dtype=np.int64)
        for _ in range(self.depth):                                             # descend one level
            left = tree[2 * node]
            right = u >= left
            u = np.where(right, u - left, u)
            node = 2 * node + right
        return torch.from_numpy(node - self.size)

    # ---- the sampler ----
    def priorities(self) -> Tensor:
        """p_q for every prompt (unseen ones at the running max). (N,)"""
        return self.tree[self.size:self.size + self.num_prompts].clone()

    def probabilities(self) -> Tensor:
        return self.priorities() / self.tree[1]

    def current_beta(self) -> float:
        """β for the next draw: linear from beta (first draw) to beta_end (draw number total_steps)."""
        frac = min(1.0, self.steps / max(1, self.total_steps - 1))
        return self.beta + (self.beta_end - self.beta) * frac

    def sample(self, batch_size: int) -> tuple[Tensor, Tensor]:
        """B distinct prompt indices (B,) and their IS weights (B,) float32, normalised by `is_norm`
        (ALGORITHMS.md §3b): batch_max w / max_b w (≤ 1, §3), mean w / mean_b w (the average step is
        GRPO's), none w as is (the reference code's).

        Successive sampling without replacement, in rounds: a round draws as many prompts as are
        still missing from the tree, keeps each new one in draw order (a repeat is discarded,
        which is the same as redrawing from the prompts not yet taken), then sets the kept
        leaves to 0 so that later rounds cannot hit them. Every round keeps at least one prompt
        and costs O(missing · log N), whatever the priorities (before, a loop redrew taken
        prompts and took seconds when most mass sat on fewer than B prompts). The zeroed leaves
        get their priorities back at the end.
        """
        if batch_size > self.num_prompts:
            raise ValueError(f"train.prompts_per_step: {batch_size} distinct prompts asked of {self.num_prompts}")
        leaves = self.tree.numpy()[self.size:]                                 # view: zeroing shows here
        taken, values, draws = [], [np.zeros(0)], 0
        restore = lambda: self._set(torch.tensor(taken, dtype=torch.int64), torch.from_numpy(np.concatenate(values)))
        while len(taken) < batch_size:
            if self.tree[1] <= 0:                           # the rest have priority 0 (only with eps = 0)
                restore()
                raise ValueError(f"PrioritySampler: {batch_size} distinct prompts asked, but only "
                                 f"{len(taken)} have a priority above 0")
            drawn = self._draw(batch_size - len(taken)).numpy()                 # (missing,)
            draws += len(drawn)
            drawn = drawn[leaves[drawn] > 0]                # padding leaves and (by rounding) taken ones
            kept = drawn[np.sort(np.unique(drawn, return_index=True)[1])]       # first occurrences, in draw order
            taken.extend(kept.tolist())
            values.append(leaves[kept].copy())
            self._set(torch.from_numpy(kept), torch.zeros(len(kept), dtype=torch.float64))
        indices = torch.tensor(taken, dtype=torch.int64)
        restore()                                                               # priorities back
        probs = self.tree[indices + self.size] / self.tree[1]                   # P(q)
        weights = (self.num_prompts * probs) ** (-self.current_beta())         # (B,) (N·P)^-β
        self.steps += 1
        self._last = {"draws": draws, "raw_weights": weights, "revisit": float(self.seen[indices].float().mean())}
        norm = {"batch_max": weights.max(), "mean": weights.mean(), "none": 1.0}[self.is_norm]
        return indices, (weights / norm).float()

    def batch_stats(self) -> dict[str, float]:
        """Diagnostics of the last `sample` and of the current priorities (logged each step).

        entropy: H(P) / ln N, 1 for uniform priorities, lower as sampling concentrates.
        is_max / is_min: the unnormalized (N·P)^-β of the batch (the loss uses w = these / is_max).
        ess: effective sample size of the batch's weights, (Σw)² / Σw², out of B.
        repeat_frac: fraction of raw draws that hit a prompt already in the batch (redrawn).
        revisit_frac: fraction of the batch's prompts that were scored in an earlier step.
        """
        raw = self._last["raw_weights"]
        probs = self.probabilities()
        probs = probs[probs > 0]
        entropy = float(-(probs * probs.log()).sum()) / math.log(self.num_prompts) if self.num_prompts > 1 else 1.0
        ess = float(raw.sum() ** 2 / (raw ** 2).sum())
        repeat = 1.0 - len(raw) / self._last["draws"]
        return {"entropy": entropy, "is_max": float(raw.max()), "is_min": float(raw.min()), "ess": ess,
                "repeat_frac": repeat, "revisit_frac": self._last["revisit"]}

    def update(self, indices: Tensor, abs_advantages: Tensor) -> None:
        """Set p_q = (stat_i |A_i| + ε)^α for the scored prompts. abs_advantages (B, G) ≥ 0."""
        a = abs_advantages.detach().double().cpu()
        stat = {"mean_abs": lambda: a.mean(1), "max_abs": lambda: a.amax(1), "last_abs": lambda: a[:, -1]}[self.priority]()
        values = (stat + self.eps) ** self.alpha                                # (B,)
        indices = indices.cpu().long()
        self.seen[indices] = True
        self._set(indices, values)
        new_max = float(values.max())
        if new_max > self.max_priority:                                         # unseen prompts follow the max
            self.max_priority = new_max
            leaves = self.tree[self.size:self.size + self.num_prompts]
            leaves[~self.seen] = new_max
            self._rebuild()

    def state_dict(self) -> dict:
        return {"priorities": self.priorities(), "seen": self.seen.clone(), "max_priority": self.max_priority,
                "steps": self.steps, "rng": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        if len(state["priorities"]) != self.num_prompts:
            raise ValueError(f"checkpoint sampler has {len(state['priorities'])} prompts, the dataset has "
                             f"{self.num_prompts}: resume with the same data.train")
        self.tree.zero_()
        self.tree[self.size:self.size + self.num_prompts] = state["priorities"]
        self._rebuild()
        self.seen, self.max_priority, self.steps = state["seen"].clone(), state["max_priority"], state["steps"]
        self.generator.set_state(state["rng"])
