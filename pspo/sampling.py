"""Counter-based sampling: one token per row from its logits, its seed and its position.

Completion j draws token t as argmax(z/T + g) over the top-p set, where z are the logits and g is
Gumbel noise that is a pure function of (the completion's seed, t, token id). The Gumbel-max trick
makes that an exact draw from softmax(z/T) renormalized on the nucleus, and because no shared RNG
stream is consumed, a completion does not depend on which other prompts share its batch or its
rank. The log-prob kept is log softmax(z/T) of the drawn token (docs/methods.md §1: the loss
divides logits by the sampling temperature; top-p is not part of ρ). Both transformers loops use
these functions (rollout.py's logits processor inside `generate`, decode.py's static-cache loop).
"""
from __future__ import annotations

import torch
from torch import Tensor

from pspo.sequences import GOLDEN, MUL1, mix, shr


def gumbel_noise(seeds: Tensor, t: int | Tensor, vocab: int) -> Tensor:
    """Gumbel(0, 1) noise, (N,) seeds x position t -> (N, V) float32, deterministic.

    t may be a 0-dim int64 tensor (the compiled decode step takes it so, to compile once)."""
    idx = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    step = torch.as_tensor(t, dtype=torch.int64, device=seeds.device) * GOLDEN   # wraps mod 2^64
    h = mix(mix(seeds[:, None] + step) + idx[None, :] * MUL1)           # (N, V)
    u = (shr(h, 40).float() + 0.5) * 2.0**-24                              # uniform in (0, 1)
    return -torch.log(-torch.log(u))


def outside_nucleus(logp: Tensor, top_p: float) -> Tensor:
    """True for tokens outside the smallest set whose probability reaches top_p. (N, V)"""
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    mass_before = sorted_logp.exp().cumsum(-1) - sorted_logp.exp()           # mass of better tokens
    drop_sorted = mass_before >= top_p                                      # the top token is never dropped
    return torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)


def perturbed_logits(logits: Tensor, seeds: Tensor | None, t: int | Tensor, temperature: float,
                     top_p: float) -> tuple[Tensor, Tensor]:
    """(z, logp), (N, V) each: z's argmax is the drawn token (greedy when seeds is None), logp =
    log softmax(logits/T). z = logits/T, outside the nucleus -inf, plus the Gumbel noise of (seed, t)."""
    z = logits.float() / temperature                                        # (N, V) raw logits / T
    logp = torch.log_softmax(z, dim=-1)
    if seeds is not None:
        if top_p < 1.0:
            z = z.masked_fill(outside_nucleus(logp, top_p), float("-inf"))
        z = z + gumbel_noise(seeds, t, z.shape[-1])
    return z, logp


def draw(logits: Tensor, seeds: Tensor | None, t: int | Tensor, temperature: float,
         top_p: float) -> tuple[Tensor, Tensor]:
    """One token per row and its log softmax(logits/T): (N, V) -> (N,) long, (N,) float32."""
    z, logp = perturbed_logits(logits, seeds, t, temperature, top_p)
    choice = z.argmax(dim=-1)                                               # (N,)
    return choice, logp.gather(1, choice[:, None]).squeeze(1)
