"""The policy update of one rollout batch: ALGORITHMS.md §1's clipped surrogate + β·KL, micro-batched
with gradient accumulation, then the grad-norm clip and the AdamW step (num_iterations times).

Micro-batches: `train.micro_batch_size` rows at a time, padded to the step's longest sequence
(train.micro_batch_tokens = 0); or token-budget micro-batches (micro_batch_tokens > 0): the rows
sorted by length and packed so that rows x (longest prompt + longest completion) of each stays
within the budget, each cut to its own widths. The loss is normalised by global counts
(loss.sequence_weights), so the gradient is the same either way; every rank runs as many
micro-batches as the busiest one (FSDP2's collectives must match), the spare ones empty.
REINFORCE++ (§6) computes its token-level advantages here, from the π_old / π_ref log-probs
scored for the update anyway. SPO (SEED_METHODS.md §B, spo.py) brings its own: token advantages,
the loss mask M (the tokens with p_t < 0.9) and the π_old they were computed from.

Modes: π_old and π_ref are scored in eval mode; the forward/backward passes run in train mode, the
only mode in which transformers recomputes checkpointed layers (model.gradient_checkpointing);
the policy is handed back in eval mode, where generation keeps its KV cache.
Numerics: a non-finite loss or gradient norm on any rank skips that optimizer step (weights and
AdamW state untouched) and is counted; the loop decides when to stop.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pspo import distributed
from pspo.advantages import reinforce_pp_advantages
from pspo.config import Config
from pspo.distributed import Dist
from pspo.loss import policy_loss, sequence_weights


@dataclass
class MicroBatch:
    rows: torch.Tensor        # (n,) row indices into the step's (N, P+T) batch
    start: int                # first column kept: P - the longest prompt among the rows
    width: int                # completion columns kept: the longest completion among the rows
    spare: bool = False       # run only to keep the ranks' collectives matched: its loss is zeroed

    def cut(self, x: torch.Tensor, P: int) -> torch.Tensor:
        """The rows' (n, P+T) inputs cut to [start, P + width)."""
        return x[self.rows, self.start:P + self.width]


def plan_micro_batches(attention_mask: torch.Tensor, mask: torch.Tensor, micro_batch_size: int,
                       micro_batch_tokens: int) -> list[MicroBatch]:
    """Micro-batches of the step's rows. attention_mask (N, P+T) left-padded prompts then
    completions; mask (N, T) completion tokens.

    micro_batch_tokens = 0: consecutive slices of micro_batch_size rows at full width (P + T).
    Otherwise: rows sorted by prompt + completion length (longest first) and packed greedily
    while n_rows x (longest prompt + longest completion) <= micro_batch_tokens (a row longer than
    the budget goes alone). Every rank gets as many micro-batches as the busiest rank (ranks may
    hold different numbers of rows, as SPO-tree's edges do; at least one each); the extra ones
    repeat one real row and are marked spare (policy_update zeroes their loss).
    """
    N, T = mask.shape
    P = attention_mask.shape[1] - T
    if micro_batch_tokens <= 0:
        batches = [MicroBatch(torch.arange(i, min(i + micro_batch_size, N)), 0, T) for i in range(0, N, micro_batch_size)]
    else:
        batches = _pack(attention_mask[:, :P].sum(1).tolist(), [max(1, int(c)) for c in mask.sum(1).tolist()], P,
                        micro_batch_tokens)
    most = int(distributed.all_reduce_max(torch.tensor(float(len(batches)), device=mask.device)))
    last = batches[-1]
    return batches + [MicroBatch(last.rows[:1], last.start, last.width, spare=True)] * (most - len(batches))


def _pack(prompt_len: list[int], completion_len: list[int], P: int, micro_batch_tokens: int) -> list[MicroBatch]:
    """Token-budget micro-batches of plan_micro_batches (micro_batch_tokens > 0)."""
    order = sorted(range(len(prompt_len)), key=lambda i: prompt_len[i] + completion_len[i], reverse=True)
    batches, rows, long_p, long_c = [], [], 0, 0
    for i in order:
        p, c = max(long_p, prompt_len[i]), max(long_c, completion_len[i])
        if rows and (len(rows) + 1) * (p + c) > micro_batch_tokens:
            batches.append(MicroBatch(torch.tensor(rows), P - long_p, long_c))
            rows, p, c = [], prompt_len[i], completion_len[i]
        rows.append(i)
        long_p, long_c = p, c
    if rows:
        batches.append(MicroBatch(torch.tensor(rows), P - long_p, long_c))
    return batches


def _forward(model, batch: MicroBatch, input_ids, attention_mask, T, temperature):
    """log π and entropy of one micro-batch's completion columns, (n, width) each."""
    P = input_ids.shape[1] - T
    return model(batch.cut(input_ids, P), batch.cut(attention_mask, P), batch.width, temperature)


@torch.no_grad()
def score_logprobs(model, input_ids, attention_mask, T, temperature, plan: list[MicroBatch]) -> torch.Tensor:
    """log π of the completion tokens under `model`, micro-batched, without grad. (N, T), 0 past each
    micro-batch's width."""
    out = torch.zeros(input_ids.shape[0], T, device=input_ids.device)
    for batch in plan:
        logp = _forward(model, batch, input_ids, attention_mask, T, temperature)[0]
        if not batch.spare:
            out[batch.rows, :batch.width] = logp.float()
    return out


