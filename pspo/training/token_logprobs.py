"""Per-token log-probs and entropies of the output head, chunked, with a hand-written backward.

    z_tv     = (h_t · W_v) / temperature                  logits of token position t, vocabulary entry v
    lse_t    = log Σ_v exp(z_tv)
    logp_t   = z_t,target - lse_t                         the logπ of docs/methods.md §1
    H_t      = lse_t - Σ_v softmax(z_t)_v · z_tv          entropy, for logging (no gradient)
    ∂logp_t/∂z_tv = onehot(target)_v - softmax(z_t)_v

A plain `log_softmax(h @ W.T).gather(...)` keeps a (tokens x vocab) block for backward and its
gradient is a dense (tokens x vocab) scatter; with a 151k vocabulary that is GBs per micro-batch and
a large share of the update's time. Here forward keeps only lse_t per token; backward recomputes one
chunk's logits at a time, forms grad_z = g·(onehot - softmax)/temperature in place, and adds
grad_z @ W to the hidden states' gradient and grad_zᵀ @ h to the head's (in float32).

Precision. The matmuls take the caller's compute dtype: bf16 when the hidden states are bf16 or
bf16 autocast is on (model.bf16), float32 otherwise (where TF32 is the user's choice, via
torch.backends.cuda.matmul.allow_tf32). Either way each product is accumulated and returned in
float32: the logits are never rounded to bf16 (a logit of 20 rounded to bf16 is off by up to 0.06,
i.e. ±6% in the ratio ρ), and the max, log-sum-exp, softmax and entropy are float32. On CUDA a bf16
product is one cuBLAS call with a float32 output (torch.mm(..., out_dtype=float32)); elsewhere the
bf16-rounded operands are multiplied in float32, which gives the same numbers.

Two ways to run the elementwise work around the two matmuls (model.logprob_head), the same formulas:
- "eager": in place on the chunk's (chunk x V) float32 logits block, one pass per operation (about ten
  reads or writes of the block in forward, and as many in backward);
- "compiled": each chunk's statistics (forward) and grad_z (backward) are one torch.compile'd function,
  which inductor fuses: two reads of the block in forward, the entropy in the same pass; in backward
  one read and one write of grad_z, straight in the compute dtype (half the bytes under bf16). The
  numbers are the eager head's up to the order of the float32 sums (tests/math/test_token_logprobs.py).
  A function whose compile fails runs the same function eagerly from then on (compiled.py's rule).
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

from pspo.training.compiled import Compiled

HEADS = ("eager", "compiled")       # model.logprob_head, resolved (model.head_mode)


def token_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float,
                   chunk_tokens: int = 2048, head: str = "eager") -> tuple[Tensor, Tensor]:
    """log softmax(h·Wᵀ / temperature)[target] per token, the logπ of docs/methods.md §1.

    hidden (N, T, H), weight (V, H) (the lm_head; with tied embeddings also the embedding matrix,
    its two gradients add up as usual), targets (N, T) -> logp (N, T) float32 with grad, entropy
    (N, T) float32 detached (float64 both for float64 inputs). The N·T tokens are processed
    chunk_tokens at a time; alive at once: two (chunk_tokens x V) float32 blocks in forward (the
    logits and their exp), one and its bf16 copy in backward, plus the head's float32 gradient.
    Nothing of vocabulary size per token is kept for backward, only lse (N·T,). head: "eager" or
    "compiled" (the module docstring).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens: expected a positive integer, got {chunk_tokens}")
    if head not in HEADS:
        raise ValueError(f"head: expected one of {', '.join(HEADS)}, got {head!r}")
    N, T, H = hidden.shape
    flat_hidden, flat_targets = hidden.reshape(N * T, H), targets.reshape(N * T)   # (N·T, H), (N·T,)
    logp, entropy = _LogprobHead.apply(flat_hidden, weight, flat_targets, temperature, chunk_tokens,
                                       _compute_dtype(hidden), head == "compiled")
    return logp.view(N, T), entropy.view(N, T)


