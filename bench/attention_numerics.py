"""Log-probs and gradients of the policy with the attention kernels a run pins, packed and unpacked, against
sdpa's math kernel and float32.

    python bench/attention_numerics.py --model FOLDER --bf16 --json OUT.json   # a GPU (the GPU check's `numerics`)
    python bench/attention_numerics.py                                        # CPU: the tiny demo model

The kernels are the ones train.py would pin (packed_attention.choose_kernels with --attention, default
train.attention's auto: probed on this device and dtype): for unpacked rows one sdpa kernel, for packed
rows varlen or that sdpa kernel per sequence. The same batch of sequences (random tokens, lengths spread
over --max-len, left-padded) is scored by `Policy.forward` (bf16 autocast over float32 weights with
--bf16) and backpropagated from the sum of the completion tokens' log-probs, five ways:
- unpacked, the pinned sdpa kernel ("default", as the GPU check's summary names it);
- unpacked, sdpa's math kernel in the same dtype;
- packed (train.packing: the sequences back to back in rows of at most --budget tokens), the pinned
  packed kernel: forward AND backward, the check of torch's varlen kernel on CUDA;
- the float32 reference: unpacked, math kernel, autocast off.
Reported: the largest and mean |Δ log p| over real completion tokens and the gradient's relative
difference ||g - g_ref|| / ||g_ref||, for default vs math, each vs float32, and packed vs unpacked.
`packed_ok` (in the JSON; the GPU check reads it: if false, its other sections run unpacked) is true
when packing adds no error of its own: in float32 packed is within 1e-4 of unpacked (log-probs and the
gradient's relative difference), and under bf16 packed's gaps to float32 are at most twice unpacked's
plus 1e-2 (a packing bug, sequences seeing each other or wrong positions, moves log-probs by O(1)).
On CUDA the kernels that ran are read off the profiler's kernel names.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.micro_batches import attention_backend  # noqa: E402
from pspo.offline.tiny import ensure_tiny_model  # noqa: E402
from pspo.training.config import ATTENTIONS  # noqa: E402
from pspo.training.micro_batches import plan_micro_batches  # noqa: E402
from pspo.training.model import attention_heads, build_policy, set_scoring  # noqa: E402
from pspo.training.packed_attention import Kernels, choose_kernels  # noqa: E402


def batch(rows: int, max_len: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Random ids (rows, max_len), left-padded attention (lengths from max_len/2 + 1 to max_len) and the
    completion width (the last half of the row: every completion token real)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(max_len // 2 + 1, max_len, rows).long()
    ids = torch.randint(0, vocab, (rows, max_len), generator=g)
    attention = (torch.arange(max_len)[None] >= max_len - lengths[:, None]).long()
    return ids * attention, attention, max_len // 2


def score(policy, ids, attention, width: int, *, kernels: Kernels, bf16: bool, budget: int = 0,
          packing: bool = False):
    """(log-probs (rows, width) float32, the flat float32 gradient): micro-batches of every row unpacked,
    or packed into rows of at most `budget` tokens; the backward of the sum of real completion log-probs."""
    set_scoring(policy, kernels=kernels, compiled=False, head=policy.head)
    policy.bf16 = bf16
    policy.zero_grad(set_to_none=True)
    mask = attention[:, -width:].float()
    P = ids.shape[1] - width
    logp = torch.zeros(mask.shape, device=ids.device)
    for b in plan_micro_batches(attention, mask, len(ids), budget if packing else 0, packing):
        part, _ = policy(b.cut(ids, P), b.cut(attention, P), b.width, 1.0, packed_width=b.length, packed=b.packed)
        (part.float() * mask[b.rows, :b.width]).sum().backward()
        logp[b.rows, :b.width] = part.detach().float()
    grad = torch.cat([p.grad.float().flatten() for p in policy.parameters() if p.grad is not None])
    return logp, grad


def kernels_that_ran(policy, ids, attention, width: int, *, kernels: Kernels, bf16: bool, budget: int,
                     packing: bool) -> str:
    """The attention kernel a forward pass ran, from the profiler's CUDA kernel names ('cpu' elsewhere)."""
    if ids.device.type != "cuda":
        return "cpu"
    from torch.profiler import ProfilerActivity, profile
    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        set_scoring(policy, kernels=kernels, compiled=False, head=policy.head)
        policy.bf16 = bf16
        mask = attention[:, -width:].float()
        P = ids.shape[1] - width
        for b in plan_micro_batches(attention, mask, len(ids), budget if packing else 0, packing):
            policy(b.cut(ids, P), b.cut(attention, P), b.width, 1.0, packed_width=b.length, packed=b.packed)
        torch.cuda.synchronize()
    names = [(e.key, e.self_device_time_total) for e in prof.key_averages()
             if e.device_type == torch.autograd.DeviceType.CUDA]
    return attention_backend(names)                  # cudnn, flash, efficient, or math (none of those)


