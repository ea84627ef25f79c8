"""Micro-batches: how one optimizer step's rows are cut into forward/backward passes (docs/methods.md §1,
"Aggregation": the loss is normalised by global counts, so the split never changes the gradient).

Two ways, chosen by `train.micro_batch_tokens`:
- 0: consecutive slices of `train.micro_batch_size` rows, padded to the step's longest sequence;
- > 0: a token budget: the rows sorted by length and packed so that rows x (longest prompt + longest
  completion) of each micro-batch stays within the budget, each cut to its own widths.
Every rank runs as many micro-batches as the busiest one (FSDP2's collectives must match); the spare
ones repeat one real row and carry no loss.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pspo import distributed


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
    repeat one real row and are marked spare (policy_update zeroes their loss). Collective.
    """
    N, T = mask.shape
    P = attention_mask.shape[1] - T
    if micro_batch_tokens <= 0:
        batches = [MicroBatch(torch.arange(i, min(i + micro_batch_size, N)), 0, T)
                   for i in range(0, N, micro_batch_size)]
    else:
        prompt_len = attention_mask[:, :P].sum(1).tolist()
        completion_len = [max(1, int(c)) for c in mask.sum(1).tolist()]
        batches = _pack(prompt_len, completion_len, P, micro_batch_tokens)
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
