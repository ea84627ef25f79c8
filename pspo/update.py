"""The policy update of one rollout batch: ALGORITHMS.md §1's clipped surrogate + β·KL, micro-batched
with gradient accumulation, then the grad-norm clip and the AdamW step (num_iterations times).
REINFORCE++ (§6) computes its token-level advantages here, from the π_old / π_ref log-probs
scored for the update anyway.

Modes: π_old and π_ref are scored in eval mode; the forward/backward passes run in train mode, the
only mode in which transformers recomputes checkpointed layers (model.gradient_checkpointing);
the policy is handed back in eval mode, where generation keeps its KV cache.
Numerics: a non-finite loss or gradient norm on any rank skips that optimizer step (weights and
AdamW state untouched) and is counted; the loop decides when to stop.
"""
from __future__ import annotations

import math

import torch

from pspo import distributed
from pspo.advantages import reinforce_pp_advantages
from pspo.config import Config
from pspo.distributed import Dist
from pspo.loss import policy_loss, sequence_weights


@torch.no_grad()
def score_logprobs(model, input_ids, attention_mask, T, temperature, micro) -> torch.Tensor:
    """log π of the completion tokens under `model`, micro-batched, without grad. (N, T)"""
    return torch.cat([model(input_ids[i:i + micro], attention_mask[i:i + micro], T, temperature)[0]
                      for i in range(0, input_ids.shape[0], micro)])


def policy_update(policy, ref, optimizer, scheduler, input_ids, attention_mask, mask, advantages,
                  cfg: Config, dist_: Dist, rewards: torch.Tensor | None = None) -> dict[str, float]:
    """num_iterations optimizer steps on one rollout batch; returns summed stats for logging.

    input_ids/attention_mask (N, P+T); mask (N, T) completion tokens; advantages (N,), already
    multiplied by the PPS importance weight (the weight touches the policy-gradient term only).
    REINFORCE++ (algo.advantage reinforce_pp*): `rewards` (N,) are the raw rewards, from which
    the token-level advantages (N, T) are computed here, and `advantages` (N,) holds the PPS IS
    weights alone, which multiply them per sequence; sums then carry "adv_abs", "adv_sq" and
    "adv_count" over the valid tokens.
    π_old and π_ref are scored in eval mode; the update runs in train mode (so gradient
    checkpointing recomputes) and the policy is back in eval mode on return, for generation.
    A non-finite loss or gradient norm (on any rank) skips that optimizer step: the weights and
    AdamW state stay as they were, and sums["skipped_steps"] counts it.
    """
    a, micro, T = cfg.algo, cfg.train.micro_batch_size, mask.shape[1]
    temperature = cfg.rollout.temperature
    num_seqs = mask.shape[0] * dist_.world_size                         # every rank holds N rows
    num_tokens = int(distributed.all_reduce_sum(mask.sum()).item())
    weights = sequence_weights(mask, a.aggregation, num_seqs, num_tokens, cfg.rollout.max_new_tokens)  # (N,)
    # π_old: with one iteration it is the current policy (ρ ≡ 1), else scored once, up front;
    # REINFORCE++'s KL reward needs it up front too.
    token_level = a.advantage != "grpo"
    if token_level and rewards is None:
        raise ValueError(f"rewards: algo.advantage={a.advantage} computes its advantages from the raw rewards")
    needs_old = a.num_iterations > 1 or (token_level and a.kl_coef > 0)
    old_logp = score_logprobs(policy, input_ids, attention_mask, T, temperature, micro) if needs_old else None
    ref_logp = score_logprobs(ref, input_ids, attention_mask, T, temperature, micro) if a.needs_reference else None
    sums: dict[str, float] = {"skipped_steps": 0.0}
    if token_level:                                                     # §6, whitened over every rank's tokens
        group = cfg.rollout.num_generations if a.advantage == "reinforce_pp_baseline" else None
        token_adv = reinforce_pp_advantages(rewards, mask, old_logp, ref_logp, a.kl_coef, a.clip_score, group,
                                            a.whiten)                   # (N, T)
        sums.update(adv_abs=float(token_adv.abs().sum()), adv_sq=float((token_adv ** 2).sum()),
                    adv_count=float(mask.sum()))
        advantages = token_adv * advantages[:, None]                    # (N, T) times the PPS IS weight
    policy.train()
    try:
        for _ in range(a.num_iterations):
            finite = True
            for i in range(0, mask.shape[0], micro):
                rows = slice(i, i + micro)
                logp, entropy = policy(input_ids[rows], attention_mask[rows], T, temperature)  # (n, T)
                old = logp.detach() if old_logp is None else old_logp[rows]
                ref_rows = None if ref_logp is None else ref_logp[rows]
                loss, stats = policy_loss(logp, old, ref_rows, advantages[rows], mask[rows], weights[rows],
                                          a.beta, a.eps_low, a.eps_high)
                finite &= bool(torch.isfinite(loss))
                # FSDP averages gradients over ranks; the loss is already a global sum, so undo the mean.
                (loss * dist_.world_size).backward()
                stats["entropy"] = (entropy * mask[rows]).sum()
                for key, value in stats.items():
                    sums[key] = sums.get(key, 0.0) + float(value)
            max_norm = cfg.optim.max_grad_norm or float("inf")
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), max_norm)
            if hasattr(grad_norm, "full_tensor"):                       # a DTensor under FSDP
                grad_norm = grad_norm.full_tensor()
            sums["grad_norm"] = sums.get("grad_norm", 0.0) + float(grad_norm) / dist_.world_size
            finite &= math.isfinite(float(grad_norm))
            if distributed.all_reduce_max(torch.tensor(float(not finite), device=dist_.device)) == 0:
                optimizer.step()
            else:                                                       # NaN/inf: keep the weights
                sums["skipped_steps"] += 1.0 / dist_.world_size
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        policy.eval()
    return sums
