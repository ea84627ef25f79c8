"""The update batch and its micro-batches: `TokenRows`, prompts + completions as the model reads them,
`UpdateBatch`, the rows one optimizer step trains on, and how they are cut into forward/backward
passes (docs/methods.md §1, "Aggregation": the loss is normalised by global counts, so the split never
changes the gradient).

Three ways, chosen by `train.micro_batch_tokens` and `train.packing`:
- micro_batch_tokens 0: consecutive slices of `train.micro_batch_size` rows, padded to the step's
  longest sequence;
- > 0 with packing (the default): a token budget filled first-fit-decreasing: the sequences
  (prompt + completion), longest first, each into the first micro-batch it fits, and scored back to
  back in one row with no padding (model.py, Policy.forward's packed path; packed_attention.py); a
  sequence longer than the budget goes alone;
- > 0 without packing: the rows sorted by length so that rows x the longest row of each micro-batch
  stays within the budget.
Unpacked, a micro-batch is scored padding-free on the left: each row's tokens start at position 0
and only the longest row sets the width, so it costs rows x its longest row.
Every rank runs as many micro-batches as the busiest one (FSDP2's collectives must match); the spare
ones repeat one real row and carry no loss.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from pspo.training.tokens import batch_inputs
from pspo.training import distributed
from pspo.training.packed_attention import Kernels, Packed


@dataclass
class TokenRows:
    """Rows of a prompt (+ prefix) then a completion, left-padded, on the rank's device."""
    input_ids: torch.Tensor               # (N, P+T) long
    attention_mask: torch.Tensor          # (N, P+T)
    mask: torch.Tensor                    # (N, T) completion tokens


def token_rows(prompt_ids: list[list[int]], completion_ids: torch.Tensor, mask: torch.Tensor, pad_id: int,
               device: torch.device) -> TokenRows:
    """One prompt (token ids) per completion (N, T) with its mask (N, T), as TokenRows on `device`."""
    input_ids, attention_mask = batch_inputs(prompt_ids, completion_ids, mask, pad_id)
    return TokenRows(input_ids.to(device), attention_mask.to(device), mask.to(device))


@dataclass
class UpdateBatch:
    """What the optimizer step (update.py) trains on, on the rank's device: a method's advantages on
    its rows, weighted and with π_old / π_ref where scored (methods.training_batch).

    The update reads nothing else: it does not know which method made the batch."""
    input_ids: torch.Tensor               # (N, P+T) long, left-padded prompt (+ prefix), then the completion
    attention_mask: torch.Tensor          # (N, P+T)
    mask: torch.Tensor                    # (N, T) completion tokens: sizes the micro-batches
    loss_mask: torch.Tensor               # (N, T) the tokens the loss aggregates over (SPO: M, within mask)
    advantages: torch.Tensor              # (N, T) token advantages Â_it, times the PPS and TIS weights
    old_logp: torch.Tensor | None = None  # (N, T) logπ_old; None with one iteration (ρ ≡ 1)
    ref_logp: torch.Tensor | None = None  # (N, T) logπ_ref; the k3 term with algo.beta > 0, else only logged


@dataclass
class MicroBatch:
    rows: torch.Tensor        # (n,) row indices into the step's (N, P+T) batch
    start: int                # first column kept: P - the longest prompt among the rows
    width: int                # completion columns kept: the longest completion among the rows
    length: int = 0           # the longest row's prompt + completion tokens: the width it is scored at
    spare: bool = False       # run only to keep the ranks' collectives matched: its loss is zeroed
    packed: Packed | None = None   # packed into one row (train.packing): its sizes

    @property
    def positions(self) -> int:
        """The positions the model runs over: the packed row's tokens, or rows x the longest row."""
        return self.packed.tokens if self.packed else len(self.rows) * self.length

    def cut(self, x: torch.Tensor, P: int) -> torch.Tensor:
        """The rows' (n, P+T) inputs cut to [start, P + width)."""
        return x[self.rows, self.start:P + self.width]


