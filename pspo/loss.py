"""The clipped surrogate objective with a k3 KL term, docs/methods.md §1.

    ρ_it  = exp(logπ_θ(o_it) - logπ_old(o_it))          logπ: token_logprobs.py (logits / temperature)
    pg_it = -min(ρ_it·Â_i, clip(ρ_it, 1-ε_low, 1+ε_high)·Â_i)
    kl_it = exp(logπ_ref - logπ_θ) - (logπ_ref - logπ_θ) - 1      (k3)
    ℓ_it  = pg_it + β·kl_it
Â_i is one value per completion (GRPO, ERS); REINFORCE++ (docs/related.md §A) gives one per token, Â_it.

Aggregation is a per-sequence weight w_i computed from GLOBAL counts (every micro-batch and rank
of the optimizer step), so the step loss Σ_i w_i Σ_t mask_it ℓ_it is a plain sum over sequences
and splitting the batch into micro-batches or ranks cannot change the gradient:

    grpo      : w_i = 1 / (N_seq · T_i)            (1/N_seq) Σ_i (1/T_i) Σ_t ℓ_it
    token_mean: w_i = 1 / Σ_j T_j                  (BNPO / DAPO)
    dr_grpo   : w_i = 1 / (N_seq · L_max)
"""
from __future__ import annotations

import torch
from torch import Tensor

AGGREGATIONS = ("grpo", "token_mean", "dr_grpo")          # algo.aggregation: the w_i above


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
    ratio = torch.exp(logp - old_logp)                                    # (N, T) ρ
    adv = advantages[:, None] if advantages.dim() == 1 else advantages   # (N, 1) or (N, T)
    unclipped = ratio * adv                                               # (N, T)
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv         # (N, T)
    pg = -torch.min(unclipped, clipped)                                   # (N, T)
    return pg, clipped < unclipped


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
                mask: Tensor, seq_weights: Tensor, beta: float, eps_low: float,
                eps_high: float) -> tuple[Tensor, dict[str, Tensor]]:
    """loss = Σ_i w_i Σ_t mask_it ℓ_it, ℓ_it = pg_it + β·kl_it (docs/methods.md §1), and stats.

    logp, old_logp, ref_logp, mask (N, T); seq_weights (N,); advantages (N,) per completion or
    (N, T) per token (REINFORCE++), the PPS IS weight already multiplied in. The KL term enters the
    loss only when beta != 0 and ref_logp is given. Summing the returned loss over micro-batches
    and ranks gives the aggregated loss of the optimizer step.

    stats are detached SUMS over these sequences, to be summed across micro-batches and ranks
    and then divided by the caller: "pg_loss" (Σ_i w_i Σ_t mask·pg, weighted like the loss),
    "kl" (Σ mask·kl, unweighted; 0 without ref_logp, logged even when beta == 0),
    "clipped_tokens", "ratio" (Σ mask·ρ) and "tokens" (Σ mask).
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
    pg, is_clipped = clipped_surrogate(logp, old_logp, advantages, eps_low, eps_high)  # (N, T)
    kl = k3_kl(logp, ref_logp) if ref_logp is not None else None          # (N, T)
    per_token = pg + beta * kl if (kl is not None and beta != 0) else pg  # (N, T) ℓ
    loss = ((per_token * mask).sum(1) * seq_weights).sum()                # scalar
    with torch.no_grad():
        stats = {
            "pg_loss": ((pg * mask).sum(1) * seq_weights).sum(),
            "kl": (kl * mask).sum() if kl is not None else logp.new_zeros(()),
            "clipped_tokens": (is_clipped * mask).sum(),
            "ratio": (torch.exp(logp - old_logp) * mask).sum(),
            "tokens": mask.sum(),
        }
    return loss, stats
