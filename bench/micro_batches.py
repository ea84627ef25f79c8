"""Fixed, token-budget and packed micro-batches on a length-skewed update (train.micro_batch_tokens,
train.packing).

    python bench/micro_batches.py                 # 2-core CPU: ~3 min; prints one table
    python bench/micro_batches.py --reps 5 --sequences 64     # longer, steadier
    python bench/micro_batches.py --arch configs/qwen2.5-math-1.5b/model_config.json --sequences 48 \
        --max-completion 3584 --max-prompt 512 --bf16 --checkpointing auto --budget 5120 --profile
                                                  # a GPU: the 1.5B recipe's update (scripts/gpu_check.sh OUT update)

A random-weight Qwen2 of 8 layers x 512 (built from a config, nothing downloaded) runs
`policy_update` on one rollout batch whose completions spread from 10 to 512 tokens
(log-uniform; prompts 20-120 tokens), as a reasoning model's do. Fixed micro-batches of
`--micro` rows are padded to the step's longest prompt + completion; the token budget is set to
the same padded size (micro x the longest sequence), so the peak memory of a micro-batch is the
same and only the padding differs; --budget sets another budget (the 1.5B GRPO recipe's is 5120, its
train.micro_batch_tokens).
`packed` fills the same budget first-fit-decreasing with sequences back to back in one row
(train.packing, no padding). The modes alternate, `--reps` times each; the table has the median
update time, real tokens per second and the padded share of positions, then the ratios.
--plan-only prints each mode's micro-batches and padded share from the plan alone (no model).
With --arch the model is that config.json's architecture at its real widths, random weights
(pspo/offline/standin.py; --model: a folder built once), and on a GPU the table adds the peak memory
of the update (allocated and reserved, AdamW state included) and the model FLOPs utilisation: the
update's FLOPs (6 x the matrix-multiply parameters x real tokens, the input embedding being a
lookup, plus causal attention, 6 x layers x query width x L^2 per sequence) / time / the GPU's
dense bf16 peak (from its name: H100 SXM, H200 and GH200 989, H100 NVL and H200 NVL 835, H100 PCIe 756,
A100 312; or --peak-tflops); the forward that
checkpointing recomputes is not counted. --checkpointing none | selective | full | auto (model.gradient_checkpointing;
the flag alone: full): auto takes the least recompute whose memory plan for this batch fits the GPU (pspo/training/
plan.py: update_peak, the largest of the modes timed; on CPU none). Each mode's row adds the plan's peak for the
micro-batches it ran (what torch.cuda.max_memory_allocated should reach, and with the allocator's cache what it
reserves). --json writes the figures to a file (the GPU check's).
The optimizer is AdamW (fused on a GPU, as train.py builds it) at lr 0, so the weights stay as
built while its state is allocated as in training. --attention, --compile and --head
are train.attention, train.compile and model.logprob_head (defaults: the config's, auto), resolved on
this device as train.py resolves them; the header and the JSON name what ran. --profile traces one more
update of the last mode timed (packed by default) with torch.profiler and prints where the GPU's time went (and which
attention kernel ran: cudnn, flash, efficient): GEMMs (and the share of them in float32),
attention, elementwise/reductions, other kernels, and idle (the wall time no kernel ran: the GPU waiting on the CPU; the
profiler's own overhead counts there too, so idle is an upper bound).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from transformers import AutoConfig, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from bench.child_process import write_figures  # noqa: E402
from pspo.training.config import ATTENTIONS, COMPILES, LOGPROB_HEADS, load_config  # noqa: E402
from pspo.training.distributed import Dist  # noqa: E402
from pspo.training.model import (attention_heads, build_policy, compile_line, compiled_layers,  # noqa: E402
                                 decoder_layers, head_mode, set_scoring)
from pspo.training.packed_attention import choose_kernels  # noqa: E402
from pspo.offline.standin import build_random_model  # noqa: E402
from pspo.training.micro_batches import plan_micro_batches  # noqa: E402
from pspo.training import plan as memory_plan  # noqa: E402
from pspo.training.metrics import UpdateSums  # noqa: E402
from pspo.training.micro_batches import UpdateBatch  # noqa: E402
from pspo.update import policy_update  # noqa: E402


def skewed_batch(n: int, vocab: int, seed: int = 0, max_completion: int = 512,
                 max_prompt: int = 120) -> tuple[torch.Tensor, ...]:
    """input_ids, attention (n, P+T) left-padded prompts then completions; mask (n, T); advantages (n,).

    Prompts are uniform in [max_prompt / 6, max_prompt] tokens, completions log-uniform in
    [10, max_completion]."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(max_prompt // 6, max_prompt + 1, (n,), generator=g)
    completions = torch.exp(torch.empty(n).uniform_(torch.log(torch.tensor(10.0)),
                                                    torch.log(torch.tensor(float(max_completion))),
                                                    generator=g)).round().long()
    P, T = int(prompts.max()), int(completions.max())
    input_ids = torch.randint(0, vocab, (n, P + T), generator=g)
    attention = torch.zeros(n, P + T, dtype=torch.long)
    mask = torch.zeros(n, T)
    for i, (p, c) in enumerate(zip(prompts.tolist(), completions.tolist())):
        attention[i, P - p:P + c] = 1
        mask[i, :c] = 1
    return input_ids, attention, mask, torch.randn(n, generator=g), completions