def plan_micro_batches(attention_mask: torch.Tensor, mask: torch.Tensor, micro_batch_size: int,
                       micro_batch_tokens: int, packing: bool = False) -> list[MicroBatch]:
    """Micro-batches of the step's rows. attention_mask (N, P+T) left-padded prompts then
    completions; mask (N, T) completion tokens.

    micro_batch_tokens = 0: consecutive slices of micro_batch_size rows, cut to full width (P + T).
    Otherwise: rows sorted by prompt + completion length (longest first) and packed greedily
    while n_rows x the first (longest) row's length <= micro_batch_tokens (a row longer than the
    budget goes alone), each cut to its rows' longest prompt and longest completion. Every rank
    gets as many micro-batches as the busiest rank (ranks may hold different numbers of rows, as
    SPO-tree's edges do; at least one each); the extra ones repeat one real row and are marked
    spare (policy_update zeroes their loss). Collective.
    packing (with micro_batch_tokens > 0): first-fit-decreasing bins of at most micro_batch_tokens
    tokens, each scored as one packed row (MicroBatch.packed).
    """
    N, T = mask.shape
    P = attention_mask.shape[1] - T
    # Every way below assigns whole rows (a row index goes to exactly one micro-batch, packing included: a
    # sequence longer than the budget goes alone, never split) and cuts each to its rows' longest completion,
    # so a sequence-level term (GSPO's ratio, docs/methods.md §11) always sees its whole sequence.
    prompt_len = attention_mask[:, :P].sum(1).tolist()
    real = [int(c) for c in mask.sum(1).tolist()]
    completion_len = [max(1, c) for c in real]
    if micro_batch_tokens > 0 and packing:
        batches = [_packed_batch(rows, prompt_len, real, completion_len, P)
                   for rows in first_fit_decreasing([p + c for p, c in zip(prompt_len, real)], micro_batch_tokens)]
    elif micro_batch_tokens <= 0:
        batches = [_micro_batch(list(range(i, min(i + micro_batch_size, N))), prompt_len, completion_len, P)
                   for i in range(0, N, micro_batch_size)]
        batches = [MicroBatch(b.rows, 0, T, b.length) for b in batches]
    else:
        batches = _pack(prompt_len, completion_len, P, micro_batch_tokens)
    most = int(distributed.all_reduce_max(torch.tensor(float(len(batches)), device=mask.device)))
    last = batches[-1]
    spare = MicroBatch(last.rows[:1], last.start, last.width, last.length, spare=True)
    if last.packed:
        spare = dataclasses.replace(_packed_batch(last.rows[:1].tolist(), prompt_len, real, completion_len, P),
                                    start=last.start, width=last.width, spare=True)
    return batches + [spare] * (most - len(batches))


def _pack(prompt_len: list[int], completion_len: list[int], P: int,
          micro_batch_tokens: int) -> list[MicroBatch]:
    """Token-budget micro-batches of plan_micro_batches (micro_batch_tokens > 0)."""
    total = [p + c for p, c in zip(prompt_len, completion_len)]
    order = sorted(range(len(total)), key=lambda i: total[i], reverse=True)
    batches, rows = [], []
    for i in order:
        if rows and (len(rows) + 1) * total[rows[0]] > micro_batch_tokens:     # rows[0]: the longest
            batches.append(_micro_batch(rows, prompt_len, completion_len, P))
            rows = []
        rows.append(i)
    if rows:
        batches.append(_micro_batch(rows, prompt_len, completion_len, P))
    return batches


def micro_batch_line(micro_batch_size: int, micro_batch_tokens: int, packing: bool, kernels: Kernels) -> str:
    """The start-up line naming how the update's micro-batches are made and the attention kernel they run
    with (packed_attention.choose_kernels: the one place it is chosen)."""
    if micro_batch_tokens <= 0:
        return (f"micro-batches: {micro_batch_size} rows each (train.micro_batch_size), attention: "
                f"sdpa {kernels.sdpa or 'any'}")
    if not packing:
        return (f"micro-batches: a token budget of {micro_batch_tokens} (rows x the longest row), unpacked, "
                f"attention: sdpa {kernels.sdpa or 'any'}")
    kernel = "varlen" if kernels.packed == "varlen" else f"sdpa {kernels.sdpa or 'any'} per sequence"
    return (f"micro-batches: sequences packed into rows of at most {micro_batch_tokens} tokens "
            f"(first-fit-decreasing), attention: {kernel}")


def first_fit_decreasing(lengths: list[int], budget: int) -> list[list[int]]:
    """Bins of sequence indices whose lengths sum to at most `budget`: longest first, each into the first
    bin with room (a sequence longer than the budget gets a bin of its own). Within 11/9 of the fewest
    bins plus one (Johnson's bound); ties keep index order, so the plan is deterministic."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fit = next((b for b, r in enumerate(room) if lengths[i] <= r), None)
        if fit is None:
            bins.append([i])
            room.append(budget - lengths[i])
        else:
            bins[fit].append(i)
            room[fit] -= lengths[i]
    return bins


def _packed_batch(rows: list[int], prompt_len: list[int], real: list[int], completion_len: list[int],
                  P: int) -> MicroBatch:
    """A packed micro-batch: the rows cut as _micro_batch cuts them, with the packed row's sizes."""
    batch = _micro_batch(rows, prompt_len, completion_len, P)
    batch.packed = Packed(tuple(int(prompt_len[i]) + real[i] for i in rows), sum(real[i] for i in rows))
    return batch


def _micro_batch(rows: list[int], prompt_len: list[int], completion_len: list[int], P: int) -> MicroBatch:
    """The rows, cut to their longest prompt and completion, scored at their longest prompt + completion."""
    return MicroBatch(torch.tensor(rows), P - max(prompt_len[i] for i in rows),
                      max(completion_len[i] for i in rows),
                      max(prompt_len[i] + completion_len[i] for i in rows))
