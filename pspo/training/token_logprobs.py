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
"""
from __future__ import annotations

import torch
from torch import Tensor


def token_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float,
                   chunk_tokens: int = 2048) -> tuple[Tensor, Tensor]:
    """log softmax(h·Wᵀ / temperature)[target] per token, the logπ of docs/methods.md §1.

    hidden (N, T, H), weight (V, H) (the lm_head; with tied embeddings also the embedding matrix,
    its two gradients add up as usual), targets (N, T) -> logp (N, T) float32 with grad, entropy
    (N, T) float32 detached (float64 both for float64 inputs). The N·T tokens are processed
    chunk_tokens at a time; alive at once: two (chunk_tokens x V) float32 blocks in forward (the
    logits and their exp), one and its bf16 copy in backward, plus the head's float32 gradient.
    Nothing of vocabulary size per token is kept for backward, only lse (N·T,).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens: expected a positive integer, got {chunk_tokens}")
    N, T, H = hidden.shape
    flat_hidden, flat_targets = hidden.reshape(N * T, H), targets.reshape(N * T)   # (N·T, H), (N·T,)
    logp, entropy = _LogprobHead.apply(flat_hidden, weight, flat_targets, temperature, chunk_tokens,
                                       _compute_dtype(hidden))
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


def _chunk_logits(h: Tensor, w: Tensor, temperature: float) -> Tensor:
    """(n, H), (V, H) operands -> z (n, V) in the statistics dtype, a fresh block to modify in place."""
    return _matmul(h, w.T).div_(temperature)


class _LogprobHead(torch.autograd.Function):
    """(M, H), (V, H), (M,) -> logp (M,), entropy (M,) detached; see the module docstring."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float,
                chunk_tokens: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        M, stat = hidden.shape[0], _stat_dtype(dtype)
        logp = torch.empty(M, dtype=stat, device=hidden.device)              # (M,)
        entropy = torch.empty(M, dtype=stat, device=hidden.device)           # (M,)
        lse = torch.empty(M, dtype=stat, device=hidden.device)               # (M,) kept for backward
        with torch.autocast(device_type=hidden.device.type, enabled=False):  # dtypes are chosen here
            w = _operand(weight, dtype)                                      # (V, H), cast once
            for start in range(0, M, chunk_tokens):
                rows = slice(start, start + chunk_tokens)
                z = _chunk_logits(_operand(hidden[rows], dtype), w, temperature)   # (n, V)
                target_z = z.gather(1, targets[rows, None]).squeeze(1)       # (n,) z_target
                top = z.amax(1, keepdim=True)                                # (n, 1) max
                z.sub_(top)                                                  # (n, V) z - max ≤ 0
                e = torch.exp(z)                                             # (n, V) exp(z - max)
                total = e.sum(1)                                             # (n,) Σ e
                weighted = z.mul_(e).sum(1)                                  # (n,) Σ e·(z - max)
                log_total = total.log()                                      # (n,)
                lse[rows] = top.squeeze(1) + log_total                       # (n,)
                logp[rows] = target_z - lse[rows]
                # H = lse - Σ p·z = log Σ e - Σ e·(z - max) / Σ e   (the max cancels)
                entropy[rows] = log_total - weighted / total
                del z, e                                                     # freed before the next block
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.chunk_tokens, ctx.dtype = temperature, chunk_tokens, dtype
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
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            w = _operand(weight, dtype)                                      # (V, H)
            for start in range(0, hidden.shape[0], ctx.chunk_tokens):
                rows = slice(start, start + ctx.chunk_tokens)
                h = _operand(hidden[rows], dtype)                            # (n, H)
                z = _chunk_logits(h, w, temperature)                         # (n, V) recomputed
                # grad_z = g·(onehot - softmax)/temp, in place in z: -g·softmax, then + g at the target
                grad_z = z.sub_(lse[rows, None]).exp_().mul_(-g[rows, None])           # (n, V)
                grad_z.scatter_add_(1, targets[rows, None], g[rows, None])
                grad_z = _operand(grad_z, dtype)                             # (n, V) compute dtype
                if need_hidden:
                    grad_hidden[rows] = _matmul(grad_z, w)                   # (n, H) grad_z @ W
                if need_weight:
                    _add_matmul_(grad_weight, grad_z.T, h)                   # (V, H) += grad_zᵀ @ h
                del z, grad_z                                                # freed before the next block
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def _add_matmul_(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc += a @ b, acc in float32 (float64): in place where the operands share its dtype."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    else:
        acc += _matmul(a, b)
