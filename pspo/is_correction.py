"""Rollout/trainer mismatch: truncated importance-sampling (TIS) weights for completions drawn by an
engine whose log-probs are not the trainer's, docs/methods.md §7. Pure tensor functions.

An engine with its own copy of the weights (vLLM: other kernels, bf16 on a GPU) samples o_it from
π_engine, while the loss treats the completions as drawn from the trainer's π_old. The policy-gradient
term of each token is reweighted by

    Δ_it  = mask_it · (log π_old(o_it) − log π_engine(o_it))
    token:    w_it = min(exp(Δ_it), C)                        one weight per token
    sequence: w_i  = min(exp(Σ_t Δ_it), C)                    one per completion, on each of its tokens

with C = rollout.is_cap. Both log-probs are log softmax(z/T) of the sampled token, scored without
grad, so w carries no gradient. On padding Δ = 0: a token weight is 1 there, a sequence weight is
its completion's (the loss masks both).
"""
from __future__ import annotations

import torch
from torch import Tensor

IS_CORRECTIONS = ("none", "token", "sequence")            # rollout.is_correction: no weight | w_it | w_i


def log_ratios(old_logp: Tensor, engine_logp: Tensor, mask: Tensor, mode: str) -> Tensor:
    """log of the untruncated weight: Δ_it (token) or Σ_t Δ_it broadcast over the row (sequence).

    old_logp, engine_logp, mask (N, T) -> (N, T) float32. Padding is zeroed before the sum, so what
    an engine or the trainer leaves there (0, a pad token's log-prob) never enters it.
    """
    keep = mask.bool()                                                       # (N, T)
    diff = (old_logp.float() - engine_logp.float()).masked_fill(~keep, 0.0)  # (N, T) Δ
    if mode == "token":
        return diff
    if mode == "sequence":
        return diff.sum(1, keepdim=True).expand_as(diff)                     # (N, 1) -> (N, T)
    raise ValueError(f"rollout.is_correction: expected token or sequence, got {mode!r}")


def correction_weights(old_logp: Tensor, engine_logp: Tensor, mask: Tensor, mode: str, cap: float) -> Tensor:
    """The TIS weights w = min(exp(log ratio), C), docs/methods.md §7. (N, T) each -> (N, T).

    exp of a large log ratio is inf, and min(inf, C) = C; of a very negative one, 0 (the sampled
    sequence is far likelier under the engine than under π_old: its gradient is switched off).
    """
    return torch.clamp(torch.exp(log_ratios(old_logp, engine_logp, mask, mode)), max=cap)


def mismatch_sums(old_logp: Tensor, engine_logp: Tensor, mask: Tensor, mode: str,
                  cap: float) -> dict[str, Tensor]:
    """This rank's sums for the logged means (over every rank's tokens): Σ|Δ|, the largest |Δ|, the
    tokens, and with a correction mode ("none": the gap only) Σw and the tokens whose weight hit C.

    old_logp, engine_logp, mask (N, T) -> scalars (float64, except `gap_max`).
    """
    keep = mask.bool()                                                       # (N, T)
    gap = (old_logp.float() - engine_logp.float()).abs().masked_fill(~keep, 0.0)   # (N, T) |Δ|
    sums = {"gap_sum": gap.sum().double(), "gap_max": gap.max() if gap.numel() else gap.new_zeros(()),
            "tokens": keep.sum().double()}
    if mode != "none":
        raw = torch.exp(log_ratios(old_logp, engine_logp, mask, mode))      # (N, T) untruncated
        sums["weight_sum"] = (torch.clamp(raw, max=cap) * keep).sum().double()
        sums["capped"] = ((raw > cap) & keep).sum().double()
    return sums
