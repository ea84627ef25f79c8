"""PPS as the paper's released code ran it (`pps.mode: released`, docs/methods.md §3a).

The official code (PSPO's `PERRepeatSampler` in `ergrpo_trainer.py`) differs from the paper's
description (priority_sampler.py) in three ways, kept here exactly so that its runs can be
reproduced:

  1. Epoch-frozen draws WITH replacement. At the start of an epoch it draws N row indices (one
     per dataset row) from the priorities of that moment and serves them in order, B per step.
     Priority updates change what is drawn only at the next epoch; a prompt can come twice in a
     step. (Its released recipes ran under one epoch: their prompt choice was uniform with
     replacement.) Our loop needs B prompts every step, so an epoch's last < B draws are dropped
     and a new epoch begins (the released code served them as a short batch).
  2. Last-sample priority. For each completion j of a group, in order, the prompt's priority is
     set to p_q = (|A_j^GRPO| + 1e-6)^α, so the last completion's value remains.
  3. Unnormalised weights per completion, computed right after that completion's own write:

         w_j = (N·P(q) + 1e-8)^(-β),   P(q) = p_q / (Σ_k p_k + 1e-8)

     multiplying that completion's advantage in the policy-gradient term only. Early on Σp ≈ N,
     so w_j ≈ (|A_j| + 1e-6)^(-0.6β): zero-advantage completions get weights up to ~27.

All rows start at priority 1 (1^α). Rows with the same problem text share one priority, the
first such row's (the released code keys its priorities by a hash of the problem): pass `leaf_of`,
the first row of each row's problem. α and β are fixed (no annealing, no normalisation).
The state (priorities, the epoch's draws, the position in them, the RNG) is the same on every
rank, since every rank draws with the same seed and applies the same (all-gathered) updates.
"""
from __future__ import annotations

import torch
from torch import Tensor

from pspo.estimators import group_advantages
from pspo.priority_sampler import check_resumed_prompts

PRIORITY_EPS, PROB_EPS, WEIGHT_EPS = 1e-6, 1e-8, 1e-8        # the released code's constants


class ReleasedSampler:
    def __init__(self, num_prompts: int, *, alpha: float = 0.6, beta: float = 0.4, seed: int = 0,
                 leaf_of: Tensor | None = None, scale_rewards: bool = True, adv_eps: float = 1e-4):
        if num_prompts < 1:
            raise ValueError("ReleasedSampler: the dataset has no prompts")
        self.num_prompts, self.alpha, self.beta = num_prompts, alpha, beta
        self.scale_rewards, self.adv_eps = scale_rewards, adv_eps        # the raw GRPO |A| (§1)
        self.leaf_of = torch.arange(num_prompts) if leaf_of is None else leaf_of.long().clone()   # (N,)
        self.tree = torch.ones(num_prompts, dtype=torch.float64)     # p_q per row: 1 at the start
        self.order = torch.zeros(0, dtype=torch.int64)               # this epoch's N draws
        self.position, self.epoch = 0, 0
        self.last_sample: dict[str, float] | None = None            # the last sample's statistics (batch_stats)
        self.generator = torch.Generator().manual_seed(seed)

    def priorities(self) -> Tensor:
        """Each row's own priority (N,): rows after the first of a duplicated problem keep 1, as in
        the released code, and are drawn so; their groups update (and weigh by) the first row's."""
        return self.tree.clone()

    def probabilities(self) -> Tensor:
        """The probability of each row at the next epoch's draws. (N,)"""
        return self.tree / self.tree.sum()

    def sample(self, batch_size: int, *, same_step: bool = False) -> Tensor:
        """The next B rows of the epoch's draws (B,). Their weights are per completion and come from
        `observe`, after each completion's own priority write (β is fixed: same_step changes nothing)."""
        if batch_size > self.num_prompts:
            raise ValueError(f"train.prompts_per_step: {batch_size} prompts per step asked of "
                             f"{self.num_prompts} (an epoch of pps.mode=released draws N rows)")
        if self.position + batch_size > len(self.order):                    # a new epoch: draw N rows
            if len(self.order):
                self.epoch += 1
            self.order = torch.multinomial(self.tree, self.num_prompts, replacement=True,
                                           generator=self.generator)
            self.position = 0
        indices = self.order[self.position:self.position + batch_size].clone()
        self.position += batch_size
        self.last_sample = {"epoch": float(self.epoch),
                            "repeat_frac": 1.0 - len(set(indices.tolist())) / len(indices)}
        return indices

    def observe(self, indices: Tensor, rewards: Tensor, accuracy: Tensor, *, normalized: bool = True) -> Tensor:
        """The step's scores (B, G) -> the priorities from each completion's raw GRPO |A|, and the
        weights per completion (B, G), never normalized (the released code's), so `normalized` changes
        nothing; `accuracy` is not read (the released code has no posterior)."""
        abs_advantages = group_advantages(rewards, self.scale_rewards, self.adv_eps).abs()   # (B, G) §1
        return self.set_priorities(indices, abs_advantages)

    def normalize(self, raw: Tensor) -> Tensor:
        """Weights of several draws, trained together: the released code normalizes none. (P, G)"""
        return raw.float()

    def set_priorities(self, indices: Tensor, abs_advantages: Tensor) -> Tensor:
        """Write the priorities completion by completion (prompt-major, as the released code loops) and
        return each completion's weight right after its own write. abs_advantages (B, G) -> (B, G)."""
        a = abs_advantages.detach().double().cpu()
        rows = self.leaf_of[indices.cpu().long()]                            # (B,) the leaves written
        touched = torch.unique(rows)
        leaves = dict(zip(touched.tolist(), self.tree[touched].tolist()))    # only these change: O(B) work
        total = float(self.tree.sum())
        n, weights = self.num_prompts, []
        for q, row in zip(rows.tolist(), a.tolist()):
            for adv in row:
                value = (adv + PRIORITY_EPS) ** self.alpha
                total += value - leaves[q]
                leaves[q] = value
                prob = value / (total + PROB_EPS)
                weights.append((n * prob + WEIGHT_EPS) ** -self.beta)
        self.tree[touched] = torch.tensor([leaves[q] for q in touched.tolist()], dtype=torch.float64)
        return torch.tensor(weights, dtype=torch.float32).view(a.shape)

    def batch_stats(self) -> dict[str, float]:
        """Of the last draw, fixed when it was drawn (so a draw made one step ahead is logged with its own
        step): epoch, epochs begun before it (0-based); repeat_frac, the batch's rows that repeat an earlier
        row of the same batch (draws with replacement)."""
        return dict(self.last_sample)

    def state_dict(self) -> dict:
        return {"released_priorities": self.tree.clone(), "order": self.order.clone(),
                "position": self.position, "epoch": self.epoch, "rng": self.generator.get_state(),
                "last_sample": self.last_sample}

    def load_state_dict(self, state: dict) -> None:
        if "released_priorities" not in state:
            raise ValueError("pps.mode: the checkpoint was trained with pps.mode=paper; "
                             "resume with the same mode")
        check_resumed_prompts(len(state["released_priorities"]), self.num_prompts)
        self.tree = state["released_priorities"].clone()
        self.order, self.position, self.epoch = state["order"].clone(), state["position"], state["epoch"]
        self.generator.set_state(state["rng"])
        self.last_sample = state.get("last_sample")
