"""The advantage estimators' formulas: pure tensor functions, docs/methods.md §1 and §2, docs/related.md §A.

A group-baseline estimator reads each prompt's reward statistics (mean, std): its group's own
(`group_statistics`: μ and the sample std s), or with ERS the prompt's smoothed (m_q, sqrt(v_q))
(ema_stats.py, docs/methods.md §2). With either:

GRPO:      A_i = (r_i - mean) / (std + ε)
Dr. GRPO:  A_i =  r_i - mean                      (scale = False)
RLOO:      A_i = G/(G-1) · (r_i - mean)           = r_i - mean_{j≠i} r_j with the group's μ (÷ (std + ε): scale)
MaxRL:     A_i = (r_i - mean) / (mean + ε)        the mean in place of the std: a prompt weighs ∝ 1/p
One value per completion; the loss broadcasts it over the completion's tokens.

REINFORCE++ (docs/related.md §A), one value per token:
    r_t = -kl_coef·(logπ_old - logπ_ref)_t + 1[t = last]·clip(R_i - b_i, ±clip_score)
    G_t = Σ_{t'≥t} r_t'                         (γ = 1)
    A_t = (G_t - mean) / sqrt(var + 1e-8)       mean, var over every valid token of the global batch
b_i = 0 (REINFORCE++), or the mean of R_i's group (REINFORCE++-baseline; ERS: m_q).

Single-stream PO (docs/methods.md §10), one value per completion, from the prompt's tracked value v̂(x):
    A = r - v̂(x),  then  (A - mean) / (std + ε)     mean, sample std over every completion of the batch
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

ReduceSum = Callable[[Tensor], Tensor]    # sums a tensor over every rank (distributed.all_reduce_sum)


WHITEN_EPS = 1e-8                                                # added to the variance, as PaddleNLP
WHITENINGS = ("bessel", "population")                           # algo.whiten: ÷(n-1) PaddleNLP | ÷n OpenRLHF


def zero_variance(rewards: Tensor) -> Tensor:
    """True for each group whose G rewards are all equal: no learning signal. (B, G) -> (B,) bool

    Decided by exact equality with the group's first reward, not by std == 0: the float32 mean
    of eight rewards of 0.7 is not 0.7, so their std (and r - μ) comes out ~1e-8, not 0.
    """
    return (rewards == rewards[:, :1]).all(dim=1)


def group_mean(values: Tensor) -> Tensor:
    """Each group's mean μ of its G values (rewards, accuracies, |A|): the one place a group's mean is
    computed. (B, G) -> (B,)

    An all-equal group's μ is its first value exactly (`zero_variance`), so every estimator centres it to
    exactly 0: the float32 mean of six rewards of 0.7 is not 0.7.
    """
    return torch.where(zero_variance(values), values[:, 0], values.mean(dim=1))


def group_statistics(rewards: Tensor) -> tuple[Tensor, Tensor]:
    """Each group's reward mean μ (`group_mean`) and sample std s (Bessel, G-1), docs/methods.md §1.
    (B, G) -> (B,), (B,). A group of one (G = 1) has s = 0: no spread to compare against.
    """
    mean = group_mean(rewards)                                                        # (B,) μ
    std = rewards.std(dim=1) if rewards.shape[1] > 1 else torch.zeros_like(mean)     # (B,) s
    return mean, std


def grpo_advantages(rewards: Tensor, mean: Tensor, std: Tensor, scale: bool = True, eps: float = 1e-4) -> Tensor:
    """GRPO advantage, docs/methods.md §1 (ERS's with the smoothed statistics, §2).

    rewards (B, G); mean, std (B,): the group's (μ, s) or ERS's (m_q, sqrt(v_q)) -> (B, G).
    """
    centered = rewards - mean[:, None]                       # (B, G)  r_i - μ
    if not scale:                                            # Dr. GRPO: no std division
        return centered
    return centered / (std[:, None] + eps)


def group_advantages(rewards: Tensor, scale: bool = True, eps: float = 1e-4) -> Tensor:
    """GRPO advantage from the group's own statistics, docs/methods.md §1. rewards: (B, G) -> (B, G).

    A group whose rewards are all equal gets A = 0 exactly, for any reward values (never NaN,
    never the ~1e-3 that float32 rounding of μ divided by s + ε would give). A group of one
    (G = 1) has no spread to compare against, so its advantage is 0 as well.
    """
    return grpo_advantages(rewards, *group_statistics(rewards), scale, eps)


def rloo_advantages(rewards: Tensor, mean: Tensor) -> Tensor:
    """RLOO advantage, docs/methods.md §1: r_i minus the mean of the group's other G - 1 rewards,
    G/(G-1)·(r_i - μ); with ERS's m_q in place of μ, §2. No std division: with it RLOO is GRPO times
    G/(G-1), which the config refuses.

    rewards (B, G); mean (B,): the group's μ or ERS's m_q -> (B, G). G ≥ 2.
    """
    G = rewards.shape[1]
    if G < 2:
        raise ValueError("rollout.num_generations: RLOO's leave-one-out mean needs G >= 2 completions")
    return G / (G - 1) * (rewards - mean[:, None])               # (B, G)  r_i - (G·μ - r_i)/(G-1)


def maxrl_advantages(rewards: Tensor, mean: Tensor, eps: float = 1e-4) -> Tensor:
    """MaxRL advantage (Tajwar et al. 2026), docs/methods.md §1: the centred rewards divided by the group's mean
    reward, its success rate p̂ for 0/1 rewards, so that a prompt's gradient weighs ∝ 1/p̂ (the maximum-likelihood
    gradient ∇ log p = ∇p / p); ERS's m_q in place of μ, §2. The config keeps the rewards ≥ 0.

    rewards (B, G); mean (B,): the group's μ or ERS's m_q -> (B, G). An all-equal group (all-zero included) gets 0
    exactly (`group_statistics`' μ is then its first reward).
    """
    return (rewards - mean[:, None]) / (mean[:, None] + eps)      # (B, G)


def single_stream_advantages(rewards: Tensor, values: Tensor, eps: float = 1e-8) -> Tensor:
    """Single-stream PO's advantage, docs/methods.md §10: A = r - v̂(x), the prompt's tracked value before
    this visit, normalised over every completion of the batch: (A - mean) / (std + ε), the sample std.

    rewards (B, G) every rank's; values (B,) v̂ -> (B, G). One completion in all has no spread: A = 0.
    """
    centered = rewards - values[:, None]                             # (B, G)  r - v̂
    if centered.numel() < 2:
        return torch.zeros_like(centered)
    return (centered - centered.mean()) / (centered.std() + eps)


def whiten(values: Tensor, mask: Tensor, variance: str = "bessel", *, reduce_sum: ReduceSum) -> Tensor:
    """(values - mean) / sqrt(var + 1e-8), times the mask; mean and var over the valid tokens of
    every rank: `reduce_sum` sums the (sum, sum of squares, count) triple over ranks (one all-reduce;
    `lambda x: x` in a world of one).

    values, mask (N, T) -> (N, T). variance: "bessel" divides by count - 1 (PaddleNLP's masked_var),
    "population" by count (OpenRLHF). A batch of one valid token has no spread: its advantage is 0.
    """
    if variance not in WHITENINGS:
        raise ValueError(f"algo.whiten: expected one of {', '.join(WHITENINGS)}, got {variance!r}")
    keep = mask.bool()
    # float64: Σx² - n·mean² is exact enough
    x = values.to(torch.float64).masked_fill(~keep, 0.0)                 # (N, T)
    sums = reduce_sum(torch.stack([x.sum(), (x ** 2).sum(), keep.sum().to(torch.float64)]))
    total, total_sq, count = sums.unbind()
    count = count.clamp(min=1.0)
    mean = total / count
    dof = count - 1 if variance == "bessel" else count
    var = ((total_sq - count * mean ** 2) / dof.clamp(min=1.0)).clamp(min=0.0)
    return ((x - mean) * torch.rsqrt(var + WHITEN_EPS)).masked_fill(~keep, 0.0).to(values.dtype)


def reinforce_pp_returns(rewards: Tensor, mask: Tensor, *, old_logp: Tensor | None, ref_logp: Tensor | None,
                         kl_coef: float, clip_score: float, baseline: Tensor | None = None) -> Tensor:
    """REINFORCE++ returns G_t = Σ_{t'≥t} r_t' (γ = 1), zero past the mask. (N, T)

    rewards (N,) one scalar per completion; mask (N, T) its valid (completion) tokens; old_logp,
    ref_logp (N, T) log-probs of the rollout policy and the KL reference (both may be None when
    kl_coef == 0). baseline (N,): REINFORCE++-baseline, b_i subtracted from each R_i first (the
    mean of its group, or ERS's m_q); None: plain REINFORCE++.
    """
    keep = mask.bool()                                                   # (N, T)
    N, T = keep.shape
    if baseline is not None:                                             # baseline: R_i - b_i, no std
        rewards = rewards - baseline
    token_rewards = torch.zeros(N, T, dtype=torch.float32, device=keep.device)   # (N, T) r_t
    if kl_coef != 0:
        if old_logp is None or ref_logp is None:
            raise ValueError("kl_coef: the KL penalty needs both old_logp and ref_logp")
        # Padding may hold any log-prob (inf - inf = NaN): it is zeroed before the difference.
        k1 = old_logp.float().masked_fill(~keep, 0.0) - ref_logp.float().masked_fill(~keep, 0.0)  # (N, T)
        token_rewards -= kl_coef * k1
    last = (torch.arange(T, device=keep.device) * keep).argmax(dim=1)    # (N,) index of the last valid token
    # an empty completion gets no score
    has_tokens = keep.any(dim=1)                                         # (N,)
    score = rewards.float().clamp(-clip_score, clip_score) * has_tokens  # (N,) only the score is clipped
    token_rewards[torch.arange(N, device=keep.device), last] += score
    return token_rewards.flip(1).cumsum(1).flip(1) * keep                # (N, T) G_t


def reinforce_pp_advantages(rewards: Tensor, mask: Tensor, *, old_logp: Tensor | None, ref_logp: Tensor | None,
                            kl_coef: float, clip_score: float, baseline: Tensor | None = None,
                            variance: str = "bessel", reduce_sum: ReduceSum) -> Tensor:
    """REINFORCE++(-baseline) token-level advantages, docs/related.md §A. (N, T)

    The returns of `reinforce_pp_returns` (same arguments), whitened over every valid token of
    every rank's batch (`whiten`, "bessel" as PaddleNLP or "population" as OpenRLHF): every rank
    must call this together.
    """
    returns = reinforce_pp_returns(rewards, mask, old_logp=old_logp, ref_logp=ref_logp, kl_coef=kl_coef,
                                   clip_score=clip_score, baseline=baseline)
    return whiten(returns, mask, variance, reduce_sum=reduce_sum)