# Dense bf16 TFLOP/s by the name torch reports, the first match wins: NVIDIA's datasheets give the
# Tensor Core figures with sparsity, twice these (H100 SXM / H200 / GH200 1,979; H100 NVL / H200 NVL
# 1,671; H100 PCIe 1,513; A100 624)
PEAK_TFLOPS = (("h100 nvl", 835.0), ("h100 pcie", 756.0), ("h200 nvl", 835.0), ("h100", 989.0),
               ("h200", 989.0), ("a100", 312.0))        # "h200" also matches GH200


def peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU from its name (H100 SXM, H200, GH200: 989; H100 NVL, H200 NVL: 835;
    H100 PCIe: 756; A100: 312); None if unknown."""
    low = device_name.lower()
    return next((tflops for key, tflops in PEAK_TFLOPS if key in low), None)


def update_flops(body_params: int, tokens: int, lengths: list[int], layers: int, attn_width: int,
                 head_params: int = 0, head_tokens: int = 0) -> float:
    """FLOPs of one update (forward 1x, backward 2x) over sequences of `lengths` (prompt + completion):
    6 x the decoder's matrix-multiply parameters (body_params: no embedding, which is a lookup, and no
    head) x real tokens, plus the output head, 6 x head_params x the tokens it scores (head_tokens: the
    completion tokens), plus causal attention, 6 x layers x attn_width x L^2 per sequence (QK^T and AV,
    2 L^2 d / 2 each forward, causal half). Checkpointing's recomputed forward is not counted (docs/gpu.md)."""
    return (6.0 * body_params * tokens + 6.0 * head_params * head_tokens
            + 6.0 * layers * attn_width * sum(n * n for n in lengths))


def mfu(flops: float, seconds: float, peak_tflops: float) -> float:
    """Model FLOPs utilisation: the update's FLOPs / time / the GPU's dense peak."""
    return flops / seconds / (peak_tflops * 1e12)


