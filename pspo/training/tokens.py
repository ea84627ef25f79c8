"""What an engine returns and the token bookkeeping around it: `Rollout` (one generate call's
completions, the record behind pspo/rollout.py's contract), the stop tokens of a chat model, left
padding and the row buckets a batch is padded to, prompt + completion inputs, and the inputs of a
continued (SPO) completion. It imports nothing from the rest of pspo, so every engine, method, the
trainer and the memory plan may import it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


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


def bucket(n: int, top: int) -> int:
    """The rows a batch of n is padded to (decode.py's static cache, the memory plan's count of it): the
    smallest of top, ceil(top/2), ceil(top/4), ..., 1 that holds n; n itself when n > top.

    bucket(36, 96) = 48, bucket(49, 96) = 96, bucket(5, 96) = 6, bucket(130, 96) = 130."""
    if n > top:
        return n
    size = top
    while size > 1 and -(-size // 2) >= n:
        size = -(-size // 2)
    return size


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
