"""The policy's attention when it scores completions (π_old, π_ref and the update): packed rows, several
sequences back to back in one row, each attending only to itself, causally; and unpacked rows, each
causal from position 0 with no mask (docs/gpu.md, "The update's speed").

The kernels are chosen once, at start-up (`choose_kernels`, train.attention), and pinned for the run
(`pin_kernels`):
- packed rows: "varlen", torch's variable-length flash attention (`torch.nn.attention.varlen.varlen_attn`;
  CUDA, bf16/fp16), the row never padded and no mask built; or "sdpa" on each sequence's slice in turn;
- unpacked rows, and each sequence of a packed row under "sdpa": one `scaled_dot_product_attention`
  kernel (flash, efficient, math or cudnn), pinned with `torch.nn.attention.sdpa_kernel`, never torch's
  per-call choice. cuDNN runs only when named: it builds an execution plan for every new shape, and
  token-budget micro-batches make new shapes every step.
auto probes the candidates in that order (varlen, else sdpa per sequence; flash, efficient, math) with
a small forward and backward on the run's device and compute dtype against float32, and keeps the first
that runs and agrees; a named kernel that fails its probe is refused at start-up in one line. Nothing
in the hot path catches an error: a kernel that fails mid-run (out of memory) stops the run.

Masks. Policy.forward passes `scoring_mask`, an empty 4-D mask. transformers takes a 4-D mask as already
prepared (masking_utils), so it builds none and reads nothing back from the device; this module reads it
as "causal within each row, or within each packed sequence". With a 2-D all-ones mask, transformers reads
the mask back from the device once per forward pass (and under tracing builds a (S, S) mask); with none, it
reads the position ids back to look for packed sequences.
Generation passes real masks: transformers' sdpa attention runs, unchanged.

Host-side bounds. A packed row's sequence offsets come twice: on the device (`cu_seq_lens_q`, which
varlen takes) and on the host (`cu_seq_lens_host`, a CPU tensor built from the micro-batch plan), which
the per-sequence loop slices by: no layer waits for the device to read them back.

Compiled layers (train.compile, model.py). The attention runs outside the compiled graphs
(torch.compiler.disable): the kernels are exactly the ones pinned here, and the per-sequence loop, whose
bounds change with every micro-batch, is never traced, so it causes no recompilation.
"""
from __future__ import annotations

import functools
import importlib.util
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from pspo.training.config import ConfigError, first_line

PACKED_ATTENTION = "pspo_packed"      # the prefix of the policy's config._attn_implementation
HAS_VARLEN = importlib.util.find_spec("torch.nn.attention.varlen") is not None     # torch >= 2.10
SDPA_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                 "math": SDPBackend.MATH, "cudnn": SDPBackend.CUDNN_ATTENTION}
NATIVE_GQA = ("flash", "math")        # sdpa kernels given fewer KV heads than query heads (enable_gqa)


@dataclass(frozen=True)
class Packed:
    """A packed micro-batch's sizes, known on the host from its plan (micro_batches.py): counting them
    on the device would wait for it."""
    lengths: tuple[int, ...]     # each sequence's prompt + completion tokens, in the row's order
    completion_tokens: int       # C: their completion tokens, the positions the head scores

    @property
    def tokens(self) -> int:
        """S: the row's length."""
        return sum(self.lengths)

    @property
    def bounds(self) -> Tensor:
        """(n + 1,) int64 offsets of the sequences in the row, on the host."""
        return torch.tensor((0, *self.lengths)).cumsum(0)