def gaps(a, b, valid) -> tuple[float, float]:
    """(max, mean) |a - b| over the valid tokens."""
    diff = (a - b).abs()[valid]
    return float(diff.max()), float(diff.mean())


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def packed_ok(figures: dict) -> bool:
    """Packing adds no error of its own (the module docstring's rule)."""
    logp_p, grad_p = figures["logp_gap_packed_vs_fp32"][0], figures["grad_rel_packed_vs_fp32"]
    logp_u, grad_u = figures["logp_gap_default_vs_fp32"][0], figures["grad_rel_default_vs_fp32"]
    if not all(math.isfinite(x) for x in (logp_p, grad_p, logp_u, grad_u)):
        return False
    if not figures["bf16"]:
        return (figures["logp_gap_packed_vs_unpacked"][0] <= 1e-4
                and figures["grad_rel_packed_vs_unpacked"] <= 1e-4)
    return logp_p <= 2 * logp_u + 1e-2 and grad_p <= 2 * grad_u + 1e-2


def main(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="a from_pretrained folder (default: the tiny demo model)")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--budget", type=int, default=0, help="packed rows' token budget (default: 2 x --max-len)")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast (model.bf16), as the GPU recipes")
    ap.add_argument("--attention", default="auto", choices=ATTENTIONS, help="train.attention (default: auto)")
    ap.add_argument("--json", default="", help="also write the figures to this JSON file")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    path = args.model or ensure_tiny_model()
    policy = build_policy(path, chunk_tokens=2048).to(device)
    kernels = choose_kernels(args.attention, device=device, bf16=args.bf16, **attention_heads(policy.lm.config))
    budget = args.budget or 2 * args.max_len
    ids, attention, width = (t.to(device) if isinstance(t, torch.Tensor) else t
                             for t in batch(args.rows, args.max_len, policy.lm.config.vocab_size))
    valid = attention[:, -width:].bool()
    math_kernels = Kernels("sdpa", "math")
    ref_logp, ref_grad = score(policy, ids, attention, width, kernels=math_kernels, bf16=False)
    default_logp, default_grad = score(policy, ids, attention, width, kernels=kernels, bf16=args.bf16)
    math_logp, math_grad = score(policy, ids, attention, width, kernels=math_kernels, bf16=args.bf16)
    packed_logp, packed_grad = score(policy, ids, attention, width, kernels=kernels, bf16=args.bf16,
                                     budget=budget, packing=True)
    shape = dict(kernels=kernels, bf16=args.bf16, budget=budget)
    packed_kernel = "varlen" if kernels.packed == "varlen" else f"sdpa {kernels.sdpa} per sequence"
    figures = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "model": path, "bf16": args.bf16, "rows": args.rows, "max_len": args.max_len, "budget": budget,
               "attention_setting": args.attention, "attention": kernels.describe(),
               "default_kernel": kernels_that_ran(policy, ids, attention, width, packing=False, **shape),
               "packed_kernel": packed_kernel,
               "packed_kernel_ran": kernels_that_ran(policy, ids, attention, width, packing=True, **shape),
               "logp_gap_default_vs_math": gaps(default_logp, math_logp, valid),
               "grad_rel_default_vs_math": rel(default_grad, math_grad),
               "logp_gap_default_vs_fp32": gaps(default_logp, ref_logp, valid),
               "logp_gap_math_vs_fp32": gaps(math_logp, ref_logp, valid),
               "grad_rel_default_vs_fp32": rel(default_grad, ref_grad),
               "grad_rel_math_vs_fp32": rel(math_grad, ref_grad),
               "logp_gap_packed_vs_unpacked": gaps(packed_logp, default_logp, valid),
               "grad_rel_packed_vs_unpacked": rel(packed_grad, default_grad),
               "logp_gap_packed_vs_fp32": gaps(packed_logp, ref_logp, valid),
               "grad_rel_packed_vs_fp32": rel(packed_grad, ref_grad)}
    figures["packed_ok"] = packed_ok(figures)
    print(f"{figures['device']}, {path}, {args.rows} rows up to {args.max_len} tokens (packed: rows of at most "
          f"{budget}), {'bf16 autocast' if args.bf16 else 'float32'}; train.attention={args.attention}: "
          f"{kernels.describe()}; kernels seen: unpacked {figures['default_kernel']}, packed "
          f"{figures['packed_kernel_ran']}\n")
    print("| compared | max abs Δ log p | mean abs Δ log p | gradient relative Δ |")
    print("|---|---:|---:|---:|")
    for label, key in (("unpacked (pinned kernel) vs math", "default_vs_math"),
                       ("unpacked (pinned kernel) vs float32 math", "default_vs_fp32"),
                       ("unpacked math vs float32 math", "math_vs_fp32"),
                       (f"packed ({packed_kernel}) vs unpacked", "packed_vs_unpacked"),
                       ("packed vs float32 math", "packed_vs_fp32")):
        high, mean = figures[f"logp_gap_{key}"]
        print(f"| {label} | {high:.2e} | {mean:.2e} | {figures[f'grad_rel_{key}']:.2e} |")
    print(f"\npacked_ok: {figures['packed_ok']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return figures


if __name__ == "__main__":
    main(sys.argv[1:])
