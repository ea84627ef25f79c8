"""The policy objectives with a k3 KL term, docs/methods.md §1 (PPO's clip) and §11 (GSPO, GSPO-token, CISPO, SAPO).

    ρ_it  = exp(logπ_θ(o_it) - logπ_old(o_it))          logπ: token_logprobs.py (logits / temperature)
    pg_it = the objective's term, algo.objective (OBJECTIVES); ppo_clip, the default:
            -min(ρ_it·Â_i, clip(ρ_it, 1-ε_low, 1+ε_high)·Â_i)
    kl_it = exp(logπ_ref - logπ_θ) - (logπ_ref - logπ_θ) - 1      (k3)
    ℓ_it  = pg_it + β·kl_it
Â_i is one value per completion (GRPO, ERS); REINFORCE++ (docs/related.md §A) gives one per token, Â_it.

Aggregation is a per-sequence weight w_i computed from GLOBAL counts (every micro-batch and rank
of the optimizer step), so the step loss Σ_i w_i Σ_t mask_it ℓ_it is a plain sum over sequences
and splitting the batch into micro-batches or ranks cannot change the gradient:

    grpo      : w_i = 1 / (N_seq · T_i)            (1/N_seq) Σ_i (1/T_i) Σ_t ℓ_it
    token_mean: w_i = 1 / Σ_j T_j                  (BNPO / DAPO)
    dr_grpo   : w_i = 1 / (N_seq · L_max)
A sequence-level objective (GSPO's ratio) reads the whole row, which a micro-batch always holds
(micro_batches.plan_micro_batches).

An objective is one function (logp, old_logp, advantages, mask, trust) -> (pg (N, T), its diagnostic (N, T)):
a bool mask of the tokens whose term its bound changed (clip_frac, clip_seq_frac), or, for the objectives of
GATED, the soft gate's weight (gate_mean). Adding one: docs/methods.md §11, "Adding an objective".
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

AGGREGATIONS = ("grpo", "token_mean", "dr_grpo")          # algo.aggregation: the w_i above


class Trust(NamedTuple):
    """The objectives' settings (algo.* of the same names, sapo_ prefixed there): each objective reads its own."""
    eps_low: float                # ε_low: the ratio's lower clip (ppo_clip, gspo, gspo_token), the weight's (cispo)
    eps_high: float               # ε_high: the upper one, likewise
    tau_pos: float                # τ_pos: sapo's gate temperature where Â > 0
    tau_neg: float                # τ_neg: where Â ≤ 0


def k3_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 estimator of KL(π_θ || π_ref) per token, docs/methods.md §1: exp(d) - d - 1, d = ref - logp.

    Non-negative, zero where the two policies agree; any shape, elementwise.
    """
    d = ref_logp - logp                                                   # logπ_ref - logπ_θ
    return torch.exp(d) - d - 1


def clipped_surrogate(logp: Tensor, old_logp: Tensor, advantages: Tensor, eps_low: float,
                      eps_high: float) -> tuple[Tensor, Tensor]:
    """pg_it = -min(ρ·Â, clip(ρ, 1-ε_low, 1+ε_high)·Â), docs/methods.md §1.

    logp, old_logp (N, T); advantages (N,) one per completion (GRPO: broadcast over its tokens)
    or (N, T) one per token (REINFORCE++, docs/related.md §A). Returns pg (N, T) and is_clipped (N, T) bool:
    where the clipped term is the strict minimum, i.e. ρ > 1+ε_high with Â > 0 or ρ < 1-ε_low
    with Â < 0, the tokens whose gradient the clip zeroes.
    """
    return _clipped(torch.exp(logp - old_logp), advantages, eps_low, eps_high)   # ρ (N, T)


def _clipped(ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float) -> tuple[Tensor, Tensor]:
    """-min(r·Â, clip(r, 1-ε_low, 1+ε_high)·Â) of any ratio r (N, T), and where the clip is the strict minimum."""
    adv = _per_token(advantages)                                          # (N, 1) or (N, T)
    unclipped = ratio * adv                                               # (N, T)
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv         # (N, T)
    return -torch.min(unclipped, clipped), clipped < unclipped


def _per_token(advantages: Tensor) -> Tensor:
    """Â (N,) one per completion -> (N, 1), broadcast over its tokens; (N, T) one per token as it is."""
    return advantages[:, None] if advantages.dim() == 1 else advantages


def _mean_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """log s_i = (1/|o_i|) Σ_t mask_it (logπ_θ - logπ_old), GSPO's length-normalised log ratio. (N, T) -> (N, 1)."""
    return ((logp - old_logp) * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)