@dataclass(frozen=True)
class Kernels:
    """The attention kernels of scoring passes, chosen once (choose_kernels)."""
    packed: str                  # packed rows: "varlen" | "sdpa" (per sequence, with the sdpa kernel)
    sdpa: str | None             # the sdpa kernel (SDPA_BACKENDS); None: torch's choice per call (unpinned)

    @property
    def name(self) -> str:
        """The attention implementation name these kernels run under (config._attn_implementation):
        PACKED_ATTENTION unpinned, e.g. "pspo_packed_varlen_flash" pinned."""
        return PACKED_ATTENTION if self.sdpa is None else f"{PACKED_ATTENTION}_{self.packed}_{self.sdpa}"

    def describe(self) -> str:
        """For the start-up line: 'packed rows varlen, unpacked rows sdpa flash'."""
        packed = "varlen" if self.packed == "varlen" else f"sdpa {self.sdpa or 'any'} per sequence"
        return f"packed rows {packed}, unpacked rows sdpa {self.sdpa or 'any'}"


UNPINNED = Kernels("sdpa", None)      # build_policy's default: torch picks the sdpa kernel per call


def scoring_mask(device: torch.device) -> Tensor:
    """The attention_mask Policy.forward passes when it scores: an empty 4-D mask (see the module
    docstring). Empty, so making it reads nothing and copies nothing."""
    return torch.empty(0, 0, 0, 0, dtype=torch.bool, device=device)


@torch.compiler.disable
def attention(module: torch.nn.Module | None, query: Tensor, key: Tensor, value: Tensor,
              attention_mask: Tensor | None, scaling: float | None = None, dropout: float = 0.0, *,
              kernels: Kernels, **kwargs) -> tuple[Tensor, None]:
    """query (N, H, S, D); key, value (N, Hkv, S, D) -> (N, S, H, D).

    With the scoring mask and cu_seq_lens_q / cu_seq_lens_host ((n + 1,) offsets of the n sequences
    packed in the one row, on the device and on the host): each sequence attends to itself causally.
    With the scoring mask alone: each row causally. Otherwise (generation): transformers' sdpa attention.
    """
    if attention_mask is None or attention_mask.numel() > 0:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    bounds = kwargs.get("cu_seq_lens_host")
    if bounds is None:                                                       # unpacked rows
        return _sdpa(query, key, value, scaling, dropout, kernels.sdpa).transpose(1, 2).contiguous(), None
    spans = bounds.tolist()                                                 # on the host: no sync
    if kernels.packed == "varlen":
        device = query.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype
        q, k, v = (x[0].transpose(0, 1).to(dtype) for x in (query, key, value))           # (S, H, D)
        longest = max(end - start for start, end in zip(spans[:-1], spans[1:]))
        return _varlen(q, k, v, kwargs["cu_seq_lens_q"], longest, scaling)[None], None
    parts = []
    for start, end in zip(spans[:-1], spans[1:]):                           # (1, H, len, D) each
        parts.append(_sdpa(query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], scaling,
                           dropout, kernels.sdpa))
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None


def _sdpa(query: Tensor, key: Tensor, value: Tensor, scale: float | None, dropout: float,
          backend: str | None) -> Tensor:
    """Causal scaled_dot_product_attention with the pinned kernel (None: torch's choice). (N, H, s, D).
    dropout is 0 in every policy build_policy makes (model.disable_dropout); varlen takes none."""
    if query.shape[1] != key.shape[1] and backend is not None and backend not in NATIVE_GQA:
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    gqa = query.shape[1] != key.shape[1]
    if backend is None:
        return F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, is_causal=True, scale=scale,
                                              enable_gqa=gqa)
    with sdpa_kernel(SDPA_BACKENDS[backend]):
        return F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, is_causal=True, scale=scale,
                                              enable_gqa=gqa)


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


def pin_kernels(lm: torch.nn.Module, kernels: Kernels) -> None:
    """Make `lm`'s attention run with `kernels` (and generation's, transformers' sdpa attention)."""
    AttentionInterface.register(kernels.name, functools.partial(attention, kernels=kernels))
    ALL_MASK_ATTENTION_FUNCTIONS.register(kernels.name, sdpa_mask)      # masks as for sdpa (generation)
    lm.config._attn_implementation = kernels.name


# ---------------------------------------------------------------- the choice, once at start-up

PROBE_LENGTHS = (5, 1, 11)    # a packed row of three sequences, one of a single token; unpacked: 2 rows of 8


