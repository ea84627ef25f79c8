"""Rollout/trainer mismatch: truncated (TIS) and masked (MIS) importance-sampling weights for
completions drawn by an engine whose log-probs are not the trainer's, docs/methods.md §7. Pure
tensor functions.

An engine with its own copy of the weights (vLLM: other kernels, bf16 on a GPU) samples o_it from
π_engine, while the loss treats the completions as drawn from the trainer's π_old. The policy-gradient
term of each token is reweighted by w, from the ratio r of the token or of the whole completion:

    Δ_it = mask_it · (log π_old(o_it) − log π_engine(o_it))
    r_it = exp(Δ_it)                         token level: one ratio per token
    r_i  = exp(Σ_t Δ_it)                     sequence level: one per completion, on each of its tokens
    r_i  = exp(Σ_t Δ_it / |o_i|)             geometric level: the per-token ratios' geometric mean, likewise
    token, sequence (truncated):             w = clip(r, C_low, C)
    token_mask, sequence_mask, geo_mask:     w = r if C_low ≤ r ≤ C, else 0       (masked)

with C = rollout.is_cap and C_low = rollout.is_floor (0: no lower bound), TRL's GRPOTrainer's
`vllm_importance_sampling_mode` (token_truncate, sequence_truncate, token_mask, sequence_mask) with
its clip_max and clip_min; geo_mask is the geometric-mean mask of verl's Geo-RS and SkyRL (a length-normalised
sequence ratio, which does not grow with the completion's length). Both log-probs are log softmax(z/T) of the
sampled token, scored without grad, so w carries no gradient. On padding Δ = 0: a token ratio is 1 there, a
sequence ratio its completion's (the loss masks both), and no count below includes a padding position.
"""
from __future__ import annotations

import torch
from torch import Tensor

# rollout.is_correction: no weight | truncated per token | per sequence | masked per token | per sequence | by the
# completion's geometric mean
IS_CORRECTIONS = ("none", "token", "sequence", "token_mask", "sequence_mask", "geo_mask")


def log_ratios(old_logp: Tensor, engine_logp: Tensor, mask: Tensor, mode: str) -> Tensor:
    """log r, the log of the untruncated, unmasked ratio: Δ_it (token, token_mask), or Σ_t Δ_it (sequence,
    sequence_mask) or its mean over the completion's tokens (geo_mask) broadcast over the row.

    old_logp, engine_logp, mask (N, T) -> (N, T) float32. Padding is zeroed before the sum, so what
    an engine or the trainer leaves there (0, a pad token's log-prob) never enters it.
    """
    keep = mask.bool()                                                       # (N, T)
    diff = (old_logp.float() - engine_logp.float()).masked_fill(~keep, 0.0)  # (N, T) Δ
    level = mode.removesuffix("_mask")
    if level == "token":
        return diff
    if level == "sequence":
        return diff.sum(1, keepdim=True).expand_as(diff)                     # (N, 1) -> (N, T)
    if level == "geo":
        return (diff.sum(1, keepdim=True) / keep.sum(1, keepdim=True).clamp(min=1)).expand_as(diff)
    raise ValueError(f"rollout.is_correction: expected {' | '.join(IS_CORRECTIONS[1:])}, got {mode!r}")


def correction_weights(old_logp: Tensor, engine_logp: Tensor, mask: Tensor, mode: str, *, cap: float,
                       floor: float = 0.0) -> Tensor:
    """The weights w of docs/methods.md §7: r truncated to [C_low, C], or zeroed outside it (the
    `_mask` modes). (N, T) each -> (N, T).

    exp of a large log ratio is inf: truncated to C, masked to 0. Of a very negative one, 0: without
    a lower bound the token's or completion's gradient is then switched off in every mode.
    """
    return _weights(torch.exp(log_ratios(old_logp, engine_logp, mask, mode)), mode, cap=cap, floor=floor)


def mismatch_sums(old_logp: Tensor, engine_logp: Tensor, mask: Tensor, mode: str, *, cap: float,
                  floor: float = 0.0) -> dict[str, Tensor]:
    """This rank's sums for the logged means (over every rank's tokens): Σ|Δ|, the largest |Δ|, the
    tokens, and with a correction mode ("none": the gap only) Σw and the tokens whose ratio left
    [C_low, C]: `capped` (truncated to a bound) or, masked, `masked` (w zeroed) with the completions
    holding a masked token (`masked_seqs`) among those with a token (`seqs`).

    old_logp, engine_logp, mask (N, T) -> scalars (float64, except `gap_max`).
    """
    keep = mask.bool()                                                       # (N, T)
    gap = (old_logp.float() - engine_logp.float()).abs().masked_fill(~keep, 0.0)   # (N, T) |Δ|
    sums = {"gap_sum": gap.sum().double(), "gap_max": gap.max() if gap.numel() else gap.new_zeros(()),
            "tokens": keep.sum().double()}
    if mode == "none":
        return sums
    ratio = torch.exp(log_ratios(old_logp, engine_logp, mask, mode))         # (N, T) r
    outside = ~_inside(ratio, cap=cap, floor=floor) & keep                   # (N, T) r ∉ [C_low, C]
    sums["weight_sum"] = (_weights(ratio, mode, cap=cap, floor=floor) * keep).sum().double()
    if mode.endswith("_mask"):
        sums["masked"] = outside.sum().double()
        sums["masked_seqs"] = outside.any(1).sum().double()
        sums["seqs"] = keep.any(1).sum().double()
    else:
        sums["capped"] = outside.sum().double()
    return sums


def _inside(ratio: Tensor, *, cap: float, floor: float) -> Tensor:
    """C_low ≤ r ≤ C, both bounds inclusive (TRL masks r < C_low and r > C). (N, T) -> (N, T) bool."""
    return (ratio >= floor) & (ratio <= cap)


def _weights(ratio: Tensor, mode: str, *, cap: float, floor: float) -> Tensor:
    """w from r (N, T): masked outside [C_low, C] (`_mask` modes) or truncated to it."""
    if mode.endswith("_mask"):
        return torch.where(_inside(ratio, cap=cap, floor=floor), ratio, 0.0)
    return torch.clamp(ratio, min=floor, max=cap)
