"""The optimizer step on one batch (docs/methods.md §1): the objective (algo.objective, §11) + β·KL over the
batch's token advantages, micro-batched with gradient accumulation, then the grad-norm clip and the AdamW
step, `algo.num_iterations` times.

It does not know which method made the batch: it trains on an `UpdateBatch` (methods.training_batch)
of token advantages (N, T) already multiplied by the PPS and TIS importance weights, the loss mask,
and π_old / π_ref where they were scored (logprobs.py). The loss is normalised by global counts
(loss.sequence_weights), so the gradient does not depend on how rows are split into micro-batches
(micro_batches.py) or ranks.

Modes: the forward/backward passes run in train mode, the only mode in which transformers recomputes
checkpointed layers (model.gradient_checkpointing); the policy is handed back in eval mode, where
generation keeps its KV cache.
Numerics: a non-finite loss or gradient norm on any rank skips that optimizer step (weights and
AdamW state untouched) and is counted; the loop decides when to stop.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from pspo.training import distributed
from pspo.training.config import Config
from pspo.training.distributed import Dist
from pspo.training.logprobs import forward_logprobs
from pspo.training.metrics import UpdateSums
from pspo.loss import policy_loss, sequence_weights
from pspo.training.micro_batches import UpdateBatch, plan_micro_batches


def policy_update(policy, optimizer, scheduler, batch: UpdateBatch, cfg: Config,
                  dist_: Dist) -> UpdateSums:
    """num_iterations optimizer steps on one batch; returns this rank's summed statistics.

    batch.old_logp may be None only with one iteration (then π_old is the current policy: ρ ≡ 1);
    batch.ref_logp must be given when algo.beta > 0 (the k3 term), and when given its KL is logged.
    Ranks may hold different numbers of rows (SPO-tree's edges): the aggregation counts them over
    all ranks. A non-finite loss or gradient norm (on any rank) skips that optimizer step: the
    weights and AdamW state stay as they were, and skipped_steps counts it.
    """
    a, T = cfg.algo, batch.mask.shape[1]
    if batch.old_logp is None and a.num_iterations > 1:
        raise ValueError("old_logp: algo.num_iterations > 1 needs π_old scored before the update")
    if batch.ref_logp is None and a.beta > 0:
        raise ValueError("ref_logp: algo.beta > 0 needs π_ref scored before the update")
    input_ids, attention_mask, lm = batch.input_ids, batch.attention_mask, batch.loss_mask   # lm (N, T)
    temperature = cfg.rollout.temperature
    counts = distributed.all_reduce_sum(torch.stack([torch.tensor(float(lm.shape[0]), dtype=torch.float64,
                                                                  device=lm.device), lm.sum().double()]))
    num_seqs, num_tokens = int(counts[0].item()), int(counts[1].item())  # over every rank
    weights = sequence_weights(lm, a.aggregation, num_seqs, num_tokens, cfg.rollout.max_new_tokens)  # (N,)
    plan = plan_micro_batches(attention_mask, batch.mask, cfg.train.micro_batch_size,
                              cfg.train.micro_batch_tokens, cfg.train.packing)
    positions = sum(b.positions for b in plan if not b.spare)     # what the model runs over (model.py)
    skipped, grad_norms = 0.0, 0.0
    sums: dict[str, float] = {}                                         # the loss's statistics, summed
    policy.train()
    try:
        for _ in range(a.num_iterations):
            # statistics stay on the device until the optimizer step: reading one back per micro-batch
            # would make the CPU wait for the GPU each time instead of queueing the next micro-batch
            finite_loss = torch.ones((), dtype=torch.bool, device=dist_.device)
            totals: dict[str, Tensor] = {}
            for micro in plan:
                logp, entropy = forward_logprobs(policy, micro, input_ids=input_ids, attention_mask=attention_mask,
                                                 T=T, temperature=temperature)   # (n, w)
                # whole rows, every completion token of each (width: their longest), so that a sequence-level
                # objective (GSPO's s_i) sees its sequence entire: micro_batches.plan_micro_batches
                rows, cols = micro.rows, slice(0, micro.width)
                m = lm[rows, cols] * (0.0 if micro.spare else 1.0)       # (n, w); a spare one: zero loss
                old = logp.detach() if batch.old_logp is None else batch.old_logp[rows, cols]
                ref = None if batch.ref_logp is None else batch.ref_logp[rows, cols]
                loss, stats = policy_loss(logp, old_logp=old, ref_logp=ref, advantages=batch.advantages[rows, cols],
                                          mask=m, seq_weights=weights[rows], beta=a.beta, eps_low=a.eps_low,
                                          eps_high=a.eps_high, objective=a.objective, tau_pos=a.sapo_tau_pos,
                                          tau_neg=a.sapo_tau_neg)
                finite_loss &= torch.isfinite(loss.detach())
                # FSDP averages gradients over ranks; the loss is already a global sum, so undo the mean.
                (loss * dist_.world_size).backward()
                stats["entropy"] = (entropy * m).sum()
                for key, value in stats.items():
                    totals[key] = totals.get(key, 0.0) + value.detach().double()    # as a float sum would
            grad_norm = _clip_grad_norm(policy, cfg.optim.max_grad_norm)
            grad_norms += grad_norm / dist_.world_size
            for key, value in totals.items():
                sums[key] = sums.get(key, 0.0) + float(value)
            finite = bool(finite_loss) and math.isfinite(grad_norm)
            if distributed.all_reduce_max(torch.tensor(float(not finite), device=dist_.device)) == 0:
                optimizer.step()
            else:                                                       # NaN/inf: keep the weights
                skipped += 1.0 / dist_.world_size
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        policy.eval()
    return UpdateSums(skipped_steps=skipped, update_positions=float(positions * a.num_iterations),
                      update_tokens=float(attention_mask.sum()) * a.num_iterations, grad_norm=grad_norms, **sums)


def _clip_grad_norm(policy, max_grad_norm: float) -> float:
    """The global gradient norm before clipping to max_grad_norm (0 = no clip), as a float."""
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), max_grad_norm or float("inf"))
    if hasattr(grad_norm, "full_tensor"):                               # a DTensor under FSDP
        grad_norm = grad_norm.full_tensor()
    return float(grad_norm)