def probe(kernels: Kernels, *, device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int,
          head_dim: int) -> str | None:
    """None when `kernels` run the forward and backward of a small packed row and of unpacked rows on
    `device` under `dtype` autocast (float32: none), shaped as the model's heads, within that dtype's
    rounding of float32 math; else why not, in one line."""
    g = torch.Generator().manual_seed(0)
    S = sum(PROBE_LENGTHS)
    bounds = torch.tensor((0, *PROBE_LENGTHS)).cumsum(0)                     # (4,) on the host
    q = torch.randn(1, heads, S, head_dim, generator=g)                     # (1, H, S, D)
    k, v = (torch.randn(1, kv_heads, S, head_dim, generator=g) for _ in range(2))
    packed = ((q, k, v), {"cu_seq_lens_q": bounds.to(device, torch.int32), "cu_seq_lens_host": bounds})
    rows = tuple(x[0, :, :16].unflatten(1, (2, 8)).transpose(0, 1) for x in (q, k, v))   # (2, H, 8, D)
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    try:
        for inputs, extra in (packed, (rows, {})):
            inputs = tuple(x.to(device) for x in inputs)
            want = _run(Kernels("sdpa", "math"), inputs, extra, device, torch.float32)
            got = _run(kernels, inputs, extra, device, dtype)
            for name, a, b in zip(("output", "dq", "dk", "dv"), got, want):
                gap = float((a - b).norm() / b.norm())
                if not gap < tolerance:
                    return f"{name} differs from float32 math by {gap:.2g} (relative), over {tolerance:g}"
    except Exception as e:  # noqa: BLE001 - the kernel refuses these inputs: the probe's answer, once
        return first_line(e, 300).split(". ")[0]                              # its first sentence
    return None


def _run(kernels: Kernels, inputs: tuple[Tensor, ...], extra: dict, device: torch.device,
         dtype: torch.dtype) -> tuple[Tensor, ...]:
    """The attention's output and the gradients of q, k, v for one probe, in float32."""
    q, k, v = (x.detach().clone().requires_grad_() for x in inputs)
    upstream = torch.linspace(-1, 1, q.numel(), device=device).view(q.shape[0], q.shape[2], q.shape[1], -1)
    with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        out, _ = attention(None, q, k, v, scoring_mask(device), None, kernels=kernels, **extra)  # (N, s, H, D)
    (out.float() * upstream).sum().backward()
    return out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()


def choose_kernels(setting: str, *, device: torch.device, bf16: bool, heads: int, kv_heads: int,
                   head_dim: int) -> Kernels:
    """train.attention resolved on the run's device and compute dtype (bf16 autocast or float32): auto
    keeps the first candidate whose probe passes (varlen, else sdpa per sequence; flash, efficient,
    math); a named kernel must pass its probe, else ConfigError (one line)."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    where = f"on {device.type} in {'bf16' if bf16 else 'float32'}"

    def refused(kernels: Kernels) -> str | None:
        if kernels.packed == "varlen" and not HAS_VARLEN:
            return f"torch {torch.__version__} has no torch.nn.attention.varlen (torch >= 2.10)"
        return _probe_once(kernels, device, dtype, heads, kv_heads, head_dim)

    if setting == "auto":
        sdpa = next((b for b in ("flash", "efficient") if refused(Kernels("sdpa", b)) is None), "math")
        varlen = Kernels("varlen", sdpa)
        return varlen if device.type == "cuda" and bf16 and refused(varlen) is None else Kernels("sdpa", sdpa)
    kernels = Kernels("varlen", "flash") if setting == "varlen" else Kernels("sdpa", setting)
    reason = refused(kernels)
    if reason is not None:
        raise ConfigError(f"train.attention: {setting} does not run {where} ({reason}); use auto")
    return kernels


@functools.lru_cache(maxsize=None)
def _probe_once(kernels: Kernels, device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int,
                head_dim: int) -> str | None:
    """probe, once per process for each question (the policy and the KL reference ask the same)."""
    return probe(kernels, device=device, dtype=dtype, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
