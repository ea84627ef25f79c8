"""Counter-based sampling: one token per row from its logits, its seed and its position.

Completion j draws token t as argmax(z/T + g) over the top-p set, where z are the logits and g is
Gumbel noise that is a pure function of (the completion's seed, t, token id). The Gumbel-max trick
makes that an exact draw from softmax(z/T) renormalized on the nucleus, and because no shared RNG
stream is consumed, a completion does not depend on which other prompts share its batch or its
rank. The log-prob kept is log softmax(z/T) of the drawn token (docs/methods.md §1: the loss
divides logits by the sampling temperature; top-p is not part of ρ). Both transformers loops use
these functions (hf_engine.py's logits processor inside `generate`, decode.py's static-cache loop).

Seeds are counter-based too: one int64 per completion, a hash of (run seed, step, prompt key,
sample index), so a completion's randomness does not depend on which prompts share its batch or
its rank (the Gumbel noise here hashes it with the position; vllm_engine.py uses it as a
per-request seed). Continuations of partial completions (SPO) are seeded the same way: by the
parent's seed (`child_seeds`, a tree's branches) or by the continued tokens themselves
(`prefix_seeds`).
"""
from __future__ import annotations

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


def prompt_keys(round_: int, prompts: int, step_prompts: int, mine: slice) -> Tensor:
    """This rank's prompt keys of a round of a step (sequence_seeds hashes them with the run's seed and the
    step): round·B + position, for the round's `prompts` = P <= B = step_prompts positions, so round 0's are
    the positions 0..B-1, and no two rounds of DAPO's dynamic sampling (docs/methods.md §9) share a key. (P/W,)"""
    return round_ * step_prompts + torch.arange(prompts)[mine]


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


def column_keys(vocab: int, device: torch.device | str | None = None) -> Tensor:
    """The vocabulary's hash keys, arange(V) x MUL1 (wrapping int64), (V,). A compiled sampler takes them
    as an input, computed once outside the graph: inductor turns arange(V) x constant into an index
    expression, and Triton then multiplies its int32 column index by a constant out of int32's range
    (a compile error on CUDA, seen with torch 2.11)."""
    return torch.arange(vocab, device=device, dtype=torch.int64) * MUL1


def gumbel_noise(seeds: Tensor, t: int | Tensor, vocab: int, columns: Tensor | None = None) -> Tensor:
    """Gumbel(0, 1) noise, (N,) seeds x position t -> (N, V) float32, deterministic.

    t may be a 0-dim int64 tensor (the compiled decode step takes it so, to compile once); columns:
    column_keys(vocab), precomputed (a compiled caller must pass them)."""
    columns = column_keys(vocab, seeds.device) if columns is None else columns
    step = torch.as_tensor(t, dtype=torch.int64, device=seeds.device) * GOLDEN   # wraps mod 2^64
    h = mix(mix(seeds[:, None] + step) + columns[None, :])              # (N, V)
    u = (shr(h, 40).float() + 0.5) * 2.0**-24                              # uniform in (0, 1)
    return -torch.log(-torch.log(u))


def outside_nucleus(logp: Tensor, top_p: float) -> Tensor:
    """True for tokens outside the smallest set whose probability reaches top_p. (N, V)"""
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    mass_before = sorted_logp.exp().cumsum(-1) - sorted_logp.exp()           # mass of better tokens
    drop_sorted = mass_before >= top_p                                      # the top token is never dropped
    return torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)


def perturbed_logits(logits: Tensor, seeds: Tensor | None, t: int | Tensor, *, temperature: float,
                     top_p: float, columns: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(z, logp), (N, V) each: z's argmax is the drawn token (greedy when seeds is None), logp =
    log softmax(logits/T). z = logits/T, outside the nucleus -inf, plus the Gumbel noise of (seed, t)
    (columns: gumbel_noise's)."""
    z = logits.float() / temperature                                        # (N, V) raw logits / T
    logp = torch.log_softmax(z, dim=-1)
    if seeds is not None:
        if top_p < 1.0:
            z = z.masked_fill(outside_nucleus(logp, top_p), float("-inf"))
        z = z + gumbel_noise(seeds, t, z.shape[-1], columns)
    return z, logp


def draw(logits: Tensor, seeds: Tensor | None, t: int | Tensor, *, temperature: float,
         top_p: float, columns: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """One token per row and its log softmax(logits/T): (N, V) -> (N,) long, (N,) float32 (columns:
    gumbel_noise's)."""
    z, logp = perturbed_logits(logits, seeds, t, temperature=temperature, top_p=top_p, columns=columns)
    choice = z.argmax(dim=-1)                                               # (N,)
    return choice, logp.gather(1, choice[:, None]).squeeze(1)