def _compute_dtype(hidden: Tensor) -> torch.dtype:
    """The matmul operands' dtype: the autocast dtype when autocast is on, else the hidden states'."""
    if hidden.dtype == torch.float64:                  # exactness checks (gradcheck) stay float64
        return torch.float64
    if torch.is_autocast_enabled(hidden.device.type):
        return torch.get_autocast_dtype(hidden.device.type)
    return hidden.dtype


def _stat_dtype(compute_dtype: torch.dtype) -> torch.dtype:
    """Accumulation and statistics dtype: float32, float64 only for float64 operands."""
    return torch.float64 if compute_dtype == torch.float64 else torch.float32


def _operand(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x rounded to the compute dtype, in the form _matmul multiplies: on CUDA the low-precision
    tensor itself; elsewhere its float32 copy (exact: bf16 and fp16 values are float32 values)."""
    x = x.to(dtype)
    if x.device.type == "cuda" or x.dtype == torch.float64:
        return x
    return x.float()


def _matmul(a: Tensor, b: Tensor) -> Tensor:
    """a @ b for _operand tensors, accumulated and returned in float32 (float64 for float64)."""
    if a.dtype in (torch.float32, torch.float64):
        return a @ b
    return torch.mm(a, b, out_dtype=torch.float32)    # CUDA: bf16/fp16 operands, fp32 output


def _chunk_stats_inplace(z: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    """The eager head's forward statistics of one chunk, in place in its block. z (n, V): h·Wᵀ (before the
    temperature), overwritten; targets (n,) -> logp, lse, entropy (n,) each."""
    z = z.div_(temperature)                                              # (n, V) z
    target_z = z.gather(1, targets[:, None]).squeeze(1)                  # (n,) z_target
    top = z.amax(1, keepdim=True)                                        # (n, 1) max
    z.sub_(top)                                                          # (n, V) z - max ≤ 0
    e = torch.exp(z)                                                     # (n, V) exp(z - max)
    total = e.sum(1)                                                     # (n,) Σ e
    weighted = z.mul_(e).sum(1)                                          # (n,) Σ e·(z - max)
    log_total = total.log()                                              # (n,)
    lse = top.squeeze(1) + log_total                                     # (n,)
    # H = lse - Σ p·z = log Σ e - Σ e·(z - max) / Σ e   (the max cancels)
    return target_z - lse, lse, log_total - weighted / total


def _chunk_stats(z: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    """_chunk_stats_inplace without writing anything of z's size: what the compiled head fuses."""
    z = z / temperature                                                  # (n, V)
    top = z.amax(1, keepdim=True)                                        # (n, 1)
    shifted = z - top                                                    # (n, V) ≤ 0
    e = torch.exp(shifted)
    total = e.sum(1)                                                     # (n,) Σ e
    weighted = (e * shifted).sum(1)                                      # (n,) Σ e·(z - max)
    log_total = total.log()
    lse = top.squeeze(1) + log_total
    target_z = z.gather(1, targets[:, None]).squeeze(1)                  # (n,)
    return target_z - lse, lse, log_total - weighted / total


def _grad_logits_inplace(z: Tensor, lse: Tensor, g: Tensor, targets: Tensor, temperature: float,
                         dtype: torch.dtype) -> Tensor:
    """The eager head's grad_z = g·(onehot - softmax) of one chunk, in place in z (n, V), h·Wᵀ before the
    temperature; lse, g (n,) with g = dL/dlogp / temperature -> grad_z (n, V), in z's dtype."""
    grad_z = z.div_(temperature).sub_(lse[:, None]).exp_().mul_(-g[:, None])    # (n, V) -g·softmax
    return grad_z.scatter_add_(1, targets[:, None], g[:, None])                 # + g at the target


