"""Advantages from rewards: pure tensor functions, ALGORITHMS.md §1.

GRPO:      A_i = (r_i - μ) / (s + ε)     μ, s = mean and sample std (Bessel, G-1) of the group
Dr. GRPO:  A_i =  r_i - μ                (scale = False)
ERS (§2):  A_i = (r_i - m_q) / (sqrt(v_q) + ε)   m_q, v_q = the prompt's smoothed statistics

One value per completion; the loss broadcasts it over the completion's tokens.
"""
from __future__ import annotations

from torch import Tensor


def zero_variance(rewards: Tensor) -> Tensor:
    """True for each group whose G rewards are all equal: no learning signal. (B, G) -> (B,) bool

    Decided by exact equality with the group's first reward, not by std == 0: the float32 mean
    of eight rewards of 0.7 is not 0.7, so their std (and r - μ) comes out ~1e-8, not 0.
    """
    return (rewards == rewards[:, :1]).all(dim=1)


def group_advantages(rewards: Tensor, scale: bool = True, eps: float = 1e-4) -> Tensor:
    """GRPO advantage, ALGORITHMS.md §1. rewards: (B, G) -> (B, G).

    A group whose rewards are all equal gets A = 0 exactly, for any reward values (never NaN,
    never the ~1e-3 that float32 rounding of μ divided by s + ε would give). A group of one
    (G = 1) has no spread to compare against, so its advantage is 0 as well.
    """
    mean = rewards.mean(dim=1, keepdim=True)                 # (B, 1)  μ
    centered = rewards - mean                                # (B, G)  r_i - μ
    if scale and rewards.shape[1] > 1:                       # GRPO; Dr. GRPO skips the std division
        std = rewards.std(dim=1, keepdim=True)               # (B, 1)  sample std (G-1)
        centered = centered / (std + eps)
    return centered.masked_fill(zero_variance(rewards)[:, None], 0.0)


def smoothed_advantages(rewards: Tensor, mean: Tensor, std: Tensor, scale: bool = True,
                        eps: float = 1e-4) -> Tensor:
    """ERS advantage, ALGORITHMS.md §2, from the smoothed (m_q, sqrt(v_q)) after this step's update.

    rewards (B, G), mean (B,), std (B,) -> (B, G). On a prompt's first visit (or with α = 1)
    m_q = μ and sqrt(v_q) = s, so this is exactly `group_advantages`.
    """
    centered = rewards - mean[:, None]                       # (B, G)  r_i - m_q
    if not scale:
        return centered
    return centered / (std[:, None] + eps)