# ---- the objectives, docs/methods.md §11: (logp, old_logp, advantages, mask, trust) -> (pg, diagnostic), (N, T) ----

def ppo_clip(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, t: Trust) -> tuple[Tensor, Tensor]:
    """PPO's per-token clip (§1), clipped_surrogate; the diagnostic: the tokens whose gradient the clip zeroes."""
    return clipped_surrogate(logp, old_logp, advantages, t.eps_low, t.eps_high)


def gspo(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, t: Trust) -> tuple[Tensor, Tensor]:
    """GSPO: -min(s_i·Â_i, clip(s_i, 1-ε_low, 1+ε_high)·Â_i) on each token of completion i, s_i = exp(log s_i);
    the gradient reaches every token through s_i. Â one per completion (config.py refuses per-token ones)."""
    return _clipped(torch.exp(_mean_log_ratio(logp, old_logp, mask)).expand_as(logp), advantages, t.eps_low,
                    t.eps_high)


def gspo_token(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, t: Trust) -> tuple[Tensor, Tensor]:
    """GSPO-token: gspo's clip of s_it = sg(s_i)·π_θ(o_it)/sg(π_θ(o_it)), whose value is s_i and whose gradient
    is token t's alone, so that a per-token Â_it (or IS weight) weighs its own token."""
    log_s = _mean_log_ratio(logp, old_logp, mask).detach()                          # (N, 1) sg(log s_i)
    return _clipped(torch.exp(log_s + logp - logp.detach()), advantages, t.eps_low, t.eps_high)


def cispo(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, t: Trust) -> tuple[Tensor, Tensor]:
    """CISPO: -sg(clip(ρ, 1-ε_low, 1+ε_high))·Â·logπ_θ: the weight is clipped and detached, never the term, so
    no token's gradient is dropped; the diagnostic: the tokens whose weight the clip changed."""
    ratio = torch.exp(logp - old_logp).detach()                                     # (N, T) ρ
    weight = torch.clamp(ratio, 1 - t.eps_low, 1 + t.eps_high)                      # (N, T) sg(clip(ρ))
    return -weight * _per_token(advantages) * logp, weight != ratio


def sapo(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, t: Trust) -> tuple[Tensor, Tensor]:
    """SAPO: -f(ρ)·Â, f(ρ) = σ(τ(ρ-1))·4/τ, τ = τ_pos where Â > 0 else τ_neg; the diagnostic: the gate
    4σ(1-σ), the token's gradient weight beside the unclipped ρ·Â (1 on-policy)."""
    adv = _per_token(advantages)                                                    # (N, 1) or (N, T)
    tau = torch.where(adv > 0, t.tau_pos, t.tau_neg)                                # (N, ·) τ
    gate = torch.sigmoid(tau * (torch.exp(logp - old_logp) - 1))                   # (N, T) σ(τ(ρ-1))
    return -gate * (4 / tau) * adv, (4 * gate * (1 - gate)).detach()


# algo.objective: the one place an objective is chosen (policy_loss); GATED log a soft gate, not a clip
OBJECTIVES = {"ppo_clip": ppo_clip, "gspo": gspo, "gspo_token": gspo_token, "cispo": cispo, "sapo": sapo}
GATED = ("sapo",)


