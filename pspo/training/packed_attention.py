"""Attention over packed sequences: several sequences back to back in one row, each attending only
to itself, causally (docs/gpu.md, "Packed micro-batches").

The policy's transformers model runs with this module's attention function (`PACKED_ATTENTION`,
set by model.py's build_policy). Called with `cu_seq_lens_q` (the cumulative sequence offsets,
(n + 1,) int32, which transformers passes through to the attention function), it attends within
each sequence, with the kernel `packed_kernel` chooses:

- "varlen": torch's own variable-length flash attention (`torch.nn.attention.varlen.varlen_attn`),
  on CUDA under bf16/fp16 autocast: the row is never padded, no mask is built;
- "sdpa per sequence": everywhere else (CPU, float32): `scaled_dot_product_attention`, causal, on
  each sequence's slice in turn. The same values; the fallback that lets every test run on CPU.

Called without them (generation, unpacked scoring) it is transformers' sdpa attention, unchanged.
"""
from __future__ import annotations

import functools
import importlib.util
import inspect
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from pspo.training.config import first_line

PACKED_ATTENTION = "pspo_packed"      # the policy's config._attn_implementation


@dataclass(frozen=True)
class Packed:
    """A packed micro-batch's sizes, known on the host from its plan (micro_batches.py): counting them
    on the device would wait for it."""
    tokens: int                  # S: prompt + completion tokens of all its sequences, the row's length
    completion_tokens: int       # C: their completion tokens, the positions the head scores
    longest: int                 # the longest sequence (varlen attention's max length)


_varlen_failed: list[str] = []       # why varlen_attn failed in this process, once it has
HAS_VARLEN = importlib.util.find_spec("torch.nn.attention.varlen") is not None     # torch >= 2.10


def packed_kernel(device_type: str, dtype: torch.dtype) -> str:
    """The kernel packed attention runs with: "varlen" (CUDA, bf16/fp16, torch >= 2.10, and it has not
    failed here), else "sdpa per sequence". The one place the choice is made; train.py logs it at
    start-up."""
    varlen = HAS_VARLEN and not _varlen_failed
    if device_type == "cuda" and dtype in (torch.bfloat16, torch.float16) and varlen:
        return "varlen"
    return "sdpa per sequence"


def packed_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                     attention_mask: Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs) -> tuple[Tensor, None]:
    """query (1, H, S, D); key, value (1, Hkv, S, D) -> (1, S, H, D). With kwargs cu_seq_lens_q
    ((n + 1,) int32 offsets of n sequences packed in the row, summing to S) and max_length_q, each
    sequence attends to itself causally; without them, transformers' sdpa attention."""
    offsets = kwargs.get("cu_seq_lens_q")
    if offsets is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    device = query.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype
    if packed_kernel(device, dtype) == "varlen":
        q, k, v = (x[0].transpose(0, 1).to(dtype) for x in (query, key, value))          # (S, H, D)
        try:
            out = _varlen(q, k, v, offsets, int(kwargs["max_length_q"]), scaling)        # (S, H, D)
            return out[None], None
        except (RuntimeError, TypeError, NotImplementedError) as e:   # this torch's kernel refuses it
            _varlen_failed.append(first_line(e, 200))
            print(f"warning: varlen attention failed ({_varlen_failed[0]}); packed rows run sdpa per "
                  "sequence from now on", file=sys.stderr)
    parts = []
    bounds = offsets.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):                     # (1, H, len, D) each
        parts.append(F.scaled_dot_product_attention(
            query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], is_causal=True,
            scale=scaling, enable_gqa=query.shape[1] != key.shape[1]))
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None


def _varlen(q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, longest: int, scale: float | None) -> Tensor:
    """varlen_attn, causal, across torch versions: 2.10 takes is_causal, later ones a (left, right)
    window; GQA through enable_gqa where it exists, else the KV heads repeated."""
    from torch.nn.attention.varlen import varlen_attn
    params = _parameters(varlen_attn)
    extra: dict = {"scale": scale}
    if "window_size" in params:
        extra["window_size"] = (-1, 0)                                  # causal
    else:
        extra["is_causal"] = True
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            extra["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    offsets = offsets.to(torch.int32)
    return varlen_attn(q, k, v, offsets, offsets, longest, longest, **extra)


@functools.lru_cache(maxsize=None)
def _parameters(fn) -> frozenset[str]:
    """A function's parameter names, read once (the attention function runs in every layer)."""
    return frozenset(inspect.signature(fn).parameters)


AttentionInterface.register(PACKED_ATTENTION, packed_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_ATTENTION, sdpa_mask)      # masks as for sdpa (generation)
