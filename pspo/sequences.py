"""The records the engines, the methods and the trainer share: `Rollout` (what generation returns),
`UpdateBatch` (what the optimizer step consumes), counter-based seeds, and padding. It imports
nothing from the rest of pspo, so everything else may import it.

Seeds are counter-based: one int64 per completion, a hash of (run seed, step, prompt key,
sample index), so a completion's randomness does not depend on which prompts share its batch or
its rank (rollout.py turns it into Gumbel noise, vllm_engine.py into a per-request seed).
Continuations of partial completions (SPO) are seeded the same way: by the parent's seed
(`child_seeds`, a tree's branches) or by the continued tokens themselves (`prefix_seeds`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

_MASK64 = (1 << 64) - 1


def _signed(x: int) -> int:
    """A 64-bit unsigned constant as the int64 torch stores."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


GOLDEN, MUL1, MUL2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def shr(x: Tensor, k: int) -> Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def mix(x: Tensor) -> Tensor:
    """splitmix64 finalizer: a bijective 64-bit hash (int64 arithmetic wraps)."""
    x = (x ^ shr(x, 30)) * MUL1
    x = (x ^ shr(x, 27)) * MUL2
    return x ^ shr(x, 31)


def sequence_seeds(seed: int, step: int, prompt_keys: Tensor, n: int) -> Tensor:
    """One int64 seed per completion: hash(seed, step, prompt key, sample index). (P,) -> (P*n,)"""
    base = mix(torch.tensor(seed, dtype=torch.int64) * GOLDEN + step)
    keys = mix(base + prompt_keys.to(torch.int64) * GOLDEN)               # (P,)
    return mix(keys[:, None] + torch.arange(1, n + 1) * GOLDEN).reshape(-1)


def child_seeds(parent_seeds: Tensor, n: int) -> Tensor:
    """n seeds under each parent seed, e.g. the children of a tree node (SPO-tree) from the seed
    that generated the node: hash(parent seed, sample index). (P,) -> (P*n,)

    Domain-separated from the parent's own Gumbel stream (rollout.gumbel_noise hashes seed + t).
    """
    keys = mix(parent_seeds.to(torch.int64) ^ MUL1)                       # (P,)
    return mix(keys[:, None] + torch.arange(1, n + 1) * GOLDEN).reshape(-1)


def prefix_seeds(seed: int, step: int, token_ids: list[list[int]], n: int) -> Tensor:
    """n seeds per token sequence (a prompt + partial completion to continue, SPO-chain's MC
    states): hash(run seed, step, the tokens themselves, sample index). (U,) -> (U*n,)

    Keyed by content, not by batch position: identical states get identical continuations on any
    rank and in any batch, so deduplicating them (segments.unique_prefixes) changes no value.
    The tokens hash as Σ_i mix(token_i·MUL1 + i·GOLDEN) (order-sensitive, wrapping), then the length.
    """
    lengths = torch.tensor([len(t) for t in token_ids], dtype=torch.int64)   # (U,)
    width = int(lengths.max()) if len(token_ids) else 0
    ids = torch.tensor([t + [0] * (width - len(t)) for t in token_ids],
                       dtype=torch.int64).reshape(len(token_ids), width)
    pos = torch.arange(1, width + 1, dtype=torch.int64) * GOLDEN           # (width,)
    terms = torch.where(torch.arange(width) < lengths[:, None], mix(ids * MUL1 + pos), 0)   # (U, width)
    base = mix(torch.tensor(seed, dtype=torch.int64) * GOLDEN + step) ^ MUL2   # not sequence_seeds' base
    keys = mix(base + mix(terms.sum(1) + lengths * MUL1))                 # (U,)
    return mix(keys[:, None] + torch.arange(1, n + 1) * GOLDEN).reshape(-1)


