"""What the engines, the trainer and the model share: the `Rollout` record, counter-based seeds,
and padding. It imports nothing from the rest of pspo, so imports flow one way:

    sequences  <-  vllm_engine (which also imports model)  <-  rollout (HFEngine, build_engine)
    sequences  <-  update, evaluation, train, eval

Seeds are counter-based: one int64 per completion, a hash of (run seed, step, prompt key,
sample index), so a completion's randomness does not depend on which prompts share its batch or
its rank (rollout.py turns it into Gumbel noise, vllm_engine.py into a per-request seed).
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


@dataclass
class Rollout:
    """Completions of one generate call, in prompt-major order (prompt p, sample j -> row p*n+j)."""
    completion_ids: Tensor   # (N, T) long, pad after the stop token
    mask: Tensor             # (N, T) float, 1 on generated tokens up to and including the stop token
    logprobs: Tensor         # (N, T) float32, log softmax(z/T) of each sampled token (0 on padding)
    truncated: Tensor        # (N,) bool, hit max_new_tokens without a stop token
    texts: list[str]         # decoded completions without special tokens
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
