"""The policy's log-probs and gradients with the default attention kernel against sdpa's math kernel.

    python bench/attention_numerics.py --model FOLDER --json OUT.json     # a GPU (the GPU check's `numerics`)
    python bench/attention_numerics.py                                    # CPU: the tiny demo model

On a GPU, `scaled_dot_product_attention` picks a fused kernel (cuDNN, flash or memory-efficient:
which one is read off the profiler's kernel names); the math kernel is the plain softmax(QK^T)V in
the input's precision. The same batch of sequences (random tokens, lengths spread over
--max-len, left-padded) is scored by `Policy.forward` (model.bf16 as --bf16 says: bf16 autocast
over float32 weights) under each kernel, then backpropagated from the sum of the completion
tokens' log-probs. Reported: the largest and mean |Δ log p| over real completion tokens, and the
gradient's relative difference ||g_default - g_math|| / ||g_math||; and the same two for each
kernel against a float32 run on the math kernel (the reference, autocast off). Then the same
sequences packed into one row (train.packing: the packed attention kernel, torch's varlen on CUDA
under bf16) against the unpacked rows and against float32: the check of the real varlen kernel.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.micro_batches import attention_backend  # noqa: E402
from pspo.offline.tiny import ensure_tiny_model  # noqa: E402
from pspo.training.logprobs import score_logprobs  # noqa: E402
from pspo.training.micro_batches import plan_micro_batches  # noqa: E402
from pspo.training.model import build_policy  # noqa: E402
from pspo.training.packed_attention import packed_kernel  # noqa: E402


def batch(rows: int, max_len: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Random ids (rows, max_len), left-padded attention (lengths from max_len/2 + 1 to max_len) and the
    completion width (the last half of the row: every completion token real)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(max_len // 2 + 1, max_len, rows).long()
    ids = torch.randint(0, vocab, (rows, max_len), generator=g)
    attention = (torch.arange(max_len)[None] >= max_len - lengths[:, None]).long()
    return ids * attention, attention, max_len // 2


def score(policy, ids, attention, width: int, backend: SDPBackend | None, bf16: bool):
    """(log-probs (rows, width) float32, the flat float32 gradient) with one sdpa kernel (None: default)."""
    policy.zero_grad(set_to_none=True)
    policy.bf16 = bf16
    with sdpa_kernel(backend) if backend is not None else torch.enable_grad():
        logp, _ = policy(ids, attention, width, 1.0)
        valid = attention[:, -width:].bool()
        logp.float()[valid].sum().backward()
    grad = torch.cat([p.grad.float().flatten() for p in policy.parameters() if p.grad is not None])
    return logp.detach().float(), grad, valid


def default_kernel(policy, ids, attention, width: int, bf16: bool) -> str:
    """The attention kernel sdpa picks by default, from the profiler's kernel names (CUDA) or 'cpu'."""
    if ids.device.type != "cuda":
        return "cpu"
    from torch.profiler import ProfilerActivity, profile
    policy.bf16 = bf16
    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        policy(ids, attention, width, 1.0)
        torch.cuda.synchronize()
    kernels = [(e.key, e.self_device_time_total) for e in prof.key_averages()
               if e.device_type == torch.autograd.DeviceType.CUDA]
    return attention_backend(kernels)                  # cudnn, flash, efficient, or math (none of those)


def gaps(a, b, valid) -> tuple[float, float]:
    diff = (a - b).abs()[valid]
    return float(diff.max()), float(diff.mean())


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="a from_pretrained folder (default: the tiny demo model)")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast (model.bf16), as the GPU recipes")
    ap.add_argument("--json", default="", help="also write the figures to this JSON file")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    path = args.model or ensure_tiny_model()
    policy = build_policy(path, chunk_tokens=2048, bf16=args.bf16).to(device)
    ids, attention, width = (t.to(device) if isinstance(t, torch.Tensor) else t
                             for t in batch(args.rows, args.max_len, policy.lm.config.vocab_size))
    kernel = default_kernel(policy, ids, attention, width, args.bf16)
    ref_logp, ref_grad, valid = score(policy, ids, attention, width, SDPBackend.MATH, False)
    default_logp, default_grad, _ = score(policy, ids, attention, width, None, args.bf16)
    math_logp, math_grad, _ = score(policy, ids, attention, width, SDPBackend.MATH, args.bf16)
    # packed rows (train.packing): the same sequences back to back in one row, the packed attention kernel
    # (torch's varlen on CUDA under bf16), against the unpacked default kernel and float32
    mask = attention[:, -width:].float()
    policy.bf16 = args.bf16
    with torch.no_grad():
        packed_logp = score_logprobs(policy, ids, attention, T=width, temperature=1.0,
                                     plan=plan_micro_batches(attention, mask, 64, 10 ** 9, packing=True)).float()
        unpacked_logp = score_logprobs(policy, ids, attention, T=width, temperature=1.0,
                                       plan=plan_micro_batches(attention, mask, 64, 0)).float()

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    figures = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "model": path, "bf16": args.bf16, "rows": args.rows, "max_len": args.max_len,
               "default_kernel": kernel,
               "logp_gap_default_vs_math": gaps(default_logp, math_logp, valid),
               "grad_rel_default_vs_math": rel(default_grad, math_grad),
               "logp_gap_default_vs_fp32": gaps(default_logp, ref_logp, valid),
               "logp_gap_math_vs_fp32": gaps(math_logp, ref_logp, valid),
               "grad_rel_default_vs_fp32": rel(default_grad, ref_grad),
               "grad_rel_math_vs_fp32": rel(math_grad, ref_grad),
               "packed_kernel": packed_kernel(device.type, torch.bfloat16 if args.bf16 else torch.float32),
               "logp_gap_packed_vs_unpacked": gaps(packed_logp, unpacked_logp, valid),
               "logp_gap_packed_vs_fp32": gaps(packed_logp, ref_logp, valid)}
    print(f"{figures['device']}, {path}, {args.rows} rows up to {args.max_len} tokens, "
          f"{'bf16 autocast' if args.bf16 else 'float32'}; the default sdpa kernel: {kernel}\n")
    print("| compared | max abs Δ log p | mean abs Δ log p | gradient relative Δ |")
    print("|---|---:|---:|---:|")
    for label, key, grad in (("default vs math", "default_vs_math", "grad_rel_default_vs_math"),
                             ("default vs float32 math", "default_vs_fp32", "grad_rel_default_vs_fp32"),
                             ("math vs float32 math", "math_vs_fp32", "grad_rel_math_vs_fp32"),
                             (f"packed ({figures['packed_kernel']}) vs unpacked", "packed_vs_unpacked", None),
                             ("packed vs float32 math", "packed_vs_fp32", None)):
        high, mean = figures[f"logp_gap_{key}"]
        print(f"| {label} | {high:.2e} | {mean:.2e} | {figures[grad]:.2e} |" if grad else
              f"| {label} | {high:.2e} | {mean:.2e} | - |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
