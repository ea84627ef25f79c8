"""Scoring π_old and π_ref: the log-probs of a batch's completion tokens under the policy before the
update and under the frozen reference (docs/methods.md §1: ρ = exp(logπ_θ - logπ_old), the k3 KL
against π_ref; docs/related.md §A: REINFORCE++'s KL reward; §B: SPO's p_t = π_old).

Scored once per step, outside the optimizer step, where the step's method or its update needs them
(methods.score_first and methods.training_batch; SPO-tree's new edges in related/spo.py), with the
update's own micro-batches and in eval mode, with the logits divided by the sampling temperature
as in the loss. Every rank must call these together (the micro-batch plan is collective).
"""
from __future__ import annotations

import torch

from pspo.training.config import Config
from pspo.training.micro_batches import MicroBatch, TokenRows, plan_micro_batches


def forward_logprobs(model, batch: MicroBatch, *, input_ids: torch.Tensor, attention_mask: torch.Tensor, T: int,
                     temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """log π and entropy of one micro-batch's completion columns, (n, width) each."""
    P = input_ids.shape[1] - T
    return model(batch.cut(input_ids, P), batch.cut(attention_mask, P), batch.width, temperature,
                 packed_width=batch.length, packed=batch.packed)


@torch.no_grad()
def score_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, T: int, temperature: float,
                   plan: list[MicroBatch]) -> torch.Tensor:
    """log π of the completion tokens under `model`, micro-batched, without grad. (N, T), 0 past each
    micro-batch's width."""
    out = torch.zeros(input_ids.shape[0], T, device=input_ids.device)
    for batch in plan:
        logp = forward_logprobs(model, batch, input_ids=input_ids, attention_mask=attention_mask, T=T,
                                temperature=temperature)[0]
        if not batch.spare:
            out[batch.rows, :batch.width] = logp.float()
    return out


def score_policy(policy, ref, rows: TokenRows, *, cfg: Config, need_old: bool,
                 need_ref: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(π_old, π_ref) log-probs (N, T) of the completions of `rows`, each only where asked (else None).
    The policy is in eval mode here (the loop hands it over so; update.py returns it so)."""
    if not (need_old or need_ref):
        return None, None
    t, T, temperature = cfg.train, rows.mask.shape[1], cfg.rollout.temperature
    plan = plan_micro_batches(rows.attention_mask, rows.mask, t.micro_batch_size, t.micro_batch_tokens, t.packing)
    old = ref_logp = None
    if need_old:
        old = score_logprobs(policy, rows.input_ids, rows.attention_mask, T=T, temperature=temperature, plan=plan)
    if need_ref:
        ref_logp = score_logprobs(ref, rows.input_ids, rows.attention_mask, T=T, temperature=temperature, plan=plan)
    return old, ref_logp