def policy_update(policy, ref, optimizer, scheduler, input_ids, attention_mask, mask, advantages,
                  cfg: Config, dist_: Dist, rewards: torch.Tensor | None = None,
                  token_advantages: torch.Tensor | None = None, loss_mask: torch.Tensor | None = None,
                  old_logp: torch.Tensor | None = None) -> dict[str, float]:
    """num_iterations optimizer steps on one rollout batch; returns summed stats for logging.

    input_ids/attention_mask (N, P+T); mask (N, T) completion tokens; advantages (N,), already
    multiplied by the PPS importance weight (the weight touches the policy-gradient term only).
    REINFORCE++ (algo.advantage reinforce_pp*): `rewards` (N,) are the raw rewards, from which
    the token-level advantages (N, T) are computed here, and `advantages` (N,) holds the PPS IS
    weights alone, which multiply them per sequence; sums then carry "adv_abs", "adv_sq" and
    "adv_count" over the valid tokens.
    SPO (algo.advantage spo_*): `token_advantages` (N, T) are final (segments.py: whitened over
    M), `loss_mask` (N, T) is M, the tokens the loss aggregates over (`mask` still sizes the
    micro-batches), `old_logp` (N, T) the π_old that M and the advantages came from (not scored
    again); `advantages` (N,) holds the PPS IS weights alone, as for REINFORCE++. Ranks may hold
    different numbers of rows (SPO-tree's edges): the aggregation counts them over all ranks.
    π_old and π_ref are scored in eval mode; the update runs in train mode (so gradient
    checkpointing recomputes) and the policy is back in eval mode on return, for generation.
    A non-finite loss or gradient norm (on any rank) skips that optimizer step: the weights and
    AdamW state stay as they were, and sums["skipped_steps"] counts it.
    """
    a, T = cfg.algo, mask.shape[1]
    temperature = cfg.rollout.temperature
    lm = mask if loss_mask is None else loss_mask                       # (N, T) the tokens the loss is over
    counts = distributed.all_reduce_sum(torch.stack([torch.tensor(float(mask.shape[0]), dtype=torch.float64,
                                                                  device=lm.device), lm.sum().double()]))
    num_seqs, num_tokens = int(counts[0].item()), int(counts[1].item())  # over every rank
    weights = sequence_weights(lm, a.aggregation, num_seqs, num_tokens, cfg.rollout.max_new_tokens)  # (N,)
    # π_old: with one iteration it is the current policy (ρ ≡ 1), else scored once, up front;
    # REINFORCE++'s KL reward needs it up front too.
    reinforce = a.advantage.startswith("reinforce_pp")
    if reinforce and rewards is None:
        raise ValueError(f"rewards: algo.advantage={a.advantage} computes its advantages from the raw rewards")
    if (token_advantages is None) != (a.advantage not in ("spo_chain", "spo_tree")):
        raise ValueError(f"token_advantages: expected them with algo.advantage=spo_*, not with {a.advantage}")
    needs_old = old_logp is None and (a.num_iterations > 1 or (reinforce and a.kl_coef > 0))
    plan = plan_micro_batches(attention_mask, mask, cfg.train.micro_batch_size, cfg.train.micro_batch_tokens)
    if needs_old:
        old_logp = score_logprobs(policy, input_ids, attention_mask, T, temperature, plan)
    ref_logp = score_logprobs(ref, input_ids, attention_mask, T, temperature, plan) if a.needs_reference else None
    P = input_ids.shape[1] - T
    positions = sum(len(b.rows) * (P - b.start + b.width) for b in plan if not b.spare)   # rows x width
    sums: dict[str, float] = {"skipped_steps": 0.0, "update_positions": float(positions * a.num_iterations),
                              "update_tokens": float(attention_mask.sum()) * a.num_iterations}
    if reinforce:                                                       # §6, whitened over every rank's tokens
        group = cfg.rollout.num_generations if a.advantage == "reinforce_pp_baseline" else None
        token_advantages = reinforce_pp_advantages(rewards, mask, old_logp, ref_logp, a.kl_coef, a.clip_score,
                                                   group, a.whiten)    # (N, T)
    if token_advantages is not None:
        sums.update(adv_abs=float(token_advantages.abs().sum()), adv_sq=float((token_advantages ** 2).sum()),
                    adv_count=float(lm.sum()))
        advantages = token_advantages * advantages[:, None]             # (N, T) times the PPS IS weight
    policy.train()
    try:
        for _ in range(a.num_iterations):
            finite = True
            for batch in plan:
                logp, entropy = _forward(policy, batch, input_ids, attention_mask, T, temperature)  # (n, w)
                rows, cols = batch.rows, slice(0, batch.width)
                m = lm[rows, cols] * (0.0 if batch.spare else 1.0)       # (n, w); a spare one: zero loss
                adv = advantages[rows, cols] if advantages.dim() == 2 else advantages[rows]
                old = logp.detach() if old_logp is None else old_logp[rows, cols]
                ref_rows = None if ref_logp is None else ref_logp[rows, cols]
                loss, stats = policy_loss(logp, old, ref_rows, adv, m, weights[rows], a.beta, a.eps_low, a.eps_high)
                finite &= bool(torch.isfinite(loss))
                # FSDP averages gradients over ranks; the loss is already a global sum, so undo the mean.
                (loss * dist_.world_size).backward()
                stats["entropy"] = (entropy * m).sum()
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