def _grad_logits(z: Tensor, lse: Tensor, g: Tensor, targets: Tensor, temperature: float,
                 dtype: torch.dtype) -> Tensor:
    """_grad_logits_inplace in one pass, written straight in the compute dtype (half the bytes of a
    float32 block under bf16): what the compiled head fuses."""
    p = torch.exp(z / temperature - lse[:, None])                               # (n, V) softmax
    at_target = torch.arange(z.shape[1], device=z.device)[None] == targets[:, None]   # (n, V) onehot
    grad_z = -g[:, None] * p + torch.where(at_target, g[:, None], 0.0)             # the eager sums' order
    return grad_z.to(dtype)


@functools.cache
def _compiled(fn) -> Compiled:
    """fn compiled once per process, for any chunk length (the last chunk is shorter); eager from a compile
    that fails (compiled.py's rule)."""
    return Compiled(fn, path=f"log-prob head ({fn.__name__})", off="model.logprob_head=eager", dynamic=True)


def _chunk_functions(compiled: bool):
    """(forward statistics, backward grad_z) of one chunk: in place and eager, or fused and compiled."""
    if compiled:
        return _compiled(_chunk_stats), _compiled(_grad_logits)
    return _chunk_stats_inplace, _grad_logits_inplace


class _LogprobHead(torch.autograd.Function):
    """(M, H), (V, H), (M,) -> logp (M,), entropy (M,) detached; see the module docstring."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float,
                chunk_tokens: int, dtype: torch.dtype, compiled: bool) -> tuple[Tensor, Tensor]:
        M, stat = hidden.shape[0], _stat_dtype(dtype)
        stats, _ = _chunk_functions(compiled)
        logp = torch.empty(M, dtype=stat, device=hidden.device)              # (M,)
        entropy = torch.empty(M, dtype=stat, device=hidden.device)           # (M,)
        lse = torch.empty(M, dtype=stat, device=hidden.device)               # (M,) kept for backward
        with torch.autocast(device_type=hidden.device.type, enabled=False):  # dtypes are chosen here
            w = _operand(weight, dtype)                                      # (V, H), cast once
            for start in range(0, M, chunk_tokens):
                rows = slice(start, start + chunk_tokens)
                z = _matmul(_operand(hidden[rows], dtype), w.T)              # (n, V) h·Wᵀ
                logp[rows], lse[rows], entropy[rows] = stats(z, targets[rows], temperature)
                del z                                                        # freed before the next block
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.chunk_tokens, ctx.dtype, ctx.compiled = temperature, chunk_tokens, dtype, compiled
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor, grad_entropy: Tensor):    # entropy has no gradient
        hidden, weight, targets, lse = ctx.saved_tensors
        dtype, temperature, stat = ctx.dtype, ctx.temperature, _stat_dtype(ctx.dtype)
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None     # (M, H)
        grad_weight = None                                                   # (V, H) float32 sum
        if need_weight:
            grad_weight = torch.zeros(weight.shape, dtype=stat, device=weight.device)
        g = grad_logp.to(stat) / temperature                                 # (M,) dL/dlogp / temp
        _, grad_logits = _chunk_functions(ctx.compiled)
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            w = _operand(weight, dtype)                                      # (V, H)
            for start in range(0, hidden.shape[0], ctx.chunk_tokens):
                rows = slice(start, start + ctx.chunk_tokens)
                h = _operand(hidden[rows], dtype)                            # (n, H)
                z = _matmul(h, w.T)                                          # (n, V) recomputed
                # grad_z = g·(onehot - softmax)/temp, rounded to the compute dtype
                grad_z = _operand(grad_logits(z, lse[rows], g[rows], targets[rows], temperature, dtype), dtype)
                if need_hidden:
                    grad_hidden[rows] = _matmul(grad_z, w)                   # (n, H) grad_z @ W
                if need_weight:
                    _add_matmul_(grad_weight, grad_z.T, h)                   # (V, H) += grad_zᵀ @ h
                del z, grad_z                                                # freed before the next block
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def _add_matmul_(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc += a @ b, acc in float32 (float64): in place where the operands share its dtype."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    else:
        acc += _matmul(a, b)