def sequence_weights(mask: Tensor, aggregation: str, num_seqs: int, num_tokens: int,
                     max_len: int) -> Tensor:
    """Per-sequence multipliers w_i (N,) float32 realising an aggregation of docs/methods.md §1.

    mask (N, T) marks completion tokens (bool or float). num_seqs and num_tokens are GLOBAL
    counts over every micro-batch and rank of the optimizer step; max_len is L_max. With them,
    Σ over the step of w_i Σ_t mask_it ℓ_it equals the aggregation exactly, however the step is
    split. A sequence with no tokens gets a finite weight (its token sum is 0 anyway).
    """
    lengths = mask.to(torch.float32).sum(1)                               # (N,) T_i
    if aggregation == "grpo":
        return 1.0 / (num_seqs * lengths.clamp(min=1))                    # 1/(N_seq·T_i)
    if aggregation == "token_mean":
        return torch.full_like(lengths, 1.0 / max(num_tokens, 1))         # 1/Σ_j T_j
    if aggregation == "dr_grpo":
        return torch.full_like(lengths, 1.0 / (num_seqs * max_len))       # 1/(N_seq·L_max)
    raise ValueError(f"algo.aggregation: expected one of {', '.join(AGGREGATIONS)}, got {aggregation!r}")


def policy_loss(logp: Tensor, *, old_logp: Tensor, ref_logp: Tensor | None, advantages: Tensor,
                mask: Tensor, seq_weights: Tensor, beta: float, eps_low: float, eps_high: float,
                objective: str = "ppo_clip", tau_pos: float = 1.0,
                tau_neg: float = 1.05) -> tuple[Tensor, dict[str, Tensor]]:
    """loss = Σ_i w_i Σ_t mask_it ℓ_it, ℓ_it = pg_it + β·kl_it (docs/methods.md §1), pg_it the objective's
    (OBJECTIVES; its settings ε_low, ε_high, τ_pos, τ_neg), and stats.

    logp, old_logp, ref_logp, mask (N, T); seq_weights (N,); advantages (N,) per completion or
    (N, T) per token (REINFORCE++), the PPS IS weight already multiplied in. The KL term enters the
    loss only when beta != 0 and ref_logp is given. Summing the returned loss over micro-batches
    and ranks gives the aggregated loss of the optimizer step.

    stats are detached SUMS over these sequences, to be summed across micro-batches and ranks
    and then divided by the caller (training/metrics.py logs each): "pg_loss" (Σ_i w_i Σ_t mask·pg,
    weighted like the loss), "kl" (Σ mask·kl, unweighted; 0 without ref_logp, logged even when beta == 0),
    "ratio" (Σ mask·ρ), "tokens" (Σ mask); a clipping objective's "clipped_tokens", "clipped_seqs" (the
    completions holding one) and "seqs" (those with a token); a gated one's "gate" (Σ mask·gate).
    """
    # Padding positions hold arbitrary log-probs (a pad token's, or 0 from the engine), and an
    # overflow there, e.g. exp(logπ_ref - logπ_θ) = inf, stays NaN after multiplying by a 0 mask
    # (inf·0 = NaN, in the loss and in its gradient). So the padding is replaced by 0 in every
    # input first: ρ = 1 and kl = 0 there, and no gradient reaches those positions.
    keep = mask.bool()                                                    # (N, T)
    logp = logp.masked_fill(~keep, 0.0)
    old_logp = old_logp.masked_fill(~keep, 0.0)
    ref_logp = ref_logp.masked_fill(~keep, 0.0) if ref_logp is not None else None
    mask = mask.to(logp.dtype)                                            # (N, T)
    trust = Trust(eps_low, eps_high, tau_pos, tau_neg)
    pg, diagnostic = OBJECTIVES[objective](logp, old_logp, advantages, mask, trust)   # (N, T) each
    kl = k3_kl(logp, ref_logp) if ref_logp is not None else None          # (N, T)
    per_token = pg + beta * kl if (kl is not None and beta != 0) else pg  # (N, T) ℓ
    loss = ((per_token * mask).sum(1) * seq_weights).sum()                # scalar
    with torch.no_grad():
        stats = {
            "pg_loss": ((pg * mask).sum(1) * seq_weights).sum(),
            "kl": (kl * mask).sum() if kl is not None else logp.new_zeros(()),
            "ratio": (torch.exp(logp - old_logp) * mask).sum(),
            "tokens": mask.sum(),
        }
        if objective in GATED:
            stats["gate"] = (diagnostic * mask).sum()
        else:
            clipped = diagnostic & keep                                   # (N, T)
            stats["clipped_tokens"] = clipped.sum().to(mask.dtype)
            stats["clipped_seqs"] = clipped.any(1).sum().to(mask.dtype)
            stats["seqs"] = keep.any(1).sum().to(mask.dtype)
    return loss, stats