def continuation_inputs(prompt_ids: list[list[int]], prefix_ids: list[list[int]] | None,
                        max_new_tokens: int) -> tuple[list[list[int]], list[int]]:
    """What an engine feeds the model, and each prompt's budget of new tokens: prompt + prefix,
    max_new_tokens - len(prefix) (a continued completion keeps the total budget of a fresh one).
    prefix_ids None: the prompts and max_new_tokens each."""
    if prefix_ids is None:
        return prompt_ids, [max_new_tokens] * len(prompt_ids)
    if len(prefix_ids) != len(prompt_ids):
        raise ValueError(f"prefix_ids: expected one per prompt ({len(prompt_ids)}), got {len(prefix_ids)}")
    budgets = [max_new_tokens - len(q) for q in prefix_ids]
    if budgets and min(budgets) < 1:
        raise ValueError(f"prefix_ids: a prefix of {max_new_tokens - min(budgets)} tokens leaves nothing "
                         f"to generate within max_new_tokens = {max_new_tokens}")
    return [list(p) + list(q) for p, q in zip(prompt_ids, prefix_ids)], budgets


@dataclass
class Rollout:
    """Completions of one generate call, in prompt-major order (prompt p, sample j -> row p*n+j).

    When the call continued partial completions (`prefix_ids`), the tensors hold the newly generated
    tokens only and `texts` the whole completion, prefix + continuation (what a reward scores)."""
    completion_ids: Tensor   # (N, T) long, pad after the stop token
    mask: Tensor             # (N, T) float, 1 on generated tokens up to and including the stop token
    logprobs: Tensor         # (N, T) float32, log softmax(z/T) of each sampled token (0 on padding)
    truncated: Tensor        # (N,) bool, hit its token budget without a stop token
    texts: list[str]         # decoded completions (prefix included) without special tokens
    gen_time_s: float        # wall time spent generating


END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")   # ChatML, Llama 3, Gemma, Phi


def stop_token_ids(tokenizer, generation_eos: int | list[int] | None = None) -> list[int]:
    """Token ids that end a completion: the tokenizer's eos, the generation config's, and the
    chat template's end-of-turn token when the vocabulary has one.

    A base model's eos is often not its chat template's end of turn: Qwen2.5-Math-1.5B ends
    sequences with <|endoftext|> while its ChatML turns end with <|im_end|>. Without the latter
    a completion runs on past the answer into an imagined next turn, to max_new_tokens.
    """
    eos = [generation_eos] if isinstance(generation_eos, int) else list(generation_eos or [])
    vocab = tokenizer.get_vocab()
    turn = [vocab[t] for t in END_OF_TURN if t in vocab]
    return sorted(set(eos + turn + [tokenizer.eos_token_id]) - {None})


def left_pad(prompt_ids: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Token-id lists -> left-padded ids and attention mask, (N, P) each (prompts end together)."""
    width = max(len(p) for p in prompt_ids)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompt_ids])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
    return ids, mask


def batch_inputs(prompt_ids: list[list[int]], completion_ids: Tensor, completion_mask: Tensor,
                 pad_id: int) -> tuple[Tensor, Tensor]:
    """Left-padded prompts + completions -> input_ids, attention_mask (N, P+T).

    prompt_ids has one entry per completion row. Completion padding is masked out; since it
    sits after the real tokens, the causal mask already keeps it from affecting them.
    """
    prompts, prompt_mask = left_pad(prompt_ids, pad_id)
    input_ids = torch.cat([prompts, completion_ids], 1)
    attention_mask = torch.cat([prompt_mask, completion_mask.long()], 1)
    return input_ids, attention_mask


@dataclass
class UpdateBatch:
    """What every advantage method (methods.py) hands the optimizer step (update.py), on the rank's device.

    The update reads nothing else: it does not know which method made the batch."""
    input_ids: Tensor               # (N, P+T) long, left-padded prompt (+ prefix), then the completion
    attention_mask: Tensor          # (N, P+T)
    mask: Tensor                    # (N, T) completion tokens: sizes the micro-batches
    loss_mask: Tensor               # (N, T) the tokens the loss aggregates over (SPO: M, within mask)
    advantages: Tensor              # (N, T) token advantages Â_it, times the PPS IS weight of the completion
    old_logp: Tensor | None = None  # (N, T) logπ_old; None with one iteration (ρ ≡ 1)
    ref_logp: Tensor | None = None  # (N, T) logπ_ref; the k3 term with algo.beta > 0, else only logged
