"""ERS: experience-weighted reward smoothing, per-prompt EMA reward statistics (docs/methods.md §2).

Per prompt q we keep (m_q, v_q, n_q): a smoothed reward mean, a smoothed reward variance and a
visit count. With a = alpha, the weight on the current group's statistics (μ, s² of its G rewards):

    first visit:   m_q <- μ,   v_q <- s²
    later visits:  m_q <- a·μ + (1-a)·m_q
                   v_q <- a·s² + (1-a)·v_q + a(1-a)·(μ - m_q_old)²     (two-part mixture variance)

`smooth` folds the step's groups in and returns the smoothed (m_q, sqrt(v_q)); a method whose baseline is its
group (GRPO, Dr. GRPO, RLOO, REINFORCE++-baseline; methods.group_baseline) uses them in place of the
group's (μ, s), e.g. GRPO's

    A_i = (r_i - m_q) / (sqrt(v_q) + ε)        (Dr. GRPO, without the std scaling: r_i - m_q)

Departure from the released code, on purpose: the cross term uses the current μ and the old m_q
(the textbook variance of a mixture), where the released code uses the smoothed μ̃; and we store a
variance and take its square root for the std (the released code divides by the variance).

Prompts are keyed by the first 8 bytes of SHA-256 of the problem text (stable under shuffling,
duplicates merge; a collision among 10^6 prompts has probability ~3e-8). Keys live in one sorted
int64 tensor beside float64 mean/variance and int32 visits: 28 bytes per distinct prompt, so 10^6
prompts take ~28 MB, with no Python object per prompt.
"""
from __future__ import annotations

import hashlib

import torch
from torch import Tensor

from pspo.estimators import group_mean


def prompt_key(text: str) -> int:
    """The signed int64 made of the first 8 bytes of SHA-256(text)."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "little", signed=True)


class EMAStats:
    """Smoothed per-prompt reward mean and variance (docs/methods.md §2)."""

    def __init__(self, alpha: float = 0.99):
        if not 0 < alpha <= 1:
            raise ValueError(f"ers.alpha: expected a number in (0, 1], got {alpha!r}")
        self.alpha = alpha
        self.keys = torch.empty(0, dtype=torch.int64)        # (N,) sorted
        self.mean = torch.empty(0, dtype=torch.float64)      # (N,) m_q
        self.var = torch.empty(0, dtype=torch.float64)       # (N,) v_q
        self.visits = torch.empty(0, dtype=torch.int32)      # (N,) n_q

    def __len__(self) -> int:
        return len(self.keys)

    def _rows(self, keys: Tensor) -> Tensor:
        """Row of each key, inserting unseen keys (visits 0) while keeping `self.keys` sorted."""
        new = torch.unique(keys[~torch.isin(keys, self.keys)])
        if len(new):
            merged, order = torch.sort(torch.cat([self.keys, new]))
            pad = torch.zeros(len(new), dtype=torch.float64)
            self.keys = merged
            self.mean = torch.cat([self.mean, pad])[order]
            self.var = torch.cat([self.var, pad])[order]
            self.visits = torch.cat([self.visits, torch.zeros(len(new), dtype=torch.int32)])[order]
        return torch.searchsorted(self.keys, keys)

    def smooth(self, keys: list[str], rewards: Tensor) -> tuple[Tensor, Tensor]:
        """Fold one group of G rewards per prompt into its statistics. rewards (B, G).

        Returns the smoothed (mean, std) per prompt after this visit, two (B,) float32 tensors.
        A prompt that appears twice in the batch is folded in twice, in batch order.
        """
        rewards = rewards.detach().double().cpu()
        mu = group_mean(rewards)                                                 # (B,) μ, exact if all equal
        var = rewards.var(1) if rewards.shape[1] > 1 else torch.zeros(len(mu))   # (B,) s² (Bessel)
        rows = self._rows(torch.tensor([prompt_key(k) for k in keys], dtype=torch.int64))
        a = self.alpha
        out_mean = torch.empty(len(keys), dtype=torch.float64)
        out_var = torch.empty(len(keys), dtype=torch.float64)
        for b, row in enumerate(rows.tolist()):                                  # B is small; order matters
            if self.visits[row] == 0:                                            # first visit: plain GRPO
                m, v = mu[b], var[b]
            else:
                m_old, v_old = self.mean[row], self.var[row]
                m = a * mu[b] + (1 - a) * m_old
                v = a * var[b] + (1 - a) * v_old + a * (1 - a) * (mu[b] - m_old) ** 2
            self.mean[row], self.var[row] = m, v
            self.visits[row] += 1
            out_mean[b], out_var[b] = m, v
        return out_mean.float(), out_var.clamp(min=0).sqrt().float()

    def visits_of(self, keys: list[str]) -> Tensor:
        """n_q of each key (0 for a prompt never smoothed). (B,) int32"""
        k = torch.tensor([prompt_key(t) for t in keys], dtype=torch.int64)
        if not len(self.keys):
            return torch.zeros(len(k), dtype=torch.int32)
        rows = torch.searchsorted(self.keys, k).clamp(max=len(self.keys) - 1)
        return torch.where(self.keys[rows] == k, self.visits[rows], 0)

    def batch_stats(self, keys: list[str], rewards: Tensor, mean: Tensor,
                    num_prompts: int) -> dict[str, float]:
        """Logged ERS diagnostics of one step, after `smooth(keys, rewards)` returned `mean`.

        gap: mean over the batch of |m_q - μ|, how far smoothing moved the baseline from the
        group mean; visits: mean n_q of the batch's prompts; seen_frac: distinct prompts with
        statistics / num_prompts (the distinct prompts of the train set).
        """
        mu = group_mean(rewards.detach().double().cpu())                         # (B,) μ
        return {"gap": float((mean.double() - mu).abs().mean()),
                "visits": float(self.visits_of(keys).float().mean()),
                "seen_frac": len(self) / num_prompts}

    def state_dict(self) -> dict[str, Tensor]:
        """The per-prompt statistics (copies: a saved state never changes with later visits);
        alpha comes from the config (it may change on resume, like lr)."""
        return {"keys": self.keys.clone(), "mean": self.mean.clone(), "var": self.var.clone(),
                "visits": self.visits.clone()}

    def load_state_dict(self, state: dict) -> None:
        """Adopt copies of the given tensors, so two trackers loaded from one state stay independent."""
        self.keys, self.mean, self.var, self.visits = (
            state[k].clone() for k in ("keys", "mean", "var", "visits"))