KERNEL_KINDS = (   # (kind, substrings of a CUDA kernel's lower-cased name), first match wins
    ("attention", ("flash", "fmha", "attention", "attn", "sdpa")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul", "_mma")),
    ("elementwise", ("elementwise", "vectorized", "reduce", "copy", "cast", "unrolled", "fill", "softmax",
                     "norm", "index", "gather", "scatter", "cat", "where", "pointwise", "adam")),
)
FP32_GEMM = ("f32f32", "sgemm", "tf32", "fp32")


def kernel_kind(name: str) -> str:
    """gemm / attention / elementwise / other for a CUDA kernel name."""
    low = name.lower()
    for kind, keys in KERNEL_KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def profile_shares(kernels: list[tuple[str, float]], wall_us: float) -> dict[str, float]:
    """Shares of the wall time: each kernel kind's summed time, fp32 GEMMs among them, and idle
    (the wall time minus all kernel time; one stream, so kernels do not overlap)."""
    shares = {kind: 0.0 for kind in ("gemm", "attention", "elementwise", "other")}
    fp32 = 0.0
    for name, us in kernels:
        kind = kernel_kind(name)
        shares[kind] += us / wall_us
        if kind == "gemm" and any(k in name.lower() for k in FP32_GEMM):
            fp32 += us / wall_us
    shares["gemm_fp32"] = fp32
    shares["idle"] = max(0.0, 1.0 - sum(shares[k] for k in ("gemm", "attention", "elementwise", "other")))
    return shares


def attention_backend(kernels: list[tuple[str, float]]) -> str:
    """Which attention implementation the GPU ran, from its kernels' names (the most time first):
    cudnn, flash, efficient (memory-efficient), math (none of those: softmax and GEMMs); a name may
    hold two words (cudnn's flash kernels): the first listed wins."""
    names = [name.lower() for name, _ in sorted(kernels, key=lambda k: -k[1])
             if kernel_kind(name) == "attention"]
    for backend, keys in (("cudnn", ("cudnn",)), ("flash", ("flash",)),
                          ("efficient", ("fmha", "efficient", "mem_eff"))):
        if any(k in name for name in names for k in keys):
            return backend
    return "math" if not names else "other: " + names[0][:60]


def profiled_update(run) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """Run `run()` (one update) under torch.profiler on the GPU; the kernel time shares and the kernels
    (name, microseconds)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    wall_us = (time.perf_counter() - start) * 1e6
    kernels = [(e.key, e.self_device_time_total) for e in prof.key_averages()
               if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0]
    return profile_shares(kernels, wall_us), kernels


CHUNK = 2048          # model.logprob_chunk_tokens, as the recipes set it


def resolve_checkpointing(asked: str, arch, runs: list[list[tuple[int, int]]], *, bf16: bool, gpu_bytes: int) -> str:
    """--checkpointing auto: the first of none, selective, full whose planned update peak (plan.update_peak, the
    largest over the runs' micro-batch sizes), with the allocator's cache and the constant (plan.device_bytes),
    fits gpu_bytes; full if none does; none on CPU (gpu_bytes 0: no GPU memory to fit). Other modes as asked."""
    if asked != "auto":
        return asked
    if not gpu_bytes:
        return "none"
    for mode in ("none", "selective", "full"):
        need = max(memory_plan.update_peak(arch, sizes, bf16=bf16, checkpointing=mode, chunk_tokens=CHUNK)
                   for sizes in runs)
        if memory_plan.device_bytes(need) <= gpu_bytes:
            return mode
    return "full"


def mode_configs(budget: int, micro: int, completion: int) -> dict:
    """The three modes' configs (configs/grpo.yaml with the batch's shape)."""
    shape_args = ["--rollout.num_generations=2", f"--rollout.max_new_tokens={completion}"]
    configs = {"fixed": [f"--train.micro_batch_size={micro}"],
               "token budget": [f"--train.micro_batch_tokens={budget}", "--train.packing=false"],
               "packed": [f"--train.micro_batch_tokens={budget}", "--train.packing=true"]}
    return {mode: load_config("configs/grpo.yaml", [*shape_args, *mode_args]) for mode, mode_args in configs.items()}


def plan_table(args) -> None:
    """--plan-only: micro-batches and padded share of each mode, from the plan alone (no model)."""
    _, attention, mask, _, lengths = skewed_batch(args.sequences, 100, max_completion=args.max_completion,
                                                  max_prompt=args.max_prompt)
    budget = args.budget or args.micro * attention.shape[1]
    print(f"{args.sequences} sequences, completions {int(lengths.min())}-{int(lengths.max())} tokens (median "
          f"{int(lengths.median())}), prompts up to {args.max_prompt}; token budget {budget}, "
          f"fixed {args.micro} rows\n")
    print("| mode | micro-batches | positions | real tokens | padded share |")
    print("|---|---:|---:|---:|---:|")
    real = int(attention.sum())
    for mode, cfg in mode_configs(budget, args.micro, mask.shape[1]).items():
        t = cfg.train
        plan = plan_micro_batches(attention, mask, t.micro_batch_size, t.micro_batch_tokens, t.packing)
        positions = sum(b.positions for b in plan)
        print(f"| {mode} | {len(plan)} | {positions:,} | {real:,} | {1 - real / positions:.3f} |")


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--micro", type=int, default=4, help="rows per fixed micro-batch")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--arch", default="", help="a config.json: its architecture at real widths (default: 8 x 512)")
    ap.add_argument("--model", default="", help="a from_pretrained folder (a model built once; instead of --arch)")
    ap.add_argument("--layers", type=int, default=None, help="with --arch: keep this many decoder layers")
    ap.add_argument("--max-completion", type=int, default=512)
    ap.add_argument("--max-prompt", type=int, default=120)
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast (model.bf16)")
    ap.add_argument("--checkpointing", nargs="?", const="full", default="none",
                    choices=("none", "selective", "full", "auto"),
                    help="model.gradient_checkpointing (the flag alone: full; auto: the plan's choice)")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="the GPU's dense bf16 peak, for MFU (default: from its name, PEAK_TFLOPS)")
    ap.add_argument("--budget", type=int, default=0, help="token budget (default: micro x the longest sequence)")
    ap.add_argument("--profile", action="store_true", help="a GPU: where one token-budget update spends its time")
    ap.add_argument("--modes", default="fixed,token budget,packed", help="which modes to time, comma-separated")
    ap.add_argument("--json", default="", help="also write the figures to this JSON file (after each update "
                    "timed and after the profile: what is measured so far)")
    ap.add_argument("--warmup", type=int, default=0, help="untimed updates of each mode first (the compiles)")
    ap.add_argument("--against-eager", action="store_true",
                    help="also time the last mode with eager decoder layers and the eager head (--compile never "
                         "--head eager), --reps times: the defaults against them")
    ap.add_argument("--plan-only", action="store_true",
                    help="no model: each mode's micro-batches and padded share on the batch's lengths")
    # how scoring runs, as train.py resolves it (defaults: the config's)
    ap.add_argument("--attention", default="auto", choices=ATTENTIONS, help="train.attention (default: auto)")
    ap.add_argument("--compile", default="auto", choices=COMPILES, help="train.compile (default: auto)")
    ap.add_argument("--head", default="auto", choices=LOGPROB_HEADS, help="model.logprob_head (default: auto)")
    args = ap.parse_args(argv)
    if args.plan_only:
        return plan_table(args)
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    folder = tempfile.mkdtemp(prefix="pspo-bench-")
    if args.model:
        folder, name = args.model, f"{os.path.basename(os.path.normpath(args.model))} (--model)"
    elif args.arch:
        build_random_model(args.arch, os.path.join(folder, "model"), shrink=False, num_layers=args.layers,
                           log=lambda *a: None)
        folder, name = os.path.join(folder, "model"), f"random {os.path.relpath(args.arch)}"
    else:
        config = Qwen2Config(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
        Qwen2ForCausalLM(config).save_pretrained(folder)
        name = "random Qwen2 8 x 512"
    arch = memory_plan.arch_from_config(AutoConfig.from_pretrained(folder))
    vocab = arch.vocab
    batch = skewed_batch(args.sequences, vocab, max_completion=args.max_completion, max_prompt=args.max_prompt)
    input_ids, attention, mask, advantages = (t.to(device) for t in batch[:4])
    lengths = batch[4]
    longest = input_ids.shape[1]
    budget = args.budget or args.micro * longest
    configs = mode_configs(budget, args.micro, mask.shape[1])
    modes = {m: cfg for m, cfg in configs.items() if m in args.modes.split(",")}
    sizes = {m: memory_plan.micro_batch_sizes(plan_micro_batches(attention, mask, cfg.train.micro_batch_size,
                                                                 cfg.train.micro_batch_tokens, cfg.train.packing))
             for m, cfg in modes.items()}
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
    checkpointing = resolve_checkpointing(args.checkpointing, arch, list(sizes.values()), bf16=args.bf16,
                                          gpu_bytes=total)
    policy = build_policy(folder, chunk_tokens=CHUNK, bf16=args.bf16, gradient_checkpointing=checkpointing).to(device)
    kernels = choose_kernels(args.attention, device=device, bf16=args.bf16, **attention_heads(policy.lm.config))
    compiled, head_kind = compiled_layers(args.compile, device), head_mode(args.head, device)
    set_scoring(policy, kernels=kernels, compiled=compiled, head=head_kind)
    scoring = (f"attention: {kernels.describe()} (--attention {args.attention}); "
               + compile_line(args.compile, args.head, device).removeprefix("scoring: "))
    params = sum(p.numel() for p in policy.parameters())
    embed, head = policy.lm.get_input_embeddings().weight, policy.lm.get_output_embeddings().weight
    # the decoder's matmuls: no embedding (a lookup) and no head (it scores completion tokens only;
    # tied to the embedding, parameters() counts it once)
    matmul_params = params - embed.numel() - (0 if head is embed else head.numel())
    where = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    gpu = device.type == "cuda"
    peak = args.peak_tflops or (peak_tflops(where) if gpu else None)
    lm_config = policy.lm.config
    heads = lm_config.num_attention_heads
    attn_width = heads * (getattr(lm_config, "head_dim", None) or lm_config.hidden_size // heads)
    flops = update_flops(matmul_params, int(attention.sum()), attention.sum(1).tolist(),
                         lm_config.num_hidden_layers, attn_width, head.numel(), int(mask.sum()))
    batch = UpdateBatch(input_ids, attention, mask, mask, advantages[:, None].expand_as(mask))
    times: dict[str, list[float]] = {m: [] for m in modes}
    peaks: dict[str, tuple[float, float]] = {}
    sums: dict[str, UpdateSums] = {}
    optimizer = torch.optim.AdamW(policy.parameters(), lr=0.0, weight_decay=0.0,    # the weights stay as built
                                  fused=True if device.type == "cuda" else None)

    def timed_update(cfg) -> tuple[UpdateSums, float, tuple[float, float] | None]:
        """One update of the batch under cfg: its sums, seconds and (on a GPU) peak allocated, reserved GiB."""
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        if gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        out = policy_update(policy, optimizer, scheduler, batch, cfg, Dist(0, 1, device))
        if gpu:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        memory = (torch.cuda.max_memory_allocated() / 2 ** 30, torch.cuda.max_memory_reserved() / 2 ** 30) if gpu \
            else None
        return out, seconds, memory

    figures: dict[str, dict] = {}
    result = {"device": where, "model": name, "parameters": params, "matmul_parameters": matmul_params,
              "sequences": args.sequences, "real_tokens": int(attention.sum()), "longest": longest,
              "bf16": args.bf16, "checkpointing": checkpointing, "checkpointing_asked": args.checkpointing,
              "budget": budget, "outside_allocator_gib": None, "update_tflops": flops / 1e12, "peak_tflops": peak,
              "modes": figures, "against_eager": None, "profile": {}, "attention_setting": args.attention,
              "attention": kernels.describe(), "compile_setting": args.compile, "compiled": compiled,
              "head_setting": args.head, "head": head_kind, "warmup": args.warmup}

    def mode_figures(mode: str) -> dict:
        s, t = sums[mode], modes[mode].train
        plan = plan_micro_batches(attention, mask, t.micro_batch_size, t.micro_batch_tokens, t.packing)
        median = statistics.median(times[mode])
        planned = memory_plan.update_peak(arch, sizes[mode], bf16=args.bf16, checkpointing=checkpointing,
                                          chunk_tokens=CHUNK)
        reserved = memory_plan.device_bytes(planned) - int(memory_plan.OVERHEAD_GIB * memory_plan.GiB)
        return {"micro_batches": len(plan), "padded_share": 1 - s.update_tokens / s.update_positions,
                "update_s": median, "real_tokens_per_s": s.update_tokens / median,
                "mfu": mfu(flops, median, peak) if gpu and peak else None,
                "peak_allocated_gib": peaks[mode][0] if gpu else None,
                "peak_reserved_gib": peaks[mode][1] if gpu else None,
                # the memory plan of these micro-batches: what max_memory_allocated should reach (never
                # under it, within 1.2x), and with the allocator's cache what max_memory_reserved may
                "plan_peak_gib": planned / 2 ** 30, "plan_reserved_gib": reserved / 2 ** 30}

    def measured() -> None:
        """Write what is measured so far (--json): a run stopped later keeps it."""
        if args.json:
            write_figures(args.json, result)

    for _ in range(args.warmup):                          # untimed: the compiles, the kernels' first calls
        for cfg in modes.values():
            timed_update(cfg)
    for _ in range(args.reps):
        for mode, cfg in modes.items():
            sums[mode], seconds, memory = timed_update(cfg)
            times[mode].append(seconds)
            if gpu:
                peaks[mode] = memory
            figures[mode] = mode_figures(mode)
            measured()
    names = list(modes)
    last = names[-1]                                      # the mode compared and profiled (packed by default)
    if args.against_eager:
        # the same update with eager decoder layers and the eager head (train.compile=never,
        # model.logprob_head=eager), --reps times: what the defaults gain on this device
        eager_layers(policy)
        policy.head = "eager"
        eager_times, eager_peak = [], None
        for _ in range(args.reps):
            eager_sums, seconds, eager_peak = timed_update(modes[last])
            eager_times.append(seconds)
        median = statistics.median(eager_times)
        result["against_eager"] = {
            "mode": last, "compile_setting": "never", "head_setting": "eager", "update_s": median,
            "real_tokens_per_s": eager_sums.update_tokens / median,
            "mfu": mfu(flops, median, peak) if gpu and peak else None,
            "peak_allocated_gib": eager_peak[0] if gpu else None, "peak_reserved_gib": eager_peak[1] if gpu else None,
            "eager_over_defaults": median / figures[last]["update_s"]}     # > 1: the defaults are faster
        measured()
        set_scoring(policy, kernels=kernels, compiled=compiled, head=head_kind)     # the defaults again
    print(f"{args.sequences} sequences, completions {int(lengths.min())}-{int(lengths.max())} tokens "
          f"(median {int(lengths.median())}), longest sequence {longest}; {name} ({params / 1e9:.3f}B parameters, "
          f"{matmul_params / 1e9:.3f}B in the decoder's matmuls, the head apart); {where}; "
          f"bf16 {'on' if args.bf16 else 'off'}, "
          f"checkpointing {checkpointing}{' (auto)' if args.checkpointing == 'auto' else ''}; "
          f"median of {args.reps}{f' after {args.warmup} untimed' if args.warmup else ''}; MFU: "
          + (f"{flops / 1e12:,.0f} TFLOPs per update (decoder matmuls + head on completion tokens + causal "
             f"attention) / time / {peak:g} TFLOP/s"
             if peak else "unknown peak (--peak-tflops)" if gpu else "GPU only") + f"\n{scoring}\n")
    print("| mode | micro-batches | padded share | update s | real tokens/s |"
          + (" MFU | peak allocated GiB | peak reserved GiB |" if gpu else "") + " plan allocated / reserved GiB |")
    print("|---|---:|---:|---:|---:|" + ("---:|---:|---:|" if gpu else "") + "---:|")
    for mode in modes:
        f = figures[mode]
        row = (f"| {mode} | {f['micro_batches']} | {f['padded_share']:.2f} | {f['update_s']:.2f} | "
               f"{f['real_tokens_per_s']:,.0f} |")
        if gpu:
            row += (f" {f['mfu']:.1%} |" if peak else " - |") \
                + f" {f['peak_allocated_gib']:.1f} | {f['peak_reserved_gib']:.1f} |"
        print(row + f" {f['plan_peak_gib']:.1f} / {f['plan_reserved_gib']:.1f} |")
    for slow, fast in zip(names, names[1:]):
        ratio = statistics.median(times[slow]) / statistics.median(times[fast])
        print(f"\n{fast} updates are {ratio:.2f}x as fast as {slow} ({slow} / {fast}, medians; "
              f"per rep: {', '.join(f'{a / b:.2f}' for a, b in zip(times[slow], times[fast]))})")
    e = result["against_eager"]
    if e:
        print(f"\n{last}, eager layers and head (--compile never --head eager): {e['update_s']:.2f} s, "
              f"{e['real_tokens_per_s']:,.0f} real tokens/s" + (f", MFU {e['mfu']:.1%}" if e["mfu"] else "")
              + f"; eager / defaults ({compile_line(args.compile, args.head, device).removeprefix('scoring: ')}) "
              f"= {e['eager_over_defaults']:.2f}")
    if args.profile and not gpu:
        print("\nprofile: GPU only (kernel times); absent on CPU")
    elif args.profile:
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        shares, kernel_times = profiled_update(
            lambda: policy_update(policy, optimizer, scheduler, batch, modes[last], Dist(0, 1, device)))
        result["profile"] = dict(shares, attention_backend=attention_backend(kernel_times))
        print(f"\nprofile of one {last} update (share of wall time):")
        print("| GEMM | of which fp32 | attention | elementwise/reductions | other kernels | idle "
              "| attention kernels |")
        print("|---:|---:|---:|---:|---:|---:|---|")
        print(f"| {shares['gemm']:.0%} | {shares['gemm_fp32']:.0%} | {shares['attention']:.0%} | "
              f"{shares['elementwise']:.0%} | {shares['other']:.0%} | {shares['idle']:.0%} | "
              f"{result['profile']['attention_backend']} |")
    # what the GPU holds beyond PyTorch's allocator (the CUDA context, library workspaces): plan.OVERHEAD_GIB
    if gpu:
        free, total = torch.cuda.mem_get_info()
        result["outside_allocator_gib"] = (total - free - torch.cuda.memory_reserved()) / 2 ** 30
    measured()


def eager_layers(policy) -> None:
    """Undo compile_layers: each decoder layer's own (class) forward again."""
    for layer in decoder_layers(policy.lm):
        layer.__dict__.pop("forward", None)

if __name__ == "__main__":
    main(sys.argv[1:])
